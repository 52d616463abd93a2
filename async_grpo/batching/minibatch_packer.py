"""MinibatchPacker: one step's samples, as they arrive, cut into token-budgeted minibatches per rank.

Plain and synchronous (no Ray, no asyncio): the experience batcher feeds it each prepared sample
and sends what it returns; tests and `python -m benchmarks.batcher` drive it directly.
"""

from __future__ import annotations

import logging

from async_grpo.batching.batcher_messages import LOSS_WEIGHT, PADDING_LOSS_WEIGHT, Minibatch
from async_grpo.batching.step_stats import StepStats
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)


class MinibatchPacker:
    """Assigns one step's samples to ranks and cuts token-budgeted minibatches as they arrive.

    Each sample goes to the rank with the fewest tokens assigned so far, so rank totals differ by
    at most one sample's tokens, and with at least world_size samples every rank gets one (an
    empty rank is always the least loaded). It joins that rank's open minibatch; when it does
    not fit, the open minibatch is closed and returned for dispatch first. A sample over the
    budget is sent alone and counted: a fallback, since the trainer refuses a config under which
    one could occur unless its oversized_sample_policy is train_alone. With `reorder_window` > 0
    up to that many samples wait, and the rank's open minibatch takes the largest waiting sample
    that still fits (best fit), closing only when none does: fewer, fuller minibatches at the
    price of a short hold-back.
    """

    def __init__(self, *, step: int, world_size: int, max_tokens_per_gpu: int, reorder_window: int = 0) -> None:
        if world_size < 1 or max_tokens_per_gpu < 1 or reorder_window < 0:
            raise ValueError(
                f"MinibatchPacker needs world_size >= 1, max_tokens_per_gpu >= 1, reorder_window >= 0; got "
                f"{world_size}, {max_tokens_per_gpu}, {reorder_window}"
            )
        self.step = step
        self.world_size = world_size
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.reorder_window = reorder_window
        self.rank_tokens = [0] * world_size
        """Tokens assigned to each rank so far (dispatched and open), padding excluded."""
        self.minibatches_per_rank = [0] * world_size
        """Minibatches emitted to each rank so far, padding included."""
        self.num_samples = 0
        self.num_tokens = 0
        self.num_output_tokens = 0
        self.oversized_samples = 0
        self.padding_minibatches = 0
        self._waiting: list[Sample] = []
        self._open: list[list[Sample]] = [[] for _ in range(world_size)]
        self._open_tokens = [0] * world_size
        self._smallest: Sample | None = None
        self._finished = False

    def add(self, sample: Sample) -> list[Minibatch]:
        """Take one sample (it will carry loss); return the minibatches now ready to send."""
        if self._finished:
            raise RuntimeError(f"MinibatchPacker(step={self.step}).add after finish")
        if sample.num_tokens < 1:
            raise ValueError(f"sample prompt_id={sample.prompt_id} has no tokens")
        self.num_samples += 1
        self.num_tokens += sample.num_tokens
        self.num_output_tokens += sample.num_sampled_tokens  # token_mean divides by trained (sampled) tokens
        if self._smallest is None or sample.num_tokens < self._smallest.num_tokens:
            self._smallest = sample
        self._waiting.append(sample)
        ready: list[Minibatch] = []
        while len(self._waiting) > self.reorder_window:
            ready.extend(self._place_one())
        return ready

    def finish(self) -> list[Minibatch]:
        """Place the waiting samples, flush open minibatches, then pad every rank to the same count.

        Padding minibatches hold the step's smallest sample with loss_weight PADDING_LOSS_WEIGHT,
        so the padded pass is a real forward/backward that adds nothing to the gradient. A step
        without samples gives no minibatches at all.
        """
        if self._finished:
            raise RuntimeError(f"MinibatchPacker(step={self.step}).finish called twice")
        ready = self.flush()
        self._finished = True
        return ready

    def flush(self) -> list[Minibatch]:
        """What finish does, without ending the step: every rank then holds the same number of
        minibatches, so ranks that stop reading after them (to answer a PromptRequest) have run
        the same forward/backward passes and none waits in a collective for the others."""
        if self._finished:
            raise RuntimeError(f"MinibatchPacker(step={self.step}).flush after finish")
        ready: list[Minibatch] = []
        while self._waiting:
            ready.extend(self._place_one())
        for rank in range(self.world_size):
            ready.extend(self._close(rank))
        target = max(self.minibatches_per_rank)
        for rank in range(self.world_size):
            while self.minibatches_per_rank[rank] < target:
                assert self._smallest is not None  # target > 0 means some sample was added
                ready.append(self._emit(rank, [self._smallest], PADDING_LOSS_WEIGHT))
                self.padding_minibatches += 1
        return ready

    def _place_one(self) -> list[Minibatch]:
        """Put one waiting sample on the least-loaded rank, closing its open minibatch if needed."""
        rank = min(range(self.world_size), key=self.rank_tokens.__getitem__)
        ready: list[Minibatch] = []
        choice = self._best_fit(self.max_tokens_per_gpu - self._open_tokens[rank])
        if choice is None:
            ready.extend(self._close(rank))
            choice = max(range(len(self._waiting)), key=lambda i: self._waiting[i].num_tokens)
        sample = self._waiting.pop(choice)
        self.rank_tokens[rank] += sample.num_tokens
        if sample.num_tokens > self.max_tokens_per_gpu:
            self.oversized_samples += 1
            logger.warning(
                "step %d: sample prompt_id=%d has %d tokens, over max_tokens_per_gpu=%d; sent alone",
                self.step, sample.prompt_id, sample.num_tokens, self.max_tokens_per_gpu,
            )
            ready.append(self._emit(rank, [sample], LOSS_WEIGHT))
            return ready
        self._open[rank].append(sample)
        self._open_tokens[rank] += sample.num_tokens
        if self._open_tokens[rank] == self.max_tokens_per_gpu:
            ready.extend(self._close(rank))  # exactly full: nothing more can join, send it now
        return ready

    def _best_fit(self, room: int) -> int | None:
        """Index of the largest waiting sample with at most `room` tokens, or None."""
        best: int | None = None
        for i, sample in enumerate(self._waiting):
            if sample.num_tokens <= room and (best is None or sample.num_tokens > self._waiting[best].num_tokens):
                best = i
        return best

    def _close(self, rank: int) -> list[Minibatch]:
        """Emit the rank's open minibatch if it has samples."""
        if not self._open[rank]:
            return []
        samples, self._open[rank], self._open_tokens[rank] = self._open[rank], [], 0
        return [self._emit(rank, samples, LOSS_WEIGHT)]

    def _emit(self, rank: int, samples: list[Sample], loss_weight: float) -> Minibatch:
        index = self.minibatches_per_rank[rank]
        self.minibatches_per_rank[rank] += 1
        return Minibatch(step=self.step, rank=rank, index=index, samples=samples, loss_weight=loss_weight)


def record_packing(stats: StepStats, packer: MinibatchPacker) -> None:
    """Copy a finished packer's totals into the step's stats."""
    stats.num_samples, stats.num_tokens = packer.num_samples, packer.num_tokens
    stats.num_output_tokens = packer.num_output_tokens
    stats.num_minibatches = max(packer.minibatches_per_rank)
    stats.padding_minibatches = packer.padding_minibatches
    stats.loss_minibatches = sum(packer.minibatches_per_rank) - packer.padding_minibatches
    stats.oversized_samples = packer.oversized_samples
