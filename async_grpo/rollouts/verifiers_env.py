"""Real `verifiers` environments (0.4.0, verifiers.v1), unmodified, as a generation worker's rollouts.

A training run with `sampling.verifiers.taskset` set (config/rollout_sources.VerifiersEnvConfig) has each
generation worker serve its loopback endpoint (openai_endpoint.py) and run the environment here,
in-process, with verifiers' own rollout code: `Env.serving()` (its interception server),
`Env.run_slot()` per rollout, the harness's own program, verifiers' train client
(`TrainClientConfig`: `renderers.client.generate` against the endpoint's `/inference/v1/generate`),
its message graph (`Trace.branches`: each branch is one exact-token training sequence) and the
taskset's rubric (`Trace.reward`). Nothing of verifiers is patched; three settings make it run
offline on our engine:

- The seats play verifiers' "null" harness (its tool-less chat program) in the "subprocess"
  runtime (rollout_sources.DEFAULT_SEAT). That program is a PEP 723 script whose packages (openai, mcp,
  httpx, tenacity, certifi) verifiers itself requires; `Runtime.prepare_uv_script` would build a
  uv environment for it (network), unless the script's path is already registered
  (verifiers/v1/runtimes/base.py, `prepare_uv_script`: `if path not in self._uv_interpreters`).
  prepare_chat_program writes the script to the path verifiers derives from its content and
  registers this interpreter for it, so the program runs on our installed packages.
- The train client renders with ExactBridgeRenderer (renderers' custom-renderer hook): a turn
  after the first is the previous prompt ids + the ids the engine sampled + the new messages'
  template tokens (multi_turn.ChatRenderer's observation delta), never a re-tokenised
  conversation. renderers' DefaultRenderer declines to bridge, so verifiers re-renders the whole
  conversation from text, and a token that does not survive decode/encode forks the trace
  (seen on the tiny model: every turn became its own branch).
- The model context points at the worker's endpoint, with `model` = its served name.

Each rollout becomes one Sample (sample_from_episode): the last trainable branch of the episode's
trainable trace. Every sampled span in it must be an exchange the endpoint served with exactly
that prompt (Endpoint.find): its sampling logprobs and weight versions are read from there. A
span with no such exchange (tokens the engine did not sample after that prompt) refuses the
rollout as drifted; a fork (more branches than one) trains the last and counts the others.
Counters under verifiers/ (VerifiersEnvStats).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from async_grpo.rollouts.multi_turn import ChatRenderer
from async_grpo.config.rollout_sources import VerifiersEnvConfig
from async_grpo.config.sampling import SEED_BOUND, SamplingConfig, derive_seed
from async_grpo.rollouts.verifiers_rollouts import _merged_runs
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

RENDERER_IMPORT_PATH = "async_grpo.rollouts.verifiers_env.ExactBridgeRenderer"
"""renderers' CustomRendererConfig.import_path of ExactBridgeRenderer."""
DRIFT_REASON = "verifiers/drifted"
EPISODE_ERROR_REASON = "verifiers/episode_error"


def prepare_chat_program() -> str:
    """Make verifiers' chat program (the "null" harness's script) runnable without uv: write it
    where SubprocessRuntime.prepare_uv_script looks for it and register this interpreter, whose
    environment holds every package the script declares. Returns the script's path."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.exists() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(data)
        temporary.replace(path)  # atomic: a concurrent reader never sees half a script
    SubprocessRuntime._interpreters[str(path)] = sys.executable
    return str(path)


def _exact_bridge_renderer_class() -> type:
    from renderers.base import RenderedTokens
    from renderers.configs import DefaultRendererConfig
    from renderers.default import DefaultRenderer

    class _ExactBridgeRenderer(DefaultRenderer):
        """DefaultRenderer (the model's chat template) whose next-turn prompt extends the exact
        previous tokens: previous prompt + sampled ids + the new messages' template delta."""

        config_class = DefaultRendererConfig

        def __init__(self, tokenizer: Any, config: Any = None) -> None:
            super().__init__(tokenizer, config)
            self._chat = ChatRenderer(tokenizer)

        def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                                new_messages: list[dict], *, tools: Any = None, **kwargs: Any) -> Any:
            if tools or kwargs or not previous_prompt_ids or not previous_completion_ids or not new_messages \
                    or any(m.get("role") not in ("user", "tool") for m in new_messages):
                return None  # verifiers then renders the whole conversation (a fork if tokens drift)
            try:
                delta = self._chat.observation(new_messages, previous_completion_ids)
            except (ValueError, TypeError) as exc:
                logger.warning("no exact bridge for %s: %s", [m.get("role") for m in new_messages], exc)
                return None
            previous = [*previous_prompt_ids, *previous_completion_ids]
            # Attribution: the delta belongs to the new messages (one span over all of them; the
            # graph keeps the tokens exact either way), the earlier tokens to no new message.
            indices = [-1] * len(previous) + [len(new_messages) - 1] * len(delta)
            return RenderedTokens(token_ids=previous + delta, message_indices=indices,
                                  message_roles=[str(m.get("role") or "") for m in new_messages],
                                  message_tool_names=[None] * len(new_messages))

    _ExactBridgeRenderer.__name__ = _ExactBridgeRenderer.__qualname__ = "ExactBridgeRenderer"
    return _ExactBridgeRenderer


def __getattr__(name: str) -> Any:
    # Built on first use: renderers (and transformers under it) load only where verifiers runs.
    if name == "ExactBridgeRenderer":
        cls = _exact_bridge_renderer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class VerifiersEnvStats:
    """Counters of a worker's verifiers rollouts (metrics under verifiers/)."""

    episodes: int = 0
    """Rollouts (episodes) run."""
    samples: int = 0
    """Samples made from them (one per episode that sampled any token)."""
    failed_episodes: int = 0
    """Episodes verifiers marked not ok (an error in the harness, the env or the rubric): their
    sample, if any token was sampled, is trained with reward 0 flagged reward_failed."""
    empty_episodes: int = 0
    """Episodes with no sampled token (the request fails, counted in generation/generation_failures)."""
    drifted: int = 0
    """Samples refused because a sampled span was not what the engine sampled after that exact
    prompt (flagged reward_failed, reward 0): never trained as if it were."""
    extra_branches: int = 0
    """Trainable branches not trained: a forked conversation trains its last branch only."""
    turns: int = 0
    sampled_tokens: int = 0
    observation_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"verifiers/{f.name}": float(getattr(self, f.name)) for f in fields(self)}


@dataclass
class _Span:
    """One sampled span of a branch and the exchange that served it."""

    start: int
    """Offset of the span's first token in the branch's token ids."""
    token_ids: list[int]
    exchange: Any


def _sampled_spans(token_ids: list[int], mask: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of sampled positions."""
    spans: list[tuple[int, int]] = []
    start = None
    for index, sampled in enumerate([*mask, False]):
        if sampled and start is None:
            start = index
        elif not sampled and start is not None:
            spans.append((start, index))
            start = None
    return spans


def _trained_branch(episode: Any, stats: VerifiersEnvStats) -> tuple[Any, Any] | None:
    """(trace, branch) to train on: the last trainable branch of the last trainable trace that
    sampled anything; extra trainable branches are counted."""
    candidates = [(trace, branch) for trace in episode.traces if trace.agent.trainable
                  for branch in trace.branches if branch.trainable and any(branch.sampled_mask)]
    if not candidates:
        return None
    stats.extra_branches += len(candidates) - 1
    return candidates[-1]


def sample_from_episode(prompt: Sample, episode: Any, endpoint: Any, stats: VerifiersEnvStats) -> Sample:
    """The Sample of one verifiers episode (see the module docstring). Raises RuntimeError when
    no token was sampled."""
    stats.episodes += 1
    if not episode.ok:
        stats.failed_episodes += 1
        logger.warning("prompt_id=%d: verifiers episode failed: %s", prompt.prompt_id,
                       "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or
                       "; ".join(f"{e.type}: {e.message}" for t in episode.traces for e in t.errors))
    chosen = _trained_branch(episode, stats)
    if chosen is None:
        stats.empty_episodes += 1
        raise RuntimeError(f"prompt_id={prompt.prompt_id}: the verifiers episode sampled no token "
                           f"(errors: {[e.message for e in episode.errors]})")
    trace, branch = chosen
    token_ids, mask = list(branch.token_ids), list(branch.sampled_mask)
    spans = [_Span(start=s, token_ids=token_ids[s:e], exchange=endpoint.find(token_ids[:s], token_ids[s:e]))
             for s, e in _sampled_spans(token_ids, mask)]
    end = spans[-1].start + len(spans[-1].token_ids)  # tokens after the last turn are not trained
    head = spans[0].start
    drifted = any(span.exchange is None for span in spans)
    if drifted:
        stats.drifted += 1
        logger.warning("prompt_id=%d: a sampled span of the verifiers trace is not what the engine sampled after "
                       "that exact prompt; refusing it (reward 0, reward_failed)", prompt.prompt_id)
    failed = drifted or not episode.ok
    reasons = [DRIFT_REASON] * drifted + [EPISODE_ERROR_REASON] * (not episode.ok)
    logprobs = [lp for span in spans for lp in (span.exchange.generation.logprobs if span.exchange
                                                else branch.logprobs[span.start:span.start + len(span.token_ids)])]
    runs = _merged_runs([run for span in spans for run in _span_runs(span)])
    last = spans[-1].exchange.generation if spans[-1].exchange else None
    finish = last.finish_reason if last else ""
    sample = Sample(input_token_ids=token_ids[:head], gt_answer=prompt.gt_answer, prompt_id=prompt.prompt_id,
                    group_id=prompt.group_id, run_id=prompt.run_id, output_token_ids=token_ids[head:end],
                    output_mask=None if all(mask[head:end]) else mask[head:end], output_text=trace.last_reply or "",
                    sampling_logprobs=logprobs, finish_reason=finish, truncated=finish == "length",
                    reward=0.0 if failed else float(trace.reward), reward_failed=failed,
                    reward_failure_reasons=reasons or None, weight_version=runs[0][0],
                    token_versions=runs if len(runs) > 1 else None)
    sample.validate_generated()
    stats.samples += 1
    stats.turns += len(spans)
    stats.sampled_tokens += sample.num_sampled_tokens
    stats.observation_tokens += len(sample.output_token_ids) - sample.num_sampled_tokens
    return sample


def _span_runs(span: _Span) -> list[tuple[int, int]]:
    if span.exchange is None:
        return [(-1, len(span.token_ids))]
    generation = span.exchange.generation
    return list(generation.version_runs or [(generation.weight_version, len(span.token_ids))])


class VerifiersEnvRunner:
    """One worker's verifiers environment: loaded and serving (its interception server, shared
    tool servers) from start() to close(); rollouts() runs a prompt's n episodes against the
    endpoint. Plain class: construct it without Ray around any openai_endpoint.Endpoint."""

    def __init__(self, config: VerifiersEnvConfig, endpoint: Any, model_path: str) -> None:
        self.config = config
        self.endpoint = endpoint
        self.model_path = model_path
        self.stats = VerifiersEnvStats()
        self._env: Any = None
        self._tasks: list[Any] = []
        self._stack: contextlib.AsyncExitStack | None = None

    async def start(self) -> None:
        import verifiers.v1 as vf

        prepare_chat_program()
        env = vf.load_environment(self.config.resolve())
        taskset = env.taskset
        if not taskset.bounded:
            raise ValueError(f"verifiers taskset {self.config.taskset!r} is infinite: a training run picks task "
                             "prompt_id % len(tasks); bound it in the taskset")
        self._tasks = list(taskset)
        if not self._tasks:
            raise ValueError(f"verifiers taskset {self.config.taskset!r} has no tasks")
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(env.serving())
        self._env, self._stack = env, stack
        logger.info("verifiers env %s over taskset %s (%d tasks) against %s", type(env).__name__,
                    self.config.taskset, len(self._tasks), self.endpoint.base_url)

    def _context(self, sampling: SamplingConfig, seed: int | None) -> Any:
        import verifiers.v1 as vf
        from renderers.configs import CustomRendererConfig

        client = vf.TrainClientConfig(base_url=self.endpoint.base_url, api_key_var="VERIFIERS_LOOPBACK_KEY",
                                      renderer=CustomRendererConfig(import_path=RENDERER_IMPORT_PATH),
                                      renderer_model_name=self.model_path)
        knobs: dict[str, Any] = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                                 "top_p": sampling.top_p}
        if seed is not None:
            knobs["seed"] = seed
        return vf.ModelContext(client=client, model=self.endpoint.config.model_name,
                               sampling=vf.SamplingConfig(**knobs))

    async def episodes(self, prompt: Sample, sampling: SamplingConfig) -> list[Any]:
        """The prompt's sampling.n verifiers episodes of task prompt_id % len(tasks), concurrently. A
        seeded config gives episode i the seed derive_seed(seed, prompt_id, i) for all its requests."""
        if self._env is None:
            raise RuntimeError("VerifiersEnvRunner.start() was not awaited")
        task = self._tasks[prompt.prompt_id % len(self._tasks)]
        seeds = [None if sampling.seed is None else derive_seed(sampling.seed, max(prompt.prompt_id, 0), i,
                                                                 bound=SEED_BOUND) for i in range(sampling.n)]
        return list(await asyncio.gather(*(self._env.run_slot(slot, self._context(sampling, seed))
                                           for slot, seed in zip(self._env.slots(task, sampling.n), seeds))))

    async def rollouts(self, prompt: Sample, sampling: SamplingConfig) -> list[Sample]:
        """The prompt's sampling.n episodes as Samples (sample_from_episode)."""
        return [sample_from_episode(prompt, episode, self.endpoint, self.stats)
                for episode in await self.episodes(prompt, sampling)]

    async def close(self) -> None:
        if self._stack is not None:
            stack, self._stack, self._env = self._stack, None, None
            await stack.aclose()


class VerifiersSource:
    """A generation worker's verifiers rollouts: the first request naming an environment
    (`sampling.verifiers`) starts the worker's endpoint (if it serves none yet) and that
    environment, which then serves every later request naming it (e.g. a training and an
    evaluation environment side by side)."""

    def __init__(self, model_path: str, start_endpoint: Callable[[], Awaitable[Any]]) -> None:
        self.model_path = model_path
        self._start_endpoint = start_endpoint
        self._lock = asyncio.Lock()
        self.runners: dict[VerifiersEnvConfig, VerifiersEnvRunner] = {}

    async def _runner(self, config: VerifiersEnvConfig) -> VerifiersEnvRunner:
        async with self._lock:  # concurrent first requests start one environment
            if config not in self.runners:
                runner = VerifiersEnvRunner(config, await self._start_endpoint(), self.model_path)
                await runner.start()
                self.runners[config] = runner
            return self.runners[config]

    async def rollouts(self, prompt: Sample, sampling: SamplingConfig) -> list[Sample]:
        return await (await self._runner(sampling.verifiers)).rollouts(prompt, sampling)

    def metrics(self) -> dict[str, float]:
        """verifiers/* counters summed over the environments this worker runs."""
        total: dict[str, float] = {}
        for runner in self.runners.values():
            for key, value in runner.stats.metrics().items():
                total[key] = total.get(key, 0.0) + value
        return total

    async def close(self) -> None:
        runners, self.runners = list(self.runners.values()), {}
        for runner in runners:
            await runner.close()
