"""The batched call path: a caller sends its requests to leased workers, a worker answers them as a stream.

`BatchedRegistryClient` (the experience batcher's) asks the registry for workers for a batch of
requests in one `lease_many` call, sends each worker its share in one `call_many` call
(BATCH_METHOD), and reports the answers back in `release_many`. `serve_many` is a worker actor's
`call_many`: it runs the requests at once and streams their outcomes back. `Bundle` carries the
arguments and the outcomes in one piece; `is_worker_death` tells a dead or FAILED worker (the
request is assigned another one) from a request's own error (the caller gets it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle

from async_grpo.routing.capacity_queue import short_error
from async_grpo.routing.lease_book import DIED, FAILED, OUTCOME_COALESCE_S, SERVED, BatchOutcome, LeaseReport

logger = logging.getLogger(__name__)

BATCH_METHOD = "call_many"
"""The worker actor method a registry client sends its leased requests to: (method, list of
argument tuples), a streaming generator of BatchOutcome chunks (serve_many implements it)."""


@dataclass(slots=True)
class Bundle:
    """A list that crosses an actor call in one piece (requests' arguments, a chunk of outcomes).

    Ray serialises a plain list item by item (msgpack, each non-builtin item pickled on its own);
    a Bundle is pickled in one go, which cost 10.5 instead of 14 us per Sample on this machine.
    """

    items: list[Any]


class WorkerFailedError(RuntimeError):
    """Raised by a worker method when the worker itself is broken (its engine died, a weight
    update failed): the registry fails the request over like an actor death (is_worker_death)."""


# Ray wraps an exception raised *inside* a worker method in RayTaskError, which may also subclass
# the cause's type; only errors about the worker actor itself mean the worker is gone.
def is_worker_death(error: BaseException) -> bool:
    """True when `error` says the actor is dead or unreachable, or that the worker declared itself
    FAILED (WorkerFailedError, e.g. its engine died): not merely that its method raised."""
    if isinstance(error, WorkerFailedError) or isinstance(getattr(error, "cause", None), WorkerFailedError):
        return True
    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(error, ray.exceptions.RayTaskError)


async def serve_many(target: Any, allowed: Collection[str], method: str, calls: Bundle) -> AsyncIterator[Bundle]:
    """A worker actor's BATCH_METHOD: run `target.method(*args)` for every args in `calls` at once
    and yield an empty Bundle (started), then the outcomes (BatchOutcome) in Bundles as they
    finish (whatever finished within OUTCOME_COALESCE_S of the first).

    Only methods in `allowed` run. A request's error is its outcome, not the batch's: the caller
    reports the requests that raised WorkerFailedError as DIED (the registry assigns them another
    worker) and hands the others their error. When the caller goes away the requests still running
    are cancelled.
    """
    if method not in allowed:
        raise ValueError(f"{BATCH_METHOD}: {method!r} is not one of {sorted(allowed)}")
    function = getattr(target, method)
    finished: list[BatchOutcome] = []
    ready = asyncio.Event()

    async def run(index: int, args: tuple[Any, ...]) -> None:
        try:
            outcome: BatchOutcome = (index, True, await function(*args))
        except Exception as err:  # the request's own failure: its outcome
            logger.warning("%s request %d failed: %s: %s", method, index, type(err).__name__, short_error(err))
            outcome = (index, False, err)
        finished.append(outcome)
        ready.set()

    tasks = [asyncio.create_task(run(i, tuple(args))) for i, args in enumerate(calls.items)]
    try:
        yield Bundle([])  # started: the caller sends this worker's next batch from now on
        left = len(tasks)
        while left:
            await ready.wait()
            if len(finished) < left:
                await asyncio.sleep(OUTCOME_COALESCE_S)
            chunk, finished[:] = list(finished), []
            ready.clear()
            left -= len(chunk)
            yield Bundle(chunk)
    finally:
        for task in tasks:
            task.cancel()


@dataclass(slots=True, eq=False)
class _ClientRequest:
    """A request in BatchedRegistryClient: queued, then leased, then sent, then answered."""

    args: tuple[Any, ...]
    cost: int
    future: asyncio.Future[Any]
    call_id: str = ""
    """The lease_many call it went out in ('' until sent)."""
    index: int = -1
    """Its position in that call."""


class BatchedRegistryClient:
    """`RequestClient` over a registry actor handle: leases workers for every request made in one
    turn of the event loop in one `lease_many` call, sends each worker its requests in one
    `call_many` call, and reports the answers of one loop turn back in one `release_many` call.

    The batcher starts a rank's prompts together, so a step's requests cost the registry three
    actor calls instead of two each, and their arguments and answers travel between this process
    and the workers only (one call per request capped a registry near 650 requests/s; relaying
    payloads through it, near 6,500 with 128 workers; benchmarks/scale.py). Answers come back as
    they finish, so packing starts on the first finished prompts. A request whose worker dies is
    assigned another one by the registry. Bound to the event loop of its first request.
    """

    def __init__(self, handle: ActorHandle) -> None:
        self._handle = handle
        self._queued: dict[str, list[_ClientRequest]] = {}
        """Requests not sent yet, per method."""
        self._cancelled: dict[str, list[int]] = {}
        """Indices to cancel_many per call id, not sent yet."""
        self._reports: dict[str, list[LeaseReport]] = {}
        """Answers to report in release_many per call id, not sent yet."""
        self._workers: dict[str, Any] = {}
        """Worker actor handles by name (from the registry's worker_handles)."""
        self._outbox: dict[tuple[str, str], list[_ClientRequest]] = {}
        """Requests for a worker whose last batch it has not started yet, per (worker, method)."""
        self._sending: set[tuple[str, str]] = set()
        """(worker, method) pairs with a batch sent and not yet started."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._flush_scheduled = False
        self._next_call = 0
        self._client_id = uuid.uuid4().hex

    async def submit(self, method: str, *args: Any, cost: int) -> Any:
        request = _ClientRequest(args=args, cost=cost, future=asyncio.get_running_loop().create_future())
        self._queued.setdefault(method, []).append(request)
        self._schedule_flush()
        try:
            return await request.future
        except asyncio.CancelledError:
            # The prompt hit its deadline or its step failed: free its place or worker in the
            # registry too (a request not sent yet is simply not sent; a worker already running
            # it finishes and its answer is dropped).
            if request.call_id:
                self._cancelled.setdefault(request.call_id, []).append(request.index)
                self._schedule_flush()
            raise

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send what this loop turn produced: cancellations, reports, new lease calls."""
        self._flush_scheduled = False
        cancelled, self._cancelled = self._cancelled, {}
        for call_id, indices in cancelled.items():
            self._handle.cancel_many.remote(call_id, indices)
        if self._reports:
            reports, self._reports = self._reports, {}
            self._handle.release_many.remote(reports)
        queued, self._queued = self._queued, {}
        for method, requests in queued.items():
            live = [r for r in requests if not r.future.done()]  # cancelled before it was sent
            if not live:
                continue
            call_id = f"{self._client_id}-{self._next_call}"
            self._next_call += 1
            for index, request in enumerate(live):
                request.call_id, request.index = call_id, index
            self._start(self._lease(call_id, method, live))

    def _start(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lease(self, call_id: str, method: str, requests: list[_ClientRequest]) -> None:
        """Send each request to the worker the registry assigns it, as assignments stream in."""
        try:
            stream = self._handle.lease_many.options(num_returns="streaming").remote(
                call_id, method, [r.cost for r in requests])
            async for ref in stream:
                by_worker: dict[str, list[_ClientRequest]] = {}
                for index, ok, value in (await ref).items:
                    request = requests[index]
                    if request.future.done():  # cancelled by its caller: the registry knows
                        continue
                    if ok:
                        by_worker.setdefault(value, []).append(request)
                    else:
                        request.future.set_exception(value)
                if by_worker:
                    await self._learn_handles(by_worker)
                for name, batch in by_worker.items():
                    self._send(method, name, batch)
        except Exception as err:  # the registry call itself failed: every request still waiting fails with it
            for request in requests:
                if not request.future.done():
                    request.future.set_exception(err)
        for request in requests:
            if not request.future.done():
                request.future.set_exception(RuntimeError(
                    f"lease_many {call_id} ended without an answer for request {request.index} ({method})"))

    async def _learn_handles(self, by_worker: dict[str, list[_ClientRequest]]) -> None:
        unknown = [name for name in by_worker if name not in self._workers]
        if unknown:
            self._workers.update(await self._handle.worker_handles.remote(unknown))

    def _send(self, method: str, name: str, requests: list[_ClientRequest]) -> None:
        """Send a worker its requests, unless it has not yet started the last batch sent to it:
        then they wait and go with the next one. So calls per worker adapt to load (one per batch
        when batches are sparse, one per round trip when they crowd in), which matters when a
        batch spreads over many workers (with 128 workers, a few requests each)."""
        key = (name, method)
        if key in self._sending:
            self._outbox.setdefault(key, []).extend(requests)
            return
        self._sending.add(key)
        self._start(self._run_on_worker(method, name, requests))

    def _started(self, key: tuple[str, str]) -> None:
        """The worker started (or never will start) the batch sent under `key`: send what waits."""
        self._sending.discard(key)
        waiting = self._outbox.pop(key, None)
        if waiting:
            live = [r for r in waiting if not r.future.done()]  # cancelled meanwhile: the registry knows
            if live:
                self._send(key[1], key[0], live)

    async def _run_on_worker(self, method: str, name: str, requests: list[_ClientRequest]) -> None:
        """One worker batch: settle each request as its answer streams back (serve_many's first,
        empty chunk says the worker has started the batch)."""
        pending = dict(enumerate(requests))
        started = False
        try:
            handle = self._workers.get(name)
            if handle is None:
                raise WorkerFailedError(f"{name} left the registry before its requests were sent")
            stream = getattr(handle, BATCH_METHOD).options(num_returns="streaming").remote(
                method, Bundle([r.args for r in requests]))
            async for ref in stream:
                chunk = (await ref).items
                if not started:
                    started = True
                    self._started((name, method))
                for position, ok, value in chunk:
                    self._settle(name, pending.pop(position), ok, value)
            if pending:
                raise RuntimeError(f"{name}: {BATCH_METHOD} ended with {len(pending)} requests unanswered")
        except Exception as err:  # the batch call itself failed: each request still waiting shares the cause
            for request in pending.values():
                self._settle(name, request, False, err)
        finally:
            if not started:
                self._started((name, method))

    def _settle(self, name: str, request: _ClientRequest, ok: bool, value: Any) -> None:
        """Queue the report that gives the worker's reservation back (sent before the caller
        runs on), then hand the caller its answer, unless its worker died: the registry then
        assigns the request again."""
        if ok:
            verdict, detail = SERVED, ""
        else:
            verdict, detail = (DIED if is_worker_death(value) else FAILED), short_error(value)
        self._reports.setdefault(request.call_id, []).append((request.index, verdict, detail))
        self._schedule_flush()
        if verdict == DIED:
            self._workers.pop(name, None)
        elif not request.future.done():
            if ok:
                request.future.set_result(value)
            else:
                request.future.set_exception(value)
