"""Rollout fetcher: one prompt's rollouts from the generation registry, then their logprobs from
the logprob, reference and teacher registries, through the registries' clients.

The experience batcher runs one `RolloutFetcher.fetch` per submitted prompt; what comes back
(`PromptRollouts`) is ready to group, prepare and pack, with every rollout it left out counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Literal, Protocol

import ray
from ray.actor import ActorHandle

from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import INITIAL_WEIGHT_VERSION, Sample, TokenLogprobs

logger = logging.getLogger(__name__)

LogprobField = Literal["ref_logprobs", "old_logprobs"]
"""The Sample field the logprob registry's answers fill."""


class RequestClient(Protocol):
    """Where the batcher sends requests: a worker registry, or a test double in unit tests."""

    async def submit(self, method: str, *args: Any, cost: int) -> Any:
        """Run `method(*args)` on some worker; `cost` is the registry's load unit."""
        ...


class RayRegistryClient:
    """`RequestClient` over a registry actor handle (vllm_registry's `submit`)."""

    def __init__(self, handle: ActorHandle) -> None:
        self._handle = handle

    async def submit(self, method: str, *args: Any, cost: int) -> Any:
        ref = self._handle.submit.remote(method, *args, cost=cost)
        try:
            return await ref
        except asyncio.CancelledError:
            # The prompt hit its deadline or its step failed: stop the remote request too, so it
            # stops holding a worker slot (best effort; a finished request ignores the cancel).
            ray.cancel(ref)
            raise


@dataclass(slots=True)
class PromptRollouts:
    """What one prompt produced."""

    fresh: list[Sample]
    """Rollouts within max_lag (counted from their oldest token's version), logprobs filled: they
    go to the packer."""
    stale: int
    """Rollouts dropped for staleness."""
    missing: int
    """sampling.n minus the rollouts the generation worker returned."""
    generate_s: float
    logprob_s: float
    dropped_logprob_version: int = 0
    """Rollouts dropped because their old-policy logprobs came from older weights than sampled them."""
    teacher_s: float = 0.0
    """Time the teacher pool took for the group (0 without distillation)."""


class RolloutFetcher:
    """Sends a prompt for rollouts and its fresh rollouts for logprobs; no state between prompts.

    `logprob` fills `logprob_field` (None: no logprob requests); `reference` fills ref_logprobs
    and `teacher` teacher_logprobs from frozen pools. All logprob services of a group run at once.
    """

    def __init__(self, *, generation: RequestClient, max_lag: int, logprob: RequestClient | None = None,
                 logprob_field: LogprobField | None = None, reference: RequestClient | None = None,
                 teacher: RequestClient | None = None) -> None:
        if (logprob is None) != (logprob_field is None):
            raise ValueError("RolloutFetcher: logprob and logprob_field go together")
        self._generation = generation
        self._max_lag = max_lag
        self._logprob = logprob
        self._logprob_field = logprob_field
        self._reference = reference
        self._teacher = teacher

    async def fetch(self, step: int, sample: Sample, sampling: SamplingConfig) -> PromptRollouts:
        """Generate sampling.n rollouts, drop the stale ones, fill logprobs of the rest."""
        n = sampling.n
        started = time.monotonic()
        rollouts: list[Sample] = await self._generation.submit("generate", sample, sampling, cost=n)
        generated = time.monotonic()
        if len(rollouts) > n:
            raise ValueError(f"generate returned {len(rollouts)} rollouts for prompt_id={sample.prompt_id}, n={n}")
        # A rollout that straddles a weight push is as stale as its oldest token.
        fresh = [r for r in rollouts if step - r.oldest_version() <= self._max_lag]
        stale = len(rollouts) - len(fresh)
        if stale:
            logger.info(
                "step %d: prompt_id=%d: %d rollouts older than max_lag=%d dropped (oldest token versions %s)",
                step, sample.prompt_id, stale, self._max_lag, sorted({r.oldest_version() for r in rollouts}),
            )
        kept, teacher_s = (await self._fill_all(fresh)) if fresh else (fresh, 0.0)
        return PromptRollouts(
            fresh=kept,
            stale=stale,
            missing=n - len(rollouts),
            generate_s=generated - started,
            logprob_s=time.monotonic() - generated,
            dropped_logprob_version=len(fresh) - len(kept),
            teacher_s=teacher_s,
        )

    async def _fill_all(self, fresh: list[Sample]) -> tuple[list[Sample], float]:
        """Every logprob service at once (the slowest sets the pace); only the old-policy answers
        can drop rollouts (their version check). The rollouts kept, and the teacher's seconds."""
        services: list[Awaitable[Any]] = []
        if self._logprob is not None:
            services.append(self._fill_logprobs(fresh))
        if self._reference is not None:
            services.append(_fill_frozen(self._reference, "reference pool", fresh, "ref_logprobs"))
        if self._teacher is not None:
            services.append(_timed(_fill_frozen(self._teacher, "teacher pool", fresh, "teacher_logprobs")))
        answers = await asyncio.gather(*services)
        kept = answers[0] if self._logprob is not None else fresh
        teacher_s = answers[-1] if self._teacher is not None else 0.0
        return kept, teacher_s

    async def _fill_logprobs(self, rollouts: list[Sample]) -> list[Sample]:
        """Fill the group's logprobs with one registry call (the worker still batches per sample);
        returns the rollouts whose logprobs' weight version passes the check.

        Reference logprobs must come from the loaded checkpoint (INITIAL_WEIGHT_VERSION): anything
        else is an error. Old-policy logprobs must come from weights at least as new as those
        that sampled the rollout (all of them: its newest token's version, for a rollout that
        straddles a push); older ones (a restarted worker still on base weights) are dropped and
        counted, never silently trained on.
        """
        assert self._logprob is not None and self._logprob_field is not None
        target = self._logprob_field
        cost = sum(r.num_tokens for r in rollouts)
        answers: list[TokenLogprobs] = await self._logprob.submit("compute_group_logprobs", rollouts, cost=cost)
        if len(answers) != len(rollouts):
            raise ValueError(
                f"compute_group_logprobs returned {len(answers)} answers for {len(rollouts)} rollouts "
                f"(prompt_id={rollouts[0].prompt_id})"
            )
        kept = []
        for rollout, answer in zip(rollouts, answers):
            if len(answer.values) != rollout.num_sampled_tokens:
                raise ValueError(
                    f"compute_group_logprobs returned {len(answer.values)} values for "
                    f"{rollout.num_sampled_tokens} sampled output tokens (prompt_id={rollout.prompt_id})"
                )
            if target == "ref_logprobs" and answer.weight_version != INITIAL_WEIGHT_VERSION:
                raise ValueError(f"reference logprobs computed with weight version {answer.weight_version}: the "
                                 f"reference worker must serve the initial checkpoint (prompt_id={rollout.prompt_id})")
            if target == "old_logprobs" and answer.weight_version < rollout.newest_version():
                logger.warning("prompt_id=%d: old-policy logprobs from weights v%d for a rollout sampled with v%d; "
                               "dropped", rollout.prompt_id, answer.weight_version, rollout.newest_version())
                continue
            setattr(rollout, target, [float(v) for v in answer.values])
            kept.append(rollout)
        return kept


async def _timed(work: Awaitable[Any]) -> float:
    """Await `work`; the seconds it took."""
    started = time.monotonic()
    await work
    return time.monotonic() - started


async def _fill_frozen(client: RequestClient, label: str, rollouts: list[Sample], field_name: str) -> None:
    """Fill `field_name` from a frozen logprob pool (reference or teacher: the model it loaded,
    weight version -1), one call for the group."""
    cost = sum(r.num_tokens for r in rollouts)
    answers: list[TokenLogprobs] = await client.submit("compute_group_logprobs", rollouts, cost=cost)
    if len(answers) != len(rollouts):
        raise ValueError(f"{label} returned {len(answers)} answers for {len(rollouts)} rollouts "
                         f"(prompt_id={rollouts[0].prompt_id})")
    for rollout, answer in zip(rollouts, answers):
        if len(answer.values) != rollout.num_sampled_tokens or answer.weight_version != INITIAL_WEIGHT_VERSION:
            raise ValueError(f"{label} answered {len(answer.values)} values at weight version "
                             f"{answer.weight_version} for {rollout.num_sampled_tokens} sampled output tokens "
                             f"(prompt_id={rollout.prompt_id}); expected one per token from its loaded model")
        setattr(rollout, field_name, [float(v) for v in answer.values])
