"""Reward functions as plug-ins: load `module:function`, check its signature, call it, validate what
it returns. The verifier pool's processes call them (math_verify_pool.VerifierPool.score_function)
under the pool's deadline; a run names them in `RewardConfig.functions` (shaping.py).

A reward function takes the prompt record (every field of the dataset record, plus `gt_answer`),
the completion's text, its token ids and the sample's metadata (prompt_id, group_id, run_id,
finish_reason, truncated, weight_version), and returns a number, or a dict of named numeric parts:

    def exact_match(prompt: dict, completion: str, token_ids: list[int], metadata: dict) -> float:
        return float(completion.strip() == prompt["gt_answer"])

    async def judged(prompt, completion, token_ids, metadata) -> dict[str, float]:
        return {"correct": 1.0, "style": 0.1, "solved": 1.0}   # parts, each logged

A dict's reward is the sum of its parts except `solved` (SOLVED_KEY), which is not added: it is
the function's own notion of solved for `reward/accuracy` (else a reward >= 1 counts as solved).
`@batched` marks a function that takes lists (prompts, completions, token_ids, metadata) and
returns one result per element; the whole batch then shares one deadline.

What counts as a failure (reward 0 for that function; `FunctionScore.kind` is the typed reason,
reward_failure.FailureKind, and the error string says it in words, the kind first):
    "raised: <Type>: <message>"   the function raised
    "bad_return: <what>"          not a number or dict of numbers; NaN or infinite; wrong length
    "timeout"                     the pool's deadline passed (the process was killed)
    "crash: ..."                  the process died (e.g. the function called os._exit)

Imports no Ray, vLLM or torch: the trainer checks the functions when its config is built
(config/reward_config.py loads and checks them) and the pool's processes call them.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from async_grpo.config.reward_config import ARGUMENTS
from async_grpo.rewards.reward_failure import FailureKind

# The dict key that states solved-ness instead of adding to the reward.
SOLVED_KEY = "solved"
# Marks a batched function (set by @batched).
_BATCHED_ATTR = "reward_batched"
# Error strings quote exception messages: keep them short.
_MAX_ERROR_CHARS = 300


@dataclass(slots=True)
class FunctionScore:
    """One reward function's result on one completion."""

    reward: float
    """The number it returned (a dict's parts summed, `solved` left out); 0.0 when failed."""
    parts: dict[str, float] = field(default_factory=dict)
    """A dict return's parts (without `solved`); {} for a plain number."""
    solved: bool | None = None
    """The function's own `solved` part (nonzero: solved); None when it gave none."""
    failed: bool = False
    """True when the function raised, hung, or returned something unusable (see `error`)."""
    error: str = ""
    """"" on success, else "<kind>: <detail>" (the module docstring lists the kinds)."""
    kind: FailureKind | None = None
    """Why it failed, as a typed value (what the counters and metrics read); None exactly when
    it did not fail."""

    def __post_init__(self) -> None:
        if self.failed != (self.kind is not None):
            raise ValueError(f"FunctionScore.kind must be set exactly when failed (failed={self.failed}, "
                             f"kind={self.kind!r})")

    def as_json(self) -> dict[str, Any]:
        return {"reward": self.reward, "parts": self.parts, "solved": self.solved, "failed": self.failed,
                "error": self.error, "kind": None if self.kind is None else self.kind.value}

    @staticmethod
    def from_json(data: dict[str, Any]) -> FunctionScore:
        solved, kind = data.get("solved"), data["kind"]
        return FunctionScore(reward=float(data["reward"]), parts={str(k): float(v) for k, v in data["parts"].items()},
                             solved=None if solved is None else bool(solved), failed=bool(data["failed"]),
                             error=str(data["error"]), kind=None if kind is None else FailureKind(kind))


def failure(kind: FailureKind | str, detail: str = "") -> FunctionScore:
    """A failed score: reward 0, `kind` (a FailureKind or its value: ValueError for any other
    string), error "<kind>: <detail>" (shortened)."""
    kind = FailureKind(kind)
    if len(detail) > _MAX_ERROR_CHARS:
        detail = detail[:_MAX_ERROR_CHARS] + "..."
    return FunctionScore(reward=0.0, failed=True, error=f"{kind}: {detail}" if detail else str(kind), kind=kind)


def batched(function: Callable) -> Callable:
    """Decorator: `function` takes lists of prompts, completions, token ids and metadata and returns a list."""
    setattr(function, _BATCHED_ATTR, True)
    return function


def is_batched(function: Callable) -> bool:
    return bool(getattr(function, _BATCHED_ATTR, False))


def _run(value: Any) -> Any:
    """The value itself, or an awaitable's result (async reward functions)."""
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


def _number(value: Any, what: str) -> float | FunctionScore:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        try:
            import numbers

            if not isinstance(value, numbers.Real):
                raise TypeError
            value = float(value)
        except (TypeError, ValueError):
            return failure(FailureKind.BAD_RETURN, f"{what} is a {type(value).__name__}, not a number")
    if not math.isfinite(value):
        return failure(FailureKind.BAD_RETURN, f"{what} is {value}")
    return float(value)


def to_score(value: Any) -> FunctionScore:
    """Validate one returned value (a number or a dict of named numbers) into a FunctionScore."""
    if isinstance(value, dict):
        parts: dict[str, float] = {}
        solved = None
        for name, part in value.items():
            number = _number(part, f"part {name!r}")
            if isinstance(number, FunctionScore):
                return number
            if name == SOLVED_KEY:
                solved = number != 0.0
            else:
                parts[str(name)] = number
        return FunctionScore(reward=sum(parts.values()), parts=parts, solved=solved)
    number = _number(value, "the return value")
    return number if isinstance(number, FunctionScore) else FunctionScore(reward=number)


def call_function(function: Callable, calls: list[dict[str, Any]]) -> list[FunctionScore]:
    """Call `function` on each call ({prompt, completion, token_ids, metadata}), or once on the
    lists when it is batched; whatever it raises or returns becomes a FunctionScore, never an exception."""
    if is_batched(function):
        try:
            values = _run(function(*([call[name] for call in calls] for name in ARGUMENTS)))
        except Exception as exc:  # noqa: BLE001 - the user's function failing is a scoring outcome
            return [failure(FailureKind.RAISED, f"{type(exc).__name__}: {exc}")] * len(calls)
        if not isinstance(values, (list, tuple)) or len(values) != len(calls):
            got = f"{len(values)} results" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            return [failure(FailureKind.BAD_RETURN, f"batched function returned {got} for {len(calls)} completions")] * len(calls)
        return [to_score(value) for value in values]
    scores = []
    for call in calls:
        try:
            scores.append(to_score(_run(function(*(call[name] for name in ARGUMENTS)))))
        except Exception as exc:  # noqa: BLE001
            scores.append(failure(FailureKind.RAISED, f"{type(exc).__name__}: {exc}"))
    return scores
