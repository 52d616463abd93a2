"""Rollouts through verifiers' token client against our loopback endpoint, as exact-token Samples.

verifiers 0.4.0 (``verifiers.v1``) talks to a trained policy through its train client, which
renders messages with a ``renderers`` Renderer and calls vLLM's ``/inference/v1/generate``
(``renderers.client.generate``); openai_endpoint.py serves that route. This module drives a
conversation through that same client code, unmodified, with an AsyncOpenAI client pointed at
the endpoint, and turns it into a Sample:

    output = turn 0's sampled ids (mask True, with their logprobs)
           + the environment's tokens before turn 1 (mask False) + turn 1's sampled ids + ...

The environment's tokens between two turns are read from the next request's prompt ids, which
must start with the previous request's prompt ids plus the ids sampled for it. If they do not
(the conversation was re-rendered from text and the template or tokenizer changed a token),
the rollout is refused with PrefixDriftError, counted in ``VerifiersStats.drifted``: training on
drifted tokens would score logprobs the engine never sampled.

Next prompts are built the way verifiers' train client builds them: the renderer's
``bridge_to_next_turn`` first; where it declines (renderers' DefaultRenderer always does), the
previous prompt and completion plus multi_turn.ChatRenderer's observation delta, so no earlier
token is ever re-tokenised.

Weight versions: renderers.client.generate passes only the request id through, not the
endpoint's per-choice ``weight_version`` / ``token_versions``; given the in-process Endpoint
(``VerifiersRollouts.endpoint``, e.g. ``GenerationWorker.endpoint_host.endpoint``), each turn's
versions are read from its exchange by request id and the Sample carries them (``weight_version``
= turn 0's, ``token_versions`` when they differ). Without it the Sample's weight_version stays -1.

The environment is two callables: ``respond`` (the messages after an assistant turn, or None when
the episode is over) and ``reward`` (the episode's reward from the final messages).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from async_grpo.rollouts.multi_turn import ChatRenderer
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

Message = dict[str, Any]
Respond = Callable[[list[Message]], Awaitable[list[Message] | None]]
"""The conversation so far (ending with the assistant's turn) -> the environment's next messages
(e.g. a tool answer, a user turn), or None when the episode ends."""
Reward = Callable[[list[Message]], Awaitable[float]]
"""The final conversation -> the episode's reward."""


class PrefixDriftError(RuntimeError):
    """A request's prompt ids do not extend the previous request's prompt plus its sampled ids."""


@dataclass(kw_only=True, frozen=True)
class VerifiersRolloutConfig:
    """How one conversation is driven."""

    model_name: str = "policy"
    """The model name sent to the endpoint."""
    max_turns: int = 1
    """Assistant turns at most (1: single-turn)."""
    turn_max_tokens: int = 64
    """New tokens per assistant turn."""
    temperature: float = 1.0
    """Sampling temperature of every turn."""
    seed: int | None = None
    """Seed of turn 0; turn t gets seed + t (the engine derives no seeds for loopback requests)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.turn_max_tokens < 1:
            raise ValueError(f"turn_max_tokens must be >= 1, got {self.turn_max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class Turn:
    """One request of a conversation, as the endpoint answered it."""

    prompt_token_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    content: str
    weight_version: int = -1
    """The weights that sampled this turn's first token (-1: unknown)."""
    version_runs: list[tuple[int, int]] | None = None
    """Run-length versions of completion_ids when a push landed inside the turn; None: all weight_version."""


@dataclass
class VerifiersStats:
    """Counters of verifiers rollouts (metrics under verifiers/)."""

    rollouts: int = 0
    turns: int = 0
    drifted: int = 0
    """Rollouts refused because a prompt did not extend the previous turn exactly."""
    sampled_tokens: int = 0
    observation_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"verifiers/{name}": float(value) for name, value in vars(self).items()}


def sample_from_turns(prompt: Sample, turns: list[Turn], reward: float, stats: VerifiersStats | None = None
                      ) -> Sample:
    """The Sample of one conversation: prompt ids of turn 0, then per turn its sampled ids (mask
    True) and before each later turn the environment's tokens (mask False) read from that turn's
    prompt ids. Raises PrefixDriftError (counted) when a prompt does not extend the last one."""
    if not turns:
        raise ValueError("a conversation needs at least one turn")
    output: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    head = turns[0].prompt_token_ids
    for index, turn in enumerate(turns):
        context = head + output
        if index:
            if turn.prompt_token_ids[:len(context)] != context:
                if stats is not None:
                    stats.drifted += 1
                at = next((i for i, (a, b) in enumerate(zip(context, turn.prompt_token_ids)) if a != b),
                          min(len(context), len(turn.prompt_token_ids)))
                raise PrefixDriftError(f"turn {index}'s prompt does not extend the conversation's exact tokens "
                                       f"(first difference at token {at} of {len(context)}): the conversation "
                                       "was re-rendered; refusing to train on drifted tokens")
            observation = turn.prompt_token_ids[len(context):]
            output += observation
            mask += [False] * len(observation)
        if len(turn.completion_logprobs) != len(turn.completion_ids):
            raise ValueError(f"turn {index}: {len(turn.completion_logprobs)} logprobs for "
                             f"{len(turn.completion_ids)} tokens")
        output += turn.completion_ids
        mask += [True] * len(turn.completion_ids)
        logprobs += turn.completion_logprobs
    runs = _merged_runs([run for turn in turns
                         for run in (turn.version_runs or [(turn.weight_version, len(turn.completion_ids))])])
    sample = Sample(input_token_ids=list(head), gt_answer=prompt.gt_answer, prompt_id=prompt.prompt_id,
                    group_id=prompt.group_id, run_id=prompt.run_id, output_token_ids=output,
                    output_mask=None if all(mask) else mask, output_text=turns[-1].content,
                    sampling_logprobs=logprobs, finish_reason=turns[-1].finish_reason,
                    truncated=turns[-1].finish_reason == "length", reward=reward,
                    weight_version=turns[0].weight_version, token_versions=runs if len(runs) > 1 else None)
    sample.validate_generated()
    if stats is not None:
        stats.rollouts += 1
        stats.turns += len(turns)
        stats.sampled_tokens += sum(mask)
        stats.observation_tokens += len(mask) - sum(mask)
    return sample


def _merged_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(version, count) runs with empty runs dropped and equal neighbours merged."""
    merged: list[tuple[int, int]] = []
    for version, count in runs:
        if count == 0:
            continue
        if merged and merged[-1][0] == version:
            merged[-1] = (version, merged[-1][1] + count)
        else:
            merged.append((version, count))
    return merged or [(runs[0][0] if runs else -1, 0)]


@dataclass
class VerifiersRollouts:
    """Drives conversations through renderers.client.generate (verifiers' train-client call)."""

    client: Any
    """An openai.AsyncOpenAI with base_url = the endpoint's base_url."""
    tokenizer: Any
    """The policy's tokenizer (with its chat template)."""
    config: VerifiersRolloutConfig
    stats: VerifiersStats = field(default_factory=VerifiersStats)
    endpoint: Any = None
    """The in-process openai_endpoint.Endpoint behind `client` (e.g. GenerationWorker.endpoint_host.endpoint),
    whose exchanges give each turn's weight versions; None: versions unknown (-1)."""

    def __post_init__(self) -> None:
        from renderers import DefaultRenderer

        self.renderer = DefaultRenderer(self.tokenizer)
        self.chat = ChatRenderer(self.tokenizer)

    async def _call(self, messages: list[Message], prompt_ids: list[int] | None, turn: int) -> Turn:
        from renderers.client import generate

        sampling: dict[str, Any] = {"max_tokens": self.config.turn_max_tokens, "temperature": self.config.temperature}
        if self.config.seed is not None:
            sampling["seed"] = self.config.seed + turn
        result = await generate(client=self.client, renderer=self.renderer, messages=messages,
                                model=self.config.model_name, prompt_ids=prompt_ids, sampling_params=sampling)
        turn_result = Turn(prompt_token_ids=list(result["prompt_ids"]), completion_ids=list(result["completion_ids"]),
                           completion_logprobs=list(result["completion_logprobs"]),
                           finish_reason=str(result.get("finish_reason") or ""),
                           content=str(result.get("content") or ""))
        exchange = self.endpoint.exchange(str(result.get("request_id") or "")) if self.endpoint else None
        if exchange is not None and exchange.generation.token_ids == turn_result.completion_ids:
            turn_result.weight_version = exchange.generation.weight_version
            turn_result.version_runs = exchange.generation.version_runs
        return turn_result

    def _next_prompt(self, turn: Turn, new_messages: list[Message]) -> list[int]:
        bridged = self.renderer.bridge_to_next_turn(turn.prompt_token_ids, turn.completion_ids, new_messages)
        if bridged is not None:
            return list(bridged.token_ids)
        return turn.prompt_token_ids + turn.completion_ids + self.chat.observation(new_messages, turn.completion_ids)

    async def rollout(self, prompt: Sample, messages: list[Message], respond: Respond, reward: Reward) -> Sample:
        """One conversation from `messages` (system/user turns) to a Sample with exact tokens."""
        conversation = list(messages)
        turns: list[Turn] = []
        prompt_ids: list[int] | None = None
        for index in range(self.config.max_turns):
            turn = await self._call(conversation, prompt_ids, index)
            turns.append(turn)
            conversation.append({"role": "assistant", "content": turn.content})
            if index + 1 == self.config.max_turns:
                break
            new_messages = await respond(conversation)
            if not new_messages:
                break
            conversation += new_messages
            prompt_ids = self._next_prompt(turn, new_messages)
        return sample_from_turns(prompt, turns, float(await reward(conversation)), self.stats)
