"""How one prompt's rollouts are sampled and scored: `SamplingConfig`, sent with every request,
and the seeds that make sampling reproducible.

The trainer fills it, the batcher stamps each step's seed on it, the generation worker obeys
it. Imports no Ray, vLLM or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Every sampling seed stays below this: 31 bits fit any RNG API that takes a C int or an int32
# (vLLM passes request seeds to torch.Generator.manual_seed, other engines may be narrower).
SEED_BOUND = 2**31


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    """How to sample and score one prompt's rollouts; sent with every request by the trainer."""

    n: int = 8
    """Completions per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy, which needs n == 1."""
    top_p: float = 1.0
    """Nucleus-sampling mass in (0, 1]."""
    max_tokens: int = 512
    """Most tokens one completion may generate; a completion that reaches it is truncated."""
    seed: int | None = None
    """Seed of a request's sampling: the request for prompt k uses request_seed(seed, k, n) and
    vLLM gives its i-th completion that seed + i, so the same (seed, prompt, weights) give the
    same rollouts. The trainer sets it from TrainerConfig.seed, and its batcher sends each step
    its own seed, derive_seed(seed, step), so a prompt drawn again at a later step gets fresh
    randomness. None samples unseeded (from the engine's own random state)."""
    scale_advantage_by_std: bool = True
    """True: advantage = (r - mean) / (std + eps) (GRPO). False: r - mean (Dr. GRPO, which
    argues the std division over-weights prompts that are nearly always solved or failed)."""
    advantage_eps: float = 1e-4
    """Added to the group std before dividing, so a group with equal rewards gets advantage 0."""
    truncated_reward: float | None = 0.0
    """Reward of a completion cut off at max_tokens, given without verifying it. math-verify
    takes the first number it finds, so a cut-off '9=9=' would score as the answer 9; 0 stops
    rewarding rambling. None verifies truncated completions like any other."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.n != 1:
            raise ValueError(f"SamplingConfig.temperature 0 (greedy) needs n == 1, got n={self.n}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < SEED_BOUND:
            raise ValueError(f"SamplingConfig.seed must be in [0, 2**31) or None, got {self.seed}")
        if self.advantage_eps < 0:
            raise ValueError(f"SamplingConfig.advantage_eps must be >= 0, got {self.advantage_eps}")
        if self.truncated_reward is not None and not math.isfinite(self.truncated_reward):
            raise ValueError(f"SamplingConfig.truncated_reward must be finite or None, got {self.truncated_reward}")


def derive_seed(base_seed: int, *keys: int, bound: int = SEED_BOUND) -> int:
    """A seed in [0, bound) drawn from (base_seed, *keys) by numpy's SeedSequence.

    SeedSequence hashes its whole entropy list, so nearby inputs (step 3 and step 4, or seed 0 and
    seed 1) give unrelated outputs, unlike base + key arithmetic, where seed s at step t+1 would
    repeat seed s+1 at step t. Deterministic across processes and platforms. Every input must be
    >= 0.
    """
    if bound < 1:
        raise ValueError(f"derive_seed: bound must be >= 1, got {bound}")
    (word,) = np.random.SeedSequence([base_seed, *keys]).generate_state(1, dtype=np.uint64)
    return int(word) % bound


def request_seed(seed: int | None, prompt_id: int, n: int) -> int | None:
    """Seed of one generate request (see SamplingConfig.seed), None when unseeded.

    vLLM seeds the request's i-th completion with seed + i, so the seed stays n - 1 below
    SEED_BOUND. A sample without a prompt id (-1) counts as prompt 0. Two requests of one step
    share a completion seed with probability ~prompts^2 * n / 2^31 (8 in a million for 32 prompts
    of 16 completions), harmless: they sample different prompts.
    """
    return None if seed is None else derive_seed(seed, max(prompt_id, 0), bound=SEED_BOUND - (n - 1))
