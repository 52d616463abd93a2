"""Reward shaping on top of the verifier's verdict: `RewardConfig` and `shape_reward`.

The verifier pays 1.0 for a correct final answer and 0.0 otherwise (math_verifier). A run may
also require an answer format, e.g. the final answer in `\\boxed{}`: `RewardConfig.format_pattern`
is a regular expression searched in the completion's text, and the reward moves by
`format_bonus` when it is found and by `-format_penalty` when it is not:

    reward = verdict + format_bonus     if re.search(format_pattern, text, re.DOTALL)
    reward = verdict - format_penalty   otherwise
    reward = truncated_reward           for a truncated completion given SamplingConfig.truncated_reward
                                        (not verified, so not shaped either)

and then, under SamplingConfig.overlong_buffer > 0, DAPO's soft overlong punishment for every
completion, truncated ones included (`overlong_penalty`):

    reward -= penalty * clip((length - (max_tokens - buffer)) / buffer, 0, 1)

A completion the verifier could not score (no answer found, timeout) has verdict 0 and is shaped
like any other: an output without any answer must not escape the penalty that an unformatted
answer pays. The generation worker applies this after verification, in its own process, so a
pattern should stay linear in the text (no nested quantifiers): it runs on every completion.

Imports no Ray, vLLM or torch. `RewardConfig` travels inside `sampling.SamplingConfig.reward`
(flags `--sampling.reward.format_pattern ...` on the trainer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# The verifier's reward for a correct answer; `reward/accuracy` and `eval/accuracy` count a
# sample as solved when its reward reaches it. A bonus this large would count a wrong but
# well-formatted answer as solved, so format_bonus stays below it.
CORRECT_VERDICT = 1.0
# Patterns are searched over the whole completion with "." matching newlines too: reasoning
# texts span many lines, and a format such as r"\\boxed\{.+\}" must not stop at the first one.
FORMAT_FLAGS = re.DOTALL


@dataclass(kw_only=True, frozen=True)
class RewardConfig:
    """Shaping of the verifier's reward: an optional bonus or penalty for a required answer format."""

    format_pattern: str | None = None
    """Python regular expression that a well-formatted completion contains, searched anywhere in
    its text with re.DOTALL (anchor it with ^ and $ to match the whole text), e.g.
    '\\\\boxed\\{.+\\}' for a boxed answer. None: no format check."""
    format_bonus: float = 0.0
    """Added to the reward of a completion that matches format_pattern; in [0, 1), so a wrong
    answer never reaches the correct answer's reward of 1."""
    format_penalty: float = 0.0
    """Subtracted from the reward of a completion that does not match format_pattern; >= 0. A
    correct but unformatted answer then scores below 1 and counts as unsolved in accuracy metrics."""

    def __post_init__(self) -> None:
        for name in ("format_bonus", "format_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"RewardConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.format_bonus >= CORRECT_VERDICT:
            raise ValueError(
                f"RewardConfig.format_bonus must be < {CORRECT_VERDICT} (the reward of a correct answer), "
                f"got {self.format_bonus}"
            )
        if self.format_pattern is None:
            if self.format_bonus or self.format_penalty:
                raise ValueError("RewardConfig.format_bonus/format_penalty are set but format_pattern is None")
            return
        if not isinstance(self.format_pattern, str) or not self.format_pattern:
            raise ValueError(
                f"RewardConfig.format_pattern must be a non-empty regex or None, got {self.format_pattern!r}"
            )
        try:
            re.compile(self.format_pattern, FORMAT_FLAGS)
        except re.error as exc:
            raise ValueError(
                f"RewardConfig.format_pattern {self.format_pattern!r} is not a valid regex: {exc}"
            ) from None


@dataclass(slots=True, frozen=True)
class ShapedReward:
    """One completion's final reward and what the format check found."""

    reward: float
    """The reward the sample carries (verdict plus shaping, or the fixed truncated reward)."""
    format_matched: bool | None
    """True/False: format_pattern was (not) found; None: not checked (no pattern, or a fixed reward)."""


def format_matches(text: str, config: RewardConfig) -> bool | None:
    """Whether `text` contains config.format_pattern; None when no pattern is configured."""
    if config.format_pattern is None:
        return None
    # `re` caches compiled patterns, and a run uses one pattern.
    return re.search(config.format_pattern, text, FORMAT_FLAGS) is not None


def shape_reward(verdict: float, text: str, *, verified: bool, config: RewardConfig) -> ShapedReward:
    """Final reward of one completion (see the module docstring).

    verdict: the verifier's reward (or the fixed truncated reward when `verified` is False);
    text: the completion's text, the one the verifier scored.
    """
    if not verified:
        return ShapedReward(reward=float(verdict), format_matched=None)
    matched = format_matches(text, config)
    if matched is None:
        return ShapedReward(reward=float(verdict), format_matched=None)
    shift = config.format_bonus if matched else -config.format_penalty
    return ShapedReward(reward=float(verdict) + shift, format_matched=matched)


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of a completion of `length` tokens: 0 up to
    max_tokens - buffer, rising linearly to `penalty` at max_tokens (0 when buffer is 0)."""
    if buffer <= 0:
        return 0.0
    excess = length - (max_tokens - buffer)
    return penalty * min(max(excess / buffer, 0.0), 1.0)
