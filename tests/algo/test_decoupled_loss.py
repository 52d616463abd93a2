"""The decoupled objective for stale tokens (LossConfig.decoupled), against a per-sample reference.

    .venv/bin/python -m pytest tests/algo/test_decoupled_loss.py -q

The loss is a function of the trainer's per-token logprobs, so the reference takes them as a leaf
tensor and writes the objective out sample by sample and token by token: the clipped ratio
around pi_old (the proximal policy), the behaviour weight from pi_old / pi_sampler on tokens
older than the trainer's version, the KL term, and each aggregation. The loss and its gradient
must match it; with no stale token the loss must equal the loss without the objective bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import Sample, post_process_batch
from trainer_core import load_trainer_config

POLICY_VERSION = 5


def _samples(seed: int, with_old: bool) -> list[Sample]:
    """Four samples at step 5: fresh (v5), stale (v4), two versions behind (v3), and one that
    straddles a push (v3 for 2 tokens, then v5); logprobs close enough that some ratios clip and
    some behaviour weights pass the cap."""
    gen = torch.Generator().manual_seed(seed)
    versions = [(5, None), (4, None), (3, None), (3, [(3, 2), (5, 3)])]
    lengths = [3, 4, 2, 5]
    samples = []
    for index, ((version, runs), n) in enumerate(zip(versions, lengths)):
        sampling = (-1.0 + 0.5 * torch.randn(n, generator=gen)).tolist()
        old = [s + 0.6 * float(torch.randn((), generator=gen)) for s in sampling]
        ref = [s + 0.3 * float(torch.randn((), generator=gen)) for s in sampling]
        samples.append(Sample(
            input_token_ids=[1, 2, 3][: 1 + index % 3], output_token_ids=list(range(10, 10 + n)), gt_answer="",
            prompt_id=index, advantage=[1.0, -0.5, 2.0, -1.5][index], sampling_logprobs=sampling,
            old_logprobs=old if with_old else None, ref_logprobs=ref, weight_version=version, token_versions=runs,
        ))
    return samples


def _token_versions(sample: Sample) -> list[int]:
    runs = sample.token_versions or [(sample.weight_version, len(sample.output_token_ids))]
    return [version for version, count in runs for _ in range(count)]


def _reference_loss(logprobs: list[torch.Tensor], samples: list[Sample], config: LossConfig) -> torch.Tensor:
    """The objective written per sample and per token (no packing, no vectorised masks)."""
    total = torch.zeros((), dtype=torch.float64)
    mode = config.is_mode if config.is_mode != "none" else "tis"
    for lp, sample in zip(logprobs, samples):
        old = torch.tensor(sample.old_logprobs, dtype=torch.float64) if sample.old_logprobs else lp.detach()
        log_ratios = lp - old
        terms = []
        for t, version in enumerate(_token_versions(sample)):
            if config.ratio_level == "sequence":
                ratio = torch.exp(log_ratios.mean())
                low, high = 1 - config.seq_clip_low, 1 + config.seq_clip_high
            else:
                ratio = torch.exp(log_ratios[t])
                low, high = 1 - config.clip_low, 1 + config.clip_high
            advantage = sample.advantage
            pg = -torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
            rho = math.exp(float(old[t]) - sample.sampling_logprobs[t])
            stale = version < POLICY_VERSION
            rule = mode if (config.decoupled and stale) else config.is_mode
            if rule == "tis":
                pg = pg * min(rho, config.is_cap)
            elif rule == "mis":
                pg = pg * (rho if rho <= config.is_cap else 0.0)
            log_ref_over_pi = sample.ref_logprobs[t] - lp[t]
            kl = torch.exp(log_ref_over_pi) - log_ref_over_pi - 1  # k3
            terms.append(pg + config.kl_coef * kl)
        stacked = torch.stack(terms)
        total = total + (stacked.mean() if config.aggregation == "sample_mean" else stacked.sum())
    return total


CONFIGS = {
    "none": LossConfig(decoupled=True, is_cap=1.2),
    "tis": LossConfig(decoupled=True, is_mode="tis", is_cap=1.2),
    "mis": LossConfig(decoupled=True, is_mode="mis", is_cap=1.2, kl_coef=0.1),
    "token-mean-cap": LossConfig(decoupled=True, is_cap=1.1, aggregation="token_mean", kl_coef=0.05),
    "gspo": LossConfig(decoupled=True, ratio_level="sequence", seq_clip_low=0.05, seq_clip_high=0.05, is_cap=1.2),
    "off": LossConfig(decoupled=False, kl_coef=0.1),
}


@pytest.mark.parametrize("with_old", [True, False], ids=["proximal-from-workers", "proximal-first-pass"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradient_match_the_per_sample_reference(name: str, with_old: bool) -> None:
    config = CONFIGS[name]
    samples = _samples(seed=3, with_old=with_old)
    batch = post_process_batch(samples)
    # The trainer's logprobs: near pi_old, so both clipped and unclipped ratios occur.
    base = batch.old_logprobs if with_old else batch.sampling_logprobs
    current = (base.double() + 0.3 * torch.randn(base.shape, generator=torch.Generator().manual_seed(9)))
    packed = current.clone().requires_grad_(True)
    loss, metrics = grpo_loss(packed, batch, config, policy_version=POLICY_VERSION)
    loss.backward()

    per_sample = current.clone().requires_grad_(True)
    lengths = [len(s.output_token_ids) for s in samples]
    reference = _reference_loss(list(per_sample.split(lengths)), samples, config)
    reference.backward()

    torch.testing.assert_close(loss.double(), reference, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(packed.grad, per_sample.grad, rtol=1e-6, atol=1e-9)
    assert packed.grad.abs().min() >= 0 and packed.grad.abs().max() > 0
    assert metrics["behaviour/stale_frac"] == pytest.approx(8 / 14)  # v4 x4, v3 x2, v3 x2 of 14 tokens
    if with_old and config.decoupled:
        rho = torch.exp(batch.old_logprobs - batch.sampling_logprobs)[batch.token_versions < POLICY_VERSION]
        assert (rho > config.is_cap).any() and (rho < config.is_cap).any(), "the cap should bind on some tokens"


def test_the_decoupled_objective_changes_the_loss_only_through_stale_tokens() -> None:
    samples = _samples(seed=4, with_old=True)
    batch = post_process_batch(samples)
    logprobs = batch.old_logprobs + 0.1
    on, _ = grpo_loss(logprobs, batch, LossConfig(decoupled=True), policy_version=POLICY_VERSION)
    off, _ = grpo_loss(logprobs, batch, LossConfig(decoupled=False), policy_version=POLICY_VERSION)
    assert not torch.equal(on, off)
    everything_fresh, _ = grpo_loss(logprobs, batch, LossConfig(decoupled=True), policy_version=3)
    assert torch.equal(everything_fresh, off)


@pytest.mark.parametrize("config", [LossConfig(kl_coef=0.1), LossConfig(is_mode="tis", is_cap=1.1),
                                    LossConfig(is_mode="mis", is_cap=1.1, aggregation="constant"),
                                    LossConfig(ratio_level="sequence")], ids=["none", "tis", "mis", "gspo"])
def test_with_no_stale_token_the_loss_is_todays_bit_for_bit(config: LossConfig) -> None:
    samples = _samples(seed=5, with_old=True)
    for sample in samples:  # every token sampled by the trainer's own weights
        sample.weight_version, sample.token_versions = POLICY_VERSION, None
    batch = post_process_batch(samples)
    results = []
    for loss_config, version in ((config, None), (LossConfig(**{**config.__dict__, "decoupled": True}), POLICY_VERSION)):
        logprobs = (batch.old_logprobs + 0.05).requires_grad_(True)
        loss, _ = grpo_loss(logprobs, batch, loss_config, policy_version=version)
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    (today, today_grad), (decoupled, decoupled_grad) = results
    assert torch.equal(today, decoupled) and torch.equal(today_grad, decoupled_grad)


def test_decoupled_needs_the_policy_version() -> None:
    batch = post_process_batch(_samples(seed=6, with_old=False))
    with pytest.raises(ValueError, match="policy_version"):
        grpo_loss(batch.sampling_logprobs, batch, LossConfig(decoupled=True))


def test_token_versions_follow_the_runs_and_skip_observation_tokens() -> None:
    straddling = Sample(input_token_ids=[1], output_token_ids=[5, 6, 7, 8, 9], gt_answer="", weight_version=2,
                        sampling_logprobs=[-1.0] * 4, output_mask=[True, True, False, True, True],
                        token_versions=[(2, 1), (3, 3)])
    plain = Sample(input_token_ids=[1], output_token_ids=[4, 4], gt_answer="", weight_version=7,
                   sampling_logprobs=[-1.0] * 2)
    assert post_process_batch([straddling, plain]).token_versions.tolist() == [2, 3, 3, 3, 7, 7]


@pytest.mark.parametrize("max_lag, flag, expected", [(0, None, False), (1, None, True), (2, None, True),
                                                     (2, "false", False), (0, "true", True)])
def test_decoupled_is_derived_from_max_lag_unless_set(max_lag: int, flag: str | None, expected: bool) -> None:
    argv = ["--model.model_path", "/nonexistent/model", "--data.path", "/nonexistent/data.jsonl",
            "--max_lag", str(max_lag)]
    if flag is not None:
        argv += ["--loss.decoupled", flag]
    assert load_trainer_config(argv).loss.decoupled is expected
