"""The experience batcher's prepare hook: released rollout groups -> samples with advantages.

`GroupPreparer.admit` decides whether a released group trains at all: a group that masked
rewards left with fewer than sampling.reward.min_scored_samples scored samples is dropped
(counts/dropped_groups_masked), and under dynamic sampling a group whose scored samples all
have one reward (counts/dropped_zero_variance_groups). `GroupPreparer.prepare` runs the
algorithm's prepare function (algorithm.py: a built-in advantage estimator, or
algorithm.prepare_batch) on the released samples whose reward is a score, so masked samples
(Sample.reward_masked) weigh in neither the baseline nor the loss; it counts what it and the
sampling options keep out of the loss, and returns the samples to pack.
"""

from __future__ import annotations

from async_grpo.algo.algorithm import (
    AlgorithmConfig, AlgorithmContext, DistillConfig, KLSettings, PrepareFn, check_prepared, load_prepare_fn,
    sequence_kl,
)
from async_grpo.batching.step_stats import StepStats
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample


class GroupPreparer:
    """Prepares released groups for one run's algorithm, sampling and KL/distillation settings."""

    def __init__(self, *, algorithm: AlgorithmConfig, sampling: SamplingConfig,
                 kl_in_reward: KLSettings | None, distill: DistillConfig) -> None:
        self._algorithm = algorithm
        self._sampling = sampling
        self._kl_policy = kl_in_reward.kl_policy_logprobs if kl_in_reward else "sampler"
        self._distill = distill if distill.teacher else None
        self._prepare: PrepareFn = load_prepare_fn(algorithm)
        self._prepare_name = algorithm.prepare_batch or f"built-in {algorithm.estimator}"

    def admit(self, samples: list[Sample], stats: StepStats) -> bool:
        """Whether a released group goes on to prepare and pack (module docstring); counts its
        masked samples and, when it is dropped, why."""
        scored = [s for s in samples if not s.reward_masked]
        if len(scored) < len(samples):
            stats.masked_samples += len(samples) - len(scored)
            if len(scored) < self._sampling.reward.min_scored_samples:
                stats.dropped_groups_masked += 1
                return False
        if self._sampling.drop_zero_variance_groups and len({s.reward for s in scored}) == 1:
            stats.dropped_zero_variance_groups += 1
            return False
        return True

    def prepare(self, samples: list[Sample], step: int, kl_beta: float | None, stats: StepStats) -> list[Sample]:
        """Run the prepare function on released samples, masked ones left out; the ones to pack (a
        prepare function's error propagates, naming it)."""
        samples = [s for s in samples if not s.reward_masked]  # counted by admit
        if not samples:
            return []
        sampling = self._sampling
        if sampling.overlong_buffer:
            limit = sampling.max_tokens - sampling.overlong_buffer
            stats.overlong_penalised += sum(1 for s in samples if s.num_sampled_tokens > limit)
        ctx = AlgorithmContext(step=step, config=self._algorithm, kl_beta=kl_beta,
                               kl_policy_logprobs=self._kl_policy, distill=self._distill)
        if kl_beta is not None:
            stats.kl_sum += sum(sequence_kl(s, self._kl_policy) for s in samples)
            stats.kl_samples += len(samples)
        prepared = check_prepared(self._prepare(samples, ctx), samples, self._prepare_name)
        stats.prepare_dropped += len(samples) - len(prepared.samples)
        stats.add_algorithm_metrics(prepared.metrics, len(samples))
        kept = []
        for sample in prepared.samples:
            if sampling.mask_truncated and sample.truncated:
                stats.masked_truncated += 1
                continue
            kept.append(sample)
        return kept
