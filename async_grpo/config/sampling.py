"""How one prompt's rollouts are sampled and scored: `SamplingConfig`, sent with every request,
and the seeds that make sampling reproducible.

A record every side reads: the trainer fills it, the batcher stamps each step's seed on it, the
generation worker obeys it. Imports no Ray, vLLM or torch.

What a completion holds when generation stops (the generation worker passes `stop` and
`stop_token_ids` to vLLM with include_stop_str_in_output=True):

    ends on             output_token_ids (trained)          output_text (rewarded)   finish_reason
    EOS                 ... + the EOS id                    without EOS (special)    'stop'
    a stop token id     ... + that id                       with its text, unless    'stop'
                                                            it is a special token
    a stop string       ... up to the token completing it   up to the stop string's  'stop'
                                                            end, the string included
    max_tokens          max_tokens tokens                   all of them              'length' (truncated)

So output_text == tokenizer.decode(output_token_ids, skip_special_tokens=True), and the tokens
the trainer trains on are the text the reward was computed on. One exception: when the token
that completes a stop string carries characters past the string's end (a BPE token such as
'>\\n' completing '</answer>'), vLLM cuts the text at the string's end while the token stays
whole: those trailing characters are trained but were not seen by the reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from async_grpo.config.reward_config import RewardConfig
from async_grpo.config.rollout_sources import EnvironmentConfig, VerifiersEnvConfig

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
    # The request for prompt k uses request_seed(seed, k, n) and vLLM gives its i-th completion
    # that seed + i. The trainer's batcher sends each step its own seed, derive_seed(seed, step),
    # so a prompt drawn again at a later step gets fresh randomness.
    seed: int | None = None
    """Seed of a request's sampling: the same (seed, prompt, weights) give the same rollouts. The
    trainer sets it from TrainerConfig.seed (see seed_sampling). None: unseeded, from the engine's
    own random state."""
    # The batcher asks the ranks for more prompts (drawn from their data order) until the step has
    # as many informative prompts as it was submitted. Counted: counts/dropped_zero_variance_groups,
    # counts/resampled_prompts.
    drop_zero_variance_groups: bool = False
    """DAPO's dynamic sampling: a group whose rollouts all scored the same (no learning signal) is
    not trained on nor counted in the gradient divisor, and is replaced by fresh prompts, for at
    most max_resample_rounds rounds."""
    max_resample_rounds: int = 3
    """Most rounds of extra prompts one step asks for under drop_zero_variance_groups."""
    mask_truncated: bool = False
    """Keep completions cut off at max_tokens out of the loss (DAPO's overlong filtering); they
    still count in their group's baseline. Counted: counts/masked_truncated."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a completion longer than max_tokens - overlong_buffer loses
    overlong_penalty x (length - (max_tokens - overlong_buffer)) / overlong_buffer of reward (the
    full overlong_penalty at max_tokens). 0: off."""
    overlong_penalty: float = 1.0
    """Reward lost at max_tokens under overlong_buffer > 0."""
    truncated_reward: float | None = 0.0
    """Reward of a completion cut off at max_tokens, given without verifying it (nor shaping it by
    `reward`). math-verify reads an answer from whatever the text holds, so a cut-off '9=9=' would
    score as the answer 9; 0 stops rewarding rambling. None verifies truncated completions like
    any other."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion (vLLM stop strings), besides the model's EOS. The stop string
    stays in the completion's text and tokens (see the module docstring), so the model is trained
    to emit it and the reward and format check see it: choose strings that hold no answer."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion, besides the model's EOS; the stop token is kept as the
    completion's last token (trained, like EOS)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward shaping after verification: an optional answer-format bonus or penalty."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn rollouts against an environment (docs/environments.md); its name "" (the
    default) keeps rollouts single-turn. With an environment its rewards are the rollout's reward
    (`reward` and the verifier are not used) and each turn samples at most max_tokens."""
    verifiers: VerifiersEnvConfig = field(default_factory=VerifiersEnvConfig)
    """Rollouts through a `verifiers` environment (its taskset "" off, the default): the worker
    serves its loopback endpoint and runs the environment against it; the environment's rubric
    is the reward (`reward` and the verifier are not used) and each turn samples at most max_tokens.
    Excludes `environment`."""

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
        if self.max_resample_rounds < 0:
            raise ValueError(f"SamplingConfig.max_resample_rounds must be >= 0, got {self.max_resample_rounds}")
        if not 0 <= self.overlong_buffer <= self.max_tokens:
            raise ValueError(f"SamplingConfig.overlong_buffer must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.overlong_buffer}")
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
            raise ValueError(f"SamplingConfig.overlong_penalty must be a finite number >= 0, got {self.overlong_penalty}")
        if self.truncated_reward is not None and not math.isfinite(self.truncated_reward):
            raise ValueError(f"SamplingConfig.truncated_reward must be finite or None, got {self.truncated_reward}")
        self._check_stops()
        if not isinstance(self.reward, RewardConfig):  # RewardConfig validates its own fields
            raise ValueError(f"SamplingConfig.reward must be a RewardConfig, got {type(self.reward).__name__}")
        if not isinstance(self.environment, EnvironmentConfig):
            raise ValueError(f"SamplingConfig.environment must be an EnvironmentConfig, "
                             f"got {type(self.environment).__name__}")
        if not isinstance(self.verifiers, VerifiersEnvConfig):
            raise ValueError(f"SamplingConfig.verifiers must be a VerifiersEnvConfig, got {type(self.verifiers).__name__}")
        if self.verifiers.enabled and self.environment.enabled:
            raise ValueError("SamplingConfig.verifiers and SamplingConfig.environment are two rollout sources; "
                             "set one of them")

    def _check_stops(self) -> None:
        """stop: non-empty strings; stop_token_ids: ints >= 0 (stored as tuples: the config is frozen)."""
        for name in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, name), (str, bytes)):
                raise ValueError(f"SamplingConfig.{name} must be a list, got the single value {getattr(self, name)!r}")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"SamplingConfig.stop must hold non-empty strings, got {text!r} in {list(self.stop)}")
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(
                    f"SamplingConfig.stop_token_ids must hold ints >= 0, got {token!r} in {list(self.stop_token_ids)}"
                )


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
