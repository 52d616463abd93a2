"""Multi-turn rollouts: the model and an environment (environments.py) take turns, with exact tokens.

    generate = engine_generate(engine, sampling_params(sampling, prompt_id), request_id)  # over vLLM's AsyncLLM
    outcome = await run_rollout(sample, config.make(), generate, ChatRenderer(tokenizer), config,
                                max_tokens_per_turn=sampling.max_tokens)
    outcome.sample.output_token_ids, outcome.sample.output_mask   # turn 1 | observation | turn 2 ...

The token stream is built by appending, never by re-tokenizing the conversation: each turn's
tokens are exactly what the engine sampled (output_mask True, one sampling logprob each), and
each observation's tokens are exactly what was appended to the engine's next prompt (output_mask
False, no logprob). The next turn's prompt is the prompt plus that stream, so what the trainer
scores is what the engine conditioned on, token for token.

Observation tokens come from the chat template rendering only the new messages (the "delta"):
ChatRenderer renders a fixed conversation ending in an assistant turn, then the same
conversation plus the new messages and the next assistant opener, and keeps the text after the
assistant turn's content. That text starts with the template's end of the assistant turn
(ChatML: "<|im_end|>\n"); the part the model already sampled (its stop token) is dropped, so a
turn cut at its token limit is closed by the observation and one that stopped is not closed twice.

Environment calls never block the event loop: `async def` methods are awaited, plain ones run in
a worker thread (asyncio.to_thread), so the engine keeps serving other rollouts meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Sequence

from async_grpo.config.rollout_sources import EnvironmentConfig
from async_grpo.rollouts.environments import Environment, EnvPrompt, Message, Reset, StepResult, Turn
from async_grpo.config.sampling import SEED_BOUND, derive_seed
from async_grpo.rollouts.token_versions import spans_to_runs
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

FINISH_STOP, FINISH_LENGTH = "stop", "length"
# A string no chat template or model writes: where the fixed assistant turn's content ends.
_SENTINEL = "\u2063sentinel-of-multi-turn\u2063"
# The fixed conversation the delta is rendered after: a user turn and an assistant turn, so the
# template renders the new messages as it would in the middle of a real conversation.
_BASE_CONVERSATION: tuple[Message, ...] = ({"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL})
ENVIRONMENT_FAILURE = "environment/raised"
"""Sample.reward_failure_reasons entry of a rollout whose environment raised in step()."""

StopReason = Literal["done", "max_turns", "token_budget", "environment_error"]


@dataclass(slots=True, frozen=True)
class Generation:
    """One engine answer to "continue these exact token ids" (n = 1)."""

    token_ids: list[int]
    """The sampled tokens (the stop token included when the turn stopped on one)."""
    logprobs: list[float]
    """The sampling logprob of each sampled token."""
    finish_reason: str
    """'stop' or 'length'."""
    text: str
    """The engine's text of token_ids."""
    weight_version: int = -1
    """The engine's weight version when it sampled this turn (its first token's)."""
    version_runs: list[tuple[int, int]] | None = None
    """Run-length versions of token_ids when a weight push landed inside the turn (the engine's
    spans, token_versions.spans_to_runs); None: every token came from weight_version."""


GenerateFn = Callable[[list[int], int], Awaitable[Generation]]
"""(prompt token ids, max new tokens) -> the engine's Generation."""


class ChatRenderer:
    """Token ids of a first conversation and of observation deltas, from the tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._special_ids = frozenset(tokenizer.all_special_ids)
        # Checked when messages are first rendered, not here: an environment that speaks in
        # tokens or plain text (StepResult.text) needs no template, e.g. the tool demo's char model.
        self._base_prefix: str | None = None

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the environment returned messages, which are rendered with the chat template, and "
                             "the tokenizer has none: return StepResult(text=...) / Reset(token_ids=...) instead")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _base(self) -> str:
        """The rendered fixed conversation up to the end of its assistant content."""
        if self._base_prefix is None:
            base = self._render(list(_BASE_CONVERSATION), generation_prompt=False)
            if _SENTINEL not in base:
                raise ValueError("the chat template drops the assistant's content; cannot render observation deltas")
            self._base_prefix = base[: base.index(_SENTINEL) + len(_SENTINEL)]
        return self._base_prefix

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (its special tokens as the template wrote them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[Message]) -> list[int]:
        """The first conversation plus the opener of the assistant's turn."""
        return self.encode(self._render(messages, generation_prompt=True))

    def observation(self, messages: list[Message], last_turn: Sequence[int]) -> list[int]:
        """Tokens of `messages` rendered after an assistant turn that ended with `last_turn`,
        plus the opener of the assistant's next turn."""
        base = self._base()
        full = self._render([*_BASE_CONVERSATION, *messages], generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders earlier messages differently once new ones follow; "
                             "observation tokens cannot be appended exactly")
        delta = full[len(base):]
        # The model's own stop token (e.g. <|im_end|>) is already in the stream; the delta must
        # not repeat it. A plain-text last token is never taken for the template's closer.
        if last_turn and last_turn[-1] in self._special_ids:
            closer = self.tokenizer.decode([last_turn[-1]], skip_special_tokens=False)
            if delta.startswith(closer):
                delta = delta[len(closer):]
        return self.encode(delta)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)


@dataclass(slots=True)
class MultiTurnStats:
    """Counters of this worker's multi-turn rollouts (metrics under multi_turn/)."""

    rollouts: int = 0
    turns: int = 0
    sampled_tokens: int = 0
    observation_tokens: int = 0
    stops: Counter = field(default_factory=Counter)
    """Rollouts per StopReason."""

    def add(self, outcome: RolloutOutcome) -> None:
        sample = outcome.sample
        self.rollouts += 1
        self.turns += outcome.turns
        self.sampled_tokens += sample.num_sampled_tokens
        self.observation_tokens += len(sample.output_token_ids) - sample.num_sampled_tokens
        self.stops[outcome.stop] += 1

    def metrics(self) -> dict[str, float]:
        out = {"multi_turn/rollouts": float(self.rollouts), "multi_turn/turns": float(self.turns),
               "multi_turn/sampled_tokens": float(self.sampled_tokens),
               "multi_turn/observation_tokens": float(self.observation_tokens)}
        out.update({f"multi_turn/stop/{reason}": float(count) for reason, count in sorted(self.stops.items())})
        return out


@dataclass(slots=True, frozen=True)
class RolloutOutcome:
    sample: Sample
    """The completed sample: output_token_ids, output_mask, sampling_logprobs, reward, ..."""
    turns: int
    """Model turns sampled."""
    stop: StopReason
    """Why the rollout ended."""


async def call_environment(method: Callable[[Any], Any], argument: Any) -> Any:
    """Await an async method; run a plain one in a worker thread, off the event loop."""
    if inspect.iscoroutinefunction(method):
        return await method(argument)
    return await asyncio.to_thread(method, argument)


def _prompt_ids(reset: Any, sample: Sample, renderer: ChatRenderer, name: str) -> list[int]:
    if not isinstance(reset, Reset):
        raise TypeError(f"{name}.reset returned {type(reset).__name__}, not environments.Reset")
    if reset.token_ids is not None:
        return list(reset.token_ids)
    if reset.messages is not None:
        return renderer.prompt(reset.messages)
    return list(sample.input_token_ids)


def _observation_ids(result: StepResult, renderer: ChatRenderer, last_turn: Sequence[int]) -> list[int]:
    if result.token_ids is not None:
        return list(result.token_ids)
    if result.text is not None:
        return renderer.encode(result.text)
    if result.messages is not None:
        return renderer.observation(result.messages, last_turn)
    return []


@dataclass(slots=True)
class _Stream:
    """The rollout's output so far: every token, which were sampled, their logprobs and versions."""

    token_ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)

    def add_turn(self, generation: Generation) -> None:
        n = len(generation.token_ids)
        if len(generation.logprobs) != n:
            raise RuntimeError(f"the engine returned {len(generation.logprobs)} logprobs for {n} tokens")
        self.token_ids += generation.token_ids
        self.mask += [True] * n
        self.logprobs += generation.logprobs
        for version, count in generation.version_runs or [(generation.weight_version, n)]:
            if self.versions and self.versions[-1][0] == version:
                self.versions[-1] = (version, self.versions[-1][1] + count)
            else:
                self.versions.append((version, count))

    def add_observation(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.mask += [False] * len(token_ids)


async def run_rollout(sample: Sample, env: Environment, generate: GenerateFn, renderer: ChatRenderer,
                      config: EnvironmentConfig, max_tokens_per_turn: int, rollout_index: int = 0) -> RolloutOutcome:
    """One rollout of `sample`'s prompt against `env` (a fresh instance): turns until the
    environment says done, config.max_turns, or config.max_total_tokens. Raises if reset fails
    or the prompt leaves no room for a token; an error in step() ends the rollout flagged
    reward_failed (reason ENVIRONMENT_FAILURE) and is logged."""
    name = type(env).__name__
    prompt_record = EnvPrompt(record=sample.record, gt_answer=sample.gt_answer,
                              prompt_token_ids=list(sample.input_token_ids), rollout_index=rollout_index)
    prompt = _prompt_ids(await call_environment(env.reset, prompt_record), sample, renderer, name)
    if len(prompt) >= config.max_total_tokens:
        raise ValueError(f"prompt_id={sample.prompt_id}: the prompt has {len(prompt)} tokens, no room left under "
                         f"environment.max_total_tokens={config.max_total_tokens}")
    stream, reward, failed = _Stream(), 0.0, False
    stop: StopReason = "max_turns"
    last = Generation(token_ids=[], logprobs=[], finish_reason=FINISH_STOP, text="")
    turns = 0
    while turns < config.max_turns:
        room = config.max_total_tokens - len(prompt) - len(stream.token_ids)
        last = await generate(prompt + stream.token_ids, min(max_tokens_per_turn, room))
        if not last.token_ids:
            raise RuntimeError(f"prompt_id={sample.prompt_id}: the engine sampled no token in turn {turns}")
        stream.add_turn(last)
        turns += 1
        try:
            result = await call_environment(env.step, Turn(index=turns - 1, token_ids=list(last.token_ids),
                                                           text=last.text, finish_reason=last.finish_reason))
            if not isinstance(result, StepResult):
                raise TypeError(f"{name}.step returned {type(result).__name__}, not environments.StepResult")
        except Exception as exc:  # the environment is user code: its failure is this rollout's, not the worker's
            logger.warning("prompt_id=%d: environment %s raised in step %d: %s: %s", sample.prompt_id, name,
                           turns - 1, type(exc).__name__, exc)
            stop, failed = "environment_error", True
            break
        reward += float(result.reward)
        if result.done:
            stop = "done"
            break
        if turns == config.max_turns:
            break
        observation = _observation_ids(result, renderer, last.token_ids)
        # An observation is only worth appending if the model can answer it with a token.
        if len(prompt) + len(stream.token_ids) + len(observation) >= config.max_total_tokens:
            stop = "token_budget"
            break
        stream.add_observation(observation)
    return RolloutOutcome(sample=_completed(sample, prompt, stream, last, reward, failed, stop, renderer),
                          turns=turns, stop=stop)


def _completed(sample: Sample, prompt: list[int], stream: _Stream, last: Generation, reward: float, failed: bool,
               stop: StopReason, renderer: ChatRenderer) -> Sample:
    truncated = last.finish_reason == FINISH_LENGTH or stop == "token_budget"
    return dataclasses.replace(
        sample,
        input_token_ids=prompt,
        output_token_ids=stream.token_ids,
        output_mask=stream.mask,
        output_text=renderer.decode(stream.token_ids),
        sampling_logprobs=stream.logprobs,
        finish_reason=FINISH_LENGTH if truncated else FINISH_STOP,
        truncated=truncated,
        reward=0.0 if failed else reward,
        reward_failed=failed,
        reward_failure_reasons=[ENVIRONMENT_FAILURE] if failed else None,
        weight_version=stream.versions[0][0],
        token_versions=stream.versions if len(stream.versions) > 1 else None,
    )


async def run_rollouts(sample: Sample, n: int, config: EnvironmentConfig, generate_for: Callable[[int], GenerateFn],
                       renderer: ChatRenderer, max_tokens_per_turn: int,
                       stats: MultiTurnStats | None = None) -> list[Sample]:
    """The prompt's n rollouts, concurrently (while one waits on its environment the engine
    serves the others); generate_for(i) is rollout i's GenerateFn."""
    outcomes = await asyncio.gather(*(
        run_rollout(sample, config.make(), generate_for(i), renderer, config, max_tokens_per_turn, rollout_index=i)
        for i in range(n)))
    if stats is not None:
        for outcome in outcomes:
            stats.add(outcome)
    return [outcome.sample for outcome in outcomes]


def engine_generate(engine: Any, params: Any, request_id: str, rollout_index: int = 0,
                    version: Callable[[], int] = lambda: -1, lora_request: Any = None) -> GenerateFn:
    """A GenerateFn over a vLLM AsyncLLM for rollout `rollout_index` of a prompt: each call is one
    request with the exact prompt token ids (TokensPrompt), n = 1, `params` with max_tokens set
    per turn and, when seeded, a seed derived from (params.seed, rollout_index, turn): one seed
    for every turn would replay the first turn's random draws, and seed + i would give rollout
    i's turn 1 the seed of rollout i + 1's turn 0. `version` is read as each turn starts."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    turn = 0

    async def generate(token_ids: list[int], max_tokens: int) -> Generation:
        nonlocal turn
        turn_params = params.clone()
        turn_params.n = 1
        turn_params.max_tokens = max_tokens
        turn_params.logprobs = 0
        turn_params.output_kind = RequestOutputKind.FINAL_ONLY
        if params.seed is not None:
            turn_params.seed = derive_seed(params.seed, rollout_index, turn, bound=SEED_BOUND)
        weight_version = version()
        final = None
        async for output in engine.generate(TokensPrompt(prompt_token_ids=list(token_ids)), turn_params,
                                            f"{request_id}-r{rollout_index}-t{turn}", lora_request=lora_request):
            final = output
        turn += 1
        if final is None or not final.outputs:
            raise RuntimeError(f"request {request_id}: the engine returned no completion for turn {turn - 1}")
        return generation_of(final.outputs[0], weight_version)

    return generate


def generation_of(completion: Any, weight_version: int) -> Generation:
    """A Generation from vLLM's CompletionOutput (requested with logprobs=0: the sampled token's)."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although the request asked for them")
    token_ids = list(completion.token_ids)
    logprobs = [float(position[token].logprob) for token, position in zip(token_ids, completion.logprobs)]
    # The engine labels each step's tokens with the weights that sampled them (token_versions):
    # a push inside this turn (pause mode keep) splits it.
    spans = getattr(completion, "weight_versions", None)
    runs = spans_to_runs(spans, len(token_ids), "multi-turn turn") if spans else None
    if runs:
        weight_version = runs[0][0]
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=str(completion.finish_reason or ""),
                      text=completion.text, weight_version=weight_version,
                      version_runs=runs if runs and len(runs) > 1 else None)
