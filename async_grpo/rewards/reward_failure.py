"""Why a reward could not be computed: one vocabulary for the verifier's results
(math_verifier.RewardResult), the reward functions' scores (reward_functions.FunctionScore), the
pool's counters (math_verify_pool.VerifierCounts) and the per-reason step metrics
(`counts/reward_failures/<function>/<reason>`, rewards.combine_scores).

The kind travels as this typed value from where a failure happens to where it is counted; the
human-readable error string ("<kind>: <detail>") is for logs and is never parsed back. Across a
pipe or JSON the kind goes as its value and is rebuilt with `FailureKind(value)`.

Imports nothing: the pure modules and the verifier processes share it.
"""

from __future__ import annotations

from enum import StrEnum


class FailureKind(StrEnum):
    """The reason a completion's reward failed; its value is the reason's name in the metrics."""

    TIMEOUT = "timeout"
    """The deadline passed; the verifier process was killed and replaced."""
    PARSE_ERROR = "parse_error"
    """math-verify found no answer in the completion (or in the gold answer, a dataset problem)."""
    VERIFY_ERROR = "verify_error"
    """math-verify's comparison raised, or the verifier process died or broke the protocol."""
    REJECTED = "rejected"
    """A pre-check cap (math_verifier.AnswerLimits) turned the completion away before any process."""
    RAISED = "raised"
    """A reward function raised."""
    BAD_RETURN = "bad_return"
    """A reward function returned something unusable: not a number or dict of numbers, NaN or
    infinite, or a batch of the wrong length."""
    CRASH = "crash"
    """The process running a reward function died (e.g. the function called os._exit), or the
    pool could not be reached; for the judge (judge_reward.py), its pool failed the call after
    the registry's retries."""
    UNPARSABLE = "unparsable"
    """The judge's reply held no verdict its rule reads (judge_template.py): garbage, a number out
    of range, or a group-wise reply missing an answer's score."""
