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

The routing (caps, least-loaded choice, the FIFO queue, timeouts, failover) is plain Python in
capacity_queue.py and lease_book.py; the batched call path's two ends (BatchedRegistryClient,
serve_many) are in batch_calls.py. This module adds what needs Ray: the workers' actors.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.actor import ActorHandle

from async_grpo.config.worker_options import HealthCheckConfig
from async_grpo.config.actor_names import ON_HEAD_NODE, RAY_NAMESPACE, check_kind, registry_name
from async_grpo.launch.ray_env import actor_runtime_env
from async_grpo.routing.batch_calls import BatchedRegistryClient, Bundle, WorkerFailedError, is_worker_death, serve_many
from async_grpo.routing.capacity_queue import CapacityQueue, WorkerLoad, WorkerPoolError, short_error
from async_grpo.routing.lease_book import BatchOutcome, LeaseBook, LeaseReport
from async_grpo.routing.worker_lifecycle import SERVING_STATES, WorkerHealth, WorkerLifecycle, WorkerState

# Workers, the batcher and tests import these from here; the lifecycle names and the last five are
# defined in the modules above.
__all__ = [
    "Registry", "RegistryActor", "RegistryConfig", "SERVING_STATES", "WorkerHealth", "WorkerLifecycle", "WorkerState",
    "WorkerStatus", "get_or_create_registry",
    "BatchedRegistryClient", "Bundle", "WorkerFailedError", "WorkerPoolError", "serve_many",
]

logger = logging.getLogger(__name__)

# Enough concurrent calls for every in-flight and queued request of a large pool plus health
# checks; the registry only awaits, so idle concurrency slots cost nothing.
REGISTRY_MAX_CONCURRENCY = 10_000
# Allocations between the garbage collector's youngest-generation passes in a registry process
# (Python's default: 700). Thousands of request records in flight survive into the old
# generations, and the full passes over them cost ~25% of the registry's CPU per batched
# request at the default (benchmarks/scale.py); they hold no reference cycles worth collecting early.
_REGISTRY_GC_THRESHOLD = 100_000


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


# A registry routes requests: a worker that cannot answer health() within 10 s is dropped from
# routing (its dispatcher, which only logs a slow answer, waits 60 s by default).
REGISTRY_HEALTH_CHECK = HealthCheckConfig(health_timeout_s=10.0)


@dataclass(kw_only=True, frozen=True)
class RegistryConfig:
    """Routing, waiting and health-check limits of one registry."""

    max_inflight_cost_per_worker: int = 1024
    """Most outstanding cost one worker may carry; a request waits while every worker is full.
    Cost units are the caller's: sequences for generation (sampling n), tokens for logprobs. A
    request costlier than the cap is still sent to an idle worker, so it can never wait forever."""
    no_worker_timeout_s: float = 60.0
    """How long `submit` waits for a worker to register when none is alive before it raises."""
    health: HealthCheckConfig = field(default_factory=lambda: REGISTRY_HEALTH_CHECK)
    """Background health checks that drop dead workers (worker_options.HealthCheckConfig)."""
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
        for name in ("no_worker_timeout_s", "weight_update_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RegistryConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries_per_request < 0:
            raise ValueError(f"RegistryConfig.max_retries_per_request must be >= 0, got {self.max_retries_per_request}")


def _is_lost_object(error: BaseException) -> bool:
    """The weights' objects are gone (their owner, a trainer rank, exited)."""
    return isinstance(error, ray.exceptions.ObjectLostError) or isinstance(
        getattr(error, "cause", None), ray.exceptions.ObjectLostError)


async def _await_ref(ref: Any) -> Any:
    return await ref


@dataclass(slots=True, kw_only=True)
class _WorkerSlot(WorkerLoad):
    """The registry's record of one registered worker: its load (WorkerLoad) plus its actor and
    what its last health probe reported."""

    handle: Any
    node_id: str
    weight_version: int
    gpu_ids: str = ""
    state: str = ""
    uptime_s: float = 0.0
    requests_failed: int = 0


class Registry:
    """Routes requests over the live workers of one kind (plain class; `RegistryActor` wraps it).

    The routing itself (caps, least-loaded choice, the FIFO queue, timeouts, failover) is a
    CapacityQueue and its LeaseBook; this class adds what needs the workers' actors: registration
    with the weight catch-up, calls, weight publishing, health checks and status.
    """

    def __init__(self, kind: str, config: RegistryConfig) -> None:
        self.kind = check_kind(kind)
        self.name = registry_name(kind)
        self.config = config
        self._queue: CapacityQueue[_WorkerSlot] = CapacityQueue(
            self.name, max_cost_per_worker=config.max_inflight_cost_per_worker,
            no_worker_timeout_s=config.no_worker_timeout_s, max_retries_per_request=config.max_retries_per_request,
            is_worker_death=is_worker_death)
        self._leases = LeaseBook(self._queue)
        self._workers = self._queue.workers
        """The live workers by name (the queue's own dict: register adds through the queue)."""
        self._next_index = 0
        self._latest_update: Any = None  # the last published update.WeightUpdate

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
        return self._queue.queued()

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
            await asyncio.wait_for(_await_ref(handle.mark_ready.remote()), self.config.health.health_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as err:
            raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: mark_ready failed: {short_error(err)}") from err
        if self._latest_update is not None and version < self._latest_update.version:
            # A publish landed during mark_ready's round trip: catch up once more. Between this
            # check and the insertion below nothing awaits, so every later publish includes it.
            version = await self._catch_up(worker_name, handle, version)
        self._queue.add(_WorkerSlot(name=worker_name, handle=handle, node_id=health.node_id, gpu_ids=health.gpu_ids,
                                    weight_version=version))  # queued requests may go to it at once
        logger.info("%s: registered %s on node %s at weight version %d (%d live)", self.name, worker_name,
                    health.node_id, version, len(self._workers))
        return version

    async def _health_for_registration(self, worker_name: str, handle: Any) -> WorkerHealth:
        try:
            health = await asyncio.wait_for(_await_ref(handle.health.remote()), self.config.health.health_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as err:
            raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: health() failed: {short_error(err)}") from err
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
                what = "timed out" if isinstance(err, asyncio.TimeoutError) else f"failed: {short_error(err)}"
                raise WorkerPoolError(f"{self.name}: cannot register {worker_name}: loading the published weights "
                                      f"v{update.version} {what}") from err
            logger.info("%s: %s caught up to published weights v%d", self.name, worker_name, version)
        return version

    async def deregister(self, worker_name: str) -> None:
        """Stop routing to the worker; requests already sent to it finish or fail over there."""
        self._drop(worker_name, None, "deregistered")

    def _drop(self, worker_name: str, slot: _WorkerSlot | None, reason: str) -> None:
        """Remove the worker (only `slot`, if given, so a re-registered namesake survives)."""
        self._queue.remove(worker_name, reason, only=slot)

    def counters(self) -> dict[str, int]:
        """Cumulative counts since the registry started."""
        return {"redispatched_requests": self._queue.redispatched_requests}

    async def submit(self, method: str, *args: Any, cost: int = 1) -> Any:
        """Call `method(*args)` on the least-loaded live worker; re-send it if that worker dies.

        `cost` is the request's load in the pool's unit (generation: sequences, i.e. sampling n;
        logprobs: tokens). Errors raised by the worker's method reach the caller unchanged.
        """
        return await self._queue.submit(method, cost, lambda slot: getattr(slot.handle, method).remote(*args))

    def lease_many(self, call_id: str, method: str, costs: list[int]) -> AsyncIterator[list[BatchOutcome]]:
        """Reserve a worker for each of a caller's requests; the caller sends them itself
        (LeaseBook.lease: the assignments stream back; release_many and cancel_many name the call)."""
        return self._leases.lease(call_id, method, costs)

    def release_many(self, reports: dict[str, list[LeaseReport]]) -> None:
        """The caller's reports on leased requests its workers answered (LeaseBook.release)."""
        self._leases.release(reports)

    def cancel_many(self, call_id: str, indices: Collection[int]) -> None:
        """Cancel requests of a running lease_many call (LeaseBook.cancel)."""
        self._leases.cancel(call_id, indices)

    def worker_handles(self, names: Collection[str]) -> dict[str, Any]:
        """The actor handles of the named live workers (leases name them; callers cache these)."""
        return {name: self._workers[name].handle for name in names if name in self._workers}

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
                self._drop(slot.name, slot, f"died during {method}: {short_error(outcome)}")
            else:
                slot.last_error = f"{method}: {short_error(outcome)}"
                failed.append(f"{slot.name}: {slot.last_error}")
        if failed:
            raise WorkerPoolError(f"{self.name}: broadcast {method} failed on {'; '.join(failed)}")
        return results

    async def publish(self, update: Any) -> dict[str, int]:
        """Make `update` (an update.WeightUpdate) the latest published weights and load it on
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
                self._drop(slot.name, slot, f"died during update_weights v{update.version}: {short_error(outcome)}")
                continue
            why = (f"did not apply v{update.version} within {timeout} s" if isinstance(outcome, asyncio.TimeoutError)
                   else f"update_weights v{update.version} failed: {short_error(outcome)}")
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
            self._queue.touch(slot)  # its health decides its place in the routing order

    async def _probe_health(self, slot: _WorkerSlot) -> None:
        timeout = self.config.health.health_timeout_s
        try:
            health: WorkerHealth = await asyncio.wait_for(_await_ref(slot.handle.health.remote()), timeout)
        except asyncio.TimeoutError:
            slot.healthy, slot.last_error = False, f"health() did not answer within {timeout} s"
            return
        except Exception as err:
            slot.healthy, slot.last_error = False, f"health: {short_error(err)}"
            if is_worker_death(err):
                self._drop(slot.name, slot, f"health check: {short_error(err)}")
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
            await asyncio.sleep(self.config.health.health_check_interval_s)
            await asyncio.gather(*(self._probe(s) for s in list(self._workers.values())))


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
