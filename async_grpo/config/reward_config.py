"""`RewardConfig`: how a run scores and shapes its completions (the trainer's `sampling.reward`),
and the `module:function` references it names, imported and checked when the config is built so
that a bad reference is one line before anything starts.

A record every side reads: the trainer builds and checks it, the batcher sends it inside
`SamplingConfig`, the generation workers and the verifier pool score by it (rewards/shaping.py
shapes, rewards/reward_functions.py calls the functions). Imports no Ray, vLLM or torch.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from async_grpo.config.judge_config import FAILURE_POLICIES, JUDGE_FUNCTION, FailurePolicy, JudgeConfig

# The verifier's reward for a correct answer; `reward/accuracy` and `eval/accuracy` count a
# sample as solved when its reward reaches it. A bonus this large would count a wrong but
# well-formatted answer as solved, so format_bonus stays below it.
CORRECT_VERDICT = 1.0
# The record field that routes a prompt to its reward function (verl's layout).
DATA_SOURCE_FIELD = "data_source"
# data_source of the prompts of data.format reasoning_gym ("reasoning_gym/<task>", written by
# data/reasoning_gym_tasks.py); without other functions they are scored by the task's own scorer
# (named here, so that this pure module does not import the scorer's module).
REASONING_GYM_SOURCE_PREFIX = "reasoning_gym/"
REASONING_GYM_FUNCTION = "async_grpo.rewards.reasoning_gym_reward:score"
# Metric names under reward/ that a reward function's name (reward/<name>) must not take.
_RESERVED_METRIC_NAMES = ("mean", "accuracy", "mean_generated", "masked_samples", "judge_agreement")
AGREEMENT_PART = "judge_agreement"
"""The reward part (metric reward/judge_agreement) that JudgeConfig.agree_with adds to judged samples."""
# Patterns are searched over the whole completion with "." matching newlines too: reasoning
# texts span many lines, and a format such as r"\\boxed\{.+\}" must not stop at the first one.
FORMAT_FLAGS = re.DOTALL
# The positional arguments every reward function takes, in order.
ARGUMENTS = ("prompt", "completion", "token_ids", "metadata")


class RewardFunctionError(ValueError):
    """A reward function reference that cannot be used (bad name, import error, wrong signature)."""


def function_name(ref: str) -> str:
    """The metric name of a reference: its function part ("my_rewards:code" -> "code")."""
    return ref.rpartition(":")[2]


@lru_cache(maxsize=None)
def load_function(ref: str) -> Callable:
    """The callable that `ref` ("package.module:function") names; RewardFunctionError (one line) if
    the reference is malformed, the module does not import, or the name is missing or not callable."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise RewardFunctionError(f"reward function {ref!r} must be written 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module, reported in one line
        raise RewardFunctionError(f"reward function {ref!r}: cannot import {module_name!r}: "
                                  f"{type(exc).__name__}: {exc}") from None
    function = module
    for part in attr.split("."):
        if not hasattr(function, part):
            raise RewardFunctionError(f"reward function {ref!r}: module {module_name!r} has no {attr!r}")
        function = getattr(function, part)
    if not callable(function):
        raise RewardFunctionError(f"reward function {ref!r} is a {type(function).__name__}, not a function")
    return function


def check_function(ref: str) -> Callable:
    """load_function, then check that it accepts the four positional arguments (ARGUMENTS)."""
    function = load_function(ref)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        return function
    try:
        signature.bind(*ARGUMENTS)
    except TypeError as exc:
        raise RewardFunctionError(f"reward function {ref!r}{signature} cannot be called as "
                                  f"f({', '.join(ARGUMENTS)}): {exc}") from None
    return function


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
        self._check_agreement()
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
        if len(set(map(function_name, self.functions))) != len(self.functions):
            raise ValueError(f"RewardConfig.functions name one function twice (metrics are per name): {self.functions!r}")
        taken = sorted(set(map(function_name, self.functions)) & set(_RESERVED_METRIC_NAMES))
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
                check_function(ref)
            except RewardFunctionError as exc:
                raise ValueError(f"RewardConfig.functions: {exc}") from None

    def _check_agreement(self) -> None:
        other = self.judge.agree_with
        if other is None:
            return
        names = [function_name(ref) for ref in self.functions]
        if JUDGE_FUNCTION not in self.functions or other not in names:
            raise ValueError(f"RewardConfig.judge.agree_with {other!r} compares two of `functions`: list both "
                             f"'{JUDGE_FUNCTION}' and a function named {other!r} there (weight 0 keeps it out of the "
                             f"reward), got {list(self.functions)}")

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
                    check_function(ref)
            except RewardFunctionError as exc:
                raise ValueError(f"RewardConfig.by_data_source: {exc}") from None
            if function_name(ref) in _RESERVED_METRIC_NAMES:
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
