"""Leases: workers reserved for a caller's batch of requests, which the caller sends itself (plain Python).

A `lease` call (the registry's lease_many) queues each request of a batch in a CapacityQueue,
under the same order, caps and waiting as a single submit, and streams back which worker each
one may go to. The caller sends the requests and reports each answer (`release`): the report
gives the reservation back, and a request whose worker died is queued again. The requests'
arguments and answers never pass through here, so one registry keeps up with many workers
(benchmarks/scale.py). vllm_registry.Registry serves it over Ray; tests drive it directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any, Generic

from async_grpo.routing.capacity_queue import CapacityQueue, W, Waiter

# How long a finished outcome waits for others to travel with it, wherever outcomes stream in
# chunks (a lease's assignments, registry -> caller; a worker's answers, batch_calls.serve_many ->
# caller): each streamed chunk costs an object and a message, whatever its size, and a few
# milliseconds are nothing beside a rollout's seconds.
OUTCOME_COALESCE_S = 0.005

BatchOutcome = tuple[int, bool, Any]
"""(index in the batch, ok, the result when ok else the exception the request raised); in a
lease stream the result is the assigned worker's name."""

SERVED, FAILED, DIED = "served", "failed", "died"
"""A leased request's verdicts in release: answered; raised its own error; its worker died."""

LeaseReport = tuple[int, str, str]
"""(index in the lease call, verdict, short error text or "")."""


@dataclass(slots=True, eq=False)
class _LeaseCall:
    """One lease call: its requests, and its outcomes not yet yielded."""

    method: str
    requests: list["_LeasedRequest"] = field(default_factory=list)
    outcomes: list[BatchOutcome] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when an outcome arrives or a request is decided."""
    undecided: int = 0
    """Requests not yet served, failed or cancelled."""
    queued: int = 0
    """Requests waiting in the queue for a worker (those with a waiter)."""

    def publish(self, outcome: BatchOutcome) -> None:
        self.outcomes.append(outcome)
        self.ready.set()


@dataclass(slots=True, eq=False)
class _LeasedRequest:
    """One request of a lease call, from arrival until it is decided."""

    call: _LeaseCall
    index: int
    """Position in its lease call (what its outcomes and reports name)."""
    cost: int
    arrived: float = 0.0
    """time.monotonic() when it (last) joined the queue: no_worker_timeout_s counts from here."""
    waiter: Waiter[Any] | None = None
    """Its place in the queue while it waits for a worker."""
    slot: Any = None
    """The worker reserved for it until its caller reports back."""
    died_on: list[str] = field(default_factory=list)
    done: bool = False
    """Served, failed or cancelled: its reservation is back and it gets no more outcomes."""

    def leave_queue(self) -> None:
        assert self.waiter is not None
        self.waiter = None
        self.call.queued -= 1

    def assign(self, worker: Any) -> None:
        """It holds a reservation on `worker`: tell its caller which worker to send it to."""
        self.leave_queue()
        self.slot = worker
        self.call.publish((self.index, True, worker.name))

    def decide(self) -> None:
        self.done = True
        self.call.undecided -= 1
        self.call.ready.set()


class LeaseBook(Generic[W]):
    """The running lease calls over one CapacityQueue, by their callers' call ids."""

    def __init__(self, queue: CapacityQueue[W]) -> None:
        self._queue = queue
        self._calls: dict[str, _LeaseCall] = {}

    async def lease(self, call_id: str, method: str, costs: list[int]) -> AsyncIterator[list[BatchOutcome]]:
        """Reserve a worker for each of a caller's requests; the caller sends them itself.

        Yields chunks of (index, True, worker name) as workers are assigned, in the queue's order
        and under its caps, or (index, False, WorkerPoolError) for a request that cannot be
        placed (no live worker for no_worker_timeout_s, or more than max_retries_per_request
        workers lost under it). A reservation holds until the caller reports the request in
        `release` (or cancels it in `cancel`); a request reported DIED is queued again and its
        next assignment follows in this stream. The stream ends when every request is decided.
        `call_id` (unique per call, the caller's) names the call to release and cancel;
        `method` only names the requests in errors and worker status.
        """
        name = self._queue.name
        if any(cost < 1 for cost in costs):
            raise ValueError(f"{name}: request cost must be >= 1, got {min(costs)}")
        if call_id in self._calls:
            raise ValueError(f"{name}: lease call id {call_id!r} is already running")
        call = _LeaseCall(method=method)
        call.requests = [_LeasedRequest(call=call, index=i, cost=c) for i, c in enumerate(costs)]
        call.undecided = len(call.requests)
        self._calls[call_id] = call
        for request in call.requests:
            self._enqueue(request)
        self._queue.serve()
        try:
            while call.undecided or call.outcomes:
                chunk = await self._next_outcomes(call)
                if chunk:
                    yield chunk
        finally:
            # The caller went away (or the call is over): stop holding queue places and slots.
            del self._calls[call_id]
            for request in call.requests:
                self._cancel_request(request)

    def release(self, reports: dict[str, list[LeaseReport]]) -> None:
        """The caller's reports on leased requests its workers answered, by lease call id: each
        gives its reservation back. SERVED and FAILED (the request's own error, which the caller
        keeps) decide the request; DIED (the worker died under it) drops that worker and queues
        the request again, up to max_retries_per_request. Reports on requests already decided or
        cancelled are ignored."""
        for call_id, call_reports in reports.items():
            call = self._calls.get(call_id)
            if call is not None:  # else the call is over: its reservations were freed when it ended
                self._take_reports(call, call_reports)
        self._queue.serve()

    def _take_reports(self, call: _LeaseCall, reports: list[LeaseReport]) -> None:
        for index, verdict, detail in reports:
            request = call.requests[index]
            slot = request.slot
            if request.done or slot is None:
                continue
            request.slot = None
            self._queue.give_back(slot, request.cost)
            if verdict == SERVED:
                slot.requests_served += 1
                request.decide()
            elif verdict == FAILED:
                slot.last_error = f"{call.method}: {detail}"
                request.decide()
            elif verdict == DIED:
                self._failed_over(request, slot, detail)
            else:
                raise ValueError(f"{self._queue.name}: release_many got verdict {verdict!r} for request {index}")

    def _failed_over(self, request: _LeasedRequest, slot: W, detail: str) -> None:
        """The request's worker died under it: drop the worker, queue the request again (or fail it)."""
        error = self._queue.failed_over(slot, request.died_on, request.call.method, detail)
        if error is not None:
            self._fail(request, error)
            return
        self._enqueue(request)

    def cancel(self, call_id: str, indices: Collection[int]) -> None:
        """Cancel requests of a running lease call: queued ones leave the queue, leased ones give
        their reservation back at once (the worker finishes them; the caller drops the answers)."""
        call = self._calls.get(call_id)
        if call is None:  # already over
            return
        for index in indices:
            self._cancel_request(call.requests[index])

    def _enqueue(self, request: _LeasedRequest) -> None:
        """Queue a leased request behind every earlier one (the caller then serves the queue)."""
        request.arrived = time.monotonic()
        request.waiter = Waiter(cost=request.cost, on_worker=request.assign)
        request.call.queued += 1
        self._queue.join(request.waiter)

    @staticmethod
    def _fail(request: _LeasedRequest, error: Exception) -> None:
        request.call.publish((request.index, False, error))
        request.decide()

    def _cancel_request(self, request: _LeasedRequest) -> None:
        """Take a leased request out of the queue or give back its reservation; it is decided."""
        if request.done:
            return
        request.decide()
        if request.waiter is not None:
            request.waiter.gone = True
            request.leave_queue()
            self._queue.serve()  # the requests behind it may fit now
        elif request.slot is not None:
            slot, request.slot = request.slot, None
            self._queue.release(slot, request.cost)

    async def _next_outcomes(self, call: _LeaseCall) -> list[BatchOutcome]:
        """The call's next outcomes (empty once every request is decided), failing its queued
        requests once the pool has had no live worker for no_worker_timeout_s (counted as in
        CapacityQueue.acquire)."""
        while not call.outcomes and call.undecided:
            # With workers alive the wait is only a periodic look at whether the pool emptied.
            remaining = self._queue.no_worker_timeout_s
            if not self._queue.workers:
                remaining = self._expire_queued(call)
                if call.outcomes:
                    break
            call.ready.clear()
            try:
                await asyncio.wait_for(call.ready.wait(), remaining)
            except asyncio.TimeoutError:
                continue
        if call.queued:
            # Requests still queue for capacity: the reservations that free up over the next
            # moment travel together (each streamed chunk costs an object and a message).
            await asyncio.sleep(OUTCOME_COALESCE_S)
        chunk, call.outcomes = call.outcomes, []
        return chunk

    def _expire_queued(self, call: _LeaseCall) -> float:
        """Fail the call's queued requests whose wait for a worker is over; seconds until the next
        one's is (no_worker_timeout_s when none waits)."""
        next_expiry = self._queue.no_worker_timeout_s
        if not call.queued:
            return next_expiry
        for request in call.requests:
            if request.waiter is None or request.done:
                continue
            left = self._queue.seconds_left(request.arrived)
            if left > 0:
                next_expiry = min(next_expiry, left)
                continue
            request.waiter.gone = True
            request.leave_queue()
            self._fail(request, self._queue.no_workers_error())
        return next_expiry
