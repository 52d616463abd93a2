"""A worker pool's capacity queue: which worker a request goes to, and who waits (plain Python).

Each worker carries the cost of the requests reserved on it (sequences or tokens: the caller's
unit) up to a cap. A request goes to the least-loaded worker with room; requests that find every
worker full wait in arrival order and are handed a worker as capacity frees, so a costly request
is not overtaken forever by cheap ones and a freed slot wakes only the requests it can serve.
With no worker alive a waiting request gives up after `no_worker_timeout_s`. A request whose
worker died is queued again, up to `max_retries_per_request` times.

Everything runs on one asyncio event loop, so the book-keeping between awaits needs no lock.
The registry actor (vllm_registry.Registry) is a thin Ray layer over this class and
lease_book.LeaseBook; tests drive both without Ray:

    queue = CapacityQueue("generation-registry", max_cost_per_worker=4, no_worker_timeout_s=60,
                          max_retries_per_request=3, is_worker_death=lambda err: False)
    queue.add(WorkerLoad(name="w0"))
    answer = await queue.submit("work", cost=1, send=lambda worker: call(worker, ...))
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 500  # keeps status tables and logs readable when a worker dumps a traceback
# The routing heap is rebuilt once it holds this many entries per live worker (each load change
# pushes one; the stale ones are dropped lazily): bounds its memory at a rebuild per ~this many changes.
_HEAP_ENTRIES_PER_WORKER = 8


class WorkerPoolError(RuntimeError):
    """A registry could not serve a request: no live worker in time, or too many workers died."""


def short_error(error: BaseException | str) -> str:
    """The last line of an error's text, cut to _MAX_ERROR_CHARS (status rows, logs, reports)."""
    text = str(error).strip().splitlines()
    return (text[-1] if text else repr(error))[:_MAX_ERROR_CHARS]


@dataclass(slots=True)
class WorkerLoad:
    """A worker's place in the queue: what it carries and what decides its rank (the registry's
    worker record extends it with the actor's handle and reported health)."""

    name: str
    inflight_cost: int = 0
    """Sum of the costs reserved on it and not yet given back."""
    inflight_requests: int = 0
    requests_dispatched: int = 0
    requests_served: int = 0
    healthy: bool = True
    """False after a failed health probe: it still serves, but comes last in the routing order."""
    last_error: str = ""
    stamp: int = 0
    """Bumped on every change of its routing key: only its newest heap entry is current."""


W = TypeVar("W", bound=WorkerLoad)


@dataclass(slots=True, eq=False)
class Waiter(Generic[W]):
    """A request queued for capacity: `submit` awaits `future`, which receives the worker reserved
    for it; a leased request is handed its worker through `on_worker` the moment it gets one."""

    cost: int
    future: asyncio.Future[W] | None = None
    on_worker: Callable[[W], None] | None = None
    gone: bool = False
    """The leased request left the queue (cancelled or timed out)."""

    def waiting(self) -> bool:
        return not self.future.done() if self.future is not None else not self.gone


class CapacityQueue(Generic[W]):
    """The live workers of one pool, their loads, and the requests waiting for capacity."""

    def __init__(self, name: str, *, max_cost_per_worker: int, no_worker_timeout_s: float,
                 max_retries_per_request: int, is_worker_death: Callable[[BaseException], bool]) -> None:
        self.name = name
        """The pool's name, first in every error and log line (the registry's actor name)."""
        self.max_cost_per_worker = max_cost_per_worker
        self.no_worker_timeout_s = no_worker_timeout_s
        self.max_retries_per_request = max_retries_per_request
        self._is_worker_death = is_worker_death
        """Tells an error that means the worker is gone (the request fails over) from the request's own."""
        self.workers: dict[str, W] = {}
        self.empty_since = time.monotonic()
        self.redispatched_requests = 0
        self._waiters: deque[Waiter[W]] = deque()
        self._heap: list[tuple[bool, int, int, str, int, int, W]] = []
        """(not healthy, inflight cost, dispatched, name, sequence, stamp, worker): pick's order, so
        the least-loaded worker is found without a pass over the pool (~20 us per request at 128)."""
        self._sequence = itertools.count()

    def queued(self) -> int:
        """Requests waiting for capacity or for a worker."""
        return sum(w.waiting() for w in self._waiters)

    def add(self, worker: W) -> None:
        """Route requests to `worker` from now on (replacing a namesake); queued ones first."""
        self.workers[worker.name] = worker
        self.touch(worker)
        self.serve()

    def remove(self, name: str, reason: str, only: W | None = None) -> None:
        """Stop routing to the named worker (only `only`, if given, so a re-registered namesake
        survives); what is reserved on it stays reserved until given back."""
        current = self.workers.get(name)
        if current is None or (only is not None and current is not only):
            return
        del self.workers[name]
        if not self.workers:
            self.empty_since = time.monotonic()
        logger.warning("%s: removed %s (%s); %d live", self.name, name, reason, len(self.workers))

    def pick(self, cost: int) -> W | None:
        """The least-loaded worker with room for `cost` (an idle worker always has room).

        Workers whose last health probe failed come last: still used, since a slow health()
        on a busy machine does not mean the worker cannot serve.
        """
        cap = self.max_cost_per_worker
        top = self._least_loaded()
        if top is None or top.inflight_requests == 0 or top.inflight_cost + cost <= cap:
            return top
        # The least-loaded one is full: only an idle or differently-healthy worker may still fit.
        fits = [w for w in self.workers.values() if w.inflight_requests == 0 or w.inflight_cost + cost <= cap]
        if not fits:
            return None
        return min(fits, key=lambda w: (not w.healthy, w.inflight_cost, w.requests_dispatched, w.name))

    def _least_loaded(self) -> W | None:
        """The first live worker in pick's order (the heap's top once stale entries are gone)."""
        heap = self._heap
        while heap:
            worker = heap[0][-1]
            if heap[0][-2] == worker.stamp and self.workers.get(worker.name) is worker:
                return worker
            heapq.heappop(heap)
        return None

    def touch(self, worker: W) -> None:
        """Record a change of the worker's load or health in the routing heap."""
        worker.stamp += 1
        heapq.heappush(self._heap, self._entry(worker))
        if len(self._heap) > _HEAP_ENTRIES_PER_WORKER * (len(self.workers) + 1):
            self._heap = []
            for live in self.workers.values():
                live.stamp += 1
                self._heap.append(self._entry(live))
            heapq.heapify(self._heap)

    def _entry(self, worker: W) -> tuple[bool, int, int, str, int, int, W]:
        return (not worker.healthy, worker.inflight_cost, worker.requests_dispatched, worker.name,
                next(self._sequence), worker.stamp, worker)

    def _reserve(self, worker: W, cost: int) -> W:
        worker.inflight_cost += cost
        worker.inflight_requests += 1
        worker.requests_dispatched += 1
        self.touch(worker)
        return worker

    def release(self, worker: W, cost: int) -> None:
        """Give a reservation back and hand the freed capacity on."""
        self.give_back(worker, cost)
        self.serve()

    def give_back(self, worker: W, cost: int) -> None:
        """Return a reservation's cost to its worker (the caller then serves the queue)."""
        worker.inflight_cost -= cost
        worker.inflight_requests -= 1
        self.touch(worker)

    def join(self, waiter: Waiter[W]) -> None:
        """Queue `waiter` behind every earlier one (the caller then serves the queue)."""
        self._waiters.append(waiter)

    def serve(self) -> None:
        """Hand freed capacity to queued requests, strictly in arrival order."""
        while self._waiters:
            head = self._waiters[0]
            if not head.waiting():  # its request gave up (timeout or cancellation)
                self._waiters.popleft()
                continue
            worker = self.pick(head.cost)
            if worker is None:
                return
            self._waiters.popleft()
            self._reserve(worker, head.cost)
            if head.future is not None:
                head.future.set_result(worker)
            else:
                assert head.on_worker is not None
                head.on_worker(worker)

    def seconds_left(self, arrived: float) -> float:
        """How long a request queued since `arrived` may still wait for a worker to register: the
        pool must have had none for no_worker_timeout_s, counted from when the request arrived or
        the pool emptied, whichever is later."""
        return max(arrived, self.empty_since) + self.no_worker_timeout_s - time.monotonic()

    def no_workers_error(self) -> WorkerPoolError:
        return WorkerPoolError(f"{self.name}: no live workers for {self.no_worker_timeout_s} s")

    async def acquire(self, cost: int) -> W:
        """Reserve `cost` on a worker, queueing for capacity or for a worker to register.

        Raises WorkerPoolError once the pool has had no live worker for `no_worker_timeout_s`
        (seconds_left).
        """
        waiter: Waiter[W] = Waiter(cost=cost, future=asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self.serve()  # served at once unless all are full or others queue ahead
        arrived = time.monotonic()
        try:
            while True:
                # With workers alive the wait is only a periodic look at whether the pool emptied.
                remaining = self.no_worker_timeout_s
                if not self.workers:
                    remaining = self.seconds_left(arrived)
                    if remaining <= 0:
                        raise self.no_workers_error()
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter.future), remaining)
                except asyncio.TimeoutError:
                    continue
        except BaseException:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: Waiter[W]) -> None:
        """Give back what a departing waiter holds; let the requests behind it move up."""
        assert waiter.future is not None
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.future.result(), waiter.cost)
        else:
            waiter.future.cancel()
            self.serve()

    def failed_over(self, worker: W, died_on: list[str], what: str, detail: str) -> WorkerPoolError | None:
        """`worker` died under a request (which had died on `died_on` before): drop the worker and
        count the request's next try; the error to fail it with once it has lost more than
        max_retries_per_request workers, else None."""
        self.remove(worker.name, f"died during {what}: {detail}", only=worker)
        died_on.append(worker.name)
        if len(died_on) > self.max_retries_per_request:
            return WorkerPoolError(f"{self.name}: {what} lost {len(died_on)} workers mid-request ({', '.join(died_on)})")
        self.redispatched_requests += 1
        return None

    async def submit(self, what: str, cost: int, send: Callable[[W], Awaitable[Any]]) -> Any:
        """`send(worker)` to the least-loaded worker with room (queueing as acquire does); send
        it again to another worker if that one dies (is_worker_death). Errors of the request's
        own reach the caller unchanged; `what` names the request in errors and worker status."""
        if cost < 1:
            raise ValueError(f"{self.name}: submit cost must be >= 1, got {cost}")
        died_on: list[str] = []
        while True:
            worker = await self.acquire(cost)
            try:
                result = await send(worker)
            except Exception as err:
                if not self._is_worker_death(err):
                    worker.last_error = f"{what}: {short_error(err)}"
                    raise
                error = self.failed_over(worker, died_on, what, short_error(err))
                if error is not None:
                    raise error from err
                continue
            finally:
                self.release(worker, cost)
            worker.requests_served += 1
            return result
