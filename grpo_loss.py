"""Per-token logprobs from cross-entropy, and the GRPO loss. Pure tensor maths: no ranks, no Ray.

The trainer and the logprob worker both score tokens with `chunked_token_logprobs`, so reference
and old-policy logprobs come from exactly the function the loss is trained with.

Loss (for samples i with output tokens t, advantage A_it (A_i broadcast, or a prepare function's
per-token advantages), output length |o_i|):

    L = sum_i sum_t c_i [ pg_t + kl_coef * kl_t ]
    pg_t = -min(r_t A_it, clip(r_t, 1 - clip_low, 1 + clip_high) A_it) * w_t

with c_i = 1/|o_i| (aggregation sample_mean) or 1 (token_mean, constant): this function returns
the sum, and the trainer divides the step's summed gradients by the step's divisor (samples for
sample_mean, output tokens for token_mean, samples x max_tokens for constant; see `step_divisor`),
which makes any split of the step over ranks and minibatches equal one pass over the whole step.

r_t = pi(t) / pi_old(t) (ratio_level token), or with ratio_level sequence (GSPO) the sequence's
geometric-mean ratio s_i = exp(mean_t log(pi(t) / pi_old(t))) for every token of sample i, with its
own clip range. Without old logprobs pi_old is pi itself, detached, so r_t = 1 and the gradient is
exactly that of on-policy GRPO's -A_i log pi(t). w_t corrects for the sampler (vLLM, possibly stale
weights) differing from the trainer (is_mode): 1 (none), min(rho_t, is_cap) (tis, truncated) or
rho_t if rho_t <= is_cap else 0 (mis, masked), with rho_t = pi_old(t) / pi_sampler(t).

Stale tokens (sampled by weights older than the trainer's, `policy_version`) and the decoupled
objective (AReaL, arXiv 2505.24298): pi_old is the proximal policy, the trainer's weights before
the step's first update (old-policy logprob workers' logprobs, else this step's first pass), so
the clip bounds the move from the current weights, while the sampler enters only through rho_t.
With `decoupled` on, every stale token gets rho_t's weight (is_mode's rule, tis when is_mode is
none) and fresh tokens keep today's weight, so a step with no stale token is today's loss exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sample_processing_utils import IGNORE_INDEX, PackedBatch

_MAX_LOG_RATIO = 20.0  # keeps exp() finite when a stale logprob is wildly off
SUMMED_METRICS = ("loss/pg",)
"""grpo_loss metrics that are sums over the batch; every other one is a mean over its output tokens."""

KLEstimator = Literal["k1", "k2", "k3"]
Aggregation = Literal["sample_mean", "token_mean", "constant"]
RatioLevel = Literal["token", "sequence"]
ISMode = Literal["none", "tis", "mis"]


@dataclass(kw_only=True, frozen=True)
class LossConfig:
    """Hyperparameters of the GRPO loss and of the KL term, in the loss or in the reward (the
    batcher reads the kl_* fields for the latter: algorithm.KLSettings)."""

    kl_coef: float = 0.0
    """Weight beta of KL(pi || pi_ref); 0 disables it (no reference logprobs needed). In the loss
    unless kl_in_reward; there, the controller's starting value."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL in the loss. k1: log(pi/ref); k2: 0.5 log(pi/ref)^2; k3: ref/pi - log(ref/pi) - 1
    (unbiased, >= 0). The KL in the reward is always the sequence's sum of k1 (see algorithm.py)."""
    # The reference's logprobs come from logprob_role: reference workers or, beside old-policy
    # logprob workers, from reference_pool workers.
    kl_in_reward: bool = False
    """Move the KL out of the loss into the reward: reward - beta * sum_t (log pi(t) - log
    pi_ref(t)) before advantages, pi's logprobs as kl_policy_logprobs says. Metrics: kl/beta,
    kl/in_reward_mean."""
    kl_policy_logprobs: Literal["sampler", "old_policy"] = "sampler"
    """kl_in_reward: the policy's logprobs in the KL: the sampler's (vLLM's sampled-token
    logprobs, no extra work) or the old-policy logprob workers' (logprob_role: old_policy with
    reference_pool: true; the trainer's own forward, free of sampler/trainer mismatch)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """kl_in_reward: fixed keeps beta = kl_coef; adaptive (Ziegler et al.) moves beta by
    clip(KL/target_kl - 1, +-0.2) x samples/kl_horizon after each step. Saved in checkpoints."""
    target_kl: float = 6.0
    """adaptive controller: target KL per sample (summed over its response tokens), in nats."""
    kl_horizon: int = 10000
    """adaptive controller: horizon in samples."""
    clip_low: float = 0.2
    """Lower clip bound: the ratio is clipped at 1 - clip_low (used only with old logprobs)."""
    clip_high: float = 0.28
    """Upper clip bound: 1 + clip_high; larger than clip_low is DAPO's clip-higher."""
    aggregation: Aggregation = "sample_mean"
    """How token terms make the step's loss: sample_mean (each sample's token mean, averaged over
    samples: GRPO), token_mean (mean over all the step's tokens: DAPO) or constant (sum over tokens
    / (samples x sampling.max_tokens): Dr. GRPO, no length normalisation)."""
    ratio_level: RatioLevel = "token"
    """token: per-token ratios (PPO/GRPO); sequence: the sequence's geometric-mean ratio (GSPO),
    clipped at [1 - seq_clip_low, 1 + seq_clip_high]."""
    seq_clip_low: float = 3e-4
    """GSPO's lower clip range (the sequence ratio is a mean of logs: much narrower than PPO's)."""
    seq_clip_high: float = 4e-4
    """GSPO's upper clip range."""
    is_mode: ISMode = "none"
    """Train-inference mismatch correction with rho_t = pi_old(t) / pi_sampler(t): none; tis (weight
    min(rho, is_cap)); mis (weight rho, tokens with rho > is_cap masked out). Measured always:
    mismatch/kl, mismatch/is_weight_mean, mismatch/masked_frac."""
    is_cap: float = 2.0
    """Cap C of tis and mis."""
    decoupled: bool | None = None
    """Decoupled objective for stale tokens: weight each token sampled by older weights by
    pi_old/pi_sampler (is_mode's rule and cap; tis under is_mode none), clip around pi_old.
    Unset: on when max_lag >= 1."""

    def __post_init__(self) -> None:
        if not (self.kl_coef >= 0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"LossConfig.kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"LossConfig.kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
        if not 0 <= self.seq_clip_low < 1 or self.seq_clip_high < 0:
            raise ValueError(f"LossConfig.seq_clip_low must be in [0, 1) and seq_clip_high >= 0, got "
                             f"{self.seq_clip_low}, {self.seq_clip_high}")
        if not self.is_cap > 0:
            raise ValueError(f"LossConfig.is_cap must be > 0, got {self.is_cap}")
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("LossConfig.kl_in_reward needs kl_coef > 0 (the controller's starting beta)")
        if self.kl_policy_logprobs not in ("sampler", "old_policy"):
            raise ValueError(f"LossConfig.kl_policy_logprobs must be sampler or old_policy, got "
                             f"{self.kl_policy_logprobs!r}")
        if self.kl_controller not in ("fixed", "adaptive"):
            raise ValueError(f"LossConfig.kl_controller must be fixed or adaptive, got {self.kl_controller!r}")
        if self.kl_controller == "adaptive" and not self.target_kl > 0:
            raise ValueError(f"LossConfig.target_kl must be > 0 for the adaptive controller, got {self.target_kl}")
        if self.kl_controller == "adaptive" and self.kl_horizon < 1:
            raise ValueError(f"LossConfig.kl_horizon must be >= 1, got {self.kl_horizon}")

    @property
    def kl_in_loss(self) -> bool:
        """Whether the loss carries a KL term (kl_coef > 0 and not moved into the reward)."""
        return self.kl_coef > 0 and not self.kl_in_reward


def step_divisor(aggregation: Aggregation, num_samples: int, num_output_tokens: int, max_tokens: int) -> float:
    """What a step's summed per-sample (sample_mean) or per-token (token_mean, constant) loss
    terms are divided by to give the step's loss (the trainer divides gradients by it)."""
    if aggregation == "sample_mean":
        return float(num_samples)
    if aggregation == "token_mean":
        return float(num_output_tokens)
    if aggregation == "constant":
        return float(num_samples * max_tokens)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def _chunk_logprobs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each label and entropy of each position for one chunk, in fp32.

    At most two [chunk, vocab] fp32 tensors live at once (at Qwen's vocabulary of 151,936 and
    1024 tokens, 0.6 GB each): log_softmax's backward needs only its output, so the logits are
    freed as soon as it exists, and the entropy is built in place on one temporary.
    The entropy comes last on purpose: checkpointing's recompute in backward stops once the
    tensors backward needs are back (torch's default early stop), so it never reruns the
    entropy (tests/algo/test_chunked_entropy.py counts the ops).
    """
    log_p = torch.log_softmax(F.linear(hidden, weight, bias).float(), dim=-1)
    ignored = labels == IGNORE_INDEX
    picked = log_p.gather(-1, labels.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    logprobs = picked.masked_fill(ignored, 0.0)  # ignored labels give 0, which we never read
    with torch.no_grad():
        entropy = log_p.exp().mul_(log_p).sum(dim=-1).neg_()
    return logprobs, entropy


def chunked_token_logprobs(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Linear,
    labels: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position logprob of `labels` and predictive entropy, chunked along the token axis.

    hidden_states: [T, H] final hidden states; labels: [T] with IGNORE_INDEX where unscored.
    Returns (logprobs [T] fp32, entropy [T] fp32, no grad). Each chunk's [chunk, vocab] logits are
    recomputed in backward (activation checkpointing), so the full [T, vocab] fp32 logits never
    exist at once, in forward or backward. T may be 0 (a context-parallel rank that scores no
    token): the empty result still hangs off hidden_states, so that rank's backward runs too.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if hidden_states.shape[0] != labels.shape[0]:
        raise ValueError(f"{hidden_states.shape[0]} hidden states for {labels.shape[0]} labels")
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, max(hidden_states.shape[0], 1), chunk_size):
        stop = start + chunk_size
        args = (hidden_states[start:stop], lm_head.weight, lm_head.bias, labels[start:stop])
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs_and_entropy, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs_and_entropy(*args)
        logprob_chunks.append(lp)
        entropy_chunks.append(ent)
    return torch.cat(logprob_chunks), torch.cat(entropy_chunks)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = (logprobs - ref_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log pi/ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(-log_ratio) + log_ratio - 1.0


SampleSums = Callable[[torch.Tensor], torch.Tensor]
"""Completes [num_samples] per-sample sums over the parts of a batch held elsewhere (differentiably):
a context-parallel group's sum. None: the batch is whole."""


def _sequence_mean(values: torch.Tensor, batch: PackedBatch, sample_sums: SampleSums | None) -> torch.Tensor:
    """Each sample's mean of a [O] per-token tensor, broadcast back over its tokens ([O])."""
    index = batch.sample_index.to(values.device)
    sums = torch.zeros(batch.num_samples, dtype=values.dtype, device=values.device).index_add(0, index, values)
    if sample_sums is not None:
        sums = sample_sums(sums)
    return (sums / batch.output_lengths_per_sample.to(values.device))[index]


def _policy_ratio(logprobs: torch.Tensor, old: torch.Tensor, batch: PackedBatch, config: LossConfig,
                  sample_sums: SampleSums | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, clipped ratio) per output token, token- or sequence-level (GSPO)."""
    log_ratio = (logprobs - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if config.ratio_level == "sequence":
        ratio = torch.exp(_sequence_mean(log_ratio, batch, sample_sums))
        return ratio, ratio.clamp(1.0 - config.seq_clip_low, 1.0 + config.seq_clip_high)
    ratio = torch.exp(log_ratio)
    return ratio, ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)


def _capped_weights(rho: torch.Tensor, mode: ISMode, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, capped flags) of importance ratios rho under tis (truncate at cap) or mis (mask
    above cap)."""
    capped = (rho > cap).float()
    if mode == "tis":
        return rho.clamp(max=cap), capped
    return rho * (1.0 - capped), capped


def _mismatch_weights(rho: torch.Tensor, log_rho: torch.Tensor, config: LossConfig,
                      metrics: dict[str, float]) -> torch.Tensor | None:
    """Importance weights against the sampler (None for is_mode none); logs the mismatch."""
    # KL(sampler || trainer) estimated on the sampler's own tokens (k3: unbiased, >= 0).
    metrics["mismatch/kl"] = (rho - log_rho - 1.0).mean().item()
    if config.is_mode == "none":
        metrics["mismatch/is_weight_mean"] = 1.0
        metrics["mismatch/masked_frac"] = 0.0
        return None
    weights, capped = _capped_weights(rho, config.is_mode, config.is_cap)
    metrics["mismatch/is_weight_mean"] = weights.mean().item()
    metrics["mismatch/masked_frac"] = capped.mean().item() if config.is_mode == "mis" else 0.0
    return weights


def _behaviour_weights(rho: torch.Tensor, stale: torch.Tensor, weights: torch.Tensor | None,
                       config: LossConfig, metrics: dict[str, float]) -> torch.Tensor | None:
    """The decoupled objective's weights: stale tokens get rho's weight under is_mode (tis when
    none), fresh ones keep `weights` (is_mode's, or 1). Logs them (behaviour/*) whether or not
    config.decoupled applies them, so runs without it show what they would be; returns the
    weights the loss applies."""
    stale_weights, capped = _capped_weights(rho, config.is_mode if config.is_mode != "none" else "tis",
                                            config.is_cap)
    applied = torch.where(stale, stale_weights, weights if weights is not None else torch.ones_like(rho))
    stale_f = stale.float()
    metrics["behaviour/stale_frac"] = stale_f.mean().item()
    metrics["behaviour/weight_mean"] = applied.mean().item()
    metrics["behaviour/weight_sq_mean"] = applied.square().mean().item()
    metrics["behaviour/capped_frac"] = (capped * stale_f).mean().item()
    if not config.decoupled or not bool(stale.any()):
        return weights  # no stale token: exactly the loss without the decoupled objective
    return applied


def grpo_loss(
    logprobs: torch.Tensor, batch: PackedBatch, config: LossConfig, policy_version: int | None = None,
    sample_sums: SampleSums | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss summed over the batch: each sample's token mean (sample_mean) or every token
    (token_mean, constant); the trainer divides by the step's divisor (see `step_divisor`).

    logprobs: [O] trainer logprobs of the output tokens, aligned with batch.advantages.
    policy_version: the weight version the trainer's weights are at (the step); tokens of older
    versions are stale. Needed by config.decoupled; without it every token counts as fresh.
    sample_sums: for part of a batch (a context-parallel rank's output tokens, whose
    output_lengths still count whole samples), completes the per-sample sums that span the parts
    (GSPO's sequence log-ratio); every other term is per token, so the parts' losses add up to
    the whole batch's.
    Returns (loss, metrics); metrics are token means over the batch (SUMMED_METRICS: sums), as
    python floats.
    """
    if logprobs.shape != batch.advantages.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} vs advantages {tuple(batch.advantages.shape)}")
    if config.decoupled and policy_version is None:
        raise ValueError("LossConfig.decoupled needs the trainer's policy_version to tell stale tokens")
    advantages = batch.advantages.to(logprobs.device)
    old = batch.old_logprobs.to(logprobs.device) if batch.old_logprobs is not None else logprobs.detach()
    ratio, clipped_ratio = _policy_ratio(logprobs, old, batch, config, sample_sums)
    unclipped_term, clipped_term = ratio * advantages, clipped_ratio * advantages
    pg = -torch.minimum(unclipped_term, clipped_term)
    metrics: dict[str, float] = {}
    log_rho = (old.detach() - batch.sampling_logprobs.to(logprobs.device)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = torch.exp(log_rho)  # pi_old / pi_sampler
    weights = _mismatch_weights(rho, log_rho, config, metrics)
    if policy_version is not None:
        stale = batch.token_versions.to(logprobs.device) < policy_version
        weights = _behaviour_weights(rho, stale, weights, config, metrics)
    if weights is not None:
        pg = pg * weights

    per_token = pg
    if config.kl_in_loss:
        if batch.ref_logprobs is None:
            raise ValueError("LossConfig.kl_coef > 0 but the batch carries no ref_logprobs")
        kl = kl_penalty(logprobs, batch.ref_logprobs.to(logprobs.device), config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        metrics["loss/kl"] = kl.detach().mean().item()
    elif batch.ref_logprobs is not None:
        with torch.no_grad():
            kl = kl_penalty(logprobs, batch.ref_logprobs.to(logprobs.device), config.kl_estimator)
        metrics["loss/kl"] = kl.mean().item()

    token_weight = (1.0 / batch.output_lengths.to(logprobs.device)) if config.aggregation == "sample_mean" else 1.0
    loss = (per_token * token_weight).sum()
    with torch.no_grad():
        is_clipped = (clipped_term < unclipped_term).float()
        metrics["loss/pg"] = (pg * token_weight).sum().item()
        metrics["loss/clip_frac"] = is_clipped.mean().item()
        metrics["loss/ratio_mean"] = ratio.mean().item()
        metrics["loss/sampler_trainer_logprob_diff"] = (
            (logprobs.detach() - batch.sampling_logprobs.to(logprobs.device)).abs().mean().item()
        )
    return loss, metrics
