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
match, or every function's own notion of solved (its `solved` part, else its reward >= 1).

Imports no Ray, vLLM or torch. `RewardConfig` travels inside `sampling.SamplingConfig.reward`
(flags `--sampling.reward.format_pattern ...`, `--sampling.reward.functions my_rewards:code` on
the trainer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence

from async_grpo.data.reasoning_gym_tasks import REASONING_GYM_SOURCE_PREFIX
from async_grpo.rewards import reward_functions
from async_grpo.rewards.judge_config import FAILURE_POLICIES, JUDGE_FUNCTION, FailurePolicy, JudgeConfig
from async_grpo.rewards.reward_functions import FunctionScore

# The verifier's reward for a correct answer; `reward/accuracy` and `eval/accuracy` count a
# sample as solved when its reward reaches it. A bonus this large would count a wrong but
# well-formatted answer as solved, so format_bonus stays below it.
CORRECT_VERDICT = 1.0
# The name the default reward (math-verify without reward functions) goes by in the per-reason
# failure counts: counts/reward_failed/math_verify/<reason>.
DEFAULT_REWARD_NAME = "math_verify"
# The record field that routes a prompt to its reward function (verl's layout).
DATA_SOURCE_FIELD = "data_source"
# Prompts of data.format reasoning_gym have data_source "reasoning_gym/<task>"
# (reasoning_gym_tasks.REASONING_GYM_SOURCE_PREFIX); without other functions they are scored by
# the task's own scorer (named here, so that this pure module does not import the scorer's module).
REASONING_GYM_FUNCTION = "async_grpo.rewards.reasoning_gym_reward:score"
# Metric names under reward/ that a reward function's name (reward/<name>) must not take.
_RESERVED_METRIC_NAMES = ("mean", "accuracy", "mean_generated", "masked_samples")
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
    correct but unformatted answer then scores below 1, while accuracy metrics count the verdict
    (`solved`), so it still counts as solved there."""
    # Called in the verifier pool's processes; each is imported and its signature checked when this
    # config is built. Empty gives the verdict of "async_grpo.rewards.math_verifier:math_verify_reward",
    # with the pool's cache and fast path.
    functions: tuple[str, ...] = ()
    """Reward functions as "module:function", importable on every node (docs/rewards.md); the
    verdict is their weighted sum. Empty: math-verify."""
    weights: tuple[float, ...] = ()
    """One finite weight per entry of `functions`; empty: 1.0 each."""
    # Other prompts: `functions`, or math-verify, or for data.format reasoning_gym the task's own
    # scorer (async_grpo.rewards.reasoning_gym_reward:score).
    by_data_source: tuple[str, ...] = ()
    """verl-style routing, "data_source=module:function" entries: a prompt whose record's
    `data_source` (data.format verl) is named here is scored by that function alone (weight 1);
    other prompts as without it. Checked like `functions`."""
    function_timeout_s: float | None = None
    """Deadline of one reward-function call (a batched function: one batch), after which its
    process is killed and the completion scores 0 for it; None: the verifier pool's deadline."""
    on_function_failure: FailurePolicy = "zero"
    """A reward function that fails (timeout, crash, raised, bad return): zero scores 0 for it (the
    others still count); mask leaves the sample out of its group's baseline and the loss, counted
    in reward/masked_samples. The judge has its own: judge.on_failure."""
    min_scored_samples: int = 2
    """A group that masking leaves with fewer scored samples than this is dropped, counted in
    counts/dropped_groups_masked (a group without masked samples is never dropped for it)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The model judge that the reward function named `judge` in functions or by_data_source
    calls (judge_config.py); unused otherwise."""

    def __post_init__(self) -> None:
        self._check_functions()
        self._check_routes()
        if self.on_function_failure not in FAILURE_POLICIES:
            raise ValueError(f"RewardConfig.on_function_failure must be one of {list(FAILURE_POLICIES)}, "
                             f"got {self.on_function_failure!r}")
        if isinstance(self.min_scored_samples, bool) or not isinstance(self.min_scored_samples, int) \
                or self.min_scored_samples < 1:
            raise ValueError(f"RewardConfig.min_scored_samples must be an int >= 1, got {self.min_scored_samples!r}")
        if not isinstance(self.judge, JudgeConfig):  # JudgeConfig validates its own fields
            raise ValueError(f"RewardConfig.judge must be a JudgeConfig, got {type(self.judge).__name__}")
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

    def _check_functions(self) -> None:
        if isinstance(self.functions, str) or not all(isinstance(f, str) for f in self.functions):
            raise ValueError(f"RewardConfig.functions must be a list of 'module:function' strings, got {self.functions!r}")
        if len(set(map(reward_functions.function_name, self.functions))) != len(self.functions):
            raise ValueError(f"RewardConfig.functions name one function twice (metrics are per name): {self.functions!r}")
        taken = sorted(set(map(reward_functions.function_name, self.functions)) & set(_RESERVED_METRIC_NAMES))
        if taken:
            raise ValueError(f"RewardConfig.functions: {taken} would overwrite the reward/{taken[0]} metric; rename it")
        if self.weights and len(self.weights) != len(self.functions):
            raise ValueError(f"RewardConfig.weights has {len(self.weights)} entries for {len(self.functions)} functions")
        for weight in self.weights:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"RewardConfig.weights must be finite numbers, got {self.weights!r}")
        timeout = self.function_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"RewardConfig.function_timeout_s must be a finite number > 0 or None, got {timeout!r}")
        for ref in self.functions:
            if ref == JUDGE_FUNCTION:  # the model judge: no function to import
                continue
            try:
                reward_functions.check_function(ref)
            except reward_functions.RewardFunctionError as exc:
                raise ValueError(f"RewardConfig.functions: {exc}") from None

    def _check_routes(self) -> None:
        if isinstance(self.by_data_source, str):
            raise ValueError(f"RewardConfig.by_data_source must be a list of 'source=module:function', "
                             f"got {self.by_data_source!r}")
        sources = []
        for entry in self.by_data_source:
            source, sep, ref = entry.partition("=") if isinstance(entry, str) else ("", "", "")
            if not sep or not source or not ref:
                raise ValueError(f"RewardConfig.by_data_source entries are 'data_source=module:function', got {entry!r}")
            sources.append(source)
            try:
                if ref != JUDGE_FUNCTION:
                    reward_functions.check_function(ref)
            except reward_functions.RewardFunctionError as exc:
                raise ValueError(f"RewardConfig.by_data_source: {exc}") from None
            if reward_functions.function_name(ref) in _RESERVED_METRIC_NAMES:
                raise ValueError(f"RewardConfig.by_data_source: {ref!r} would overwrite a reward/ metric; rename it")
        if len(set(sources)) != len(sources):
            raise ValueError(f"RewardConfig.by_data_source names a data_source twice: {self.by_data_source!r}")

    def functions_for(self, record: dict | None) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """(functions, weights) that score a prompt from `record`: its data_source's route, else
        `functions` and their weights; ((), ()) means math-verify."""
        source = (record or {}).get(DATA_SOURCE_FIELD)
        for entry in self.by_data_source:
            name, _, ref = entry.partition("=")
            if name == source:
                return (ref,), (1.0,)
        if not self.functions and isinstance(source, str) and source.startswith(REASONING_GYM_SOURCE_PREFIX):
            # data.format reasoning_gym: the task's own scorer is the default reward.
            return (REASONING_GYM_FUNCTION,), (1.0,)
        return self.functions, self.function_weights()

    @property
    def uses_judge(self) -> bool:
        """Whether some prompt is scored by the model judge (JUDGE_FUNCTION)."""
        return JUDGE_FUNCTION in self.functions or any(e.partition("=")[2] == JUDGE_FUNCTION for e in self.by_data_source)

    @property
    def may_mask(self) -> bool:
        """Whether a failure can mask a sample under this config (masks_failure of some function)."""
        return self.on_function_failure == "mask" or (self.uses_judge and self.judge.on_failure == "mask")

    def masks_failure(self, ref: str) -> bool:
        """Whether a failure of the function `ref` masks its sample rather than scoring 0 for it."""
        policy = self.judge.on_failure if ref == JUDGE_FUNCTION else self.on_function_failure
        return policy == "mask"

    def function_weights(self) -> tuple[float, ...]:
        """The weight of each function (1.0 each when `weights` is empty)."""
        return tuple(float(w) for w in self.weights) if self.weights else (1.0,) * len(self.functions)


@dataclass(slots=True, frozen=True)
class CombinedScore:
    """The verdict of one completion from the reward functions."""

    reward: float
    """sum_i weight_i * reward_i (a failed function contributes 0)."""
    solved: bool
    """Every function says solved (its `solved` part, else its reward >= CORRECT_VERDICT); a
    failed function's completion is unsolved."""
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
                   masking: Sequence[bool] | None = None) -> CombinedScore:
    """One completion's verdict from its functions' scores (names, weights, scores aligned);
    masking[i]: a failure of function i masks the completion (None: no function masks)."""
    parts: dict[str, float] = {}
    errors = []
    reasons = []
    solved = True
    masked = False
    for i, (name, score) in enumerate(zip(names, scores, strict=True)):
        parts[name] = score.reward
        parts.update({f"{name}/{part}": value for part, value in score.parts.items()})
        if score.failed:
            errors.append(f"{name}: {score.error}")
            reasons.append(f"{name}/{score.kind}")
            masked = masked or (masking is not None and masking[i])
        solved = solved and not score.failed and (
            score.solved if score.solved is not None else score.reward >= CORRECT_VERDICT)
    reward = sum(w * s.reward for w, s in zip(weights, scores, strict=True))
    return CombinedScore(reward=reward, solved=solved, parts=parts, errors=tuple(errors),
                         failure_reasons=tuple(reasons), masked=masked)


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
