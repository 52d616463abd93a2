"""The trainer's staleness metrics with per-token weight versions: staleness/mean and /max count
from each sample's oldest token, staleness/token_mean weighs every sampled token by its own version.

    .venv/bin/python -m pytest tests/telemetry/test_token_versions_metrics.py -q
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from async_grpo.telemetry.metrics import StepAccumulator
from async_grpo.trainer.fsdp_setup import DistInfo
from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import Sample, post_process_batch


def _sample(n: int, weight_version: int, token_versions: list[tuple[int, int]] | None = None) -> Sample:
    return Sample(input_token_ids=[5, 6], output_token_ids=[7] * n, gt_answer="1", prompt_id=0,
                  sampling_logprobs=[-0.5] * n, weight_version=weight_version, token_versions=token_versions)


def _record(step: int, samples: list[Sample]) -> dict[str, float]:
    batch = post_process_batch(samples)
    acc = StepAccumulator(step=step)
    acc.add_minibatch(samples, batch, torch.zeros(batch.advantages.numel()), 0.5, {})
    end = SimpleNamespace(dropped_stale=0, timed_out_prompts=0, oversized_samples=0, num_minibatches=1)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return acc.finalize(dist=dist, end=end, grad_norm=1.0, lr=1e-3, push_s=0.0, step_s=1.0, batcher_stats={})


def test_staleness_counts_the_oldest_token_and_the_token_mean_each_token() -> None:
    # Step 5: A has 2 tokens from v4 (lag 1); B started on v2 (1 token, lag 3), then 3 tokens of v4.
    record = _record(5, [_sample(2, 4), _sample(4, 2, [(2, 1), (4, 3)])])
    assert record["staleness/mean"] == (1 + 3) / 2
    assert record["staleness/max"] == 3.0
    assert record["staleness/token_mean"] == (2 * 1 + 1 * 3 + 3 * 1) / 6


def test_a_sample_whose_first_token_is_not_its_oldest() -> None:
    """A run's initial push may go backwards (a worker that served v7 of an earlier run gets v0):
    the oldest version, not the first, sets the staleness."""
    record = _record(1, [_sample(3, 7, [(7, 1), (0, 2)])])
    assert record["staleness/max"] == 1.0 and record["staleness/mean"] == 1.0
    assert record["staleness/token_mean"] == (1 * -6 + 2 * 1) / 3


def test_without_token_versions_the_token_mean_is_the_sample_lag() -> None:
    record = _record(3, [_sample(2, 3), _sample(4, 1)])
    assert record["staleness/mean"] == 1.0 and record["staleness/max"] == 2.0
    assert record["staleness/token_mean"] == (0 * 2 + 2 * 4) / 6


def test_behaviour_weights_are_logged_over_the_steps_tokens() -> None:
    """behaviour/*: the decoupled objective's weights, token-weighted over two minibatches, against
    the weights written out token by token (stale: min(pi_old / pi_sampler, cap); fresh: 1)."""
    minibatches = [[_sample(2, 4), _sample(3, 2, [(2, 1), (5, 2)])], [_sample(4, 5)]]
    for k, samples in enumerate(minibatches):
        for j, sample in enumerate(samples):
            n = len(sample.output_token_ids)
            sample.old_logprobs = [-0.5 + 0.4 * ((t + j + k) % 3) for t in range(n)]
    acc = StepAccumulator(step=5)
    expected: list[float] = []
    config = LossConfig(decoupled=True, is_cap=1.3)
    for samples in minibatches:
        batch = post_process_batch(samples)
        loss, metrics = grpo_loss(batch.old_logprobs.clone(), batch, config, policy_version=5)
        acc.add_minibatch(samples, batch, torch.zeros(batch.advantages.numel()), float(loss), metrics)
        for sample in samples:
            versions = [v for v, c in (sample.token_versions or [(sample.weight_version, 10)]) for _ in range(c)]
            for t, old in enumerate(sample.old_logprobs):
                rho = math.exp(old - sample.sampling_logprobs[t])
                expected.append(min(rho, 1.3) if versions[t] < 5 else 1.0)
    end = SimpleNamespace(dropped_stale=0, timed_out_prompts=0, oversized_samples=0, num_minibatches=2)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    record = acc.finalize(dist=dist, end=end, grad_norm=1.0, lr=1e-3, push_s=0.0, step_s=1.0, batcher_stats={})
    weights = torch.tensor(expected, dtype=torch.float64)
    assert record["behaviour/stale_frac"] == pytest.approx((2 + 1) / 9)
    assert record["behaviour/weight_mean"] == pytest.approx(float(weights.mean()), rel=1e-6)
    assert record["behaviour/weight_std"] == pytest.approx(float(weights.std(unbiased=False)), rel=1e-5)
    assert record["behaviour/capped_frac"] == pytest.approx(sum(1 for w in expected if w == 1.3) / 9)
    assert 0 < record["behaviour/capped_frac"] < record["behaviour/stale_frac"]
