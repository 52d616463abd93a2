"""A generation worker decides the verdicts that need no math-verify itself (plain numbers, the
pre-checks' refusals: math_verifier.quick_verdict) and sends only the rest to the verifier pool,
counting them (issue 37, item 4). Checked against the pool's own function on the same inputs."""

from __future__ import annotations

import asyncio
from typing import Any

from async_grpo.rewards.math_verifier import RewardResult, quick_verdict, score_completion
from async_grpo.rollouts.rollout_scoring import RolloutScorer


class RecordingPool:
    """Stands in for the verifier pool: math-verify's verdict in process, each call recorded."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        self.calls.append(list(completions))
        return [score_completion(c, gt_answer) for c in completions]

    async def score_function(self, ref: str, calls: list[dict[str, Any]], timeout_s: float | None = None) -> list:
        raise NotImplementedError


COMPLETIONS = ["7", "8", "\\boxed{7}", "the answer is 7/1", "7.0"]


def _scorer(pool: RecordingPool, counted: list[int], verifier: RecordingPool | None = None) -> RolloutScorer:
    return RolloutScorer("w", connect=lambda: pool, verifier=verifier, count_in_worker=counted.append)


def test_plain_numbers_are_decided_in_the_worker_and_the_rest_go_to_the_pool() -> None:
    pool, counted = RecordingPool(), []
    results = asyncio.run(_scorer(pool, counted).verify(COMPLETIONS, "7"))
    local = [c for c in COMPLETIONS if quick_verdict(c, "7") is not None]
    assert local and len(local) < len(COMPLETIONS)  # the inputs exercise both paths
    assert pool.calls == [[c for c in COMPLETIONS if c not in local]]
    assert counted == [len(local)]
    # The same verdicts as the pool alone gives, in the completions' order.
    alone = asyncio.run(RecordingPool().score(COMPLETIONS, "7"))
    assert [(r.reward, r.failed) for r in results] == [(r.reward, r.failed) for r in alone]


def test_a_group_of_plain_numbers_makes_no_call() -> None:
    pool, counted = RecordingPool(), []
    results = asyncio.run(_scorer(pool, counted).verify(["7", "3", "7"], "7"))
    assert pool.calls == [] and counted == [3] and [r.reward for r in results] == [1.0, 0.0, 1.0]


def test_the_self_check_and_a_given_verifier_see_every_completion() -> None:
    pool, counted = RecordingPool(), []
    asyncio.run(_scorer(pool, counted).verify(["2"], "2", in_worker=False))
    assert pool.calls == [["2"]] and counted == [0]
    given = RecordingPool()  # a test's own verifier decides everything itself
    asyncio.run(_scorer(RecordingPool(), counted, verifier=given).verify(["7", "8"], "7"))
    assert given.calls == [["7", "8"]]
