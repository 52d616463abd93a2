"""What the experience batcher counts per step: `StepCounts` (the totals every rank's EndOfStep
carries) and `StepStats` (those plus timings and reward breakdowns, for the trainer's metrics).

Each counter is declared once, with its metric name: a counter added to `StepCounts` reaches the
EndOfStep message (batcher_messages.EndOfStep is built from it), the batcher's metrics and the
rank-0 data path's message header without another edit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

from sample_processing_utils import JudgeUsage, Sample

_METRIC = "metric"
"""Field metadata key: the metric name a counter is reported under (absent: not reported)."""


def counter(metric: str | None = None) -> Any:
    """A count starting at 0, reported as `metric` by StepStats.as_metrics (None: not reported)."""
    return field(default=0, metadata={_METRIC: metric} if metric else {})


@dataclass(slots=True, kw_only=True)
class StepCounts:
    """A step's totals over all ranks, as its EndOfStep carries them."""

    step: int
    """The step counted."""
    num_samples: int = counter("batcher/num_samples")
    """Samples carrying loss, over all ranks (padding and dropped excluded): divide gradients by
    this for the mean over the whole step's batch."""
    num_tokens: int = counter("batcher/num_tokens")
    """Prompt + output tokens of those samples."""
    num_minibatches: int = counter("batcher/minibatches_per_rank")
    """Minibatches each rank received for the step, padding included (equal on every rank)."""
    num_prompts: int = counter("batcher/num_prompts")
    """Prompts submitted for the step by all ranks."""
    timed_out_prompts: int = counter("batcher/timed_out_prompts")
    """Prompts cancelled at prompt_deadline_s; none of their rollouts are in the step."""
    dropped_stale: int = counter("batcher/dropped_stale")
    """Rollouts dropped because step - (their oldest token's weight version) > max_lag."""
    oversized_samples: int = counter("batcher/oversized_samples")
    """Samples over max_tokens_per_gpu, each sent alone in its own minibatch (the trainer logs
    it as counts/oversized_samples; expected only under oversized_sample_policy: train_alone)."""
    padding_minibatches: int = counter("batcher/padding_minibatches")
    """Padding minibatches (loss_weight 0) added over all ranks to equalise the counts."""
    missing_rollouts: int = counter("batcher/missing_rollouts")
    """Rollouts the generation worker returned fewer than sampling.n, summed over prompts."""
    num_output_tokens: int = counter()
    """Output tokens of the loss-carrying samples (the token_mean aggregation's divisor)."""
    dropped_zero_variance_groups: int = counter("counts/dropped_zero_variance_groups")
    """Groups not trained on because all their rollouts scored the same
    (sampling.drop_zero_variance_groups)."""
    resampled_prompts: int = counter("counts/resampled_prompts")
    """Extra prompts the step asked the ranks for to replace dropped groups (all ranks)."""
    masked_truncated: int = counter("counts/masked_truncated")
    """Truncated samples kept out of the loss (sampling.mask_truncated)."""
    prepare_dropped: int = counter("counts/prepare_dropped")
    """Samples a prepare function (algorithm.prepare_batch) returned no advantage for."""


@dataclass(slots=True, kw_only=True)
class StepStats(StepCounts):
    """What happened in one step, for the trainer's metrics (see `as_metrics`)."""

    loss_minibatches: int = counter()
    """Minibatches carrying loss, over all ranks."""
    dropped_logprob_version: int = counter("batcher/dropped_logprob_version")
    """Rollouts dropped because their old-policy logprobs came from older weights than sampled them."""
    finished_prompts: int = counter()
    """Prompts whose generate (and logprobs) came back, stale or not."""
    overlong_penalised: int = counter("counts/overlong_penalised")
    """Released samples longer than max_tokens - overlong_buffer (their reward carries the soft
    overlong punishment; 0 when overlong_buffer is 0)."""
    # Over every generated rollout, like reward/mean_generated (the trainer's counts/reward_failed
    # counts the trained ones).
    reward_failed: int = counter("counts/reward_failures")
    """Released rollouts whose scoring failed (reward 0 from the failed function, or masked)."""
    masked_samples: int = counter("reward/masked_samples")
    """Released rollouts whose failed reward masked them (Sample.reward_masked): out of their
    group's baseline and the loss, and out of reward/mean_generated and the reward/<function> means."""
    dropped_groups_masked: int = counter("counts/dropped_groups_masked")
    """Groups not trained on because masking left fewer than sampling.reward.min_scored_samples
    scored samples."""
    failed: bool = False
    first_submit_s: float = 0.0
    """time.monotonic() of the step's first submit_prompts."""
    last_submit_s: float = 0.0
    """time.monotonic() when the last rank submitted."""
    first_minibatch_s: float = 0.0
    """time.monotonic() when the first minibatch was dispatched (0.0: none yet)."""
    completed_s: float = 0.0
    """time.monotonic() when EndOfStep was sent (0.0: not yet)."""
    generate_s: float = 0.0
    """Sum over prompts of the generate request's latency."""
    logprob_s: float = 0.0
    """Sum over prompts of the time spent waiting for all of its rollouts' logprobs."""
    teacher_s: float = 0.0
    """Sum over prompts of the teacher pool's time for its rollouts (distillation only)."""
    rank_wait_s: float = 0.0
    """Time trainer ranks spent blocked in next_message for this step, summed over ranks."""
    generated_reward_sum: float = 0.0
    """Sum of the rewards of every rollout whose group was released (trained, dropped for zero
    variance, masked for truncation or dropped by a prepare function alike), except those whose
    failed reward masked them (no score)."""
    generated_samples: int = 0
    reward_part_sums: dict[str, float] = field(default_factory=dict)
    """Per reward function (and named part): the sum over released rollouts that carry it."""
    reward_part_counts: dict[str, int] = field(default_factory=dict)
    reward_failure_counts: dict[str, int] = field(default_factory=dict)
    """Per "<function>/<reason>" (Sample.reward_failure_reasons): released rollouts that failed so."""
    judge_usage: JudgeUsage | None = None
    """The judge pool's work for the released rollouts, summed (None: none was judged)."""
    kl_beta: float | None = None
    """beta of the KL in the reward for this step (None: the KL is not in the reward)."""
    kl_sum: float = 0.0
    """Sum over prepared samples of their KL(policy || reference) (kl_in_reward only)."""
    kl_samples: int = 0
    algorithm_sums: dict[str, float] = field(default_factory=dict)
    """Prepare-function metrics, each summed weighted by the samples of its call."""
    algorithm_weights: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """The StepCounts fields and their values: what the step's EndOfStep carries."""
        return {f.name: getattr(self, f.name) for f in fields(StepCounts)}

    def record_released(self, samples: list[Sample]) -> None:
        """Count the rewards of a released group (whatever becomes of it next); a masked sample's
        failures count, its reward (no score) does not."""
        scored = [s for s in samples if not s.reward_masked]
        self.generated_reward_sum += sum(s.reward for s in scored)
        self.generated_samples += len(scored)
        for s in scored:
            for name, value in (s.reward_parts or {}).items():
                self.reward_part_sums[name] = self.reward_part_sums.get(name, 0.0) + value
                self.reward_part_counts[name] = self.reward_part_counts.get(name, 0) + 1
        for s in samples:
            if s.judge_usage is not None:
                self.judge_usage = s.judge_usage if self.judge_usage is None else self.judge_usage.plus(s.judge_usage)
            self.reward_failed += s.reward_failed
            for reason in s.reward_failure_reasons or ():
                self.reward_failure_counts[reason] = self.reward_failure_counts.get(reason, 0) + 1

    def add_algorithm_metrics(self, metrics: dict[str, float], num_samples: int) -> None:
        for name, value in metrics.items():
            self.algorithm_sums[name] = self.algorithm_sums.get(name, 0.0) + float(value) * num_samples
            self.algorithm_weights[name] = self.algorithm_weights.get(name, 0) + num_samples

    def as_metrics(self, max_tokens_per_gpu: int) -> dict[str, float]:
        """Namespaced metrics: batcher/* and counts/* are counts and ratios, timing/* are seconds."""
        now = time.monotonic()
        done = self.completed_s or now
        capacity = self.loss_minibatches * max_tokens_per_gpu
        return {
            **{f.metadata[_METRIC]: float(getattr(self, f.name)) for f in fields(self) if _METRIC in f.metadata},
            # Over all loss-carrying minibatches, each rank's final partial one included.
            "batcher/fill": self.num_tokens / capacity if capacity else 0.0,
            "batcher/failed": float(self.failed),
            "timing/batcher_step_s": _elapsed(self.first_submit_s, done),
            "timing/batcher_after_last_submit_s": _elapsed(self.last_submit_s, done),
            "timing/batcher_first_minibatch_s": _elapsed(self.first_submit_s, self.first_minibatch_s),
            "timing/batcher_generate_s_mean": mean(self.generate_s, self.finished_prompts),
            "timing/batcher_logprob_s_mean": mean(self.logprob_s, self.finished_prompts),
            "timing/teacher_s": mean(self.teacher_s, self.finished_prompts),
            "timing/batcher_rank_wait_s": self.rank_wait_s,
            # Over every generated rollout: reward/mean counts trained samples only, which dynamic
            # sampling and masking select.
            "reward/mean_generated": mean(self.generated_reward_sum, self.generated_samples),
            # One per reward function (rewards.RewardConfig.functions), its unweighted mean.
            **{f"reward/{name}": mean(total, self.reward_part_counts[name])
               for name, total in self.reward_part_sums.items()},
            **{f"counts/reward_failures/{reason}": float(count) for reason, count in self.reward_failure_counts.items()},
            **self._algorithm_metrics(),
            **self._judge_metrics(),
        }

    def _judge_metrics(self) -> dict[str, float]:
        """judge/*: the step's judge requests (retries included), retries and tokens over the
        released rollouts, and the mean seconds from a judged unit's (an answer's, or a group's
        in group-wise mode) first send to its outcome; nothing when no rollout was judged."""
        usage = self.judge_usage
        if usage is None:
            return {}
        return {"judge/requests": usage.requests, "judge/retries": usage.retries,
                "judge/tokens_in": usage.tokens_in, "judge/tokens_out": usage.tokens_out,
                "judge/latency_s_mean": mean(usage.latency_s, usage.requests - usage.retries)}

    def _algorithm_metrics(self) -> dict[str, float]:
        # A prepare function's namespaced metrics ("distill/reverse_kl") keep their name; bare
        # names go under algorithm/.
        out = {(name if "/" in name else f"algorithm/{name}"): total / max(self.algorithm_weights[name], 1)
               for name, total in self.algorithm_sums.items()}
        if self.kl_beta is not None:
            out["kl/beta"] = self.kl_beta
            out["kl/in_reward_mean"] = mean(self.kl_sum, self.kl_samples)
        return out


def _elapsed(start: float, stop: float) -> float:
    """stop - start, or 0.0 when either moment has not happened (0.0)."""
    return stop - start if start and stop else 0.0


def mean(total: float, count: float) -> float:
    """total / count, 0.0 for no count."""
    return total / count if count else 0.0
