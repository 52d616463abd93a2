"""Failures masked, not zeroed (issue 60, item 3): a sample whose reward failed under a masking
policy (Sample.reward_masked) stays out of its group's baseline and out of the loss, a group left
with too few scored samples is dropped and counted, and a run that masks nothing trains exactly
as before. Advantages are checked against values worked out by hand per group.

    .venv/bin/python -m pytest tests/batching/test_masked_rewards.py -q
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from async_grpo.algo.algorithm import AlgorithmConfig, DistillConfig
from async_grpo.batching.batcher_config import BatcherConfig, ExperienceConfig
from async_grpo.batching.group_preparer import GroupPreparer
from async_grpo.batching.step_stats import StepStats
from async_grpo.config.reward_config import RewardConfig
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample
from vllm_experience_batcher import EndOfStep, ExperienceBatcher, Minibatch

_WAIT_BOUND_S = 60.0  # a broken batcher fails the test instead of hanging it; never what decides a pass
MASK = None  # a masked rollout in the reward tables below
MASKING = RewardConfig(on_function_failure="mask")


def _group(prompt_id: int, rewards: list[float | None]) -> list[Sample]:
    return [Sample(input_token_ids=[1, 2], gt_answer="", prompt_id=prompt_id, output_token_ids=[3, 4],
                   sampling_logprobs=[-1.0, -1.0], reward=0.0 if r is None else r, reward_failed=r is None,
                   reward_masked=r is None) for r in rewards]


def _preparer(estimator: str = "grpo", **sampling: Any) -> GroupPreparer:
    return GroupPreparer(algorithm=AlgorithmConfig(estimator=estimator, advantage_eps=0.0),
                         sampling=SamplingConfig(n=4, **sampling), kl_in_reward=None, distill=DistillConfig())


def _admit_and_prepare(preparer: GroupPreparer, samples: list[Sample], stats: StepStats) -> list[Sample] | None:
    return preparer.prepare(samples, 0, None, stats) if preparer.admit(samples, stats) else None


@pytest.mark.parametrize("estimator, expected", [
    # scored rewards 1, 0, 0.5: mean 0.5, population std sqrt(1/6)
    ("grpo", [0.5 * math.sqrt(6), -0.5 * math.sqrt(6), 0.0]),
    ("dr_grpo", [0.5, -0.5, 0.0]),
    # leave-one-out: the others' means are 0.25, 0.75, 0.5
    ("rloo", [0.75, -0.75, 0.0]),
])
def test_masked_samples_stay_out_of_the_baseline_and_the_loss(estimator: str, expected: list[float]) -> None:
    samples = _group(0, [1.0, MASK, 0.0, 0.5])
    stats = StepStats(step=0)
    trained = _admit_and_prepare(_preparer(estimator, reward=MASKING), samples, stats)
    assert trained == [samples[0], samples[2], samples[3]]  # the masked one is not packed
    assert [s.advantage for s in trained] == pytest.approx(expected)
    assert (stats.masked_samples, stats.dropped_groups_masked) == (1, 0)
    # Zeroing the failure instead would have moved every advantage: the mask is not a 0 reward.
    zeroed = _group(0, [1.0, 0.0, 0.0, 0.5])
    _preparer(estimator).prepare(zeroed, 0, None, StepStats(step=0))
    assert [zeroed[i].advantage for i in (0, 2, 3)] != pytest.approx(expected)


def test_groups_are_baselined_apart() -> None:
    """Two groups, one with two masked samples: each group's baseline is over its own scored samples."""
    preparer, stats = _preparer("dr_grpo", reward=MASKING), StepStats(step=0)
    a = _admit_and_prepare(preparer, _group(0, [1.0, 0.0, MASK, MASK]), stats)
    b = _admit_and_prepare(preparer, _group(1, [0.2, 0.4, 0.9, 0.5]), stats)
    assert a is not None and [s.advantage for s in a] == pytest.approx([0.5, -0.5])
    assert b is not None and [s.advantage for s in b] == pytest.approx([-0.3, -0.1, 0.4, 0.0])
    assert stats.masked_samples == 2


def test_a_group_with_too_few_scored_samples_is_dropped_and_counted() -> None:
    preparer, stats = _preparer(reward=RewardConfig(on_function_failure="mask", min_scored_samples=3)), StepStats(step=0)
    assert _admit_and_prepare(preparer, _group(0, [1.0, 0.0, MASK, MASK]), stats) is None
    assert _admit_and_prepare(preparer, _group(1, [MASK] * 4), stats) is None
    kept = _admit_and_prepare(preparer, _group(2, [1.0, 0.0, 1.0, MASK]), stats)
    assert kept is not None and len(kept) == 3
    # A group short of the minimum without any masked sample (stale or missing rollouts) is kept.
    assert _admit_and_prepare(preparer, _group(3, [1.0, 0.0]), stats) is not None
    assert (stats.masked_samples, stats.dropped_groups_masked) == (7, 2)
    assert stats.as_metrics(64)["counts/dropped_groups_masked"] == 2.0
    assert stats.as_metrics(64)["reward/masked_samples"] == 7.0


def test_dynamic_sampling_reads_the_variance_of_the_scored_samples() -> None:
    """A masked sample's placeholder reward (0) must not pass for variance among scored ones."""
    preparer, stats = _preparer(reward=MASKING, drop_zero_variance_groups=True), StepStats(step=0)
    assert _admit_and_prepare(preparer, _group(0, [1.0, 1.0, MASK, 1.0]), stats) is None
    assert (stats.dropped_zero_variance_groups, stats.dropped_groups_masked) == (1, 0)


def test_released_reward_metrics_leave_masked_rewards_out() -> None:
    stats = StepStats(step=0)
    samples = _group(0, [1.0, MASK, 0.5, 0.0])
    for s, part in zip(samples, (1.0, 0.0, 0.5, 0.0)):
        s.reward_parts = {"judge": part}
    samples[1].reward_failure_reasons = ["judge/timeout"]
    stats.record_released(samples)
    metrics = stats.as_metrics(64)
    assert metrics["reward/mean_generated"] == pytest.approx(0.5) and metrics["reward/judge"] == pytest.approx(0.5)
    assert metrics["counts/reward_failures"] == 1 and metrics["counts/reward_failures/judge/timeout"] == 1


def test_min_scored_samples_above_n_is_refused_when_something_masks() -> None:
    with pytest.raises(ValueError, match="min_scored_samples"):
        ExperienceConfig(max_tokens_per_gpu=64, sampling=SamplingConfig(n=2, reward=RewardConfig(
            on_function_failure="mask", min_scored_samples=3)))
    ExperienceConfig(max_tokens_per_gpu=64, sampling=SamplingConfig(n=2, reward=RewardConfig(min_scored_samples=3)))


def test_a_reward_function_cannot_take_the_masked_count_metric_name() -> None:
    with pytest.raises(ValueError, match="reward/masked_samples"):
        RewardConfig(functions=("my_rewards:masked_samples",))


# ------------------------------------------------------------------------------------------
# Through the batcher
# ------------------------------------------------------------------------------------------


@dataclass
class MaskingGeneration:
    """Generation stand-in: n rollouts of 2 tokens, reward_of(prompt, i) a number or MASK."""

    reward_of: Callable[[Sample, int], float | None]

    async def submit(self, method: str, *args: Any, cost: int) -> list[Sample]:
        prompt, sampling = args
        rollouts = _group(prompt.prompt_id, [self.reward_of(prompt, i) for i in range(sampling.n)])
        for r in rollouts:
            r.weight_version = 0
        return rollouts


async def _run_step(generation: MaskingGeneration, sampling: SamplingConfig, prompts: int,
                    estimator: str = "grpo") -> tuple[list[Sample], EndOfStep, dict[str, float]]:
    experience = ExperienceConfig(max_tokens_per_gpu=64, prompt_deadline_s=_WAIT_BOUND_S, sampling=sampling,
                                  logprob_role="none", max_lag=0, algorithm=AlgorithmConfig(estimator=estimator))
    batcher = ExperienceBatcher(BatcherConfig(world_size=1, experience=experience, reorder_window=0), generation, None)
    await batcher.submit_prompts(0, 0, [Sample(input_token_ids=[1, 2], gt_answer="", prompt_id=p)
                                        for p in range(prompts)])
    trained: list[Sample] = []
    while True:
        message = await asyncio.wait_for(batcher.next_message(0, 0), _WAIT_BOUND_S)
        if isinstance(message, EndOfStep):
            return trained, message, batcher.stats(0)
        assert isinstance(message, Minibatch)
        if message.loss_weight > 0:
            trained.extend(message.samples)


def test_the_batcher_trains_scored_samples_and_drops_groups_masking_emptied() -> None:
    # prompt 0: one masked of 4; prompt 1: three masked (dropped, min 2); prompt 2: none masked.
    table = {0: [1.0, 0.0, MASK, 1.0], 1: [MASK, 1.0, MASK, MASK], 2: [0.0, 0.0, 1.0, 1.0]}
    sampling = SamplingConfig(n=4, reward=MASKING)
    trained, end, stats = asyncio.run(_run_step(MaskingGeneration(lambda p, i: table[p.prompt_id][i]), sampling, 3,
                                                estimator="dr_grpo"))
    got = sorted((s.prompt_id, s.reward, s.advantage) for s in trained)
    third = pytest.approx(1 / 3)
    assert got == [(0, 0.0, -2 / 3), (0, 1.0, third), (0, 1.0, third),
                   (2, 0.0, -0.5), (2, 0.0, -0.5), (2, 1.0, 0.5), (2, 1.0, 0.5)]
    assert end.num_samples == 7  # the gradient divisor counts scored, trained samples only
    assert stats["reward/masked_samples"] == 4 and stats["counts/dropped_groups_masked"] == 1
    assert stats["reward/mean_generated"] == pytest.approx(5 / 8)  # 8 scored rollouts, masked ones left out


def test_masking_that_masks_nothing_trains_bit_for_bit_as_before() -> None:
    """The same step with the default options and with masking on: identical samples, advantages
    and counts; and the default's grpo advantages are the hand-computed +-1 (rewards 1, 0, 0, 1)."""
    table = {0: [1.0, 0.0, 0.0, 1.0], 1: [0.25, 0.5, 1.0, 0.0]}
    generation = MaskingGeneration(lambda p, i: table[p.prompt_id][i])
    runs = [asyncio.run(_run_step(generation, SamplingConfig(n=4, reward=reward), 2))
            for reward in (RewardConfig(), MASKING)]
    (default, end_default, _), (masking, end_masking, stats) = runs
    assert [(s.prompt_id, s.reward, s.advantage) for s in default] == \
        [(s.prompt_id, s.reward, s.advantage) for s in masking]
    assert end_default == end_masking and stats["reward/masked_samples"] == 0
    eps = AlgorithmConfig().advantage_eps
    assert sorted(s.advantage for s in default if s.prompt_id == 0) == [-0.5 / (0.5 + eps)] * 2 + [0.5 / (0.5 + eps)] * 2
