"""The judge as a reward function (issue 60, items 2-3): JudgeReward against an in-process fake
judge client (a test double of the pool: this tests the reward kind's own logic), the registry
client against a fake lease client, and the judge combined with another reward function in the
generation worker's scorer, where failures mask.

    .venv/bin/python -m pytest tests/rewards/test_judge_reward.py -q
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import pytest

from async_grpo.rewards import judge_reward
from async_grpo.config.judge_config import JudgeConfig
from async_grpo.rewards.judge_reward import (
    JUDGE_METHOD, JudgeItem, JudgeReply, JudgeRequest, JudgeReward, JudgeStats, RegistryJudgeClient,
)
from async_grpo.rewards.reward_failure import FailureKind
from async_grpo.rewards.reward_functions import FunctionScore
from async_grpo.config.reward_config import RewardConfig
from async_grpo.rollouts.rollout_scoring import RolloutScorer
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample

_WAIT_BOUND_S = 60.0  # a judge that stalls fails the test instead of hanging it; never what decides a pass
Answer = Callable[[JudgeRequest], "str | BaseException"]


class FakeJudge:
    """Stands in for the judge pool: answers each request with answer(request), records each call."""

    def __init__(self, answer: Answer, delay_s: float = 0.0) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.calls: list[list[JudgeRequest]] = []

    async def judge(self, requests: Sequence[JudgeRequest], timeout_s: float) -> list[JudgeReply | BaseException]:
        self.calls.append(list(requests))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out: list[JudgeReply | BaseException] = []
        for request in requests:
            reply = self.answer(request)
            out.append(reply if isinstance(reply, BaseException) else JudgeReply(reply, 10, len(reply)))
        return out


def _user(request: JudgeRequest) -> str:
    return request.messages[-1]["content"]


def _completion_of(request: JudgeRequest) -> str:
    """The answer a per-sample request shows (the default template: after 'Answer:')."""
    return _user(request).split("Answer:\n", 1)[1].split("\n\n", 1)[0]


def _items(*completions: str, prompt: str = "3+4=") -> list[JudgeItem]:
    return [JudgeItem(record={"prompt": prompt}, completion=c, gt_answer="7") for c in completions]


def _rewards(scores: list[FunctionScore]) -> list[float | str]:
    return [str(s.kind) if s.failed else s.reward for s in scores]


def test_per_sample_judging_scores_each_answer_and_counts_the_call() -> None:
    judge = FakeJudge(lambda r: "10" if _completion_of(r) == "7" else "2")
    reward = JudgeReward(JudgeConfig(low=0, high=10), judge)
    scores = asyncio.run(reward.score(_items("7", "8", "7")))
    assert _rewards(scores) == [1.0, 0.2, 1.0]
    assert len(judge.calls) == 1 and len(judge.calls[0]) == 3  # one call for the three requests
    metrics = reward.stats.as_metrics()
    assert metrics["judge/calls"] == 1 and metrics["judge/requests"] == 3 and metrics["judge/scored"] == 3
    assert metrics["judge/tokens_in"] == 30 and metrics["judge/tokens_out"] == 5  # "10" + "2" + "10"


def test_groups_scored_concurrently_share_one_call() -> None:
    judge = FakeJudge(lambda r: "yes" if _completion_of(r) == "7" else "no")
    reward = JudgeReward(JudgeConfig(verdict="yes_no"), judge)

    async def scenario() -> list[list[FunctionScore]]:
        return await asyncio.gather(reward.score(_items("7", "1")), reward.score(_items("6", "7", "7")))

    first, second = asyncio.run(scenario())
    assert (_rewards(first), _rewards(second)) == ([1.0, 0.0], [0.0, 1.0, 1.0])
    assert [len(call) for call in judge.calls] == [5]


@pytest.mark.parametrize("window_s, calls", [(0.0, [1, 2]), (0.2, [3])])
def test_a_batch_window_gathers_groups_that_arrive_apart(window_s: float, calls: list[int]) -> None:
    """The second group asks one loop turn after the first: apart without a window, together
    within one (a window far longer than a loop turn)."""
    judge = FakeJudge(lambda r: "5")
    reward = JudgeReward(JudgeConfig(batch_window_s=window_s), judge)

    async def later(items: list[JudgeItem]) -> list[FunctionScore]:
        await asyncio.sleep(0)
        return await reward.score(items)

    async def scenario() -> None:
        await asyncio.gather(reward.score(_items("1")), later(_items("2", "3")))

    asyncio.run(scenario())
    assert [len(call) for call in judge.calls] == calls


def test_group_wise_judging_sends_one_request_per_group() -> None:
    def answer(request: JudgeRequest) -> str:
        text = _user(request)
        assert "Answer 1:\n7\n\nAnswer 2:\n9\n\nAnswer 3:\n7" in text and "K from 1 to 3" in text
        return "Answer 2 is off by two.\n1: <score>5</score>\n2: <score>1</score>\n3: <score>4</score>"

    judge = FakeJudge(answer)
    reward = JudgeReward(JudgeConfig(verdict="tags", low=0, high=5, group_wise=True), judge)
    assert _rewards(asyncio.run(reward.score(_items("7", "9", "7")))) == [1.0, 0.2, 0.8]
    assert [len(call) for call in judge.calls] == [1]


def test_a_partial_group_reply_is_retried_then_fails_every_answer() -> None:
    judge = FakeJudge(lambda r: "1: 5\n2: 6")  # three answers shown, two scored
    reward = JudgeReward(JudgeConfig(group_wise=True, retries=2), judge)
    scores = asyncio.run(reward.score(_items("a", "b", "c")))
    assert _rewards(scores) == ["unparsable"] * 3
    assert "no verdict for answer 3 of 3" in scores[0].error
    assert len(judge.calls) == 3  # the first try and two retries
    metrics = reward.stats.as_metrics()
    assert (metrics["judge/retries"], metrics["judge/failures/unparsable"], metrics["judge/masked"]) == (2, 3, 3)


def test_a_retry_that_parses_scores_the_answer() -> None:
    replies = iter(["I cannot decide.", "8"])
    judge = FakeJudge(lambda r: next(replies))
    reward = JudgeReward(JudgeConfig(retries=1), judge)
    assert _rewards(asyncio.run(reward.score(_items("7")))) == [0.8]
    assert reward.stats.retries == 1 and reward.stats.failures == {}


@pytest.mark.parametrize("outcome, kind", [
    (TimeoutError(), FailureKind.TIMEOUT),
    (RuntimeError("judge-registry: no live worker after 3 retries"), FailureKind.CRASH),
])
def test_client_failures_become_typed_failures(outcome: BaseException, kind: FailureKind) -> None:
    reward = JudgeReward(JudgeConfig(retries=0, on_failure="zero"), FakeJudge(lambda r: outcome))
    (score,) = asyncio.run(reward.score(_items("7")))
    assert (score.failed, score.kind, score.reward) == (True, kind, 0.0)
    assert reward.stats.masked == 0  # on_failure zero


def test_a_judge_that_sleeps_past_its_deadline_times_out_instead_of_stalling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake ignores its deadline; JudgeReward cuts it off at timeout_s plus its grace."""
    monkeypatch.setattr(judge_reward, "_CLIENT_GRACE_S", 0.05)
    judge = FakeJudge(lambda r: "5", delay_s=3600.0)
    reward = JudgeReward(JudgeConfig(timeout_s=0.05, retries=1), judge)
    scores = asyncio.run(asyncio.wait_for(reward.score(_items("7", "8")), timeout=_WAIT_BOUND_S))
    assert _rewards(scores) == ["timeout", "timeout"] and len(judge.calls) == 2  # tried, then retried
    assert reward.stats.as_metrics()["judge/failures/timeout"] == 2


def test_a_client_answering_the_wrong_count_fails_the_batch_as_a_crash() -> None:
    class Short(FakeJudge):
        async def judge(self, requests, timeout_s):
            return []

    (score,) = asyncio.run(JudgeReward(JudgeConfig(retries=0), Short(lambda r: "")).score(_items("7")))
    assert score.kind == FailureKind.CRASH and "0 outcomes for 1 requests" in score.error


def test_a_record_without_a_question_fails_without_a_call() -> None:
    judge = FakeJudge(lambda r: "5")
    (score,) = asyncio.run(JudgeReward(JudgeConfig(), judge).score([JudgeItem(record={"x": 1}, completion="7")]))
    assert score.kind == FailureKind.RAISED and "'prompt' or 'question'" in score.error and judge.calls == []


def test_stats_are_shared_by_the_rewards_given_one() -> None:
    stats = JudgeStats()
    for config in (JudgeConfig(), JudgeConfig(verdict="yes_no")):
        asyncio.run(JudgeReward(config, FakeJudge(lambda r: "yes 5"), stats).score(_items("7")))
    assert (stats.calls, stats.scored) == (2, 2)


class StepClock:
    """A clock that moves 0.5 s each time it is read: latencies become countable reads."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def test_each_answer_carries_what_judging_it_cost() -> None:
    replies = iter(["maybe", "8", "9"])  # the first answer's first reply fails and is retried
    reward = JudgeReward(JudgeConfig(retries=1), FakeJudge(lambda r: next(replies)))
    (first, used_first), (second, used_second) = asyncio.run(reward.score_with_usage(_items("7", "8")))
    assert (first.reward, second.reward) == (0.9, 0.8)
    # "maybe" then "9" for the first (two requests of 10 tokens each), "8" for the second
    assert (used_first.requests, used_first.retries, used_first.tokens_in, used_first.tokens_out) == (2, 1, 20, 6)
    assert (used_second.requests, used_second.retries, used_second.tokens_in, used_second.tokens_out) == (1, 0, 10, 1)


def test_a_group_request_is_shared_evenly_by_its_answers() -> None:
    clock = StepClock()
    reward = JudgeReward(JudgeConfig(verdict="yes_no", group_wise=True), FakeJudge(lambda r: "1: yes\n2: no"),
                         clock=clock)
    judged = asyncio.run(reward.score_with_usage(_items("7", "9")))
    reply_tokens = len("1: yes\n2: no")
    assert [score.reward for score, _ in judged] == [1.0, 0.0]
    # one request of 10 tokens over two answers; the clock is read at the start and the end of
    # the answer's judging and around the client call, so the group took 3 x 0.5 s
    for _, usage in judged:
        assert (usage.requests, usage.retries, usage.tokens_in, usage.tokens_out) == (0.5, 0.0, 5.0, reply_tokens / 2)
        assert usage.latency_s == pytest.approx(1.5 / 2)


def test_failed_judging_still_carries_its_requests() -> None:
    reward = JudgeReward(JudgeConfig(retries=2), FakeJudge(lambda r: TimeoutError()))
    ((score, usage),) = asyncio.run(reward.score_with_usage(_items("7")))
    assert score.kind == FailureKind.TIMEOUT
    assert (usage.requests, usage.retries, usage.tokens_in, usage.tokens_out) == (3, 2, 0, 0)  # no reply, no tokens


# ------------------------------------------------------------------------------------------
# The registry client: one lease per request, deadlines applied per request
# ------------------------------------------------------------------------------------------


class FakeLease:
    """Stands in for BatchedRegistryClient: runs the 'worker' in process, records each submit."""

    def __init__(self, worker: Callable[[JudgeRequest], Any]) -> None:
        self.worker = worker
        self.submits: list[tuple[str, int]] = []

    async def submit(self, method: str, *args: Any, cost: int) -> Any:
        self.submits.append((method, cost))
        (request,) = args
        return await self.worker(request)


def test_registry_client_leases_each_request_and_keeps_failures_per_request() -> None:
    async def worker(request: JudgeRequest) -> Any:
        text = _user(request)
        if "slow" in text:
            await asyncio.sleep(3600)
        if "dead" in text:
            raise RuntimeError("judge-registry: request failed on 4 workers")
        if "odd" in text:
            return "not a reply"
        return JudgeReply(text="ok")

    lease = FakeLease(worker)
    requests = [JudgeRequest(messages=[{"role": "user", "content": c}], max_tokens=8, temperature=0.0)
                for c in ("fine", "slow", "dead", "odd")]
    outcomes = asyncio.run(RegistryJudgeClient(lease).judge(requests, timeout_s=0.05))
    assert outcomes[0] == JudgeReply(text="ok")
    assert isinstance(outcomes[1], TimeoutError)
    assert isinstance(outcomes[2], RuntimeError) and "4 workers" in str(outcomes[2])
    assert isinstance(outcomes[3], TypeError)
    assert lease.submits == [(JUDGE_METHOD, 1)] * 4


def test_reward_config_takes_the_judge_as_a_weighted_function() -> None:
    config = RewardConfig(functions=("judge", "async_grpo.rewards.code_reward:run_tests"), weights=(0.5, 0.5),
                          judge=JudgeConfig(verdict="yes_no"))
    assert config.uses_judge and config.may_mask  # the judge masks by default
    assert config.masks_failure("judge") and not config.masks_failure("async_grpo.rewards.code_reward:run_tests")
    plain = RewardConfig(functions=("async_grpo.rewards.code_reward:run_tests",))
    assert not plain.uses_judge and not plain.may_mask  # today's behaviour: failures score 0
    assert RewardConfig(by_data_source=("chat=judge",)).uses_judge
    with pytest.raises(ValueError, match="on_function_failure"):
        RewardConfig(on_function_failure="drop")
    with pytest.raises(ValueError, match="min_scored_samples"):
        RewardConfig(min_scored_samples=0)


# ------------------------------------------------------------------------------------------
# In the generation worker's scorer: combined with another function, failures masked
# ------------------------------------------------------------------------------------------


class CodePool:
    """The verifier pool's reward functions: 'pass' scores 1, anything else 0; 'hang' times out."""

    async def score(self, completions: list[str], gt_answer: str) -> list:
        raise NotImplementedError

    async def score_function(self, ref: str, calls: list[dict[str, Any]], timeout_s: float | None = None) -> list:
        from async_grpo.rewards.reward_functions import failure

        return [failure(FailureKind.TIMEOUT) if c["completion"].startswith("hang")
                else FunctionScore(reward=float(c["completion"].startswith("pass"))) for c in calls]


CODE = "async_grpo.rewards.code_reward:run_tests"


def _group(*completions: str) -> list[Sample]:
    return [Sample(input_token_ids=[1], gt_answer="7", prompt_id=0, output_token_ids=[2], output_text=c,
                   record={"prompt": "Write it."}) for c in completions]


def _verdicts(reward: RewardConfig, judge: FakeJudge | None, *completions: str) -> tuple[list[Sample], list]:
    scorer = RolloutScorer("w", connect=CodePool, connect_judge=(lambda: judge) if judge else None)
    samples = _group(*completions)
    results = asyncio.run(scorer.verdicts(samples, "7", SamplingConfig(n=len(samples), reward=reward)))
    return samples, results


def test_judge_and_code_reward_combine_by_weight_and_judge_failures_mask() -> None:
    judge = FakeJudge(lambda r: "garbage" if "mumble" in _completion_of(r) else "10")
    reward = RewardConfig(functions=("judge", CODE), weights=(0.25, 0.75), judge=JudgeConfig(retries=0))
    samples, results = _verdicts(reward, judge, "pass A", "fail B", "pass mumble")
    assert [r.reward for r in results] == [1.0, 0.25, 0.75]  # 0.25 x judge + 0.75 x code
    assert [s.reward_masked for s in samples] == [False, False, True]
    assert samples[2].reward_failure_reasons == ["judge/unparsable"]
    assert samples[0].reward_parts == {"judge": 1.0, "run_tests": 1.0}
    assert [s.judge_usage.requests for s in samples] == [1, 1, 1]  # retries=0: one request each


def test_samples_judged_group_wise_share_the_groups_request() -> None:
    judge = FakeJudge(lambda r: "1: yes\n2: no\n3: yes\n4: no")
    reward = RewardConfig(functions=("judge",), judge=JudgeConfig(verdict="yes_no", group_wise=True))
    samples, results = _verdicts(reward, judge, "a", "b", "c", "d")
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert [s.judge_usage.requests for s in samples] == [0.25] * 4 and len(judge.calls) == 1
    plain, _ = _verdicts(RewardConfig(functions=(CODE,)), None, "pass")
    assert plain[0].judge_usage is None  # no judge in the reward: nothing to carry


def test_code_failures_score_zero_by_default_and_mask_when_asked() -> None:
    zero, results = _verdicts(RewardConfig(functions=(CODE,)), None, "pass", "hang")
    assert [(r.reward, r.failed, s.reward_masked) for s, r in zip(zero, results)] == [(1.0, False, False),
                                                                                       (0.0, True, False)]
    masked, results = _verdicts(RewardConfig(functions=(CODE,), on_function_failure="mask"), None, "pass", "hang")
    assert [(r.failed, s.reward_masked) for s, r in zip(masked, results)] == [(False, False), (True, True)]
    assert masked[1].reward_failure_reasons == ["run_tests/timeout"]


def test_a_worker_without_a_judge_client_fails_judged_samples_as_crashes() -> None:
    samples, _ = _verdicts(RewardConfig(functions=("judge",)), None, "7")
    assert samples[0].reward_masked and samples[0].reward_failure_reasons == ["judge/crash"]
