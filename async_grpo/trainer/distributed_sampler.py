"""The trainer's prompt sampler: endless, seeded, sharded across data-parallel ranks, resumable.

Pure (numpy only). prompt_feeder.PromptFeeder draws each step's prompt indices from it:

    sampler = InfiniteDistributedSampler(num_items=1000, rank=0, world_size=2, seed=0)
    indices = sampler.next_batch(8)         # 8 of this rank's 500 per epoch
    state = sampler.state_dict()            # JSON; load_state_dict(state) resumes every rank
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np


class InfiniteDistributedSampler:
    """Endless prompt indices for one data-parallel rank: each epoch a fresh seeded permutation,
    dealt round-robin to the ranks, so the ranks' shards of an epoch are disjoint.

    The last `num_items % world_size` indices of each epoch's permutation are dropped, so every
    rank draws exactly `num_items // world_size` per epoch and no index repeats within an epoch;
    since each epoch permutes afresh, the dropped ones differ from epoch to epoch.

    Every rank draws the same number of indices per step, so epoch and position are the same on
    all ranks: one rank's state_dict() resumes them all exactly where they were.

    A state may also name positions ahead to pass over once (`skip`): prompts already trained
    although drawn after the state's position (dynamic sampling's extra prompts for an earlier
    step, drawn after a later step's prompts; see prompt_feeder.PromptFeeder).
    """

    def __init__(self, num_items: int, rank: int, world_size: int, seed: int) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"InfiniteDistributedSampler: world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"InfiniteDistributedSampler: rank must be in [0, {world_size}), got {rank!r}")
        if not isinstance(num_items, int) or num_items < world_size:
            raise ValueError(
                f"InfiniteDistributedSampler: num_items ({num_items!r}) must be an int >= world_size ({world_size}), "
                "so that every rank gets at least one item per epoch"
            )
        self.num_items = num_items
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_rank = num_items // world_size
        self._epoch = 0
        self._position = 0
        self._shard = self._epoch_shard(0)
        self._skip: set[tuple[int, int]] = set()
        """(epoch, position) pairs ahead that are passed over once."""

    @property
    def epoch(self) -> int:
        """Epoch the next index comes from (0-based)."""
        return self._epoch

    def _epoch_shard(self, epoch: int) -> list[int]:
        permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
        return permutation[self.rank : self.per_rank * self.world_size : self.world_size].tolist()

    def _next_index(self) -> int:
        return self.next_drawn(1)[0][0]

    def next_drawn(self, k: int) -> list[tuple[int, tuple[int, int]]]:
        """The next k (index, (epoch, position)) pairs: what next_batch draws, and where from."""
        drawn = []
        while len(drawn) < k:
            if self._position == self.per_rank:
                self._epoch += 1
                self._position = 0
                self._shard = self._epoch_shard(self._epoch)
            where = (self._epoch, self._position)
            self._position += 1
            if where in self._skip:
                self._skip.discard(where)
                continue
            drawn.append((self._shard[where[1]], where))
        return drawn

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self._next_index()

    def next_batch(self, k: int) -> list[int]:
        """The next k indices of this rank (crossing into the next epoch when one runs out)."""
        if k < 0:
            raise ValueError(f"InfiniteDistributedSampler.next_batch: k must be >= 0, got {k}")
        return [index for index, _ in self.next_drawn(k)]

    def state_dict(self) -> dict[str, int]:
        """JSON-serialisable position: the epoch, the indices already drawn from it, and the
        settings that must match on resume."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_items": self.num_items,
            "world_size": self.world_size,
            "seed": self.seed,
            "skip": [list(where) for where in sorted(self._skip)],
        }

    @staticmethod
    def with_skipped(state: dict[str, Any], positions: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """A copy of `state` that also passes over `positions` at or after its own position."""
        here = (state["epoch"], state["position"])
        skip = {tuple(w) for w in state.get("skip", [])} | {tuple(w) for w in positions if tuple(w) >= here}
        return {**state, "skip": [list(w) for w in sorted(skip)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict(); refuses one taken with another dataset size, world size or seed."""
        for name in ("num_items", "world_size", "seed"):
            if state.get(name) != getattr(self, name):
                raise ValueError(
                    f"InfiniteDistributedSampler.load_state_dict: {name} is {state.get(name)!r} in the saved state "
                    f"but {getattr(self, name)!r} here; resuming would draw different data"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"InfiniteDistributedSampler.load_state_dict: epoch must be an int >= 0, got {epoch!r}")
        if not isinstance(position, int) or not 0 <= position <= self.per_rank:
            raise ValueError(
                f"InfiniteDistributedSampler.load_state_dict: position must be in [0, {self.per_rank}], got {position!r}"
            )
        self._epoch, self._position = epoch, position
        self._shard = self._epoch_shard(epoch)
        self._skip = {(int(e), int(p)) for e, p in state.get("skip", [])}
