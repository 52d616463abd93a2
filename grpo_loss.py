"""Per-token logprobs from cross-entropy, and the GRPO loss. Pure tensor maths: no ranks, no Ray.

The trainer and the logprob worker both score tokens with `chunked_token_logprobs`, so reference
and old-policy logprobs come from exactly the function the loss is trained with.

Loss (for samples i with output tokens t, advantage A_i, output length |o_i|):

    L = sum_i (1/|o_i|) sum_t [ pg_t + kl_coef * kl_t ]
    pg_t = -min(r_t A_i, clip(r_t, 1 - clip_low, 1 + clip_high) A_i) * w_t

where r_t = pi(t) / pi_old(t). Without old logprobs pi_old is pi itself, detached, so r_t = 1 and
the gradient is exactly that of the seed's -A_i log pi(t). w_t is an optional truncated
importance-sampling weight min(pi_old(t) / pi_sampler(t), tis_cap) correcting for the sampler
(vLLM, possibly stale weights) differing from the trainer. The sum over samples is not averaged:
the trainer divides gradients by the step's total sample count (see trainer_core).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sample_processing_utils import IGNORE_INDEX, PackedBatch

_MAX_LOG_RATIO = 20.0  # keeps exp() finite when a stale logprob is wildly off

KLEstimator = Literal["k1", "k2", "k3"]


@dataclass(kw_only=True, frozen=True)
class LossConfig:
    """Hyperparameters of the GRPO loss."""

    kl_coef: float = 0.0
    """Weight of the KL(pi || pi_ref) penalty; 0 disables it (no reference logprobs needed)."""
    kl_estimator: KLEstimator = "k3"
    """k1: log(pi/ref); k2: 0.5 log(pi/ref)^2; k3: ref/pi - log(ref/pi) - 1 (unbiased, >= 0)."""
    clip_low: float = 0.2
    """Lower clip bound: the ratio is clipped at 1 - clip_low (used only with old logprobs)."""
    clip_high: float = 0.28
    """Upper clip bound: 1 + clip_high; larger than clip_low is DAPO's clip-higher."""
    tis_cap: float | None = None
    """Cap of the truncated importance-sampling weight against sampling logprobs; None: off."""

    def __post_init__(self) -> None:
        if self.kl_coef < 0:
            raise ValueError(f"LossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"LossConfig.kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"LossConfig.tis_cap must be > 0 or None, got {self.tis_cap}")


def _chunk_logprobs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each label and entropy of each position for one chunk, in fp32.

    At most two [chunk, vocab] fp32 tensors live at once (at Qwen's vocabulary of 151,936 and
    1024 tokens, 0.6 GB each): log_softmax's backward needs only its output, so the logits are
    freed as soon as it exists, and the entropy is built in place on one temporary.
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
    exist at once, in forward or backward.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if hidden_states.shape[0] != labels.shape[0]:
        raise ValueError(f"{hidden_states.shape[0]} hidden states for {labels.shape[0]} labels")
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, hidden_states.shape[0], chunk_size):
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


def grpo_loss(
    logprobs: torch.Tensor, batch: PackedBatch, config: LossConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss summed over the batch's samples (each sample's tokens averaged).

    logprobs: [O] trainer logprobs of the output tokens, aligned with batch.advantages.
    Returns (loss, metrics); metrics are token means over the batch, as python floats.
    """
    if logprobs.shape != batch.advantages.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} vs advantages {tuple(batch.advantages.shape)}")
    advantages = batch.advantages.to(logprobs.device)
    old = batch.old_logprobs.to(logprobs.device) if batch.old_logprobs is not None else logprobs.detach()
    log_ratio = (logprobs - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    unclipped_term, clipped_term = ratio * advantages, clipped_ratio * advantages
    pg = -torch.minimum(unclipped_term, clipped_term)
    metrics: dict[str, float] = {}

    if config.tis_cap is not None:
        sampling = batch.sampling_logprobs.to(logprobs.device)
        tis_log = (old.detach() - sampling).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        tis_weight = torch.exp(tis_log).clamp(max=config.tis_cap)
        pg = pg * tis_weight
        metrics["loss/tis_weight_mean"] = tis_weight.mean().item()

    per_token = pg
    if config.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("LossConfig.kl_coef > 0 but the batch carries no ref_logprobs")
        kl = kl_penalty(logprobs, batch.ref_logprobs.to(logprobs.device), config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        metrics["loss/kl"] = kl.detach().mean().item()
    elif batch.ref_logprobs is not None:
        with torch.no_grad():
            kl = kl_penalty(logprobs, batch.ref_logprobs.to(logprobs.device), config.kl_estimator)
        metrics["loss/kl"] = kl.mean().item()

    loss = (per_token / batch.output_lengths.to(logprobs.device)).sum()
    with torch.no_grad():
        is_clipped = (clipped_term < unclipped_term).float()
        metrics["loss/pg"] = (pg / batch.output_lengths.to(logprobs.device)).sum().item()
        metrics["loss/clip_frac"] = is_clipped.mean().item()
        metrics["loss/ratio_mean"] = ratio.mean().item()
        metrics["loss/sampler_trainer_logprob_diff"] = (
            (logprobs.detach() - batch.sampling_logprobs.to(logprobs.device)).abs().mean().item()
        )
    return loss, metrics
