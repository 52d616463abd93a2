"""The registry's routing without Ray: CapacityQueue (caps, least-loaded choice, the FIFO queue,
timeouts, failover) and LeaseBook (lease calls over it).

`_Worker` stands in for a worker: its `work` calls can be held behind a gate, so the tests decide
exactly which requests are in flight, and `kill()` makes its running and later calls fail the way a
dead actor's do. Each scenario runs on one event loop, as the registry actor's does; no sleep
decides an outcome (the bounded waits below only keep a broken queue from hanging the suite). The
registry actor's own behaviour (handles, streaming, workers really dying) is
tests/routing/test_registry.py's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import pytest

from async_grpo.routing.capacity_queue import CapacityQueue, WorkerLoad, WorkerPoolError
from async_grpo.routing.lease_book import DIED, FAILED, SERVED, BatchOutcome, LeaseBook

_NAME = "generation-registry"
# Upper bound on how long a test waits for something that should happen at once; it keeps a
# broken queue from hanging the suite and is never what decides a pass.
_WAIT_BOUND_S = 60.0
# A no-worker timeout short enough to wait out in a unit test.
_SHORT_TIMEOUT_S = 0.3
_BAD_TAG = "bad"  # _Worker.work raises ValueError for this tag


class _Died(Exception):
    """What a call on a killed _Worker raises (the tests' is_worker_death recognises only this)."""


@dataclass(slots=True, kw_only=True)
class _Worker(WorkerLoad):
    """A worker in the queue that also serves the requests sent to it (held ones wait at a gate)."""

    held: bool = False
    calls: list[Any] = field(default_factory=list)
    gates: dict[Any, asyncio.Event] = field(default_factory=dict)
    active: int = 0
    peak: int = 0
    dead: bool = False

    async def work(self, tag: Any) -> tuple[str, Any]:
        self.calls.append(tag)
        if self.dead:
            raise _Died(f"{self.name} is dead")
        if tag == _BAD_TAG:
            raise ValueError(f"{self.name}: bad request {tag}")
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await self.gate(tag).wait()
        finally:
            self.active -= 1
        if self.dead:
            raise _Died(f"{self.name} died during {tag}")
        return self.name, tag

    def gate(self, tag: Any) -> asyncio.Event:
        if tag not in self.gates:
            self.gates[tag] = asyncio.Event()
            if not self.held:
                self.gates[tag].set()
        return self.gates[tag]

    def release(self, tag: Any) -> None:
        self.gate(tag).set()

    def open_gate(self) -> None:
        self.held = False
        for gate in self.gates.values():
            gate.set()

    def kill(self) -> None:
        """Its held calls and every later one fail with _Died."""
        self.dead = True
        self.open_gate()


def _queue(**limits: Any) -> CapacityQueue[_Worker]:
    options: dict[str, Any] = dict(max_cost_per_worker=1024, no_worker_timeout_s=_WAIT_BOUND_S,
                                   max_retries_per_request=3)
    return CapacityQueue(_NAME, is_worker_death=lambda err: isinstance(err, _Died), **{**options, **limits})


def _workers(queue: CapacityQueue[_Worker], *names: str, **options: Any) -> list[_Worker]:
    workers = [_Worker(name=name, **options) for name in names]
    for worker in workers:
        queue.add(worker)
    return workers


def _submit(queue: CapacityQueue[_Worker], tag: Any, cost: int = 1) -> asyncio.Task[Any]:
    return asyncio.ensure_future(queue.submit("work", cost, lambda worker: worker.work(tag)))


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _WAIT_BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def _run(scenario: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, 3 * _WAIT_BOUND_S))


def _loads(worker: WorkerLoad) -> tuple[int, int, int]:
    return worker.inflight_requests, worker.inflight_cost, worker.requests_served


# --- CapacityQueue: the submit path -------------------------------------------------------------


def test_requests_go_to_the_least_loaded_worker():
    async def scenario() -> None:
        queue = _queue()
        a, b = _workers(queue, "a", "b", held=True)
        big = _submit(queue, "big", cost=10)
        await _until(lambda: len(a.calls) + len(b.calls) == 1, "big")
        small = [_submit(queue, i, cost=1) for i in range(4)]
        await _until(lambda: len(a.calls) + len(b.calls) == 5, "small")
        big_worker, other = (a, b) if "big" in a.calls else (b, a)
        assert big_worker.calls == ["big"], "cost-1 requests went to the worker carrying cost 10"
        assert sorted(other.calls) == [0, 1, 2, 3]
        a.open_gate()
        b.open_gate()
        assert (await big)[0] == big_worker.name
        assert {(await task)[0] for task in small} == {other.name}

    _run(scenario())


def test_equal_costs_spread_evenly():
    async def scenario() -> None:
        queue = _queue()
        a, b = _workers(queue, "a", "b", held=True)
        tasks = [_submit(queue, i) for i in range(6)]
        await _until(lambda: len(a.calls) + len(b.calls) == 6, "all")
        assert (len(a.calls), len(b.calls)) == (3, 3)
        a.open_gate()
        b.open_gate()
        assert sorted(tag for _, tag in await asyncio.gather(*tasks)) == list(range(6))

    _run(scenario())


def test_cap_holds_requests_until_capacity_frees():
    async def scenario() -> None:
        queue = _queue(max_cost_per_worker=2)
        (worker,) = _workers(queue, "capped", held=True)
        tasks = [_submit(queue, i) for i in range(5)]
        await _until(lambda: len(worker.calls) == 2, "two requests at the worker")
        assert (worker.inflight_requests, worker.inflight_cost) == (2, 2)
        await _until(lambda: queue.queued() == 3, "three requests queued")
        assert not any(task.done() for task in tasks)

        worker.open_gate()
        assert sorted(tag for _, tag in await asyncio.gather(*tasks)) == list(range(5))
        assert worker.peak == 2
        # A request costlier than the cap still runs on an idle worker instead of waiting forever.
        assert await _submit(queue, "huge", cost=7) == ("capped", "huge")
        assert _loads(worker) == (0, 0, 6)

    _run(scenario())


def test_queued_requests_are_served_in_arrival_order():
    # Capacity frees one request at a time, so that each step lets at most one request through
    # and the worker's record is the queue's dispatch order.
    async def scenario() -> None:
        queue = _queue(max_cost_per_worker=4)
        (worker,) = _workers(queue, "fifo", held=True)
        first = []
        for i in range(4):
            first.append(_submit(queue, i))
            await _until(lambda: len(worker.calls) == i + 1, f"request {i} to reach the worker")
        big = _submit(queue, "big", cost=3)
        await _until(lambda: queue.queued() == 1, "the big request to queue")
        small = []
        for i in range(3):
            small.append(_submit(queue, f"small-{i}"))
            await _until(lambda: queue.queued() == i + 2, f"small-{i} to queue")

        # A request's answer comes back only after its cost was given back and the freed
        # capacity handed on, so reading the queue right after it does not race the hand-over.
        for i in range(2):
            worker.release(i)
            await first[i]
            assert queue.queued() == 4, f"a cheap request overtook the costly one once request {i} finished"
        worker.release(2)
        await first[2]
        assert queue.queued() == 3, "the costly request did not run once its cost fit"
        await _until(lambda: len(worker.calls) == 5, "the big request to reach the worker")
        # "big" holds 3 of 4 units from here on: each finished cost-1 request lets the next one in.
        for step, (tag, task) in enumerate([(3, first[3]), ("small-0", small[0]), ("small-1", small[1])]):
            worker.release(tag)
            await task
            assert queue.queued() == 2 - step, f"not exactly one queued request ran once {tag} finished"
            await _until(lambda: len(worker.calls) == 6 + step, f"the next queued request to reach the worker after {tag}")
        worker.open_gate()
        await asyncio.gather(*first, big, *small)
        # The costly request waited until its cost fit; the cheap ones behind it did not overtake it.
        assert worker.calls == [0, 1, 2, 3, "big", "small-0", "small-1", "small-2"]

    _run(scenario())


def test_a_cancelled_queued_request_frees_its_place():
    async def scenario() -> None:
        queue = _queue(max_cost_per_worker=1)
        (worker,) = _workers(queue, "cancel", held=True)
        running = _submit(queue, "running")
        await _until(lambda: len(worker.calls) == 1, "the first request to run")
        queued = _submit(queue, "queued")
        await _until(lambda: queue.queued() == 1, "the second request to queue")
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert queue.queued() == 0
        worker.open_gate()
        assert await running == ("cancel", "running")
        assert await _submit(queue, "after") == ("cancel", "after")
        assert worker.calls == ["running", "after"]
        assert (worker.inflight_requests, worker.inflight_cost) == (0, 0)

    _run(scenario())


def test_a_cancelled_running_request_gives_its_cost_back():
    async def scenario() -> None:
        queue = _queue(max_cost_per_worker=1)
        (worker,) = _workers(queue, "w", held=True)
        running = _submit(queue, "running")
        await _until(lambda: len(worker.calls) == 1, "the request to run")
        waiting = _submit(queue, "waiting")
        await _until(lambda: queue.queued() == 1, "the second request to queue")
        running.cancel()
        await _until(lambda: len(worker.calls) == 2, "the queued request to take the freed place")
        worker.open_gate()
        assert await waiting == ("w", "waiting")
        assert _loads(worker) == (0, 0, 1)

    _run(scenario())


def test_a_request_cancelled_as_it_is_handed_a_worker_leaves_nothing_reserved():
    async def scenario() -> None:
        queue = _queue(max_cost_per_worker=1)
        (worker,) = _workers(queue, "w")
        holder = await queue.acquire(1)
        task = _submit(queue, "unlucky")
        await _until(lambda: queue.queued() == 1, "the request to queue")
        queue.release(holder, 1)  # hands the freed place to the queued request at once...
        task.cancel()  # ...which is cancelled before it runs on
        # Python 3.11's wait_for lets a request whose worker was already handed over run on
        # (its send happens); later versions raise CancelledError. Either way nothing stays held.
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(outcome, asyncio.CancelledError):
            assert worker.calls == []
        else:
            assert outcome == ("w", "unlucky") and worker.calls == ["unlucky"]
        assert (worker.inflight_requests, worker.inflight_cost, queue.queued()) == (0, 0, 0)

    _run(scenario())


def test_requests_on_a_killed_worker_complete_on_the_other():
    async def scenario() -> None:
        queue = _queue()
        (doomed,) = _workers(queue, "doomed", held=True)
        (survivor,) = _workers(queue, "survivor")
        tasks = [_submit(queue, i) for i in range(8)]
        await _until(lambda: doomed.active > 0, "requests held on the doomed worker")
        doomed.kill()
        results = await asyncio.gather(*tasks)
        assert sorted(tag for _, tag in results) == list(range(8))
        assert {name for name, _ in results} == {"survivor"}
        assert sorted(queue.workers) == ["survivor"]
        # Each request sent to the doomed worker (held there, or sent just before it died) went again.
        assert queue.redispatched_requests == len(doomed.calls) > 0
        assert _loads(survivor) == (0, 0, 8) and (doomed.inflight_requests, doomed.inflight_cost) == (0, 0)

    _run(scenario())


def test_all_workers_dead_raises_an_error_naming_the_registry():
    async def scenario() -> None:
        queue = _queue(no_worker_timeout_s=_SHORT_TIMEOUT_S)
        a, b = _workers(queue, "a", "b", held=True)
        tasks = [_submit(queue, i) for i in range(4)]
        await _until(lambda: len(a.calls) + len(b.calls) == 4, "all")
        started = time.monotonic()
        a.kill()
        b.kill()
        for task in tasks:
            with pytest.raises(WorkerPoolError, match=f"generation-registry: no live workers for {_SHORT_TIMEOUT_S} s"):
                await task
        assert time.monotonic() - started >= _SHORT_TIMEOUT_S, "the queue gave up before waiting for a new worker"
        assert queue.queued() == 0

    _run(scenario())


def test_the_no_worker_timeout_counts_from_when_the_pool_emptied():
    # Requests queued for capacity longer than the timeout while a worker lived still get the
    # whole timeout, counted from when the pool emptied, for a new worker to register.
    async def scenario() -> None:
        queue, book = _book(max_cost_per_worker=1, no_worker_timeout_s=_SHORT_TIMEOUT_S)
        (worker,) = _workers(queue, "w")
        await queue.acquire(1)  # the worker is full from here on
        submitted = _submit(queue, "submitted")
        leased = _Caller(book, "call-0", [1])
        await asyncio.sleep(2 * _SHORT_TIMEOUT_S)  # queued past the timeout, with a worker alive
        assert not submitted.done() and not leased.task.done() and queue.queued() == 2
        emptied = time.monotonic()
        queue.remove("w", "deregistered")
        with pytest.raises(WorkerPoolError, match="no live workers"):
            await submitted
        assert time.monotonic() - emptied >= _SHORT_TIMEOUT_S, "submit's wait was counted from its arrival"
        await leased.task
        assert isinstance(leased.failed[0], WorkerPoolError)
        assert leased.ended - emptied >= _SHORT_TIMEOUT_S, "the lease's wait was counted from its arrival"

    _run(scenario())


def test_a_worker_registering_in_time_serves_waiting_requests():
    async def scenario() -> None:
        queue = _queue()
        task = _submit(queue, "late")
        await _until(lambda: queue.queued() == 1, "the request to wait for a worker")
        assert not task.done()
        _workers(queue, "late")
        assert await task == ("late", "late")

    _run(scenario())


def test_a_request_that_loses_too_many_workers_fails_with_the_list():
    async def scenario() -> None:
        queue = _queue(max_retries_per_request=1)
        workers = _workers(queue, "w0", "w1", "w2")
        for worker in workers:
            worker.kill()
        with pytest.raises(WorkerPoolError, match=r"generation-registry: work lost 2 workers mid-request \(w0, w1\)"):
            await _submit(queue, "x")
        assert sorted(queue.workers) == ["w2"]
        assert queue.redispatched_requests == 1
        assert all((w.inflight_requests, w.inflight_cost) == (0, 0) for w in workers)

    _run(scenario())


def test_worker_errors_propagate_without_removing_the_worker():
    async def scenario() -> None:
        queue = _queue()
        (worker,) = _workers(queue, "erring")
        with pytest.raises(ValueError, match="bad request"):
            await _submit(queue, _BAD_TAG)
        assert sorted(queue.workers) == ["erring"]
        assert "bad request" in worker.last_error and worker.healthy
        assert _loads(worker) == (0, 0, 0)
        with pytest.raises(ValueError, match="submit cost must be >= 1"):
            await _submit(queue, "free", cost=0)

    _run(scenario())


def test_an_unhealthy_worker_comes_last_but_still_serves():
    async def scenario() -> None:
        queue = _queue(max_cost_per_worker=2)
        healthy, sick = _workers(queue, "b-healthy", "a-sick", held=True)
        sick.healthy = False
        queue.touch(sick)
        tasks = [_submit(queue, i) for i in range(3)]
        await _until(lambda: len(healthy.calls) + len(sick.calls) == 3, "all three at workers")
        assert (healthy.calls, sick.calls) == ([0, 1], [2]), "the unhealthy worker was not last in line"
        healthy.open_gate()
        sick.open_gate()
        await asyncio.gather(*tasks)

    _run(scenario())


def test_removing_a_replaced_worker_keeps_its_namesake():
    queue = _queue()
    old = _Worker(name="w")
    queue.add(old)
    new = _Worker(name="w")
    queue.add(new)  # re-registered: the old record may still be failed over by a late answer
    queue.remove("w", "died", only=old)
    assert queue.workers == {"w": new}
    queue.remove("w", "deregistered")
    assert queue.workers == {}


# --- LeaseBook: the batched path ----------------------------------------------------------------


class _Caller:
    """Reads one lease call's stream the way BatchedRegistryClient does, recording each chunk."""

    def __init__(self, book: LeaseBook[_Worker], call_id: str, costs: list[int]) -> None:
        self.call_id = call_id
        self.chunks: list[list[BatchOutcome]] = []
        self.assigned: dict[int, str] = {}
        """Where each request was last sent (index -> worker name)."""
        self.failed: dict[int, Exception] = {}
        self.ended = 0.0
        """time.monotonic() when the stream ended."""
        self.task = asyncio.ensure_future(self._read(book.lease(call_id, "work", costs)))

    async def _read(self, stream: Any) -> None:
        async for chunk in stream:
            self.chunks.append(chunk)
            for index, ok, value in chunk:
                if ok:
                    self.assigned[index] = value
                else:
                    self.failed[index] = value
        self.ended = time.monotonic()

    def on(self, name: str) -> list[int]:
        return sorted(i for i, worker in self.assigned.items() if worker == name)


def _book(**limits: Any) -> tuple[CapacityQueue[_Worker], LeaseBook[_Worker]]:
    queue = _queue(**limits)
    return queue, LeaseBook(queue)


def _report(book: LeaseBook[_Worker], caller: _Caller, indices: list[int], verdict: str, detail: str = "") -> None:
    book.release({caller.call_id: [(i, verdict, detail) for i in indices]})


def test_a_batch_goes_least_loaded_in_one_chunk():
    async def scenario() -> None:
        queue, book = _book()
        a, b = _workers(queue, "a", "b")
        caller = _Caller(book, "call-0", [10, 1, 1, 1, 1])
        await _until(lambda: len(caller.assigned) == 5, "all five assigned")
        assert len(caller.chunks) == 1, "the batch's assignments did not travel together"
        big, other = (a, b) if caller.assigned[0] == "a" else (b, a)
        assert (caller.on(big.name), caller.on(other.name)) == ([0], [1, 2, 3, 4]), \
            "cost-1 requests went to the worker carrying cost 10"
        assert (big.inflight_cost, other.inflight_cost) == (10, 4)
        _report(book, caller, [0, 1, 2, 3, 4], SERVED)
        await caller.task  # every request decided: the stream ends
        assert sorted(_loads(w) for w in (a, b)) == [(0, 0, 1), (0, 0, 4)]

    _run(scenario())


def test_a_batch_waits_at_the_cap_and_is_served_as_capacity_frees():
    async def scenario() -> None:
        queue, book = _book(max_cost_per_worker=2)
        (worker,) = _workers(queue, "capped")
        caller = _Caller(book, "call-0", [1] * 5)
        await _until(lambda: len(caller.assigned) == 2, "two requests assigned")
        assert queue.queued() == 3 and not caller.task.done()
        reported: set[int] = set()
        peak = 0
        while len(reported) < 5:  # the worker answers one request at a time, as capacity frees
            await _until(lambda: len(caller.assigned) > len(reported), "the next assignment")
            peak = max(peak, len(caller.assigned) - len(reported))
            index = min(set(caller.assigned) - reported)
            _report(book, caller, [index], SERVED)
            reported.add(index)
        await caller.task
        assert peak == 2
        assert sorted(caller.assigned) == list(range(5)) and caller.failed == {}
        assert sum(len(chunk) for chunk in caller.chunks) == 5, "a request was assigned twice"
        assert _loads(worker) == (0, 0, 5)

    _run(scenario())


def test_a_batch_on_a_worker_killed_mid_batch_completes_on_the_other():
    async def scenario() -> None:
        queue, book = _book()
        doomed, survivor = _workers(queue, "doomed", "survivor")
        caller = _Caller(book, "call-0", [1] * 8)
        await _until(lambda: len(caller.assigned) == 8, "all eight assigned")
        held = caller.on("doomed")
        assert len(held) == 4
        _report(book, caller, caller.on("survivor"), SERVED)
        _report(book, caller, held, DIED, "actor died")
        await _until(lambda: caller.on("survivor") == list(range(8)), "the failed-over requests reassigned")
        assert sorted(i for i, _, _ in caller.chunks[-1]) == held, "the failed-over requests did not travel together"
        assert sorted(queue.workers) == ["survivor"]
        assert queue.redispatched_requests == 4
        _report(book, caller, held, SERVED)
        await caller.task
        assert _loads(survivor) == (0, 0, 8) and (doomed.inflight_requests, doomed.inflight_cost) == (0, 0)

    _run(scenario())


def test_batched_requests_on_a_failed_worker_wait_for_a_new_one():
    async def scenario() -> None:
        queue, book = _book()
        _workers(queue, "broken")
        caller = _Caller(book, "call-0", [1, 1])
        await _until(lambda: len(caller.assigned) == 2, "both assigned")
        _report(book, caller, [0, 1], DIED, "broken FAILED: engine died")
        assert queue.workers == {} and queue.queued() == 2
        _workers(queue, "healthy")
        await _until(lambda: caller.on("healthy") == [0, 1], "both reassigned to the new worker")
        assert queue.redispatched_requests == 2
        _report(book, caller, [0, 1], SERVED)
        await caller.task

    _run(scenario())


def test_batched_requests_without_workers_fail_with_an_error_naming_the_registry():
    async def scenario() -> None:
        queue, book = _book(no_worker_timeout_s=_SHORT_TIMEOUT_S)
        started = time.monotonic()
        caller = _Caller(book, "call-0", [1, 1, 1])
        await caller.task
        assert time.monotonic() - started >= _SHORT_TIMEOUT_S, "the queue gave up before waiting for a worker"
        assert sorted(caller.failed) == [0, 1, 2] and caller.assigned == {}
        assert all(isinstance(e, WorkerPoolError) for e in caller.failed.values())
        assert all(f"generation-registry: no live workers for {_SHORT_TIMEOUT_S} s" in str(e)
                   for e in caller.failed.values())
        assert queue.queued() == 0

    _run(scenario())


def test_a_batched_request_error_stays_its_own():
    async def scenario() -> None:
        queue, book = _book()
        (worker,) = _workers(queue, "erring")
        caller = _Caller(book, "call-0", [1, 1, 1])
        await _until(lambda: len(caller.assigned) == 3, "all three assigned")
        _report(book, caller, [0, 2], SERVED)
        _report(book, caller, [1], FAILED, "erring: bad request bad")
        await caller.task
        assert sorted(queue.workers) == ["erring"]
        assert "bad request" in worker.last_error and worker.healthy
        assert _loads(worker) == (0, 0, 2)

    _run(scenario())


def test_a_batched_request_that_loses_too_many_workers_fails():
    async def scenario() -> None:
        queue, book = _book(max_retries_per_request=0)
        _workers(queue, "w0", "w1")
        caller = _Caller(book, "call-0", [1])
        await _until(lambda: 0 in caller.assigned, "the request assigned")
        lost = caller.assigned[0]
        _report(book, caller, [0], DIED, "actor died")
        await caller.task
        assert f"generation-registry: work lost 1 workers mid-request ({lost})" in str(caller.failed[0])
        assert queue.redispatched_requests == 0 and sorted(queue.workers) == sorted({"w0", "w1"} - {lost})

    _run(scenario())


def test_cancelling_batched_requests_frees_their_places():
    async def scenario() -> None:
        queue, book = _book(max_cost_per_worker=1)
        (worker,) = _workers(queue, "cancel")
        caller = _Caller(book, "call-0", [1, 1])
        await _until(lambda: caller.assigned == {0: "cancel"}, "the first request assigned")
        assert queue.queued() == 1
        book.cancel("call-0", [1])
        assert queue.queued() == 0
        # A leased request's cost comes back at once when it is cancelled, as with submit.
        book.cancel("call-0", [0])
        assert (worker.inflight_requests, worker.inflight_cost) == (0, 0)
        await caller.task  # both decided: the stream ends
        _report(book, caller, [0], SERVED)  # a late answer on a cancelled request: ignored
        after = _Caller(book, "call-1", [1])
        await _until(lambda: after.assigned == {0: "cancel"}, "the next request assigned")
        _report(book, after, [0], SERVED)
        await after.task
        assert _loads(worker) == (0, 0, 1)

    _run(scenario())


def test_cancelling_a_queued_leased_request_lets_the_ones_behind_it_in():
    async def scenario() -> None:
        queue, book = _book(max_cost_per_worker=2)
        (worker,) = _workers(queue, "w")
        caller = _Caller(book, "call-0", [1, 2, 1])
        await _until(lambda: caller.assigned == {0: "w"}, "the first request assigned")
        assert queue.queued() == 2, "the cheap request overtook the costly one"
        book.cancel("call-0", [1])
        await _until(lambda: caller.assigned == {0: "w", 2: "w"}, "the request behind the cancelled one assigned")
        _report(book, caller, [0, 2], SERVED)
        await caller.task
        assert _loads(worker) == (0, 0, 2)

    _run(scenario())


def test_a_caller_going_away_frees_its_reservations_and_places():
    async def scenario() -> None:
        queue, book = _book(max_cost_per_worker=1)
        (worker,) = _workers(queue, "w")
        caller = _Caller(book, "call-0", [1, 1])
        await _until(lambda: len(caller.assigned) == 1 and queue.queued() == 1, "one assigned, one queued")
        caller.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller.task
        assert queue.queued() == 0 and (worker.inflight_requests, worker.inflight_cost) == (0, 0)
        again = _Caller(book, "call-0", [1])  # the call id is free again
        await _until(lambda: again.assigned == {0: "w"}, "a new call's request assigned")
        again.task.cancel()

    _run(scenario())


def test_leased_and_submitted_requests_share_one_arrival_order():
    async def scenario() -> None:
        queue, book = _book(max_cost_per_worker=1)
        (worker,) = _workers(queue, "w", held=True)
        running = _submit(queue, "running")
        await _until(lambda: worker.calls == ["running"], "the first request to run")
        caller = _Caller(book, "call-0", [1])
        await _until(lambda: queue.queued() == 1, "the leased request to queue")
        later = _submit(queue, "later")
        await _until(lambda: queue.queued() == 2, "the submitted request to queue behind it")
        worker.release("running")
        await running
        await _until(lambda: caller.assigned == {0: "w"}, "the leased request to go first")
        assert queue.queued() == 1 and worker.calls == ["running"]
        _report(book, caller, [0], SERVED)
        worker.open_gate()
        assert await later == ("w", "later")
        await caller.task

    _run(scenario())


def test_bad_lease_calls_are_refused_with_the_registry_name():
    async def scenario() -> None:
        queue, book = _book()
        _workers(queue, "w")
        with pytest.raises(ValueError, match="generation-registry: request cost must be >= 1, got 0"):
            await anext(book.lease("bad-cost", "work", [1, 0]))
        caller = _Caller(book, "call-0", [1])
        await _until(lambda: caller.assigned == {0: "w"}, "the request assigned")
        with pytest.raises(ValueError, match="lease call id 'call-0' is already running"):
            await anext(book.lease("call-0", "work", [1]))
        with pytest.raises(ValueError, match="release_many got verdict 'lost' for request 0"):
            _report(book, caller, [0], "lost")
        caller.task.cancel()

    _run(scenario())
