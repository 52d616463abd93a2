"""What the experience batcher sends each trainer rank, and the per-rank mailboxes that hold it.

A rank reads `Minibatch`es of a step, possibly a `PromptRequest` (dynamic sampling), then the
step's `EndOfStep`; a failed step wakes its readers with `ExperienceBatcherError`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from async_grpo.batching.step_stats import StepCounts
from sample_processing_utils import Sample

LOSS_WEIGHT = 1.0
"""loss_weight of a minibatch whose samples carry loss."""
PADDING_LOSS_WEIGHT = 0.0
"""loss_weight of a padding minibatch: a real forward/backward whose loss is multiplied away."""


@dataclass(slots=True)
class Minibatch:
    """Samples for one forward/backward pass on one rank."""

    step: int
    """Training step (= the weight version it trains at) the samples belong to."""
    rank: int
    """Trainer rank that receives it; with context parallelism the group (its cp ranks all receive it)."""
    index: int
    """Position among this (step, rank)'s minibatches, from 0."""
    samples: list[Sample]
    """The samples, packed by the trainer into one token stream (total <= max_tokens_per_gpu, x
    context_parallel for a group, except a single oversized sample, which travels alone)."""
    loss_weight: float
    """LOSS_WEIGHT, or PADDING_LOSS_WEIGHT for a padding minibatch (its loss must not count)."""

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens over all samples."""
        return sum(s.num_tokens for s in self.samples)


@dataclass(slots=True, kw_only=True)
class EndOfStep(StepCounts):
    """Last message of a step for one rank; the counts (step_stats.StepCounts, declared there
    once) are step totals over all ranks."""


@dataclass(slots=True)
class PromptRequest:
    """Asks a rank for `count` more prompts of `step` (dynamic sampling): the rank draws them from
    its data order and submits them with submit_prompts(..., round=round_index), then goes on
    reading the step's messages."""

    step: int
    count: int
    """Prompts this rank is asked for (every rank is asked for the same number; with context
    parallelism the group's first rank submits them for its group)."""
    round_index: int
    """1 for the first resampling round, 2 for the second, ..."""


class ExperienceBatcherError(RuntimeError):
    """A step cannot complete: a registry request failed. The message carries the cause."""


BatcherMessage = Minibatch | EndOfStep | PromptRequest
"""What a rank reads from the batcher."""


@dataclass(slots=True)
class _StepFailed:
    """Mailbox item that wakes a rank waiting on a step that failed."""


class RankMailboxes:
    """One queue per rank for one step's messages; `fail` replaces whatever waits with a wake-up
    that makes every reader raise."""

    def __init__(self, world_size: int) -> None:
        self._queues: list[asyncio.Queue[BatcherMessage | _StepFailed]] = [asyncio.Queue() for _ in range(world_size)]

    def put(self, rank: int, message: BatcherMessage) -> None:
        self._queues[rank].put_nowait(message)

    def broadcast(self, message: EndOfStep | PromptRequest) -> None:
        """The same message to every rank."""
        for queue in self._queues:
            queue.put_nowait(message)

    def fail(self) -> None:
        """Drop undelivered messages; every rank's next get returns None."""
        for queue in self._queues:
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(_StepFailed())

    async def get(self, rank: int) -> BatcherMessage | None:
        """The rank's next message; None once the step has failed."""
        message = await self._queues[rank].get()
        return None if isinstance(message, _StepFailed) else message
