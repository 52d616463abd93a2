"""StepCounts / StepStats: each counter declared once reaches EndOfStep and the batcher's metrics."""

from __future__ import annotations

from dataclasses import fields

from async_grpo.batching.batcher_messages import EndOfStep
from async_grpo.batching.step_stats import StepCounts, StepStats
from sample_processing_utils import JudgeUsage, Sample


def _distinct_counts() -> StepStats:
    """A StepStats whose StepCounts fields all hold different values (step 1, then 2, 3, ...)."""
    stats = StepStats(step=1)
    for value, f in enumerate(fields(StepCounts)[1:], start=2):
        setattr(stats, f.name, value)
    return stats


def test_end_of_step_carries_exactly_the_step_counts() -> None:
    stats = _distinct_counts()
    stats.loss_minibatches, stats.finished_prompts = 100, 101  # stats-only counters stay behind
    end = EndOfStep(**stats.counts())
    assert [f.name for f in fields(EndOfStep)] == [f.name for f in fields(StepCounts)]
    for f in fields(StepCounts):
        assert getattr(end, f.name) == getattr(stats, f.name), f.name
    assert len({getattr(end, f.name) for f in fields(StepCounts)}) == len(fields(StepCounts))


def test_every_reported_counter_appears_in_the_metrics_with_its_value() -> None:
    stats = _distinct_counts()
    metrics = stats.as_metrics(max_tokens_per_gpu=10)
    named = {"batcher/num_prompts": "num_prompts", "batcher/minibatches_per_rank": "num_minibatches",
             "batcher/padding_minibatches": "padding_minibatches", "counts/resampled_prompts": "resampled_prompts",
             "counts/prepare_dropped": "prepare_dropped"}
    for key, name in named.items():
        assert metrics[key] == float(getattr(stats, name)), key
    metric_names = [f.metadata["metric"] for f in fields(StepStats) if "metric" in f.metadata]
    assert len(metric_names) == len(set(metric_names)), "two counters report under one name"
    assert "num_output_tokens" not in {k.rsplit("/", 1)[-1] for k in metrics}  # declared without a metric


def test_released_rewards_are_counted_per_part_and_failure_reason() -> None:
    def scored(reward: float, parts: dict[str, float], failed: bool = False, reasons: list[str] | None = None) -> Sample:
        return Sample(input_token_ids=[1], gt_answer="4", prompt_id=0, output_token_ids=[2], reward=reward,
                      reward_parts=parts, reward_failed=failed, reward_failure_reasons=reasons)

    stats = StepStats(step=0)
    stats.record_released([scored(1.0, {"math": 1.0}), scored(0.5, {"math": 0.0, "len": 0.5}, True, ["math/timeout"])])
    metrics = stats.as_metrics(max_tokens_per_gpu=10)
    assert metrics["reward/mean_generated"] == 0.75
    assert (metrics["reward/math"], metrics["reward/len"]) == (0.5, 0.5)
    assert (metrics["counts/reward_failures"], metrics["counts/reward_failures/math/timeout"]) == (1.0, 1.0)


def test_the_judges_work_is_summed_over_released_rollouts() -> None:
    def judged(usage: JudgeUsage | None, masked: bool = False) -> Sample:
        return Sample(input_token_ids=[1], gt_answer="4", prompt_id=0, output_token_ids=[2], judge_usage=usage,
                      reward_masked=masked)

    stats = StepStats(step=0)
    assert not any(key.startswith("judge/") for key in stats.as_metrics(max_tokens_per_gpu=10))  # none judged
    # a group of two judged group-wise (one request, retried once: 3 s from first send to outcome)...
    group = JudgeUsage(requests=2, retries=1, tokens_in=40, tokens_out=12, latency_s=3.0)
    stats.record_released([judged(group.share(2)), judged(group.share(2), masked=True)])
    # ...and two answers judged alone, 1 s each; a rollout without a judge adds nothing
    stats.record_released([judged(JudgeUsage(requests=1, tokens_in=8, tokens_out=1, latency_s=1.0))] * 2
                          + [judged(None)])
    metrics = stats.as_metrics(max_tokens_per_gpu=10)
    assert (metrics["judge/requests"], metrics["judge/retries"]) == (4.0, 1.0)
    assert (metrics["judge/tokens_in"], metrics["judge/tokens_out"]) == (56.0, 14.0)
    assert metrics["judge/latency_s_mean"] == 5.0 / 3  # three judged units: the group and two answers
