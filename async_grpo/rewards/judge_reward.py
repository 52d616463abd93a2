"""The model judge as a reward function: answers through the judge template to a judge client, the
replies read by the verdict rule into FunctionScores (RewardConfig's function named `judge`).

    judge = JudgeReward(config, RegistryJudgeClient(BatchedRegistryClient(judge_registry)))
    scores = await judge.score(items)     # one group's answers -> one FunctionScore each

Per-sample mode sends one request per answer, group-wise mode one per group (judge_template.py).
Requests made within `batch_window_s` (0: one turn of the event loop, i.e. the groups a worker
scores concurrently) go out in one `JudgeClient.judge` call. A request that fails (past
`timeout_s`, an unparsable reply, a pool error) is sent again up to `retries` times; after that its
answers fail with FailureKind TIMEOUT, UNPARSABLE or CRASH, which JudgeConfig.on_failure turns
into a masked sample or a 0 part (shaping.combine_scores). A client that overruns the deadline
itself is cut off at timeout_s + _CLIENT_GRACE_S: a judge never stalls a group.

The judge pool's side (served like the teacher: its own workers and registry) implements
JUDGE_METHOD: `judge(request: JudgeRequest) -> JudgeReply` on the worker actor, reached through
the registry's leases and failover. `JudgeStats` counts calls, tokens, latency and failures as
`judge/*` metrics. Imports no Ray or vLLM: the client is handed a registry client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Protocol, Sequence

from async_grpo.config.judge_config import JudgeConfig
from async_grpo.rewards.judge_template import (
    group_messages, parse_group_verdict, parse_verdict, prompt_text, sample_messages,
)
from async_grpo.rewards.reward_failure import FailureKind
from async_grpo.rewards.reward_functions import FunctionScore, failure
from sample_processing_utils import JudgeUsage

logger = logging.getLogger(__name__)

JUDGE_METHOD = "judge"
"""The judge worker's method a registry lease calls: judge(JudgeRequest) -> JudgeReply."""
JUDGE_REQUEST_COST = 1
"""A judge request's cost in the registry's load unit: one sequence, as generation counts them."""
# How far past timeout_s a client call may run before its requests are failed as timeouts: the
# client applies the deadline itself; this only bounds one that does not.
_CLIENT_GRACE_S = 5.0


@dataclass(slots=True, frozen=True)
class JudgeRequest:
    """One chat for the judge to answer (built by judge_template's builders)."""

    messages: list[dict[str, str]]
    """The chat, [{"role", "content"}], system message first when there is one; the judge worker
    applies its tokenizer's chat template and opens the assistant turn."""
    max_tokens: int
    """Most tokens of the reply (JudgeConfig.max_tokens)."""
    temperature: float
    """Sampling temperature of the reply (JudgeConfig.temperature; 0: greedy)."""


@dataclass(slots=True, frozen=True)
class JudgeReply:
    """The judge's answer to one request."""

    text: str
    """The reply's text, read by the verdict rule."""
    prompt_tokens: int = 0
    """Tokens of the request as the judge's tokenizer encoded it."""
    completion_tokens: int = 0
    """Tokens of the reply."""


class JudgeClient(Protocol):
    """Where JudgeReward sends its requests: the judge pool through a registry (RegistryJudgeClient),
    or a test double."""

    async def judge(self, requests: Sequence[JudgeRequest], timeout_s: float) -> list[JudgeReply | BaseException]:
        """One outcome per request, in order: its reply, or the exception it failed with
        (TimeoutError once it has run timeout_s). Never raises for one request's failure."""
        ...


class LeaseClient(Protocol):
    """A registry client (routing.batch_calls.BatchedRegistryClient): runs method(*args) on a
    worker the registry leases, the least loaded, re-sent elsewhere when the worker dies."""

    async def submit(self, method: str, *args: Any, cost: int) -> Any: ...


class RegistryJudgeClient:
    """JudgeClient over the judge pool's registry: each request leased on its own (JUDGE_METHOD,
    cost JUDGE_REQUEST_COST), so a batch spreads over the least-loaded judges and a dead judge's
    requests go to another, as generation requests do; the registry client sends the requests of
    one loop turn in one lease call and each worker its share in one call. A request past
    timeout_s is cancelled, which frees its place in the registry."""

    def __init__(self, lease: LeaseClient) -> None:
        self._lease = lease

    async def judge(self, requests: Sequence[JudgeRequest], timeout_s: float) -> list[JudgeReply | BaseException]:
        async def one(request: JudgeRequest) -> JudgeReply:
            async with asyncio.timeout(timeout_s):
                reply = await self._lease.submit(JUDGE_METHOD, request, cost=JUDGE_REQUEST_COST)
            if not isinstance(reply, JudgeReply):
                raise TypeError(f"the judge worker answered a {type(reply).__name__}, not a JudgeReply")
            return reply

        return list(await asyncio.gather(*(one(r) for r in requests), return_exceptions=True))


@dataclass(slots=True)
class JudgeStats:
    """What one process's judging did since it started; `as_metrics` gives the judge/* keys."""

    calls: int = 0
    """JudgeClient.judge calls (each a batch of requests)."""
    requests: int = 0
    """Requests sent, retries included."""
    retries: int = 0
    """Requests sent again after a failed attempt."""
    tokens_in: int = 0
    """Request tokens of the replies received (JudgeReply.prompt_tokens)."""
    tokens_out: int = 0
    """Reply tokens received (JudgeReply.completion_tokens)."""
    latency_s: float = 0.0
    """Sum over calls of their seconds from sending to the last outcome."""
    scored: int = 0
    """Answers given a score."""
    masked: int = 0
    """Answers whose judging failed under on_failure mask."""
    failures: dict[str, int] = field(default_factory=dict)
    """Answers whose judging failed after its retries, per FailureKind value."""

    def as_metrics(self) -> dict[str, float]:
        """judge/<counter>, judge/latency_s_mean (per call) and judge/failures/<kind>."""
        counters = {f"judge/{f.name}": float(getattr(self, f.name)) for f in fields(self)
                    if f.name not in ("latency_s", "failures")}
        return {**counters, "judge/latency_s_mean": self.latency_s / self.calls if self.calls else 0.0,
                **{f"judge/failures/{kind}": float(n) for kind, n in self.failures.items()}}


@dataclass(slots=True, frozen=True)
class JudgeItem:
    """One answer to judge, with what its template shows besides it."""

    record: Mapping[str, Any] | None
    """The prompt record ({prompt} comes from it: JudgeConfig.prompt_field)."""
    completion: str
    """The answer's text."""
    gt_answer: str = ""
    """The record's gold answer ({gt_answer})."""


@dataclass(slots=True, eq=False)
class _Pending:
    request: JudgeRequest
    future: asyncio.Future[JudgeReply | BaseException]


@dataclass(slots=True, frozen=True)
class _Failure:
    kind: FailureKind
    detail: str


class JudgeReward:
    """Scores answers with a judge under one JudgeConfig; bound to the event loop of its first call."""

    def __init__(self, config: JudgeConfig, client: JudgeClient, stats: JudgeStats | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.stats = stats if stats is not None else JudgeStats()
        self._client = client
        self._template = config.template()
        self._clock = clock
        self._queue: list[_Pending] = []
        self._flush_handle: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def score(self, items: Sequence[JudgeItem]) -> list[FunctionScore]:
        """One FunctionScore per item: per-sample, each judged alone (concurrently); group-wise,
        the items are one group judged in one request. Failures are scores, never exceptions."""
        return [score for score, _ in await self.score_with_usage(items)]

    async def score_with_usage(self, items: Sequence[JudgeItem]) -> list[tuple[FunctionScore, JudgeUsage]]:
        """`score`, each item's score with what judging it cost (a group request's usage shared
        evenly over its items)."""
        if not items:
            return []
        if self.config.group_wise:
            return await self._judge_group(items)
        judged = await asyncio.gather(*(self._judge_group([item]) for item in items))
        return [pair for pairs in judged for pair in pairs]

    async def _judge_group(self, items: Sequence[JudgeItem]) -> list[tuple[FunctionScore, JudgeUsage]]:
        """items judged in one request (one item: the per-sample chat), retried as configured."""
        try:
            request = self._request(items)
        except ValueError as exc:  # the record has no question to show: no retry mends that
            return [(score, JudgeUsage()) for score in self._failed(_Failure(FailureKind.RAISED, str(exc)), len(items))]
        started, attempts, tokens_in, tokens_out = self._clock(), 0, 0, 0
        outcome: list[float] | _Failure = _Failure(FailureKind.CRASH, "not sent")
        for attempts in range(1, 2 + self.config.retries):
            if attempts > 1:
                self.stats.retries += 1
            reply = await self._send(request)
            if isinstance(reply, JudgeReply):
                tokens_in, tokens_out = tokens_in + reply.prompt_tokens, tokens_out + reply.completion_tokens
            outcome = self._read(reply, len(items))
            if not isinstance(outcome, _Failure):
                break
        self.stats.tokens_in += tokens_in
        self.stats.tokens_out += tokens_out
        spent = JudgeUsage(requests=attempts, retries=attempts - 1, tokens_in=tokens_in, tokens_out=tokens_out,
                           latency_s=self._clock() - started).share(len(items))
        if isinstance(outcome, _Failure):
            return [(score, spent) for score in self._failed(outcome, len(items))]
        self.stats.scored += len(outcome)
        return [(FunctionScore(reward=score), spent) for score in outcome]

    def _failed(self, cause: _Failure, count: int) -> list[FunctionScore]:
        self.stats.failures[cause.kind.value] = self.stats.failures.get(cause.kind.value, 0) + count
        if self.config.on_failure == "mask":
            self.stats.masked += count
        return [failure(cause.kind, cause.detail)] * count

    def _request(self, items: Sequence[JudgeItem]) -> JudgeRequest:
        config, first = self.config, items[0]
        prompt = prompt_text(first.record, config.prompt_field)
        if config.group_wise:
            messages = group_messages(config, self._template, prompt=prompt, gt_answer=first.gt_answer,
                                      completions=[item.completion for item in items])
        else:
            messages = sample_messages(config, self._template, prompt=prompt, completion=first.completion,
                                       gt_answer=first.gt_answer)
        return JudgeRequest(messages=messages, max_tokens=config.max_tokens, temperature=config.temperature)

    def _read(self, outcome: JudgeReply | BaseException, width: int) -> list[float] | _Failure:
        """A reply's scores (one per answer shown), or why there are none."""
        if isinstance(outcome, TimeoutError):
            return _Failure(FailureKind.TIMEOUT, f"no judge reply within timeout_s={self.config.timeout_s}")
        if isinstance(outcome, BaseException):
            return _Failure(FailureKind.CRASH, f"judge call failed: {type(outcome).__name__}: {outcome}")
        if self.config.group_wise:
            group = parse_group_verdict(outcome.text, width, self.config)
            return group.scores if group.scores is not None else _Failure(FailureKind.UNPARSABLE, group.problem)
        verdict = parse_verdict(outcome.text, self.config)
        return [verdict.score] if verdict.score is not None else _Failure(FailureKind.UNPARSABLE, verdict.problem)

    async def _send(self, request: JudgeRequest) -> JudgeReply | BaseException:
        """The outcome of one request, sent with the others queued in the same batch window."""
        loop = asyncio.get_running_loop()
        pending = _Pending(request=request, future=loop.create_future())
        self._queue.append(pending)
        if self._flush_handle is None:
            window = self.config.batch_window_s
            self._flush_handle = loop.call_later(window, self._flush) if window else loop.call_soon(self._flush)
        return await pending.future

    def _flush(self) -> None:
        self._flush_handle = None
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._call(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, batch: list[_Pending]) -> None:
        """One client call for the batch; every request's future gets an outcome, whatever happens."""
        self.stats.calls += 1
        self.stats.requests += len(batch)
        started = self._clock()
        timeout_s = self.config.timeout_s
        outcomes: list[Any] | None = None
        try:
            async with asyncio.timeout(timeout_s + _CLIENT_GRACE_S):
                answered = list(await self._client.judge([p.request for p in batch], timeout_s))
            if len(answered) != len(batch):
                raise RuntimeError(f"the judge client answered {len(answered)} outcomes for {len(batch)} requests")
            outcomes = answered
        except TimeoutError as exc:
            outcomes = [exc] * len(batch)
        except Exception as exc:  # noqa: BLE001 - the client failing is every request's outcome
            logger.warning("judge call of %d requests failed: %s: %s", len(batch), type(exc).__name__, exc)
            outcomes = [exc] * len(batch)
        finally:
            self.stats.latency_s += self._clock() - started
            if outcomes is None:  # cancelled mid-call (the loop is closing): no caller waits forever
                outcomes = [RuntimeError("the judge call was cancelled")] * len(batch)
            for pending, outcome in zip(batch, outcomes):
                if not pending.future.done():  # its caller may have given up (cancelled)
                    pending.future.set_result(outcome)
