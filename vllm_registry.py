"""Worker registries: one detached Ray actor per worker kind that routes requests to live workers.

Generation workers and logprob workers each join a pool named after their kind
("generation-registry", "logprob-registry"). The first dispatcher of a kind creates the pool's
registry; every later caller gets the same actor back. Callers never talk to workers directly:

    registry = get_or_create_registry(GENERATION)
    samples = await registry.submit.remote("generate", sample, sampling, cost=sampling.n)
    versions = await registry.publish.remote(update)          # weights: every worker, and every later joiner

`submit` sends each request to the live worker with the least outstanding cost (sequences or
tokens in flight), waits while every worker is at its cap, and re-sends a request whose worker
died to another one. With no worker alive it waits `no_worker_timeout_s` for one to register,
then raises an error that names the registry, so a caller never hangs silently.

`lease_many` is the batched path (the experience batcher's, through `BatchedRegistryClient`):
the caller asks for workers for a list of requests in one actor call and is streamed the worker
each request may go to, under the same order, caps and waiting as `submit`; it sends the
requests itself, those given one worker together in one `call_many` call (a streaming generator
on the worker, `serve_many`), and reports each answer back (`release_many`), so a dead worker's
requests are assigned again. Arguments and answers never pass through the registry. One actor
call per request caps a registry near 650 requests/s on the 2-core machine; relaying batches
through it cost 45 (8 workers) to 155 (128 workers) us of its CPU per request; leasing costs
less (benchmarks/scale.py, RESULTS.md).
"""

from __future__ import annotations

import asyncio
import enum
import gc
import heapq
import itertools
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.actor import ActorHandle

from ray_env import ON_HEAD_NODE, RAY_NAMESPACE, actor_runtime_env, check_kind, registry_name

logger = logging.getLogger(__name__)

# Enough concurrent calls for every in-flight and queued request of a large pool plus health
# checks; the registry only awaits, so idle concurrency slots cost nothing.
REGISTRY_MAX_CONCURRENCY = 10_000
_MAX_ERROR_CHARS = 500  # keeps status tables and logs readable when a worker dumps a traceback
# Allocations between the garbage collector's youngest-generation passes in a registry process
# (Python's default: 700). Thousands of request records in flight survive into the old
# generations, and the full passes over them cost ~25% of the registry's CPU per batched
# request at the default (benchmarks/scale.py); they hold no reference cycles worth collecting early.
_REGISTRY_GC_THRESHOLD = 100_000
# The routing heap is rebuilt once it holds this many entries per live worker (each load change
# pushes one; the stale ones are dropped lazily): bounds its memory at a rebuild per ~this many changes.
_HEAP_ENTRIES_PER_WORKER = 8

# How long a finished outcome waits for others to travel with it (registry -> caller and
# worker -> registry): each streamed chunk costs an object and a message, whatever its size, and
# a few milliseconds are nothing beside a rollout's seconds.
OUTCOME_COALESCE_S = 0.005

BATCH_METHOD = "call_many"
"""The worker actor method a registry client sends its leased requests to: (method, list of
argument tuples), a streaming generator of BatchOutcome chunks (serve_many implements it)."""

BatchOutcome = tuple[int, bool, Any]
"""(index in the batch, ok, the result when ok else the exception the request raised); in a
lease stream the result is the assigned worker's name."""

SERVED, FAILED, DIED = "served", "failed", "died"
"""A leased request's verdicts in release_many: answered; raised its own error; its worker died."""

LeaseReport = tuple[int, str, str]
"""(index in the lease_many call, verdict, short error text or "")."""


@dataclass(slots=True)
class Bundle:
    """A list that crosses an actor call in one piece (requests' arguments, a chunk of outcomes).

    Ray serialises a plain list item by item (msgpack, each non-builtin item pickled on its own);
    a Bundle is pickled in one go, which cost 10.5 instead of 14 us per Sample on this machine.
    """

    items: list[Any]


class WorkerState(str, enum.Enum):
    """Where a worker is in its life (seed 003). Only READY and RUNNING workers get requests."""

    INIT = "INIT"
    """Constructed: loading its model, running its self-check, catching up on weights."""
    READY = "READY"
    """Self-check passed and the latest published weights loaded; no request served yet."""
    RUNNING = "RUNNING"
    """Has served at least one request."""
    FINISH = "FINISH"
    """Shut down cleanly."""
    FAILED = "FAILED"
    """Self-check, engine or weight update failed (WorkerHealth.detail says why); never serves again."""


SERVING_STATES = (WorkerState.READY, WorkerState.RUNNING)


class WorkerFailedError(RuntimeError):
    """Raised by a worker method when the worker itself is broken (its engine died, a weight
    update failed): the registry fails the request over like an actor death (is_worker_death)."""


@dataclass(slots=True)
class WorkerLifecycle:
    """A worker's state and counters, kept by the worker (plain; both worker kinds embed one)."""

    worker_name: str
    state: WorkerState = WorkerState.INIT
    reason: str = ""
    """Why the worker FAILED ('' otherwise)."""
    self_checked: bool = False
    """The canary request passed (start())."""
    started_at: float = field(default_factory=time.monotonic)
    requests_served: int = 0
    requests_failed: int = 0

    def passed_self_check(self) -> None:
        self.self_checked = True

    def mark_ready(self) -> None:
        """INIT -> READY once the self-check passed (the registry calls it after the weight catch-up)."""
        self.require_alive()
        if not self.self_checked:
            raise WorkerFailedError(f"{self.worker_name}: cannot become READY before its self-check passed")
        if self.state == WorkerState.INIT:
            self.state = WorkerState.READY
            logger.info("%s: READY", self.worker_name)

    def served(self) -> None:
        self.requests_served += 1
        if self.state == WorkerState.READY:
            self.state = WorkerState.RUNNING

    def request_failed(self) -> None:
        self.requests_failed += 1

    def fail(self, reason: str) -> WorkerFailedError:
        """Enter FAILED (first reason kept); returns the error to raise."""
        if self.state != WorkerState.FAILED:
            self.state, self.reason = WorkerState.FAILED, reason
            logger.error("%s: FAILED: %s", self.worker_name, reason)
        return WorkerFailedError(f"{self.worker_name} FAILED: {self.reason}")

    def finish(self) -> None:
        if self.state != WorkerState.FAILED:
            self.state = WorkerState.FINISH

    def require_alive(self) -> None:
        """Raise WorkerFailedError if FAILED: a failed worker answers nothing but health()."""
        if self.state == WorkerState.FAILED:
            raise WorkerFailedError(f"{self.worker_name} FAILED: {self.reason}")

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at


@dataclass(slots=True)
class WorkerHealth:
    """What a worker's `health()` reports about itself."""

    name: str
    """Ray actor name of the worker, e.g. 'generation-worker-0'."""
    kind: str
    """GENERATION or LOGPROB."""
    node_id: str
    """Ray node id (hex) the worker runs on."""
    weight_version: int
    """Weight version the worker currently serves (-1: initial checkpoint)."""
    inflight_requests: int
    """Requests the worker is processing right now."""
    healthy: bool
    """False when the worker cannot serve requests (engine not started or failed)."""
    detail: str = ""
    """Free-text reason when unhealthy, or a short note."""
    state: WorkerState = WorkerState.READY
    """Lifecycle state; `healthy` is False outside READY / RUNNING."""
    uptime_s: float = 0.0
    """Seconds since the worker was constructed."""
    requests_served: int = 0
    """Requests the worker answered."""
    requests_failed: int = 0
    """Requests that raised inside the worker."""
    gpu_ids: str = ""
    """The worker's CUDA_VISIBLE_DEVICES: the GPUs Ray granted it ('' on CPU)."""

    @classmethod
    def of(cls, life: WorkerLifecycle, *, kind: str, node_id: str, weight_version: int, inflight_requests: int,
           problem: str = "", note: str = "") -> "WorkerHealth":
        """The record for a worker whose lifecycle is `life`; `problem` (engine gone, ...) makes it unhealthy."""
        serving = life.state in SERVING_STATES and not problem
        detail = life.reason if life.state == WorkerState.FAILED else (problem or note)
        return cls(
            name=life.worker_name, kind=kind, node_id=node_id, weight_version=weight_version,
            inflight_requests=inflight_requests, healthy=serving, detail=detail, state=life.state,
            uptime_s=life.uptime_s, requests_served=life.requests_served, requests_failed=life.requests_failed,
            gpu_ids=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        )


@dataclass(slots=True)
class WorkerStatus:
    """One row of a registry's `status()`: the registry's view of a worker plus its own health."""

    kind: str
    """GENERATION or LOGPROB."""
    name: str
    """Ray actor name of the worker."""
    node_id: str
    """Ray node id (hex) the worker runs on."""
    inflight_cost: int
    """Sum of the costs of requests the registry has sent and not yet seen answered."""
    inflight_requests: int
    """Number of requests the registry has sent and not yet seen answered."""
    requests_served: int
    """Requests this worker has answered successfully since it registered."""
    weight_version: int
    """Weight version the worker reported (-1 when it did not answer)."""
    healthy: bool
    """The worker answered `health()` in time and reported itself healthy."""
    last_error: str
    """The most recent error seen from this worker, or '' if none."""
    state: str = ""
    """The worker's lifecycle state (WorkerState value; '' when it did not answer)."""
    uptime_s: float = 0.0
    """Seconds since the worker was constructed."""
    requests_failed: int = 0
    """Requests that raised inside the worker, as it reports them."""
    gpu_ids: str = ""
    """The worker's CUDA_VISIBLE_DEVICES: the GPUs Ray granted it ('' on CPU)."""


@dataclass(kw_only=True, frozen=True)
class RegistryConfig:
    """Routing, waiting and health-check limits of one registry."""

    max_inflight_cost_per_worker: int = 1024
    """Most outstanding cost one worker may carry; a request waits while every worker is full.
    Cost units are the caller's: sequences for generation (sampling n), tokens for logprobs. A
    request costlier than the cap is still sent to an idle worker, so it can never wait forever."""
    no_worker_timeout_s: float = 60.0
    """How long `submit` waits for a worker to register when none is alive before it raises."""
    health_check_interval_s: float = 10.0
    """Seconds between background health checks that drop dead workers."""
    health_timeout_s: float = 10.0
    """How long a worker's `health()` may take before it is reported unhealthy."""
    max_retries_per_request: int = 3
    """How many times one request is re-sent after the worker serving it died."""
    weight_update_timeout_s: float = 600.0
    """How long a worker may take to apply a published weight version (publish, and the catch-up
    of a registering worker). One that misses it is removed and killed, so its dispatcher
    restarts it, rather than left serving old weights."""

    def __post_init__(self) -> None:
        if self.max_inflight_cost_per_worker < 1:
            raise ValueError(
                f"RegistryConfig.max_inflight_cost_per_worker must be >= 1, got {self.max_inflight_cost_per_worker}"
            )
        for name in ("no_worker_timeout_s", "health_check_interval_s", "health_timeout_s", "weight_update_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RegistryConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries_per_request < 0:
            raise ValueError(f"RegistryConfig.max_retries_per_request must be >= 0, got {self.max_retries_per_request}")


class WorkerPoolError(RuntimeError):
    """A registry could not serve a request: no live worker in time, or too many workers died."""


# Ray wraps an exception raised *inside* a worker method in RayTaskError, which may also subclass
# the cause's type; only errors about the worker actor itself mean the worker is gone.
def is_worker_death(error: BaseException) -> bool:
    """True when `error` says the actor is dead or unreachable, or that the worker declared itself
    FAILED (WorkerFailedError, e.g. its engine died): not merely that its method raised."""
    if isinstance(error, WorkerFailedError) or isinstance(getattr(error, "cause", None), WorkerFailedError):
        return True
    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(error, ray.exceptions.RayTaskError)


def _is_lost_object(error: BaseException) -> bool:
    """The weights' objects are gone (their owner, a trainer rank, exited)."""
    return isinstance(error, ray.exceptions.ObjectLostError) or isinstance(
        getattr(error, "cause", None), ray.exceptions.ObjectLostError)


def _short(error: BaseException | str) -> str:
    text = str(error).strip().splitlines()
    return (text[-1] if text else repr(error))[:_MAX_ERROR_CHARS]


async def _await_ref(ref: Any) -> Any:
    return await ref


@dataclass(slots=True)
class _WorkerSlot:
    """The registry's book-keeping for one registered worker."""

    name: str
    handle: Any
    node_id: str
    weight_version: int
    gpu_ids: str = ""
    inflight_cost: int = 0
    inflight_requests: int = 0
    requests_dispatched: int = 0
    requests_served: int = 0
    healthy: bool = True
    last_error: str = ""
    state: str = ""
    uptime_s: float = 0.0
    requests_failed: int = 0
    stamp: int = 0
    """Bumped on every change of its routing key: only its newest heap entry is current."""


@dataclass(slots=True, eq=False)
class _LeaseCall:
    """One lease_many call: its requests, and its outcomes not yet yielded."""

    method: str
    requests: list["_LeasedRequest"] = field(default_factory=list)
    outcomes: list[BatchOutcome] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when an outcome arrives or a request is decided."""
    undecided: int = 0
    """Requests not yet served, failed or cancelled."""


@dataclass(slots=True, eq=False)
class _LeasedRequest:
    """One request of a lease_many call, from arrival until it is decided."""

    call: _LeaseCall
    index: int
    """Position in its lease_many call (what its outcomes and reports name)."""
    cost: int
    arrived: float = 0.0
    """time.monotonic() when it (last) joined the queue: no_worker_timeout_s counts from here."""
    waiter: "_Waiter | None" = None
    """Its place in the queue while it waits for a worker."""
    slot: _WorkerSlot | None = None
    """The worker reserved for it until its caller reports back."""
    died_on: list[str] = field(default_factory=list)
    done: bool = False
    """Served, failed or cancelled: its reservation is back and it gets no more outcomes."""


@dataclass(slots=True, eq=False)
class _Waiter:
    """A request queued for capacity: `submit` awaits `future`, which receives the slot reserved
    for it; a leased request (`request`) is assigned the moment it gets one."""

    cost: int
    future: asyncio.Future | None = None
    request: _LeasedRequest | None = None
    gone: bool = False
    """The leased request left the queue (cancelled or timed out)."""

    def waiting(self) -> bool:
        return not self.future.done() if self.future is not None else not self.gone


class Registry:
    """Routes requests over the live workers of one kind (plain class; `RegistryActor` wraps it).

    Requests that find every worker full queue in arrival order and are handed a worker as
    capacity frees, so a costly request is not overtaken forever by cheap ones and a freed slot
    wakes only the requests it can serve. Everything runs on one event loop: the book-keeping
    between awaits needs no lock.
    """

    def __init__(self, kind: str, config: RegistryConfig) -> None:
        self.kind = check_kind(kind)
        self.name = registry_name(kind)
        self.config = config
        self._workers: dict[str, _WorkerSlot] = {}
        self._waiters: deque[_Waiter] = deque()
        self._empty_since = time.monotonic()
        self._next_index = 0
        self._latest_update: Any = None  # the last published weight_sync.WeightUpdate
        self.redispatched_requests = 0
        self._heap: list[tuple[bool, int, int, str, int, int, _WorkerSlot]] = []
        """(not healthy, inflight cost, dispatched, name, sequence, stamp, slot): _pick's order, so
        the least-loaded worker is found without a pass over the pool (~20 us per request at 128)."""
        self._sequence = itertools.count()
        self._calls: dict[str, _LeaseCall] = {}
        """Running lease_many calls by their caller's id (release_many and cancel_many name them)."""

    def allocate_index(self) -> int:
        """A worker index never handed out before by this registry (names stay unique)."""
        index = self._next_index
        self._next_index += 1
        return index

    def live_workers(self) -> list[str]:
        """Names of the workers requests are routed to."""
        return sorted(self._workers)

    def queued_requests(self) -> int:
        """Requests waiting for capacity or for a worker."""
        return sum(w.waiting() for w in self._waiters)

    async def register(self, worker_name: str) -> int:
        """Add the named worker actor (namespace RAY_NAMESPACE) to the pool; returns its weight version.

        The worker must have passed its self-check (start()). It first loads the latest published
        weights (publish), then becomes READY and starts receiving requests, so a worker that joins
        a running job never serves old weights. Re-registering a pooled worker only refreshes it.
        """
        try:
            handle = ray.get_actor(worker_name, namespace=RAY_NAMESPACE)
        except ValueError as err:
            raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: no such actor in {RAY_NAMESPACE!r}") from err
        health = await self._health_for_registration(worker_name, handle)
        version = await self._catch_up(worker_name, handle, health.weight_version)
        try:
            await asyncio.wait_for(_await_ref(handle.mark_ready.remote()), self.config.health_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as err:
            raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: mark_ready failed: {_short(err)}") from err
        if self._latest_update is not None and version < self._latest_update.version:
            # A publish landed during mark_ready's round trip: catch up once more. Between this
            # check and the insertion below nothing awaits, so every later publish includes it.
            version = await self._catch_up(worker_name, handle, version)
        self._workers[worker_name] = _WorkerSlot(name=worker_name, handle=handle, node_id=health.node_id,
                                                 gpu_ids=health.gpu_ids,
                                                 weight_version=version)
        self._touch(self._workers[worker_name])
        logger.info("%s: registered %s on node %s at weight version %d (%d live)", self.name, worker_name,
                    health.node_id, version, len(self._workers))
        self._serve_waiters()
        return version

    async def _health_for_registration(self, worker_name: str, handle: Any) -> WorkerHealth:
        try:
            health = await asyncio.wait_for(_await_ref(handle.health.remote()), self.config.health_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as err:
            raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: health() failed: {_short(err)}") from err
        if health.kind != self.kind or health.state not in (WorkerState.INIT, *SERVING_STATES):
            raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: kind={health.kind!r} "
                                  f"state={WorkerState(health.state).value} {health.detail}")
        return health

    def _needs(self, version: int) -> Any:
        """The published update a worker at `version` must load first, or None."""
        latest = self._latest_update
        if latest is None or version == latest.version or (version > latest.version and not latest.initial):
            return None
        return latest

    async def _catch_up(self, worker_name: str, handle: Any, version: int) -> int:
        """Load the latest published weights into a registering worker until it holds them."""
        while (update := self._needs(version)) is not None:
            try:
                version = await asyncio.wait_for(_await_ref(handle.update_weights.remote(update)),
                                                 self.config.weight_update_timeout_s)
            except Exception as err:
                if _is_lost_object(err):
                    # The trainer that published it has exited, so no one can load it: forget it.
                    # The worker is unchanged and joins at its own version; the next run's first
                    # push (initial) sets every worker's weights anyway.
                    logger.warning("%s: published weights v%d are gone (their trainer exited); %s joins at v%d",
                                   self.name, update.version, worker_name, version)
                    if self._latest_update is update:
                        self._latest_update = None
                    return version
                what = "timed out" if isinstance(err, asyncio.TimeoutError) else f"failed: {_short(err)}"
                raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: loading the published weights "
                                      f"v{update.version} {what}") from err
            logger.info("%s: %s caught up to published weights v%d", self.name, worker_name, version)
        return version

    async def deregister(self, worker_name: str) -> None:
        """Stop routing to the worker; requests already sent to it finish or fail over there."""
        self._drop(worker_name, None, "deregistered")

    def _drop(self, worker_name: str, slot: _WorkerSlot | None, reason: str) -> None:
        """Remove the worker (only `slot`, if given, so a re-registered namesake survives)."""
        current = self._workers.get(worker_name)
        if current is None or (slot is not None and current is not slot):
            return
        del self._workers[worker_name]
        if not self._workers:
            self._empty_since = time.monotonic()
        logger.warning("%s: removed %s (%s); %d live", self.name, worker_name, reason, len(self._workers))

    def _pick(self, cost: int) -> _WorkerSlot | None:
        """The least-loaded worker with room for `cost` (an idle worker always has room).

        Workers whose last health probe failed come last: still used, since a slow health()
        on a busy machine does not mean the worker cannot serve.
        """
        cap = self.config.max_inflight_cost_per_worker
        top = self._least_loaded()
        if top is None or top.inflight_requests == 0 or top.inflight_cost + cost <= cap:
            return top
        # The least-loaded one is full: only an idle or differently-healthy worker may still fit.
        fits = [s for s in self._workers.values() if s.inflight_requests == 0 or s.inflight_cost + cost <= cap]
        if not fits:
            return None
        return min(fits, key=lambda s: (not s.healthy, s.inflight_cost, s.requests_dispatched, s.name))

    def _least_loaded(self) -> _WorkerSlot | None:
        """The first live worker in _pick's order (the heap's top once stale entries are gone)."""
        heap = self._heap
        while heap:
            slot = heap[0][-1]
            if heap[0][-2] == slot.stamp and self._workers.get(slot.name) is slot:
                return slot
            heapq.heappop(heap)
        return None

    def _touch(self, slot: _WorkerSlot) -> None:
        """Record a change of the worker's load or health in the routing heap."""
        slot.stamp += 1
        heapq.heappush(self._heap, (not slot.healthy, slot.inflight_cost, slot.requests_dispatched, slot.name,
                                    next(self._sequence), slot.stamp, slot))
        if len(self._heap) > _HEAP_ENTRIES_PER_WORKER * (len(self._workers) + 1):
            self._heap = []
            for live in self._workers.values():
                live.stamp += 1
                self._heap.append((not live.healthy, live.inflight_cost, live.requests_dispatched, live.name,
                                   next(self._sequence), live.stamp, live))
            heapq.heapify(self._heap)

    def _reserve(self, slot: _WorkerSlot, cost: int) -> _WorkerSlot:
        slot.inflight_cost += cost
        slot.inflight_requests += 1
        slot.requests_dispatched += 1
        self._touch(slot)
        return slot

    def _release(self, slot: _WorkerSlot, cost: int) -> None:
        self._give_back(slot, cost)
        self._serve_waiters()

    def _give_back(self, slot: _WorkerSlot, cost: int) -> None:
        """Return a reservation's cost to its worker (the caller then serves the queue)."""
        slot.inflight_cost -= cost
        slot.inflight_requests -= 1
        self._touch(slot)

    def _serve_waiters(self) -> None:
        """Hand freed capacity to queued requests, strictly in arrival order."""
        while self._waiters:
            head = self._waiters[0]
            if not head.waiting():  # its request gave up (timeout or cancellation)
                self._waiters.popleft()
                continue
            slot = self._pick(head.cost)
            if slot is None:
                return
            self._waiters.popleft()
            self._reserve(slot, head.cost)
            if head.future is not None:
                head.future.set_result(slot)
            else:
                assert head.request is not None
                self._assign(head.request, slot)

    async def _acquire(self, cost: int) -> _WorkerSlot:
        """Reserve `cost` on a worker, queueing for capacity or for a worker to register.

        Raises WorkerPoolError once the pool has had no live worker for `no_worker_timeout_s`
        counted from when this request arrived or the pool emptied, whichever is later.
        """
        waiter = _Waiter(cost=cost, future=asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._serve_waiters()  # served at once unless all are full or others queue ahead
        arrived = time.monotonic()
        timeout = self.config.no_worker_timeout_s
        try:
            while True:
                # With workers alive the wait is only a periodic look at whether the pool emptied.
                remaining = timeout
                if not self._workers:
                    remaining = max(arrived, self._empty_since) + timeout - time.monotonic()
                    if remaining <= 0:
                        raise WorkerPoolError(f"{self.name}: no live workers for {timeout} s")
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter.future), remaining)
                except asyncio.TimeoutError:
                    continue
        except BaseException:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: _Waiter) -> None:
        """Give back what a departing waiter holds; let the requests behind it move up."""
        assert waiter.future is not None
        if waiter.future.done() and not waiter.future.cancelled():
            self._release(waiter.future.result(), waiter.cost)
        else:
            waiter.future.cancel()
            self._serve_waiters()

    def counters(self) -> dict[str, int]:
        """Cumulative counts since the registry started."""
        return {"redispatched_requests": self.redispatched_requests}

    async def submit(self, method: str, *args: Any, cost: int = 1) -> Any:
        """Call `method(*args)` on the least-loaded live worker; re-send it if that worker dies.

        `cost` is the request's load in the pool's unit (generation: sequences, i.e. sampling n;
        logprobs: tokens). Errors raised by the worker's method reach the caller unchanged.
        """
        if cost < 1:
            raise ValueError(f"{self.name}: submit cost must be >= 1, got {cost}")
        died_on: list[str] = []
        while True:
            slot = await self._acquire(cost)
            try:
                result = await getattr(slot.handle, method).remote(*args)
            except Exception as err:
                if not is_worker_death(err):
                    slot.last_error = f"{method}: {_short(err)}"
                    raise
                died_on.append(slot.name)
                self._drop(slot.name, slot, f"died during {method}: {_short(err)}")
                if len(died_on) > self.config.max_retries_per_request:
                    raise WorkerPoolError(
                        f"{self.name}: {method} lost {len(died_on)} workers mid-request ({', '.join(died_on)})"
                    ) from err
                self.redispatched_requests += 1
                continue
            finally:
                self._release(slot, cost)
            slot.requests_served += 1
            return result

    async def lease_many(self, call_id: str, method: str, costs: list[int]) -> AsyncIterator[list[BatchOutcome]]:
        """Reserve a worker for each of a caller's requests; the caller sends them itself.

        Yields chunks of (index, True, worker name) as workers are assigned, in submit's order
        and under its caps, or (index, False, WorkerPoolError) for a request that cannot be
        placed (no live worker for no_worker_timeout_s, or more than max_retries_per_request
        workers lost under it). A reservation holds until the caller reports the request in
        release_many (or cancels it in cancel_many); a request reported DIED is queued again and
        its next assignment follows in this stream. The stream ends when every request is
        decided. The requests' arguments and answers never pass through the registry: it does
        only the book-keeping, so one registry keeps up with many workers (benchmarks/scale.py).
        `call_id` (unique per call, the caller's) names the call to release_many and cancel_many;
        `method` only names the requests in errors and worker status.
        """
        if any(cost < 1 for cost in costs):
            raise ValueError(f"{self.name}: request cost must be >= 1, got {min(costs)}")
        if call_id in self._calls:
            raise ValueError(f"{self.name}: lease call id {call_id!r} is already running")
        call = _LeaseCall(method=method)
        call.requests = [_LeasedRequest(call=call, index=i, cost=c) for i, c in enumerate(costs)]
        call.undecided = len(call.requests)
        self._calls[call_id] = call
        for request in call.requests:
            self._enqueue(request)
        self._serve_waiters()
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

    def release_many(self, reports: dict[str, list[LeaseReport]]) -> None:
        """The caller's reports on leased requests its workers answered, by lease_many call id:
        each gives its reservation back. SERVED and FAILED (the request's own error, which the caller keeps)
        decide the request; DIED (the worker died under it) drops that worker and queues the
        request again, up to max_retries_per_request. Reports on requests already decided or
        cancelled are ignored."""
        for call_id, call_reports in reports.items():
            call = self._calls.get(call_id)
            if call is not None:  # else the call is over: its reservations were freed when it ended
                self._take_reports(call, call_reports)
        self._serve_waiters()

    def _take_reports(self, call: _LeaseCall, reports: list[LeaseReport]) -> None:
        for index, verdict, detail in reports:
            request = call.requests[index]
            slot = request.slot
            if request.done or slot is None:
                continue
            request.slot = None
            self._give_back(slot, request.cost)
            if verdict == SERVED:
                slot.requests_served += 1
                self._decide(request)
            elif verdict == FAILED:
                slot.last_error = f"{call.method}: {detail}"
                self._decide(request)
            elif verdict == DIED:
                self._failed_over(request, slot, detail)
            else:
                raise ValueError(f"{self.name}: release_many got verdict {verdict!r} for request {index}")

    def _failed_over(self, request: _LeasedRequest, slot: _WorkerSlot, detail: str) -> None:
        """The request's worker died under it: drop the worker, queue the request again (or fail it)."""
        method = request.call.method
        self._drop(slot.name, slot, f"died during {method}: {detail}")
        request.died_on.append(slot.name)
        if len(request.died_on) > self.config.max_retries_per_request:
            self._fail(request, WorkerPoolError(
                f"{self.name}: {method} lost {len(request.died_on)} workers mid-request ({', '.join(request.died_on)})"))
            return
        self.redispatched_requests += 1
        self._enqueue(request)

    def worker_handles(self, names: Collection[str]) -> dict[str, Any]:
        """The actor handles of the named live workers (leases name them; callers cache these)."""
        return {name: self._workers[name].handle for name in names if name in self._workers}

    def cancel_many(self, call_id: str, indices: Collection[int]) -> None:
        """Cancel requests of a running lease_many call: queued ones leave the queue, leased ones
        give their reservation back at once (the worker finishes them; the caller drops the answers)."""
        call = self._calls.get(call_id)
        if call is None:  # already over
            return
        for index in indices:
            self._cancel_request(call.requests[index])

    def _enqueue(self, request: _LeasedRequest) -> None:
        """Queue a leased request behind every earlier one (the caller then serves the queue)."""
        request.arrived = time.monotonic()
        request.waiter = _Waiter(cost=request.cost, request=request)
        self._waiters.append(request.waiter)

    def _assign(self, request: _LeasedRequest, slot: _WorkerSlot) -> None:
        """`request` holds a reservation on `slot`: tell its caller which worker to send it to."""
        request.waiter, request.slot = None, slot
        self._publish_outcome(request.call, (request.index, True, slot.name))

    def _fail(self, request: _LeasedRequest, error: Exception) -> None:
        self._publish_outcome(request.call, (request.index, False, error))
        self._decide(request)

    def _decide(self, request: _LeasedRequest) -> None:
        request.done = True
        request.call.undecided -= 1
        request.call.ready.set()

    @staticmethod
    def _publish_outcome(call: _LeaseCall, outcome: BatchOutcome) -> None:
        call.outcomes.append(outcome)
        call.ready.set()

    def _cancel_request(self, request: _LeasedRequest) -> None:
        """Take a leased request out of the queue or give back its reservation; it is decided."""
        if request.done:
            return
        self._decide(request)
        if request.waiter is not None:
            request.waiter.gone, request.waiter = True, None
            self._serve_waiters()  # the requests behind it may fit now
        elif request.slot is not None:
            slot, request.slot = request.slot, None
            self._release(slot, request.cost)

    async def _next_outcomes(self, call: _LeaseCall) -> list[BatchOutcome]:
        """The call's next outcomes (empty once every request is decided), failing its queued
        requests once the pool has had no live worker for no_worker_timeout_s (counted as in
        _acquire)."""
        while not call.outcomes and call.undecided:
            # With workers alive the wait is only a periodic look at whether the pool emptied.
            remaining = self.config.no_worker_timeout_s
            if not self._workers:
                remaining = self._expire_queued(call)
                if call.outcomes:
                    break
            call.ready.clear()
            try:
                await asyncio.wait_for(call.ready.wait(), remaining)
            except asyncio.TimeoutError:
                continue
        if any(request.waiter is not None for request in call.requests):
            # Requests still queue for capacity: the reservations that free up over the next
            # moment travel together (each streamed chunk costs an object and a message).
            await asyncio.sleep(OUTCOME_COALESCE_S)
        chunk, call.outcomes = call.outcomes, []
        return chunk

    def _expire_queued(self, call: _LeaseCall) -> float:
        """Fail the call's queued requests whose wait for a worker is over; seconds until the next
        one's is (no_worker_timeout_s when none waits)."""
        timeout = self.config.no_worker_timeout_s
        now = time.monotonic()
        next_expiry = timeout
        for request in call.requests:
            if request.waiter is None or request.done:
                continue
            left = max(request.arrived, self._empty_since) + timeout - now
            if left > 0:
                next_expiry = min(next_expiry, left)
                continue
            request.waiter.gone, request.waiter = True, None
            self._fail(request, WorkerPoolError(f"{self.name}: no live workers for {timeout} s"))
        return next_expiry

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        """Call `method(*args)` on every live worker at once; dead workers are removed and skipped."""
        slots = list(self._workers.values())
        outcomes = await asyncio.gather(
            *(_await_ref(getattr(s.handle, method).remote(*args)) for s in slots), return_exceptions=True
        )
        results: dict[str, Any] = {}
        failed: list[str] = []
        for slot, outcome in zip(slots, outcomes):
            if not isinstance(outcome, BaseException):
                results[slot.name] = outcome
            elif is_worker_death(outcome):
                self._drop(slot.name, slot, f"died during {method}: {_short(outcome)}")
            else:
                slot.last_error = f"{method}: {_short(outcome)}"
                failed.append(f"{slot.name}: {slot.last_error}")
        if failed:
            raise WorkerPoolError(f"{self.name}: broadcast {method} failed on {'; '.join(failed)}")
        return results

    async def publish(self, update: Any) -> dict[str, int]:
        """Make `update` (a weight_sync.WeightUpdate) the latest published weights and load it on
        every pooled worker, each within weight_update_timeout_s; returns name -> version served.

        Workers that register later load it before they serve (register). A worker that dies is
        dropped; one that fails or misses the deadline is dropped and killed, so its dispatcher
        restarts it and it rejoins at this version. Raises WorkerPoolError only when every worker
        failed with an error of its own (a bad update, not a bad worker).
        """
        self._latest_update = update
        slots = list(self._workers.values())
        timeout = self.config.weight_update_timeout_s
        outcomes = await asyncio.gather(
            *(asyncio.wait_for(_await_ref(s.handle.update_weights.remote(update)), timeout) for s in slots),
            return_exceptions=True,
        )
        results: dict[str, int] = {}
        errors: list[str] = []
        for slot, outcome in zip(slots, outcomes):
            if not isinstance(outcome, BaseException):
                results[slot.name] = slot.weight_version = int(outcome)
                continue
            if is_worker_death(outcome):
                self._drop(slot.name, slot, f"died during update_weights v{update.version}: {_short(outcome)}")
                continue
            why = (f"did not apply v{update.version} within {timeout} s" if isinstance(outcome, asyncio.TimeoutError)
                   else f"update_weights v{update.version} failed: {_short(outcome)}")
            slot.last_error = why
            errors.append(f"{slot.name}: {why}")
            self._drop(slot.name, slot, why + "; killing it so that its dispatcher restarts it")
            ray.kill(slot.handle, no_restart=True)
        if errors and not results and len(errors) == len(slots):
            raise WorkerPoolError(f"{self.name}: publish v{update.version} failed on every worker: {'; '.join(errors)}")
        return results

    async def _probe(self, slot: _WorkerSlot) -> None:
        """Refresh one worker's health and version; unhealthy if slow or failing, dropped if dead."""
        try:
            await self._probe_health(slot)
        finally:
            self._touch(slot)  # its health decides its place in the routing order

    async def _probe_health(self, slot: _WorkerSlot) -> None:
        timeout = self.config.health_timeout_s
        try:
            health: WorkerHealth = await asyncio.wait_for(_await_ref(slot.handle.health.remote()), timeout)
        except asyncio.TimeoutError:
            slot.healthy, slot.last_error = False, f"health() did not answer within {timeout} s"
            return
        except Exception as err:
            slot.healthy, slot.last_error = False, f"health: {_short(err)}"
            if is_worker_death(err):
                self._drop(slot.name, slot, f"health check: {_short(err)}")
            return
        slot.healthy, slot.weight_version = health.healthy, health.weight_version
        slot.state, slot.uptime_s, slot.requests_failed = WorkerState(health.state).value, health.uptime_s, \
            health.requests_failed
        if not health.healthy:
            slot.last_error = f"unhealthy: {health.detail}"
        if health.state == WorkerState.FAILED:
            self._drop(slot.name, slot, f"FAILED: {health.detail}")

    async def status(self) -> list[WorkerStatus]:
        """Probe every registered worker and report one row each (dead ones once, then dropped)."""
        slots = list(self._workers.values())
        await asyncio.gather(*(self._probe(s) for s in slots))
        return [
            WorkerStatus(
                kind=self.kind,
                name=s.name,
                node_id=s.node_id,
                gpu_ids=s.gpu_ids,
                inflight_cost=s.inflight_cost,
                inflight_requests=s.inflight_requests,
                requests_served=s.requests_served,
                weight_version=s.weight_version,
                healthy=s.healthy,
                last_error=s.last_error,
                state=s.state,
                uptime_s=s.uptime_s,
                requests_failed=s.requests_failed,
            )
            for s in slots
        ]

    async def run_health_checks(self) -> None:
        """Forever: probe all workers every `health_check_interval_s`, dropping dead ones."""
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await asyncio.gather(*(self._probe(s) for s in list(self._workers.values())))


async def serve_many(target: Any, allowed: Collection[str], method: str, calls: Bundle) -> AsyncIterator[Bundle]:
    """A worker actor's BATCH_METHOD: run `target.method(*args)` for every args in `calls` at once
    and yield an empty Bundle (started), then the outcomes (BatchOutcome) in Bundles as they
    finish (whatever finished within OUTCOME_COALESCE_S of the first).

    Only methods in `allowed` run. A request's error is its outcome, not the batch's: the registry
    fails over the requests that raised WorkerFailedError and hands the others their error. When
    the caller goes away the requests still running are cancelled.
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
            logger.warning("%s request %d failed: %s: %s", method, index, type(err).__name__, _short(err))
            outcome = (index, False, err)
        finished.append(outcome)
        ready.set()

    tasks = [asyncio.create_task(run(i, tuple(args))) for i, args in enumerate(calls.items)]
    try:
        yield Bundle([])  # started: the registry sends this worker's next batch from now on
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


@ray.remote
class RegistryActor:
    """Ray shell over `Registry`; runs the periodic health check in its event loop."""

    def __init__(self, kind: str, config: RegistryConfig) -> None:
        gc.freeze()  # what start-up imported lives as long as the process: no pass need scan it
        gc.set_threshold(_REGISTRY_GC_THRESHOLD)
        self._registry = Registry(kind, config)
        # Async actors run __init__ inside their event loop, so the monitor can start here.
        self._monitor = asyncio.get_running_loop().create_task(self._registry.run_health_checks())

    async def get_config(self) -> RegistryConfig:
        return self._registry.config

    async def allocate_index(self) -> int:
        return self._registry.allocate_index()

    async def live_workers(self) -> list[str]:
        return self._registry.live_workers()

    async def queued_requests(self) -> int:
        return self._registry.queued_requests()

    async def register(self, worker_name: str) -> int:
        return await self._registry.register(worker_name)

    async def deregister(self, worker_name: str) -> None:
        await self._registry.deregister(worker_name)

    async def submit(self, method: str, *args: Any, cost: int = 1) -> Any:
        return await self._registry.submit(method, *args, cost=cost)

    async def lease_many(self, call_id: str, method: str, costs: list[int]) -> AsyncIterator[Bundle]:
        """Registry.lease_many over the wire, each chunk of outcomes in a Bundle. Streaming: call
        with `.options(num_returns="streaming")`."""
        async for chunk in self._registry.lease_many(call_id, method, costs):
            yield Bundle(chunk)

    async def release_many(self, reports: dict[str, list[LeaseReport]]) -> None:
        self._registry.release_many(reports)

    async def worker_handles(self, names: list[str]) -> dict[str, Any]:
        return self._registry.worker_handles(names)

    async def cancel_many(self, call_id: str, indices: list[int]) -> None:
        self._registry.cancel_many(call_id, indices)

    async def broadcast(self, method: str, *args: Any) -> dict[str, Any]:
        return await self._registry.broadcast(method, *args)

    async def publish(self, update: Any) -> dict[str, int]:
        return await self._registry.publish(update)

    async def counters(self) -> dict[str, int]:
        return self._registry.counters()

    async def status(self) -> list[WorkerStatus]:
        return await self._registry.status()


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
            verdict, detail = (DIED if is_worker_death(value) else FAILED), _short(value)
        self._reports.setdefault(request.call_id, []).append((request.index, verdict, detail))
        self._schedule_flush()
        if verdict == DIED:
            self._workers.pop(name, None)
        elif not request.future.done():
            if ok:
                request.future.set_result(value)
            else:
                request.future.set_exception(value)

def get_or_create_registry(kind: str, config: RegistryConfig | None = None) -> ActorHandle:
    """The registry actor of `kind`, created (detached, 0 CPUs) if this is the first caller.

    `config` only applies when this call creates the registry; an existing one keeps its own.
    """
    return RegistryActor.options(
        name=registry_name(kind),
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        resources=ON_HEAD_NODE,  # never on a worker node that can be lost mid-run
        max_concurrency=REGISTRY_MAX_CONCURRENCY,
        # A crashed registry comes back under the same name (callers' handles keep working),
        # empty: every dispatcher re-registers its worker at its next health check.
        max_restarts=-1,
        # Detached: it outlives whoever created it, so it carries the repository on its own path.
        runtime_env=actor_runtime_env(),
    ).remote(kind, config if config is not None else RegistryConfig())
