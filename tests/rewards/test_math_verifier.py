"""The answer checks (math_verifier.py), the process pool (math_verify_pool.py) and its Ray actors
(math_verify_cluster.py): real math-verify in worker processes, which answer of a long text counts, the
pre-checks and the plain-number fast path (checked against math-verify itself), deadlines,
replacement, the Ray actor path (the verification_slot path: tests/rewards/test_verifier_slots.py;
the typed failure kinds: tests/rewards/test_reward_failure.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator

import pytest

from async_grpo.config.actor_names import VERIFIER_POOL_ACTOR_NAME
from async_grpo.rewards.math_verifier import (
    DEFAULT_LIMITS, AnswerLimits, RewardResult, exponent_tower_height, last_boxed, nesting_depth, numeric_power_digits,
    plain_number_verdict, precheck, quick_verdict, score_completion, verify_with_math_verify,
)
from async_grpo.rewards.reward_failure import FailureKind
from async_grpo.rewards.math_verify_cluster import (
    VerifierPoolActor, connect_verifier_pool, get_or_create_verifier_pool, plan_verifier_shards, shutdown_verifier_pool,
)
from async_grpo.rewards.math_verify_pool import VerifierPool, VerifierPoolConfig, default_num_processes

# Deadline of the pools that only see well-behaved completions: far above math-verify's ~2 ms per
# sample, so a loaded shared machine never turns a normal sample into a timeout.
NORMAL_TIMEOUT_S = 5.0
# Deadline of the pools that are fed hostile completions: short, to keep the tests quick.
HOSTILE_TIMEOUT_S = 2.0
# Slack on top of the deadline for pipe I/O and a busy 2-core machine. Without the watchdog these
# inputs run for well over 20 s (measured), so deadline + slack still tells "killed" from "hung".
DEADLINE_SLACK_S = 5.0
# Above math-verify's own recursion and regex limits: parsing it hangs for far longer than a deadline.
HOSTILE_MEGABYTE = "\\boxed{" + "1+" * 500_000 + "1}"
HOSTILE_TOWER = "\\boxed{5^{5^{5^{5^5}}}}"
# Within the tower cap (height 2), yet math-verify hangs on it (sympy computes 9^387420489
# exactly; seen running past 8 s): the power-digits cap catches it.
NUMERIC_TOWER = "\\boxed{9^{9^{9}}}"
# Pre-checks off: lets the known hostile shapes reach a process, to test the deadline on them.
NO_LIMITS = AnswerLimits(max_completion_chars=2**40, max_answer_chars=2**40, max_nesting_depth=2**40,
                         max_exponent_tower=2**40, max_power_digits=10**30)
# Deadline of the test where a hostile sample must still be running when the others are done:
# far longer than a few ordinary verifications take on any machine; the test kills it instead.
LONG_TIMEOUT_S = 60.0
# How long a killed actor's name may take to disappear (Ray marks it dead asynchronously).
ACTOR_GONE_WAIT_S = 30.0
TIMEOUT = RewardResult(reward=0.0, failed=True, error="timeout", kind=FailureKind.TIMEOUT)
CORRECT = RewardResult(reward=1.0, failed=False, error="")
WRONG = RewardResult(reward=0.0, failed=False, error="")

# (completion, gold answer, expected reward), all decided by hand.
GRADED_CASES = [
    ("The sum is \\boxed{7}.", "7", 1.0),
    ("7", "7", 1.0),
    ("3+4=7", "7", 1.0),
    ("I think it is 7.", "7", 1.0),
    ("\\boxed{7}", "\\boxed{7}", 1.0),
    ("so the answer is $7$", "$7$", 1.0),
    ("$\\frac{14}{2}$", "7", 1.0),
    ("3+4=8", "7", 0.0),
    ("\\boxed{8}", "7", 0.0),
    ("The sum is \\boxed{70}.", "7", 0.0),
    ("so we get $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "$\\frac{1}{2}$", 1.0),
    ("1/2", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{2}", "\\sqrt{2}", 0.0),
]


# Long reasoning texts: (completion, gold answer, expected reward), decided by hand from the rule in
# math_verifier's docstring: the last complete \boxed{} alone, else math-verify's pick (the
# rightmost answer, an "answer"-anchored one first).
LONG_TEXT_CASES = [
    ("The answer is 3. Let me check: 2+2=4. \\boxed{5}", "5", 1.0),
    ("The answer is 3. Let me check: 2+2=4. \\boxed{5}", "3", 0.0),
    ("The answer is 3. Let me check: 2+2=4. \\boxed{5}", "4", 0.0),
    # Several boxes: only the last counts (math-verify alone reads the set {3, 5}: neither matched).
    ("First \\boxed{3}. Hmm, that is wrong. Recounting: 2+3=5, so \\boxed{5}", "5", 1.0),
    ("First \\boxed{3}. Hmm, that is wrong. Recounting: 2+3=5, so \\boxed{5}", "3", 0.0),
    ("$\\boxed{2}$ and $\\boxed{3}$", "3", 1.0),
    # A box followed by more reasoning still answers with the box.
    ("So \\boxed{7}. Sanity check: 3+4=7, 7-3=4, and 10 is too many.", "7", 1.0),
    # Nested braces stay whole.
    ("Half of the pie: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("Half of the pie: \\boxed{\\frac{1}{2}}", "1", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
    # An unclosed last box (a cut-off output) does not count; the complete one before it does.
    ("\\boxed{3}, or rather \\boxed{5", "3", 1.0),
    # No box: the last number.
    ("We start with 12 apples, then 7 more: 19", "19", 1.0),
    ("We start with 12 apples, then 7 more: 19", "12", 0.0),
    ("12 apples. 7 more. In total 19 apples.", "19", 1.0),
    ("Step 1: 2+3=5. Step 2: 5*2=10", "10", 1.0),
    ("$\\frac{1}{3}$ first, then $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
    # ... unless the word "answer" introduces an earlier one.
    ("The answer is 5 (I checked it with 2 methods)", "5", 1.0),
    ("The answer is 5. Later: 3", "5", 1.0),
    ("The answer is 5. Later: 3", "3", 0.0),
]


def _pool_children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("math-verifier-")}


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifierPool]:
    with VerifierPool(num_processes=2, timeout_s=NORMAL_TIMEOUT_S) as verifier:
        yield verifier


def _graded(results: list[RewardResult]) -> list[tuple[float, bool]]:
    return [(r.reward, r.failed) for r in results]


def test_graded_answers_match_hand_made_expectations(pool: VerifierPool) -> None:
    results = []
    for completion, gold, _ in GRADED_CASES:
        results += pool.score_sync([completion], gold)
    assert _graded(results) == [(expected, False) for _, _, expected in GRADED_CASES]
    assert all(r.error == "" for r in results)


def test_long_texts_answer_with_the_last_box_or_the_last_number(pool: VerifierPool) -> None:
    results = [result for completion, gold, _ in LONG_TEXT_CASES for result in pool.score_sync([completion], gold)]
    assert _graded(results) == [(expected, False) for _, _, expected in LONG_TEXT_CASES]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no box", None),
        ("\\boxed{7}", "7"),
        ("a \\boxed{3} b \\boxed{5} c", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed {7}", "7"),
        ("\\boxed{}", ""),
        ("\\boxed{3} \\boxed{5", "3"),
        ("\\boxed{5", None),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{a \\} b}", "a \\} b"),
        ("{ \\boxed{4} }", "4"),
        ("} stray \\boxed{4}", "4"),
        ("\\boxed{x \\boxed{2}}", "2"),
    ],
)
def test_last_boxed_takes_the_last_complete_box(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_empty_last_box_is_no_answer(pool: VerifierPool) -> None:
    (result,) = pool.score_sync(["\\boxed{7} ... \\boxed{}"], "7")
    assert result == RewardResult(reward=0.0, failed=True, error="parse_error: no answer found in the last \\boxed{}",
                                  kind=FailureKind.PARSE_ERROR)


def test_async_score_keeps_order_across_processes(pool: VerifierPool) -> None:
    completions = ["\\boxed{7}", "\\boxed{6}", "3+4=7", "no idea", "$7$", "7.0", "\\boxed{77}"]
    results = asyncio.run(pool.score(completions, "7"))
    assert _graded(results) == [(1.0, False), (0.0, False), (1.0, False), (0.0, True), (1.0, False), (1.0, False), (0.0, False)]
    assert results == pool.score_sync(completions, "7")


def test_completion_without_answer_is_a_counted_parse_failure(pool: VerifierPool) -> None:
    before = pool.stats()
    results = pool.score_sync(["I cannot solve this.", ""], "7")
    assert results == [RewardResult(reward=0.0, failed=True, error="parse_error: no answer found in completion",
                                    kind=FailureKind.PARSE_ERROR)] * 2
    after = pool.stats()
    assert after["parse_errors"] - before["parse_errors"] == 2
    assert after["failed"] - before["failed"] == 2
    assert after["scored"] - before["scored"] == 2


def test_unparsable_gold_answer_fails_every_completion(pool: VerifierPool) -> None:
    results = pool.score_sync(["\\boxed{7}", "7"], "")
    assert [(r.reward, r.failed) for r in results] == [(0.0, True)] * 2
    assert all(r.error.startswith("parse_error: gold answer ''") for r in results)
    assert all(r.kind == FailureKind.PARSE_ERROR for r in results)


def test_empty_batch_and_bad_arguments(pool: VerifierPool) -> None:
    assert pool.score_sync([], "7") == []
    with pytest.raises(TypeError, match="gt_answer must be str"):
        pool.score_sync(["7"], 7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"completions\[1\] must be str"):
        pool.score_sync(["7", None], "7")  # type: ignore[list-item]
    with pytest.raises(TypeError, match="single str"):
        pool.score_sync("7", "7")
    with pytest.raises(ValueError, match="num_processes"):
        VerifierPool(num_processes=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(num_processes=1, timeout_s=float("nan"))


@pytest.mark.system
def test_repeated_completions_are_verified_once_and_the_cache_is_lru() -> None:
    with VerifierPool(num_processes=2, timeout_s=NORMAL_TIMEOUT_S, cache_size=3) as verifier:
        first = verifier.score_sync(["7", "8", "7", "no idea", "7", "8"], "7")
        assert first == [CORRECT, WRONG, CORRECT, first[3], CORRECT, WRONG] and first[3].error.startswith("parse_error")
        stats = verifier.stats()
        assert (stats["scored"], stats["cache_hits"]) == (3, 3)  # three distinct completions
        # The same gold: all from the cache (a parse failure is as deterministic as a grade).
        assert asyncio.run(verifier.score(["no idea", "8", "7"], "7")) == [first[3], WRONG, CORRECT]
        assert (verifier.stats()["scored"], verifier.stats()["cache_hits"]) == (3, 6)
        # Another gold is another key; with 3 entries the least recently used ("no idea" for gold "7") goes.
        assert verifier.score_sync(["8"], "8") == [CORRECT]
        assert verifier.score_sync(["8", "7", "no idea"], "7") == [WRONG, CORRECT, first[3]]
        assert (verifier.stats()["scored"], verifier.stats()["cache_hits"]) == (5, 8)
    with VerifierPool(num_processes=1, timeout_s=NORMAL_TIMEOUT_S, cache_size=0) as uncached:
        assert uncached.score_sync(["7", "7"], "7") == [CORRECT, CORRECT]
        assert (uncached.stats()["scored"], uncached.stats()["cache_hits"]) == (2, 0)
    with pytest.raises(ValueError, match="cache_size"):
        VerifierPool(num_processes=1, timeout_s=1.0, cache_size=-1)


@pytest.mark.system
def test_hostile_outputs_time_out_and_the_replacement_serves() -> None:
    """One process, pre-checks off: every sample after a timeout is served by a fresh process."""
    before = _pool_children()
    verifier = VerifierPool(num_processes=1, timeout_s=HOSTILE_TIMEOUT_S, limits=NO_LIMITS)
    try:
        # The tower comes twice: a timeout is never cached, so the second one is verified (and killed)
        # again. The normal completions differ and are no plain numbers, so each one is served by a
        # process (not the cache, not the fast path).
        normal = ["so it is \\boxed{\\frac{14}{2}}", "it is \\boxed{3+4}", "\\boxed{\\frac{21}{3}}, it is"]
        for hostile, completion in zip((HOSTILE_TOWER, HOSTILE_MEGABYTE, NUMERIC_TOWER), normal):
            start = time.monotonic()
            assert verifier.score_sync([hostile], "7") == [TIMEOUT]
            assert time.monotonic() - start < HOSTILE_TIMEOUT_S + DEADLINE_SLACK_S
            assert verifier.score_sync([completion], "7") == [CORRECT]
        stats = verifier.stats()
        assert (stats["timeouts"], stats["restarts"], stats["failed"], stats["scored"]) == (3, 3, 3, 6)
        assert (stats["cache_hits"], stats["fast_path"], stats["rejected"]) == (0, 0, 0)
        assert len(_pool_children() - before) == 1
    finally:
        verifier.close()
    assert _pool_children() - before == set()
    with pytest.raises(RuntimeError, match="after close"):
        verifier.score_sync(["7"], "7")


@pytest.mark.system
def test_normal_samples_flow_beside_timeouts() -> None:
    """Two processes, a hostile sample (pre-checks off) in the same call: the others are scored
    right, in order."""
    with VerifierPool(num_processes=2, timeout_s=HOSTILE_TIMEOUT_S, limits=NO_LIMITS) as verifier:
        results = asyncio.run(verifier.score([HOSTILE_TOWER, "\\boxed{\\frac{14}{2}}", "\\boxed{3+5}", "3+4=7"], "7"))
        assert results == [TIMEOUT, CORRECT, WRONG, CORRECT]
        assert verifier.stats()["timeouts"] == 1


@pytest.mark.system
def test_a_running_hostile_sample_does_not_hold_back_other_calls() -> None:
    """While one process is stuck on a hostile sample (pre-checks off, 60 s deadline), another call's samples are
    all scored by the other process: the call returns while the hostile one is still running."""
    before = _pool_children()
    normal = ["\\boxed{\\frac{14}{2}}", "\\boxed{3+4}", "so $\\sqrt{49}$", "\\boxed{\\frac{1}{2}}", "3+4=7", "\\boxed{x}"]
    with VerifierPool(num_processes=2, timeout_s=LONG_TIMEOUT_S, limits=NO_LIMITS) as verifier:
        pids = _pool_children() - before

        async def both() -> None:
            hostile = asyncio.ensure_future(verifier.score([HOSTILE_TOWER], "7"))
            await asyncio.sleep(0)  # the hostile sample is queued first
            assert _graded(await verifier.score(normal, "7")) == [(1.0, False)] * 3 + [(0.0, False), (1.0, False), (0.0, False)]
            assert not hostile.done()
            for pid in pids:  # end the stuck process now rather than waiting out its deadline
                os.kill(pid, signal.SIGKILL)
            (result,) = await hostile
            assert result.failed and result.error.startswith("verify_error: verifier process died")
            assert result.kind == FailureKind.VERIFY_ERROR

        asyncio.run(both())
        assert verifier.stats()["timeouts"] == 0


@pytest.mark.system
def test_known_hostile_shapes_are_rejected_without_a_process() -> None:
    """One process and a 60 s deadline: had any of these reached math-verify, the call would end
    in a timeout. They are rejected with the cap they broke, and counted."""
    deep = "\\boxed{" + "(" * 9 + "1" + ")" * 9 + "}"
    long_box = "\\boxed{" + "1+" * 300 + "1}"
    plain_tower = "so 2**3**4**5"
    hostile = [HOSTILE_TOWER, HOSTILE_MEGABYTE, "$" + "x" * 1_000_000 + "$", deep, long_box, plain_tower, NUMERIC_TOWER]
    with VerifierPool(num_processes=1, timeout_s=LONG_TIMEOUT_S) as verifier:
        results = verifier.score_sync([*hostile, "\\boxed{\\frac{14}{2}}", "\\boxed{7}"], "7")
        assert results[-2:] == [CORRECT, CORRECT]
        errors = [r.error for r in results[:-2]]
        assert all(r.failed and r.reward == 0.0 and r.kind == FailureKind.REJECTED for r in results[:-2])
        assert errors == [
            "rejected: boxed answer exponent tower height 4 exceeds max_exponent_tower=2",
            "rejected: completion length 1000009 exceeds max_completion_chars=131072",
            "rejected: completion length 1000002 exceeds max_completion_chars=131072",
            "rejected: boxed answer nesting depth 9 exceeds max_nesting_depth=8",
            "rejected: boxed answer length 601 exceeds max_answer_chars=512",
            "rejected: completion exponent tower height 3 exceeds max_exponent_tower=2",
            "rejected: boxed answer numeric power of 3.7e+08 digits exceeds max_power_digits=1000000",
        ]
        stats = verifier.stats()
        assert (stats["rejected"], stats["failed"], stats["fast_path"], stats["scored"]) == (7, 7, 1, 9)
        assert (stats["timeouts"], stats["restarts"]) == (0, 0)


@pytest.mark.parametrize(
    ("text", "height"),
    [
        ("7", 0),
        ("x^2+y^2", 1),
        ("2^3+4^5", 1),
        ("e^{i\\pi}", 1),
        ("{5^5}^5", 1),
        ("2^{2^n}", 2),
        ("e^{-x^{2}}", 2),
        ("9^{9^{9}}", 2),
        ("5^{5^{5^5}}", 3),
        ("5^{5^{5^{5^5}}}", 4),
        ("2**3**4**5", 3),
        ("5 ** (5 ** (5 ** 5))", 3),
        ("a^b ^c", 2),
        ("(2^{3})^{4} + 2^{3^{4}}", 2),
    ],
)
def test_exponent_tower_height(text: str, height: int) -> None:
    assert exponent_tower_height(text) == height


@pytest.mark.parametrize(
    ("text", "digits"),
    [
        ("x^{10}", 0.0),
        ("2^{10}", 10 * math.log10(2)),
        ("3^{-20}", 20 * math.log10(3)),
        ("2**3**4", 81 * math.log10(2)),  # 2**(3**4): the chain folds from the right
        ("9^{9^{9}}", 9**9 * math.log10(9)),
        ("x^{10^9}", 9.0),
        ("1^{99999999999} + 0^{5}", 0.0),
        ("2^{" + "9" * 5000 + "}", math.inf),  # an exponent int() would refuse to read
    ],
)
def test_numeric_power_digits(text: str, digits: float) -> None:
    assert numeric_power_digits(text, passes=2) == pytest.approx(digits)


@pytest.mark.parametrize(
    ("text", "depth"),
    [("7", 0), ("\\frac{1}{2}", 1), ("\\frac{\\sqrt{3}}{2}", 2), ("\\left(\\frac{1}{2}, 3\\right)", 2),
     ("[0, 1)", 1), ("1) 2) (3", 1), ("((()))", 3), ("\\{1, \\{2\\}\\}", 2)],
)
def test_nesting_depth(text: str, depth: int) -> None:
    assert nesting_depth(text) == depth


def test_each_cap_rejects_just_above_itself_and_passes_at_it() -> None:
    limits = AnswerLimits(max_completion_chars=40, max_answer_chars=10, max_nesting_depth=2, max_exponent_tower=1,
                          max_power_digits=10)
    at_caps = ["x" * 40, "\\boxed{" + "1" * 10 + "}", "\\boxed{((1))}", "\\boxed{2^{x}}", "\\boxed{10^{10}}"]
    over_caps = ["x" * 41, "\\boxed{" + "1" * 11 + "}", "\\boxed{(((1)))}", "\\boxed{2^{2^x}}", "\\boxed{10^{11}}"]
    caps = ("max_completion_chars=40", "max_answer_chars=10", "max_nesting_depth=2", "max_exponent_tower=1",
            "max_power_digits=10")
    assert [precheck(text, limits) for text in at_caps] == [None] * len(caps)
    errors = [precheck(text, limits).error for text in over_caps]
    assert [e.split(":")[0] for e in errors] == ["rejected"] * len(caps)
    assert [precheck(text, limits).kind for text in over_caps] == [FailureKind.REJECTED] * len(caps)
    for error, cap in zip(errors, caps):
        assert cap in error
    # Outside the box, only the completion's length counts: math-verify parses the box alone.
    assert precheck("(((((( 5^{5^{5^5}} \\boxed{7}", limits) is None
    # Without a box the whole text is the answer, so its nesting and towers count.
    assert "max_nesting_depth" in precheck("(((7", limits).error


# Plain-number pairs (answer, gold) whose verdicts math-verify decides (the test compares).
PLAIN_PAIRS = [
    ("7", "7"), ("7", "8"), ("7.0", "7"), ("7", "7.00"), ("0.5", "0.50"), ("0.5", "0.05"), ("-3", "-3"), ("-3", "3"),
    ("0", "-0"), ("-0.0", "0"), ("10", "1"), ("100", "100.000000"), ("0.000001", "0.000002"), ("0.000001", "0"),
    ("999999999999999", "999999999999999"), ("999999999999999", "999999999999998"), ("123456789.123456", "123456789.123456"),
    ("123456789.123456", "123456789.123457"), ("12345678901234.5", "12345678901234.5"), ("2.5", "2.50000"), ("1", "1.000001"),
]
# Inputs the fast path must leave to math-verify: not plain, or where math-verify is not exact equality.
NOT_PLAIN = ["1/2", "\\frac{1}{2}", "1,000", "1e6", "007", ".5", "5.", "+7", "7%", "x", "", "- 7", "0.1234567",
             "7.0000001", "1234567890123456", "3\\,000", "$7$", "7 apples"]


def _random_plain_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """Near misses and equal values written differently: ints, decimals, negatives, trailing zeros."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        decimals = rng.choice([0, 0, 1, 2, 3, 6])
        value = rng.randint(-10**9, 10**9) / 10**decimals
        gold = f"{value:.{decimals}f}"
        kind = rng.choice(["same", "padded", "nudged"])
        if kind == "same":
            answer = gold
        elif kind == "padded":
            answer = f"{value:.{decimals + rng.randint(0, 6 - decimals)}f}" if decimals < 6 else gold
        else:
            answer = f"{value + rng.choice([-1, 1]) / 10**decimals:.{decimals}f}"
        pairs.append((answer, gold))
    return pairs


def _math_verify_reward(completion: str, gold: str) -> float:
    """math-verify's own verdict, the independent reference: the gold wrapped in $...$ as the pool
    reads a bare gold answer, the completion parsed whole."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    predicted = parse(completion, parsing_timeout=None)
    return 1.0 if verify(gold_parsed, predicted, timeout_seconds=None) else 0.0


def test_plain_number_fast_path_agrees_with_math_verify() -> None:
    pairs = PLAIN_PAIRS + _random_plain_pairs(120, seed=0)
    checked = 0
    for answer, gold in pairs:
        for completion in (f"so the answer is \\boxed{{{answer}}}", answer):
            fast = quick_verdict(completion, gold)
            assert fast is not None, (completion, gold)
            assert (fast.reward, fast.failed) == (_math_verify_reward(completion, gold), False), (completion, gold)
            checked += 1
    assert checked == 2 * len(pairs)
    # Both verdicts occur, so a fast path that always said "equal" (or "different") would fail.
    assert {quick_verdict(a, g).reward for a, g in PLAIN_PAIRS} == {0.0, 1.0}


@pytest.mark.parametrize("text", NOT_PLAIN)
def test_fast_path_leaves_other_inputs_to_math_verify(text: str) -> None:
    assert plain_number_verdict(text, "7") is None
    assert plain_number_verdict("7", text) is None


def test_shortcuts_never_change_a_verdict_on_ordinary_inputs() -> None:
    """score_completion (pre-checks, fast path, math-verify) == math-verify alone, case by case."""
    # Equal values written differently (the fast path decides them) and near misses it leaves alone.
    extra = [("\\boxed{7.00}", "7"), ("0.50", "0.5"), ("\\boxed{-0}", "0"), ("\\boxed{7.0000001}", "7"),
             ("\\boxed{0.1234567}", "0.1234568"), ("\\boxed{1,000}", "1000")]
    cases = [(c, g) for c, g, _ in GRADED_CASES + LONG_TEXT_CASES] + extra
    for completion, gold in cases:
        assert score_completion(completion, gold) == verify_with_math_verify(completion, gold), (completion, gold)


@pytest.mark.system
def test_without_the_fast_path_plain_numbers_go_to_math_verify() -> None:
    with VerifierPool(num_processes=1, timeout_s=NORMAL_TIMEOUT_S, fast_path=False) as verifier:
        assert verifier.score_sync(["\\boxed{7.0}", "8", "\\boxed{5^{5^{5^5}}}"], "7") == [
            CORRECT, WRONG, RewardResult(reward=0.0, failed=True, error="rejected: boxed answer exponent tower height 3 exceeds max_exponent_tower=2",
                                         kind=FailureKind.REJECTED),
        ]
        stats = verifier.stats()
        assert (stats["fast_path"], stats["rejected"], stats["scored"]) == (0, 1, 3)


def test_pool_config_defaults_and_validation(monkeypatch) -> None:
    assert VerifierPoolConfig().limits == DEFAULT_LIMITS
    for cores, expected in ((1, 2), (2, 2), (8, 8), (100, 32)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert default_num_processes() == expected
    for bad in ({"num_processes": 0}, {"timeout_s": 0.0}, {"timeout_s": float("inf")}, {"cache_size": -1}):
        with pytest.raises(ValueError, match=f"VerifierPoolConfig.{next(iter(bad))}"):
            VerifierPoolConfig(**bad)
    with pytest.raises(ValueError, match="AnswerLimits.max_nesting_depth"):
        AnswerLimits(max_nesting_depth=0)


@pytest.mark.system
def test_process_killed_mid_sample_is_reported_and_replaced() -> None:
    before = _pool_children()
    with VerifierPool(num_processes=1, timeout_s=60.0, limits=NO_LIMITS) as verifier:
        (pid,) = _pool_children() - before
        results: list[RewardResult] = []

        async def kill_while_scoring() -> None:
            task = asyncio.ensure_future(verifier.score([HOSTILE_TOWER], "7"))
            await asyncio.sleep(0.5)  # the tower keeps the process busy for far longer than this
            os.kill(pid, signal.SIGKILL)
            results.extend(await task)

        asyncio.run(kill_while_scoring())
        assert results == [RewardResult(reward=0.0, failed=True, error=f"verify_error: verifier process died (exit code {-signal.SIGKILL})",
                                        kind=FailureKind.VERIFY_ERROR)]
        assert verifier.score_sync(["\\boxed{\\frac{14}{2}}"], "7") == [CORRECT]
        stats = verifier.stats()
        assert (stats["crashes"], stats["verify_errors"], stats["restarts"]) == (1, 1, 1)


@pytest.mark.parametrize(
    ("node_slots", "num_processes", "expected"),
    [
        ({}, 4, {}),
        ({"a": 0.0, "b": 0.5}, 4, {}),
        ({"a": 100.0}, 4, {"a": 4}),
        ({"b": 100.0, "a": 100.0}, 5, {"a": 3, "b": 2}),
        ({"a": 1.0, "b": 100.0, "c": 0.0}, 5, {"a": 1, "b": 4}),
        ({"a": 2.0, "b": 1.0}, 4, {"a": 2, "b": 1}),
        ({"a": 2.5, "b": 2.0}, 1, {"a": 1}),
    ],
)
def test_processes_are_dealt_over_the_nodes_with_slots(node_slots, num_processes, expected) -> None:
    assert plan_verifier_shards(node_slots, num_processes) == expected


def test_without_verification_slots_the_pool_runs_in_its_actor_and_says_so(ray_local, caplog) -> None:
    """The fixture's cluster offers no verification_slot: today's behaviour, logged as unaccounted."""
    with caplog.at_level(logging.WARNING, logger="async_grpo.rewards.math_verify_cluster"):
        actor = VerifierPoolActor(num_processes=1, timeout_s=NORMAL_TIMEOUT_S)  # the plain class, in process
    try:
        warnings = [r.getMessage() for r in caplog.records if r.name == "async_grpo.rewards.math_verify_cluster"]
        assert len(warnings) == 1 and "outside Ray's CPU accounting" in warnings[0] and "verification_slot" in warnings[0]
        assert asyncio.run(actor.shards()) == []
        assert asyncio.run(actor.placement()) == {ray_local.get_runtime_context().get_node_id(): 1}
        assert asyncio.run(actor.score(["\\boxed{7}"], "7")) == [CORRECT]
        assert asyncio.run(actor.stats())["shards"] == 0
    finally:
        actor.close()


def test_ray_actor_is_shared_and_sized_by_first_caller(ray_local) -> None:
    from async_grpo.config.actor_names import RAY_NAMESPACE

    # The pool is detached and the Ray fixture session-wide: a generation worker started by an
    # earlier test may have created it. Remove it, so this test's call is really the first.
    shutdown_verifier_pool()
    handle = get_or_create_verifier_pool(num_processes=1, timeout_s=NORMAL_TIMEOUT_S)
    try:
        results = ray_local.get(handle.score.remote(["\\boxed{7}", "\\boxed{8}", "nothing"], "7"))
        assert _graded(results) == [(1.0, False), (0.0, False), (0.0, True)]
        same = get_or_create_verifier_pool(num_processes=3, timeout_s=1.0)
        assert ray_local.get(same.stats.remote())["num_processes"] == 1
        assert ray_local.get(same.stats.remote())["scored"] == 3
        assert ray_local.get_actor(VERIFIER_POOL_ACTOR_NAME, namespace=RAY_NAMESPACE) is not None
        # No verification_slot here: no shards, the client scores on the pool actor itself.
        assert ray_local.get(same.shards.remote()) == []
        client = connect_verifier_pool(num_processes=3, timeout_s=1.0)
        assert asyncio.run(client.score(["\\boxed{7}", "\\boxed{9}"], "7")) == [CORRECT, WRONG]
        assert ray_local.get(same.stats.remote())["scored"] == 4  # "\\boxed{7}" came from the cache
    finally:
        shutdown_verifier_pool()
    # The kill is asynchronous: the name goes once Ray has marked the actor dead.
    deadline = time.monotonic() + ACTOR_GONE_WAIT_S
    while VERIFIER_POOL_ACTOR_NAME in {a["name"] for a in ray_local.util.list_named_actors(all_namespaces=True)}:
        assert time.monotonic() < deadline, "the pool actor outlived shutdown_verifier_pool()"
        time.sleep(0.2)


def test_every_forkserver_preload_module_imports() -> None:
    """multiprocessing's forkserver skips a preload that fails to import without a word, so a
    stale name would leave every forked verifier cold: each must import from the repository root."""
    import importlib.util

    from async_grpo.rewards.math_verify_process import FORKSERVER_PRELOAD

    for name in FORKSERVER_PRELOAD:
        assert importlib.util.find_spec(name) is not None, name
