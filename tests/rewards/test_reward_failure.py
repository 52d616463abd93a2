"""Failure kinds travel as typed values (reward_failure.FailureKind) from where a reward fails to
the counters and metrics that count them; the error text is never read back. Each test gives an
error text that names a different kind than the typed one, so a counter that parsed the text
would count the wrong thing."""

from __future__ import annotations

import json

import pytest

from async_grpo.rewards import reward_functions
from async_grpo.rewards.math_verifier import RewardResult, failure
from async_grpo.rewards.reward_failure import FailureKind
from async_grpo.rewards.reward_functions import FunctionScore
from async_grpo.rewards.shaping import combine_scores
from async_grpo.rewards.math_verify_pool import ResultCache, VerifierCounts
from async_grpo.rewards.math_verify_process import decode_result, encode_result

# The kinds a math-verify result can fail with, and the pool counter each one adds to.
RESULT_COUNTERS = {FailureKind.TIMEOUT: "timeouts", FailureKind.PARSE_ERROR: "parse_errors",
                   FailureKind.VERIFY_ERROR: "verify_errors", FailureKind.REJECTED: "rejected"}
# The kinds a reward function's score can fail with, and the pool counter each one adds to.
FUNCTION_COUNTERS = {FailureKind.RAISED: "function_raised", FailureKind.BAD_RETURN: "function_bad_returns",
                     FailureKind.TIMEOUT: "function_timeouts", FailureKind.REJECTED: "function_rejected",
                     FailureKind.CRASH: "function_crashes"}


def _misleading(kind: FailureKind) -> str:
    """An error text whose first word is another kind than `kind`."""
    other = FailureKind.CRASH if kind != FailureKind.CRASH else FailureKind.TIMEOUT
    return f"{other}: the text says {other}, the kind says {kind}"


def test_kind_values_are_the_metric_reasons() -> None:
    # counts/reward_failures/<function>/<reason> and the error texts use these names; they must not move.
    assert {kind.value for kind in FailureKind} == {"timeout", "parse_error", "verify_error", "rejected", "raised",
                                                    "bad_return", "crash", "unparsable"}
    assert f"{FailureKind.BAD_RETURN}" == "bad_return" and str(FailureKind.PARSE_ERROR) == "parse_error"


def test_failures_build_the_same_error_text_and_carry_the_kind() -> None:
    assert failure(FailureKind.TIMEOUT) == RewardResult(reward=0.0, failed=True, error="timeout",
                                                        kind=FailureKind.TIMEOUT)
    assert failure(FailureKind.PARSE_ERROR, "x" * 400).error == "parse_error: " + "x" * 300 + "..."
    score = reward_functions.failure("crash", "gone")
    assert (score.reward, score.failed, score.error, score.kind) == (0.0, True, "crash: gone", FailureKind.CRASH)
    with pytest.raises(ValueError, match="'exploded'"):
        reward_functions.failure("exploded")


def test_a_kind_goes_with_a_failure_and_only_with_one() -> None:
    with pytest.raises(ValueError, match="RewardResult.kind"):
        RewardResult(reward=1.0, failed=False, error="", kind=FailureKind.TIMEOUT)
    with pytest.raises(ValueError, match="FunctionScore.kind"):
        FunctionScore(reward=0.0, failed=True, error="raised: ValueError")
    with pytest.raises(ValueError, match="FunctionScore.kind"):
        FunctionScore(reward=1.0, kind=FailureKind.RAISED)


def test_the_pool_counts_results_by_their_kind() -> None:
    counts = VerifierCounts()
    for kind in RESULT_COUNTERS:
        counts.record(RewardResult(reward=0.0, failed=True, error=_misleading(kind), kind=kind))
    counts.record(RewardResult(reward=1.0, failed=False, error=""))
    counts.record(RewardResult(reward=0.0, failed=True, error="verifier pool failed: no kind"))
    snapshot = counts.snapshot()
    assert (snapshot["scored"], snapshot["failed"]) == (6, 5)
    assert {counter: snapshot[counter] for counter in RESULT_COUNTERS.values()} == dict.fromkeys(
        RESULT_COUNTERS.values(), 1)


def test_the_pool_counts_function_scores_by_their_kind() -> None:
    counts = VerifierCounts()
    scores = [reward_functions.failure(kind, _misleading(kind)) for kind in FUNCTION_COUNTERS]
    counts.record_function([*scores, FunctionScore(reward=1.0)])
    snapshot = counts.snapshot()
    assert (snapshot["function_calls"], snapshot["function_failed"]) == (len(FUNCTION_COUNTERS) + 1,
                                                                          len(FUNCTION_COUNTERS))
    assert {counter: snapshot[counter] for counter in FUNCTION_COUNTERS.values()} == dict.fromkeys(
        FUNCTION_COUNTERS.values(), 1)


def test_the_cache_skips_timeouts_and_verify_errors_by_kind() -> None:
    cache = ResultCache(size=8)
    for kind in RESULT_COUNTERS:
        cache.put(("7", kind.value), RewardResult(reward=0.0, failed=True, error=_misleading(kind), kind=kind))
    kept = {kind for kind in RESULT_COUNTERS if cache.get(("7", kind.value)) is not None}
    assert kept == {FailureKind.PARSE_ERROR, FailureKind.REJECTED}


def test_the_metric_reason_is_the_kind() -> None:
    scores = [reward_functions.failure(FailureKind.BAD_RETURN, "raised: not really"), FunctionScore(reward=1.0)]
    combined = combine_scores(["f", "g"], [1.0, 1.0], scores)
    assert combined.failure_reasons == ("f/bad_return",)
    assert combined.errors == ("f: bad_return: raised: not really",)


@pytest.mark.parametrize("kind", [None, *FailureKind])
def test_kinds_cross_the_pipe(kind: FailureKind | None) -> None:
    result = RewardResult(reward=0.0, failed=True, error="whatever", kind=kind)
    assert decode_result(encode_result(result)) == result
    score = FunctionScore(reward=0.0, failed=True, error="whatever", kind=kind) if kind else FunctionScore(
        reward=0.5, parts={"a": 0.5}, solved=True)
    assert FunctionScore.from_json(json.loads(json.dumps(score.as_json()))) == score


def test_an_unknown_kind_from_a_process_is_a_protocol_error() -> None:
    reply = json.dumps({"reward": 0.0, "failed": True, "error": "x", "kind": "exploded"}).encode("utf-8")
    with pytest.raises(ValueError):
        decode_result(reply)
