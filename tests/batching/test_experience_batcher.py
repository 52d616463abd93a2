"""Experience batcher: packing rules, staleness, deadlines, error propagation, step routing.

Packer tests feed `MinibatchPacker` directly (no Ray, no asyncio) and check its promises from the
minibatches it returns. Batcher tests run the plain `ExperienceBatcher` on asyncio with in-process
stand-ins for the two registries (support.batcher_fakes). The Ray tests at the end go through the
real actor (`get_or_create_batcher`) with small registry stand-in actors, and once with a real
`vllm_registry` registry that has no workers.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from typing import Any

import pytest
import ray

from async_grpo.batching.batcher_messages import (
    LOSS_WEIGHT, PADDING_LOSS_WEIGHT, EndOfStep, ExperienceBatcherError, Minibatch,
)
from async_grpo.batching.minibatch_packer import MinibatchPacker
from async_grpo.config.actor_names import BATCHER_ACTOR_NAME, GENERATION, RAY_NAMESPACE
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample, TokenLogprobs
from support import batcher_fakes
from support.batcher_fakes import (
    ROLLOUTS_PER_PROMPT, WAIT_BOUND_S, FakeGeneration, FakeLogprob, batcher_config, fake_logprobs, fake_output_length,
    fake_prompts, fake_rollouts, fake_sample,
)
from vllm_experience_batcher import ExperienceBatcher, get_or_create_batcher
from vllm_registry import Bundle, RegistryActor, RegistryConfig, serve_many

# Ray workers cannot import this test module or support (tests/ is not on their path): ship the
# stand-in actors and the builders they call by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(batcher_fakes)

# Prompt deadline of the timeout test: long enough for every answering stand-in to finish many
# times over on a loaded 2-core machine, so only the prompt whose stand-in never answers reaches it.
_DEADLINE_S = 5.0
_N = ROLLOUTS_PER_PROMPT  # rollouts per prompt in the batcher tests (batcher_config's sampling.n)


# --------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------


def _pack(sizes: list[int], world_size: int, budget: int, window: int) -> tuple[MinibatchPacker, list[Minibatch], list[Sample]]:
    packer = MinibatchPacker(step=5, world_size=world_size, max_tokens_per_gpu=budget, reorder_window=window)
    samples = [fake_sample(i, 1, size - 1) for i, size in enumerate(sizes)]
    out: list[Minibatch] = []
    for sample in samples:
        out.extend(packer.add(sample))
    out.extend(packer.finish())
    return packer, out, samples


# --------------------------------------------------------------------------------------------
# MinibatchPacker
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("seed", range(6))
def test_packer_invariants_on_random_steps(seed: int, window: int) -> None:
    rng = random.Random(seed)
    world_size, budget = rng.randint(1, 5), 100
    sizes = [rng.choice([rng.randint(1, 40), rng.randint(40, 100), rng.randint(101, 130)]) for _ in range(rng.randint(world_size, 60))]
    packer, out, samples = _pack(sizes, world_size, budget, window)

    real = [mb for mb in out if mb.loss_weight == LOSS_WEIGHT]
    padding = [mb for mb in out if mb.loss_weight == PADDING_LOSS_WEIGHT]
    assert len(real) + len(padding) == len(out), "loss_weight is either 1 or 0"
    # Every sample in exactly one loss-carrying minibatch.
    assert sorted(id(s) for mb in real for s in mb.samples) == sorted(id(s) for s in samples)
    # Budget: only a lone sample may exceed it, and each oversized sample is counted.
    for mb in real:
        assert mb.num_tokens <= budget or len(mb.samples) == 1
    assert packer.oversized_samples == sum(size > budget for size in sizes)
    # Every rank has work, and rank totals differ by at most the largest sample.
    rank_tokens = [sum(mb.num_tokens for mb in real if mb.rank == r) for r in range(world_size)]
    assert all(t > 0 for t in rank_tokens)
    assert max(rank_tokens) - min(rank_tokens) <= max(sizes)
    # Equal pass counts per rank, indices 0..k-1 in emission order, padding is one real sample.
    per_rank = [[mb.index for mb in out if mb.rank == r] for r in range(world_size)]
    assert all(indices == list(range(len(per_rank[0]))) for indices in per_rank)
    assert all(mb.step == 5 for mb in out)
    for mb in padding:
        assert len(mb.samples) == 1 and mb.samples[0].num_tokens == min(sizes)
    assert packer.padding_minibatches == len(padding)
    # Totals exclude padding.
    assert packer.num_samples == len(sizes) and packer.num_tokens == sum(sizes)


def test_packer_pads_short_ranks_with_zero_weight_minibatches() -> None:
    # Rank 0 takes 90, rank 1 takes 90, the third 90 goes to rank 0 (tie -> lowest rank) and
    # does not fit: rank 0 ends with two minibatches, rank 1 with one, so rank 1 gets a pad.
    packer, out, samples = _pack([90, 90, 90], world_size=2, budget=100, window=0)
    assert [(mb.rank, mb.index, mb.loss_weight) for mb in out] == [
        (0, 0, LOSS_WEIGHT), (0, 1, LOSS_WEIGHT), (1, 0, LOSS_WEIGHT), (1, 1, PADDING_LOSS_WEIGHT),
    ]
    assert out[3].samples[0] in samples
    assert (packer.num_samples, packer.num_tokens, packer.padding_minibatches) == (3, 270, 1)


def test_packer_dispatches_as_soon_as_a_minibatch_is_closed() -> None:
    packer = MinibatchPacker(step=0, world_size=1, max_tokens_per_gpu=100, reorder_window=0)
    a, b, c, d = fake_sample(0, 60), fake_sample(1, 30), fake_sample(2, 20), fake_sample(3, 80)
    assert packer.add(a) == [] and packer.add(b) == []
    closed = packer.add(c)  # 60 + 30 + 20 > 100: the open minibatch goes now, c starts the next
    assert [mb.samples for mb in closed] == [[a, b]]
    exactly_full = packer.add(d)  # 20 + 80 == 100: nothing else can join, sent without waiting
    assert [mb.samples for mb in exactly_full] == [[c, d]]
    assert packer.finish() == []


def test_packer_sends_an_oversized_sample_alone_after_the_open_minibatch() -> None:
    packer = MinibatchPacker(step=0, world_size=2, max_tokens_per_gpu=100, reorder_window=0)
    small0, small1, big = fake_sample(0, 30), fake_sample(1, 30), fake_sample(2, 150)
    assert packer.add(small0) == [] and packer.add(small1) == []
    ready = packer.add(big)  # rank 0 (tie) holds small0 open: it is sent first, then big alone
    assert [(mb.rank, mb.index, mb.samples) for mb in ready] == [(0, 0, [small0]), (0, 1, [big])]
    assert packer.oversized_samples == 1
    rest = packer.finish()
    assert [(mb.rank, mb.index, mb.loss_weight) for mb in rest] == [
        (1, 0, LOSS_WEIGHT), (1, 1, PADDING_LOSS_WEIGHT),
    ]


def test_packer_window_takes_the_best_fit() -> None:
    packer = MinibatchPacker(step=0, world_size=1, max_tokens_per_gpu=100, reorder_window=2)
    s70, s50, s30 = fake_sample(0, 70), fake_sample(1, 50), fake_sample(2, 30)
    assert packer.add(s70) == [] and packer.add(s50) == []  # held in the window
    assert packer.add(s30) == []  # window overflows: the largest (70) opens the minibatch
    # Arrival order would pack [70], [50, 30]; best fit puts 30 with 70 and fills it exactly.
    assert [mb.samples for mb in packer.finish()] == [[s70, s30], [s50]]


def test_packer_with_no_samples_sends_nothing() -> None:
    packer = MinibatchPacker(step=0, world_size=3, max_tokens_per_gpu=100)
    assert packer.finish() == []
    assert (packer.num_samples, packer.padding_minibatches) == (0, 0)
    with pytest.raises(RuntimeError):
        packer.add(fake_sample(0, 5))


@pytest.mark.parametrize(
    "field, value",
    [("world_size", 0), ("max_tokens_per_gpu", 0), ("prompt_deadline_s", 0.0), ("logprob_role", "new"),
     ("max_lag", -1), ("reorder_window", -1), ("context_parallel", 0), ("context_parallel", 3)],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        batcher_config(**{field: value})


# --------------------------------------------------------------------------------------------
# ExperienceBatcher on asyncio, with in-process registry stand-ins
# --------------------------------------------------------------------------------------------


async def _drain(batcher: ExperienceBatcher, rank: int, step: int) -> tuple[list[Minibatch], EndOfStep]:
    minibatches: list[Minibatch] = []
    while isinstance(message := await batcher.next_message(rank, step), Minibatch):
        minibatches.append(message)
    return minibatches, message


def _expected_tokens(prompt_ids: list[int], prompt_len: int = 4) -> int:
    return sum(prompt_len + fake_output_length(pid, i) for pid in prompt_ids for i in range(_N))


@pytest.mark.parametrize("role, field, other", [("reference", "ref_logprobs", "old_logprobs"),
                                                ("old_policy", "old_logprobs", "ref_logprobs")])
def test_batcher_fills_the_roles_logprobs_and_reports_step_totals(role: str, field: str, other: str) -> None:
    async def scenario() -> None:
        generation, logprob = FakeGeneration({}, {}), FakeLogprob(reference=role == "reference")
        batcher = ExperienceBatcher(batcher_config(logprob_role=role), generation, logprob)
        await batcher.submit_prompts(0, 0, fake_prompts(range(0, 3)))
        await batcher.submit_prompts(1, 0, fake_prompts(range(3, 5)))
        (mbs0, end0), (mbs1, end1) = await asyncio.gather(_drain(batcher, 0, 0), _drain(batcher, 1, 0))
        assert end0 == end1
        assert (end0.num_prompts, end0.num_samples, end0.num_tokens) == (5, 5 * _N, _expected_tokens(list(range(5))))
        assert len(mbs0) == len(mbs1) == end0.num_minibatches
        real = [s for mb in mbs0 + mbs1 if mb.loss_weight == LOSS_WEIGHT for s in mb.samples]
        assert Counter(s.prompt_id for s in real) == {pid: _N for pid in range(5)}
        for s in real:
            assert getattr(s, field) == fake_logprobs(s) and getattr(s, other) is None
        assert sorted(generation.calls) == [(pid, _N) for pid in range(5)]
        group_tokens: dict[int, int] = {}
        for s in real:
            group_tokens[s.prompt_id] = group_tokens.get(s.prompt_id, 0) + s.num_tokens
        assert sorted(logprob.calls) == sorted(group_tokens.items())  # one call per group, costed in tokens
        stats = batcher.stats()  # no step: the most recently completed one
        assert (stats["batcher/step"], stats["batcher/num_samples"], stats["batcher/num_prompts"]) == (0, 5 * _N, 5)
        assert all(value >= 0 for key, value in stats.items() if key.startswith("timing/"))
        assert batcher.stats(7) == {}

    asyncio.run(scenario())


def test_a_context_parallel_group_is_one_consumer_with_the_group_budget() -> None:
    """4 ranks, context_parallel 2: groups {0, 1} and {2, 3}. A group's first rank submits, both
    of its ranks receive the same minibatches of up to 2 x 40 tokens, and every sample (41-51
    tokens: over one rank's budget, within the group's) trains once, none counted oversized."""
    async def scenario() -> None:
        batcher = ExperienceBatcher(batcher_config(world_size=4, context_parallel=2), FakeGeneration({}, {}),
                                    FakeLogprob())
        with pytest.raises(ValueError, match="only the first rank of each group"):
            await batcher.submit_prompts(1, 0, [])
        await batcher.submit_prompts(0, 0, fake_prompts(range(0, 3), prompt_len=40))
        await batcher.submit_prompts(2, 0, fake_prompts(range(3, 5), prompt_len=40))
        drained = await asyncio.gather(*(_drain(batcher, rank, 0) for rank in range(4)))
        (group0, end), (copy0, _), (group1, _), (copy1, _) = drained
        assert all(rank_end == end for _, rank_end in drained)
        assert copy0 == group0 and copy1 == group1  # the same messages to each rank of a group
        assert {mb.rank for mb in group0} == {0} and {mb.rank for mb in group1} == {1}
        assert len(group0) == len(group1) == end.num_minibatches
        real = [s for mb in group0 + group1 if mb.loss_weight == LOSS_WEIGHT for s in mb.samples]
        assert Counter(s.prompt_id for s in real) == {pid: _N for pid in range(5)}
        assert (end.num_prompts, end.num_samples, end.num_tokens, end.oversized_samples) == (
            5, 5 * _N, _expected_tokens(list(range(5)), prompt_len=40), 0)
        assert all(s.num_tokens > 40 for s in real) and all(mb.num_tokens <= 80 for mb in group0 + group1)
        assert 0 < batcher.stats(0)["batcher/fill"] <= 1  # against the group's budget

    asyncio.run(scenario())


def test_batcher_without_a_logprob_role_sends_no_logprob_requests() -> None:
    async def scenario() -> None:
        batcher = ExperienceBatcher(batcher_config(logprob_role="none", world_size=1), FakeGeneration({}, {}), None)
        await batcher.submit_prompts(0, 0, fake_prompts(range(2)))
        mbs, end = await _drain(batcher, 0, 0)
        assert end.num_samples == 2 * _N
        assert all(s.ref_logprobs is None and s.old_logprobs is None for mb in mbs for s in mb.samples)

    asyncio.run(scenario())


def test_stale_rollouts_are_dropped_counted_and_not_scored() -> None:
    step, max_lag = 4, 1
    versions = {0: step - 2, 1: step - 1, 2: step}  # prompt 0 lags 2 versions: too stale

    async def scenario() -> None:
        logprob = FakeLogprob()
        batcher = ExperienceBatcher(batcher_config(world_size=1, max_lag=max_lag), FakeGeneration(versions, {}),
                                    logprob)
        await batcher.submit_prompts(0, step, fake_prompts(range(3)))
        mbs, end = await _drain(batcher, 0, step)
        assert end.dropped_stale == _N
        assert (end.num_samples, end.num_tokens) == (2 * _N, _expected_tokens([1, 2]))
        assert {s.prompt_id for mb in mbs for s in mb.samples} == {1, 2}
        assert {pid for pid, _ in logprob.calls} == {1, 2}  # no logprobs spent on dropped rollouts
        assert batcher.stats(step)["batcher/dropped_stale"] == _N

    asyncio.run(scenario())


def test_rollouts_straddling_a_push_are_as_stale_as_their_oldest_token() -> None:
    """max_lag counts from the oldest token: prompt 0's rollouts started on v2 and finished on v3,
    so at step 4 (max_lag 1) they are dropped although most of their tokens are recent enough;
    prompt 1's (v3 then v4) are kept, their token versions intact."""
    step, max_lag = 4, 1

    async def scenario() -> None:
        generation = FakeGeneration({0: step - 2, 1: step - 1}, {}, pushed_after_first_token={0: step - 1, 1: step})
        batcher = ExperienceBatcher(batcher_config(world_size=1, max_lag=max_lag), generation, FakeLogprob())
        await batcher.submit_prompts(0, step, fake_prompts(range(2)))
        mbs, end = await _drain(batcher, 0, step)
        assert (end.dropped_stale, end.num_samples) == (_N, _N)
        trained = [s for mb in mbs if mb.loss_weight == LOSS_WEIGHT for s in mb.samples]
        assert {s.prompt_id for s in trained} == {1}
        assert sorted(s.token_versions for s in trained) == sorted(
            [(step - 1, 1), (step, fake_output_length(1, i) - 1)] for i in range(_N))

    asyncio.run(scenario())


def test_old_policy_logprobs_older_than_a_rollouts_newest_token_are_dropped() -> None:
    """A rollout whose last tokens came from v2 needs old-policy logprobs from v2 or later: an
    answer from v1 (the weights its first token came from) is dropped and counted."""
    async def scenario() -> None:
        generation = FakeGeneration({0: 1, 1: 1}, {}, pushed_after_first_token={0: 2})
        batcher = ExperienceBatcher(batcher_config(logprob_role="old_policy", world_size=1), generation,
                                    FakeLogprob(claimed_version=1))
        await batcher.submit_prompts(0, 2, fake_prompts(range(2)))
        minibatches, end = await _drain(batcher, 0, 2)
        trained = Counter(s.prompt_id for mb in minibatches if mb.loss_weight == LOSS_WEIGHT for s in mb.samples)
        # fake_output_length(0, 0) is 1: that rollout has only its v1 token and keeps its logprobs.
        assert trained == {0: 1, 1: _N} and end.num_samples == _N + 1
        assert batcher.stats(2)["batcher/dropped_logprob_version"] == _N - 1

    asyncio.run(scenario())


def test_short_generate_answers_are_counted() -> None:
    async def scenario() -> None:
        batcher = ExperienceBatcher(batcher_config(world_size=1), FakeGeneration({}, {}, short_by=1), FakeLogprob())
        await batcher.submit_prompts(0, 0, fake_prompts(range(2)))
        _, end = await _drain(batcher, 0, 0)
        assert (end.missing_rollouts, end.num_samples) == (2, 2 * (_N - 1))

    asyncio.run(scenario())


def test_a_step_without_samples_sends_only_end_of_step() -> None:
    async def scenario() -> None:
        batcher = ExperienceBatcher(batcher_config(), FakeGeneration({}, {}), FakeLogprob())
        await batcher.submit_prompts(0, 0, [])
        await batcher.submit_prompts(1, 0, [])
        for rank in range(2):
            mbs, end = await _drain(batcher, rank, 0)
            assert mbs == [] and (end.num_samples, end.num_minibatches, end.num_prompts) == (0, 0, 0)
        with pytest.raises(ValueError, match="already finished"):
            await batcher.next_message(0, 0)

    asyncio.run(scenario())


def test_submit_checks_rank_and_duplicates() -> None:
    async def scenario() -> None:
        batcher = ExperienceBatcher(batcher_config(), FakeGeneration({}, {}), FakeLogprob())
        with pytest.raises(ValueError, match="rank"):
            await batcher.submit_prompts(2, 0, [])
        await batcher.submit_prompts(0, 0, [])
        with pytest.raises(ValueError, match="already submitted"):
            await batcher.submit_prompts(0, 0, [])

    asyncio.run(scenario())


def test_old_policy_logprobs_from_older_weights_than_the_sampler_are_dropped_and_counted() -> None:
    # A restarted old_policy worker still on base weights (-1) answers for rollouts sampled with v1
    # (prompt 1) and v0 (the rest): those from older weights are dropped, never trained on.
    async def scenario() -> None:
        generation = FakeGeneration({1: 1}, {})
        batcher = ExperienceBatcher(batcher_config(logprob_role="old_policy", world_size=1), generation,
                                    FakeLogprob(claimed_version=0))
        await batcher.submit_prompts(0, 1, fake_prompts(range(3)))
        minibatches, end = await _drain(batcher, 0, 1)
        trained = Counter(s.prompt_id for mb in minibatches if mb.loss_weight == LOSS_WEIGHT for s in mb.samples)
        assert trained == {0: _N, 2: _N} and end.num_samples == 2 * _N
        assert batcher.stats(1)["batcher/dropped_logprob_version"] == _N

    asyncio.run(scenario())


def test_reference_logprobs_from_pushed_weights_fail_the_step() -> None:
    async def scenario() -> None:
        batcher = ExperienceBatcher(batcher_config(world_size=1), FakeGeneration({}, {}),
                                    FakeLogprob(claimed_version=3))
        await batcher.submit_prompts(0, 0, fake_prompts([4]))
        with pytest.raises(ExperienceBatcherError, match="reference logprobs computed with weight version 3"):
            await asyncio.wait_for(_drain(batcher, 0, 0), WAIT_BOUND_S)

    asyncio.run(scenario())


class NoWorkerError(RuntimeError):
    """What a registry raises when it has no live worker (stand-in for WorkerPoolError)."""


@pytest.mark.parametrize(
    "generation_error, wrong_logprobs, expected",
    [
        (NoWorkerError("generation-registry: no live workers for 60 s"), set(), "generation-registry: no live workers"),
        # A TimeoutError from a registry is an error, not this batcher's deadline.
        (TimeoutError("generation-registry: worker timed out"), set(), "TimeoutError: generation-registry"),
        (None, {1}, "compute_group_logprobs returned"),
    ],
)
def test_a_failing_request_fails_the_step_for_every_rank(
    generation_error: BaseException | None, wrong_logprobs: set[int], expected: str
) -> None:
    async def scenario() -> None:
        generation = FakeGeneration({}, {1: generation_error} if generation_error else {})
        generation.release.clear()  # hold every answer until rank 1 is already waiting
        # A budget no step here fills: no minibatch can reach a rank before the failure.
        batcher = ExperienceBatcher(batcher_config(max_tokens_per_gpu=1000), generation, FakeLogprob(wrong_logprobs))
        await batcher.submit_prompts(0, 0, fake_prompts(range(0, 2)))
        await batcher.submit_prompts(1, 0, fake_prompts(range(2, 4)))
        waiting = asyncio.create_task(batcher.next_message(1, 0))
        while len(generation.calls) < 4:
            await asyncio.sleep(0)
        generation.release.set()
        with pytest.raises(ExperienceBatcherError, match=expected) as woken:
            await asyncio.wait_for(waiting, WAIT_BOUND_S)
        assert "prompt_id=1" in str(woken.value)
        for rank in (0, 1):  # every later call raises too, never hangs
            with pytest.raises(ExperienceBatcherError, match=expected):
                await asyncio.wait_for(batcher.next_message(rank, 0), WAIT_BOUND_S)
        assert batcher.stats(0)["batcher/failed"] == 1.0
        # Other steps are unaffected.
        await batcher.submit_prompts(0, 1, fake_prompts([10]))
        await batcher.submit_prompts(1, 1, [])
        _, end = await _drain(batcher, 0, 1)
        assert end.num_samples == _N

    asyncio.run(scenario())


# --------------------------------------------------------------------------------------------
# Through Ray: the actor, registry stand-in actors, and a real registry without workers
# --------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class RegistryDouble:
    """Stands in for a registry actor and its one worker: leases every request to itself at once
    and answers `generate` and `compute_group_logprobs` itself.

    Prompts listed in `hang` never get an answer; the double counts the cancellations the
    batcher sends when it gives up on them.
    """

    def __init__(self, hang: tuple[int, ...] = (), version: int = 0) -> None:
        self._hang = set(hang)
        self._version = version
        self._calls: list[tuple[str, int, int]] = []
        self._answered: list[int] = []
        self._cancelled = 0
        self._undecided: dict[str, set[int]] = {}
        self._decided: dict[str, asyncio.Event] = {}

    async def submit(self, method: str, *args: Any, cost: int = 1) -> Any:
        sample = args[0] if method == "generate" else args[0][0]  # a prompt, or a group's first rollout
        self._calls.append((method, sample.prompt_id, cost))
        if sample.prompt_id in self._hang:
            await asyncio.Event().wait()
        self._answered.append(sample.prompt_id)
        if method == "generate":
            return fake_rollouts(sample, args[1].n, self._version)
        return [TokenLogprobs(weight_version=-1, values=fake_logprobs(s)) for s in args[0]]

    async def lease_many(self, call_id: str, method: str, costs: list[int]) -> Any:
        """The batched path the batcher actor uses: every request leased to this double, the
        stream open until each is reported or cancelled (as the registry's)."""
        self._undecided[call_id] = set(range(len(costs)))
        self._decided[call_id] = asyncio.Event()
        yield Bundle([(i, True, "double") for i in range(len(costs))])
        await self._decided[call_id].wait()

    def release_many(self, reports: dict[str, list[tuple[int, str, str]]]) -> None:
        for call_id, call_reports in reports.items():
            self._decide(call_id, [index for index, _, _ in call_reports])

    def cancel_many(self, call_id: str, indices: list[int]) -> None:
        self._cancelled += len(indices)
        self._decide(call_id, indices)

    def _decide(self, call_id: str, indices: list[int]) -> None:
        self._undecided[call_id].difference_update(indices)
        if not self._undecided[call_id]:
            self._decided[call_id].set()

    def worker_handles(self, names: list[str]) -> dict[str, Any]:
        return {name: ray.get_runtime_context().current_actor for name in names}

    async def call_many(self, method: str, calls: Bundle) -> Any:
        async for chunk in serve_many(self, ("generate", "compute_group_logprobs"), method, calls):
            yield chunk

    async def generate(self, sample: Sample, sampling: SamplingConfig) -> list[Sample]:
        return await self.submit("generate", sample, sampling, cost=sampling.n)

    async def compute_group_logprobs(self, *args: Any) -> list[TokenLogprobs]:
        return await self.submit("compute_group_logprobs", *args)

    def calls(self) -> list[tuple[str, int, int]]:
        return list(self._calls)

    def answered(self) -> list[int]:
        return list(self._answered)

    def cancelled(self) -> int:
        return self._cancelled

    def counters(self) -> dict[str, int]:
        """What the registry reports (vllm_registry's counters): this double never re-sends."""
        return {"redispatched_requests": 0}


@pytest.fixture
def batcher_actors(ray_local):
    """Creates batchers through get_or_create_batcher; kills the named actor afterwards."""
    yield get_or_create_batcher
    try:
        ray.kill(ray.get_actor(BATCHER_ACTOR_NAME, namespace=RAY_NAMESPACE))
    except ValueError:
        pass  # the test never created one


def _drain_remote(batcher, rank: int, step: int) -> tuple[list[Minibatch], EndOfStep]:
    minibatches: list[Minibatch] = []
    while isinstance(message := ray.get(batcher.next_message.remote(rank, step), timeout=WAIT_BOUND_S), Minibatch):
        minibatches.append(message)
    return minibatches, message


def test_actor_routes_two_steps_submitted_ahead_to_the_right_ranks(batcher_actors) -> None:
    generation, logprob = RegistryDouble.remote(), RegistryDouble.remote()
    config = batcher_config(max_tokens_per_gpu=30, reorder_window=4)
    batcher = batcher_actors(config, generation_registry=generation, logprob_registry=logprob)
    prompts = {(0, 0): range(0, 3), (1, 0): range(3, 6), (0, 1): range(10, 14), (1, 1): range(14, 16)}
    ray.get([batcher.submit_prompts.remote(rank, step, fake_prompts(ids)) for (rank, step), ids in prompts.items()])

    # Rank 0 reads step 1 first, rank 1 step 0 first: each (step, rank) stream is its own.
    streams = {(0, 1): _drain_remote(batcher, 0, 1), (1, 0): _drain_remote(batcher, 1, 0)}
    streams[(0, 0)] = _drain_remote(batcher, 0, 0)
    streams[(1, 1)] = _drain_remote(batcher, 1, 1)
    for step in (0, 1):
        step_ids = [pid for (_, s), ids in prompts.items() if s == step for pid in ids]
        ends = [streams[(rank, step)][1] for rank in (0, 1)]
        assert ends[0] == ends[1] and ends[0].step == step
        assert (ends[0].num_samples, ends[0].num_tokens) == (len(step_ids) * _N, _expected_tokens(step_ids))
        real: list[Sample] = []
        for rank in (0, 1):
            mbs = streams[(rank, step)][0]
            assert [(mb.step, mb.rank, mb.index) for mb in mbs] == [(step, rank, i) for i in range(len(mbs))]
            assert len(mbs) == ends[0].num_minibatches
            real += [s for mb in mbs if mb.loss_weight == LOSS_WEIGHT for s in mb.samples]
            assert all(mb.num_tokens <= config.experience.max_tokens_per_gpu for mb in mbs)
        assert Counter(s.prompt_id for s in real) == {pid: _N for pid in step_ids}
        assert all(s.ref_logprobs == fake_logprobs(s) for s in real)
    assert sorted(c for c in ray.get(generation.calls.remote())) == sorted(
        ("generate", pid, _N) for ids in prompts.values() for pid in ids
    )
    stats = ray.get(batcher.stats.remote(1))
    assert (stats["batcher/num_prompts"], stats["counts/redispatched_requests"]) == (6, 0)
    # A second caller gets the same actor; a different config is refused, not silently ignored.
    assert get_or_create_batcher(config, generation_registry=generation, logprob_registry=logprob) == batcher
    with pytest.raises(ValueError, match="different config"):
        get_or_create_batcher(batcher_config(max_tokens_per_gpu=31), generation_registry=generation,
                              logprob_registry=logprob)


def test_actor_cancels_and_counts_a_prompt_past_its_deadline(batcher_actors) -> None:
    hung_prompt = 2
    generation, logprob = RegistryDouble.remote(hang=(hung_prompt,)), RegistryDouble.remote()
    ray.get([generation.calls.remote(), logprob.calls.remote()])  # both up before the clock starts
    config = batcher_config(prompt_deadline_s=_DEADLINE_S)
    batcher = batcher_actors(config, generation_registry=generation, logprob_registry=logprob)
    ray.get([batcher.submit_prompts.remote(0, 0, fake_prompts(range(0, 2))),
             batcher.submit_prompts.remote(1, 0, fake_prompts(range(2, 4)))])
    (mbs0, end), (mbs1, _) = _drain_remote(batcher, 0, 0), _drain_remote(batcher, 1, 0)
    assert (end.timed_out_prompts, end.num_prompts, end.num_samples) == (1, 4, 3 * _N)
    assert hung_prompt not in {s.prompt_id for mb in mbs0 + mbs1 for s in mb.samples}
    assert ray.get(batcher.stats.remote(0))["batcher/timed_out_prompts"] == 1
    give_up = time.monotonic() + WAIT_BOUND_S  # the cancel travels on after EndOfStep
    while ray.get(generation.cancelled.remote()) != 1 and time.monotonic() < give_up:
        time.sleep(0.05)
    assert ray.get(generation.cancelled.remote()) == 1, "the registry was not told to free the hung request"
    assert hung_prompt in {pid for _, pid, _ in ray.get(generation.calls.remote())}
    assert hung_prompt not in ray.get(generation.answered.remote())


def test_actor_reports_a_registry_without_workers_to_the_trainer(batcher_actors) -> None:
    registry = RegistryActor.options(num_cpus=0).remote(GENERATION, RegistryConfig(no_worker_timeout_s=0.5))
    assert ray.get(registry.live_workers.remote()) == []
    batcher = batcher_actors(batcher_config(logprob_role="none"), generation_registry=registry)
    ray.get([batcher.submit_prompts.remote(0, 0, fake_prompts([0])), batcher.submit_prompts.remote(1, 0, [])])
    for rank in (0, 1):
        with pytest.raises(ExperienceBatcherError, match="generation-registry: no live workers") as raised:
            ray.get(batcher.next_message.remote(rank, 0), timeout=WAIT_BOUND_S)
        assert "prompt_id=0" in str(raised.value)
    ray.kill(registry)
