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

The verdict comes from math-verify by default; `RewardConfig.functions` replaces it with
plug-in reward functions (reward_functions.py, docs/rewards.md), each weighted:

    verdict = sum_i weights[i] * functions[i](prompt, completion, token_ids, metadata)

run in the verifier pool's processes under its deadline; a function that fails scores 0 for that
completion (the others still count) and the sample is flagged reward_failed. The name `judge`
(judge_config.JUDGE_FUNCTION) stands for a model judge instead (judge_reward.py), run from the
generation worker. Under `on_function_failure: mask` (the judge's own `judge.on_failure`, mask by
default) a failure masks the sample instead (CombinedScore.masked, Sample.reward_masked): the
batcher leaves it out of its group's baseline and the loss, and drops a group left with fewer
than `min_scored_samples` scored samples (batching/group_preparer.py). `solved` (what
`reward/accuracy` and `eval/accuracy` count) is the verdict's, never the shaping's: math-verify's
match, or every weighted function's own notion of solved (its `solved` part, else its reward >= 1).
A function of weight 0 is a monitor: scored and logged (reward/<name>), it enters neither the
reward nor `solved`, and its failures mask nothing; `judge.agree_with` compares the judge with one
(verdict_agreement, reward/judge_agreement).

Imports no Ray, vLLM or torch. `RewardConfig` (config/reward_config.py, a record every side
reads) travels inside `SamplingConfig.reward` (flags `--sampling.reward.format_pattern ...`,
`--sampling.reward.functions my_rewards:code` on the trainer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from async_grpo.config.reward_config import AGREEMENT_PART, CORRECT_VERDICT, FORMAT_FLAGS, RewardConfig
from async_grpo.rewards.reward_functions import FunctionScore

# The name the default reward (math-verify without reward functions) goes by in the per-reason
# failure counts: counts/reward_failed/math_verify/<reason>.
DEFAULT_REWARD_NAME = "math_verify"


@dataclass(slots=True, frozen=True)
class CombinedScore:
    """The verdict of one completion from the reward functions."""

    reward: float
    """sum_i weight_i * reward_i (a failed function contributes 0)."""
    solved: bool
    """Every weighted function says solved (its `solved` part, else its reward >= CORRECT_VERDICT);
    a failed weighted function's completion is unsolved. Weight-0 functions (monitors) do not count."""
    parts: dict[str, float]
    """Per-function rewards by function name (unweighted), and each dict part as "<name>/<part>"."""
    errors: tuple[str, ...]
    """"<name>: <error>" of each failed function; empty when none failed."""
    failure_reasons: tuple[str, ...] = ()
    """"<name>/<kind>" of each failed function (kind: raised, bad_return, timeout, crash,
    rejected, unparsable), for the per-reason counts of the step metrics."""
    masked: bool = False
    """A function whose failures mask (RewardConfig.masks_failure) failed: `reward` is no score,
    and the sample stays out of its group's baseline and the loss."""


def combine_scores(names: Sequence[str], weights: Sequence[float], scores: Sequence[FunctionScore],
                   masking: Sequence[bool] | None = None, agreement: tuple[str, str] | None = None) -> CombinedScore:
    """One completion's verdict from its functions' scores (names, weights, scores aligned);
    masking[i]: a failure of function i masks the completion (None: no function masks);
    agreement (judge, other): adds their verdict_agreement as the AGREEMENT_PART part when both scored."""
    parts: dict[str, float] = {}
    errors = []
    reasons = []
    solved = True
    masked = False
    for i, (name, weight, score) in enumerate(zip(names, weights, scores, strict=True)):
        parts[name] = score.reward
        parts.update({f"{name}/{part}": value for part, value in score.parts.items()})
        if score.failed:
            errors.append(f"{name}: {score.error}")
            reasons.append(f"{name}/{score.kind}")
            masked = masked or (masking is not None and masking[i] and weight != 0)
        if weight != 0:
            solved = solved and score_solved(score)
    if agreement is not None:
        agreed = verdict_agreement(names, scores, *agreement)
        if agreed is not None:
            parts[AGREEMENT_PART] = agreed
    reward = sum(w * s.reward for w, s in zip(weights, scores, strict=True))
    return CombinedScore(reward=reward, solved=solved, parts=parts, errors=tuple(errors),
                         failure_reasons=tuple(reasons), masked=masked)


def score_solved(score: FunctionScore) -> bool:
    """One function's own verdict: its `solved` part, else its reward reaching CORRECT_VERDICT;
    a failed call is unsolved."""
    return not score.failed and (score.solved if score.solved is not None else score.reward >= CORRECT_VERDICT)


def verdict_agreement(names: Sequence[str], scores: Sequence[FunctionScore], judge: str, other: str) -> float | None:
    """1.0 when the functions `judge` and `other` both call the completion solved or both not
    (score_solved), 0.0 when they differ; None when either failed or is not among `names`."""
    by_name = dict(zip(names, scores, strict=True))
    first, second = by_name.get(judge), by_name.get(other)
    if first is None or second is None or first.failed or second.failed:
        return None
    return float(score_solved(first) == score_solved(second))


def counts_as_solved(solved: bool | None, reward: float) -> bool:
    """What accuracy metrics count: the verdict's `solved` when the worker set it, else (samples
    from before it existed, or built by hand) a reward reaching CORRECT_VERDICT."""
    return solved if solved is not None else reward >= CORRECT_VERDICT


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
