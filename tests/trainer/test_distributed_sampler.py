"""distributed_sampler.py: the trainer's endless, sharded, resumable prompt sampler."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler


def test_sampler_ranks_are_disjoint_within_each_epoch() -> None:
    num_items, world_size = 11, 3  # 11 % 3 = 2 items dropped per epoch
    samplers = [InfiniteDistributedSampler(num_items, rank, world_size, seed=5) for rank in range(world_size)]
    for epoch in range(4):
        shards = [s.next_batch(3) for s in samplers]
        drawn = [i for shard in shards for i in shard]
        assert len(set(drawn)) == 9, f"epoch {epoch}: ranks overlap: {shards}"
        assert all(0 <= i < num_items for i in drawn)
        assert all(s.epoch == epoch for s in samplers)
    assert samplers[0].next_batch(1) and samplers[0].epoch == 4


def test_sampler_is_deterministic_and_reshuffles_each_epoch() -> None:
    a = InfiniteDistributedSampler(20, 1, 2, seed=0).next_batch(40)
    b = InfiniteDistributedSampler(20, 1, 2, seed=0).next_batch(40)
    c = InfiniteDistributedSampler(20, 1, 2, seed=1).next_batch(40)
    assert a == b and a != c
    epochs = [a[i : i + 10] for i in range(0, 40, 10)]
    assert all(len(set(e)) == 10 for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4
    single = InfiniteDistributedSampler(6, 0, 1, seed=0)
    assert sorted(single.next_batch(6)) == list(range(6))  # world_size 1: every item once per epoch
    assert list(islice(iter(InfiniteDistributedSampler(20, 1, 2, seed=0)), 40)) == a


@pytest.mark.parametrize("drawn_before_save", [0, 7, 10, 23])
def test_sampler_resumes_exactly_from_a_json_state(drawn_before_save: int) -> None:
    original = InfiniteDistributedSampler(20, 0, 2, seed=9)
    original.next_batch(drawn_before_save)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = InfiniteDistributedSampler(20, 0, 2, seed=9)
    resumed.load_state_dict(state)
    assert resumed.next_batch(25) == original.next_batch(25)


def test_one_ranks_state_resumes_every_rank() -> None:
    rank0, rank1 = (InfiniteDistributedSampler(20, r, 2, seed=2) for r in (0, 1))
    rank0.next_batch(13)
    rank1.next_batch(13)
    resumed1 = InfiniteDistributedSampler(20, 1, 2, seed=2)
    resumed1.load_state_dict(rank0.state_dict())
    assert resumed1.next_batch(15) == rank1.next_batch(15)


def test_sampler_rejects_mismatched_state_and_bad_arguments() -> None:
    sampler = InfiniteDistributedSampler(20, 0, 2, seed=0)
    for name, value in (("seed", 1), ("num_items", 21), ("world_size", 4)):
        with pytest.raises(ValueError, match=f"{name} is {value}"):
            sampler.load_state_dict({**sampler.state_dict(), name: value})
    with pytest.raises(ValueError, match="position"):
        sampler.load_state_dict({**sampler.state_dict(), "position": 11})
    with pytest.raises(ValueError, match="num_items"):
        InfiniteDistributedSampler(1, 0, 2, seed=0)
    with pytest.raises(ValueError, match="rank"):
        InfiniteDistributedSampler(10, 2, 2, seed=0)
    with pytest.raises(ValueError, match="k must be"):
        sampler.next_batch(-1)
