"""The registry actor: registration and weight catch-up, publish, health checks, status, workers
really dying under requests, and the batched path over Ray (lease_many streams, BatchedRegistryClient,
serve_many).

The routing itself (caps, least-loaded choice, arrival order, timeouts, the failover logic) is
tested without Ray against the plain classes in tests/routing/test_capacity_queue.py. The tests here
use `FakeWorker`, a small Ray actor standing in for an inference worker: its `work` calls can be
held behind a gate, so the tests control exactly which requests are in flight (no sleeps decide the
outcome). The integration tests at the end use two real vLLM generation workers on the tiny model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from typing import Any, Awaitable, Callable

import pytest
import ray

from async_grpo.config.worker_options import HealthCheckConfig, VerificationConfig
from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE, registry_name, worker_actor_name
from async_grpo.weights.update import WeightUpdate
from support.generation_worker import engine_core_processes
from vllm_experience_batcher import BatchedRegistryClient
from vllm_registry import (
    Bundle, RegistryConfig, WorkerFailedError, WorkerHealth, WorkerPoolError, WorkerState, get_or_create_registry,
    serve_many,
)

# Upper bound on how long a test waits for something that should happen at once; it keeps a
# broken registry from hanging the suite and is never what decides a pass.
_WAIT_BOUND_S = 60.0
# How long one probe of a restarting actor may take before it is retried.
_PROBE_TIMEOUT_S = 5.0
_BAD_TAG = "bad"  # FakeWorker.work raises ValueError for this tag


@ray.remote(num_cpus=0)
class FakeWorker:
    """Stands in for an inference worker: records calls; when held, each `work` call waits until
    `open_gate()` lets it finish."""

    def __init__(self, name: str, held: bool = False, health_delay_s: float = 0.0, update_delay_s: float = 0.0,
                 failing_update: bool = False, broken: bool = False, fetch: bool = False) -> None:
        self._name = name
        self._gate = asyncio.Event()  # held calls wait here until open_gate()
        if not held:
            self._gate.set()
        self._health_delay_s = health_delay_s
        self._calls: list[Any] = []
        self._active = 0
        self._version = -1
        self._state = WorkerState.INIT
        self._failure = ""
        self._update_delay_s = update_delay_s
        self._failing_update = failing_update
        self._lifecycle: list[str] = []  # "update v3", "ready": the order the registry drove it in
        self._broken = broken  # its engine is dead: `work` enters FAILED and raises WorkerFailedError
        self._fetch = fetch  # update_weights reads the update's objects, as real workers do
        self._batch_sizes: list[int] = []

    async def work(self, tag: Any) -> tuple[str, Any]:
        self._calls.append(tag)
        if self._broken:
            self.fail_with("engine died")
            raise WorkerFailedError(f"{self._name} FAILED: engine died")
        if tag == _BAD_TAG:
            raise ValueError(f"{self._name}: bad request {tag}")
        self._active += 1
        try:
            await self._gate.wait()
        finally:
            self._active -= 1
        return self._name, tag

    async def fail(self) -> None:
        raise ValueError(f"{self._name}: bad request")

    async def call_many(self, method: str, calls: Bundle):
        """The registry's batched path, as the real workers serve it (serve_many)."""
        self._batch_sizes.append(len(calls.items))
        async for chunk in serve_many(self, ("work", "fail"), method, calls):
            yield chunk

    def batch_sizes(self) -> list[int]:
        """Requests per call_many call, in arrival order."""
        return list(self._batch_sizes)

    async def set_version(self, version: int) -> int:
        self._version = version
        return version

    async def update_weights(self, update: WeightUpdate) -> int:
        self._lifecycle.append(f"update v{update.version}")
        if self._fetch:
            await asyncio.gather(*update.shard_refs)
        await asyncio.sleep(self._update_delay_s)
        if self._failing_update:
            raise ValueError(f"{self._name}: cannot load v{update.version}")
        self._version = update.version
        return update.version

    def warm(self, update: WeightUpdate) -> None:
        """Receive a WeightUpdate once: unpickling it imports weights/update.py (and torch), seconds."""

    def mark_ready(self) -> None:
        self._lifecycle.append("ready")
        if self._state == WorkerState.INIT:
            self._state = WorkerState.READY

    def lifecycle(self) -> list[str]:
        return list(self._lifecycle)

    def fail_with(self, reason: str) -> None:
        """Enter FAILED, as a worker whose engine died does: every later call raises WorkerFailedError."""
        self._state, self._failure = WorkerState.FAILED, reason

    def set_health_delay(self, delay_s: float) -> None:
        self._health_delay_s = delay_s

    def open_gate(self) -> None:
        """Let every held call, and every later one, finish."""
        self._gate.set()

    def calls(self) -> list[Any]:
        return list(self._calls)

    async def health(self) -> WorkerHealth:
        await asyncio.sleep(self._health_delay_s)
        node_id = ray.get_runtime_context().get_node_id()
        return WorkerHealth(
            name=self._name, kind=GENERATION, node_id=node_id, weight_version=self._version,
            inflight_requests=self._active, healthy=self._state != WorkerState.FAILED, state=self._state,
            detail=self._failure,
        )


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _WAIT_BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# FakeWorkers started by the current test; make_registry kills them when the test ends.
_started_workers: list[Any] = []


def _start_worker(prefix: str, **options: Any) -> tuple[str, Any]:
    """A named FakeWorker in the project namespace (unique name: tests share one cluster)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    handle = FakeWorker.options(name=name, namespace=RAY_NAMESPACE).remote(name, **options)
    _started_workers.append(handle)
    ray.get(handle.health.remote())
    return name, handle


def _kill_registry() -> None:
    try:
        handle = ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE)
    except ValueError:
        return
    ray.kill(handle)

    def gone() -> bool:
        try:
            ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE)
        except ValueError:
            return True
        return False

    _wait_until(gone, "the killed registry's name to be released")


@pytest.fixture
def make_registry(ray_local):
    """Build the generation registry with a test config; kill it (it is detached) afterwards."""
    _kill_registry()

    def make(**overrides: Any) -> Any:
        return get_or_create_registry(GENERATION, RegistryConfig(**overrides))

    yield make
    _kill_registry()
    while _started_workers:
        ray.kill(_started_workers.pop())


def _register(registry: Any, *names: str) -> None:
    ray.get([registry.register.remote(name) for name in names])


def test_actor_names():
    assert registry_name(GENERATION) == "generation-registry"
    assert registry_name("logprob") == "logprob-registry"
    assert worker_actor_name(GENERATION, 0) == "generation-worker-0"
    with pytest.raises(ValueError, match="unknown worker kind"):
        registry_name("trainer")
    with pytest.raises(ValueError, match="max_inflight_cost_per_worker"):
        RegistryConfig(max_inflight_cost_per_worker=0)


def test_get_if_exists_returns_the_same_actor(make_registry):
    first = make_registry()
    second = get_or_create_registry(GENERATION, RegistryConfig(max_inflight_cost_per_worker=7))
    assert first._actor_id == second._actor_id
    assert ray.get(second.get_config.remote()) == RegistryConfig(), "an existing registry keeps its config"
    assert ray.get(first.allocate_index.remote()) == 0
    assert ray.get(second.allocate_index.remote()) == 1


def test_a_crashed_registry_restarts_empty_under_the_same_handle(make_registry):
    registry = make_registry(max_inflight_cost_per_worker=5)
    name, _ = _start_worker("survivor")
    _register(registry, name)
    crashed = ray.get(registry.__ray_call__.remote(_worker_id))
    ray.kill(registry, no_restart=False)
    # The kill reaches the actor asynchronously: until it lands, the old process still answers
    # calls, and a call it accepted then fails with ActorUnavailableError. So wait for an answer
    # from a new process, not for any answer.
    _wait_until(lambda: _incarnation(registry) not in (None, crashed), "the registry to restart")
    assert ray.get(registry.live_workers.remote()) == []
    assert ray.get(registry.get_config.remote()).max_inflight_cost_per_worker == 5
    _register(registry, name)
    assert ray.get(registry.submit.remote("work", "again"), timeout=_WAIT_BOUND_S) == (name, "again")


# Run on an actor through `__ray_call__`: the Ray worker id of its process, new on each restart.
# A lambda travels by value (the detached registry cannot import this test module).
_worker_id = lambda _actor: ray.get_runtime_context().get_worker_id()  # noqa: E731


def _incarnation(registry: Any) -> str | None:
    """The worker id of the process serving `registry`, or None while it does not answer."""
    try:
        return ray.get(registry.__ray_call__.remote(_worker_id), timeout=_PROBE_TIMEOUT_S)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_requests_on_a_killed_worker_complete_on_the_other(make_registry):
    registry = make_registry()
    (doomed, doomed_worker), (survivor, _) = _start_worker("doomed", held=True), _start_worker("survivor")
    _register(registry, doomed, survivor)
    refs = [registry.submit.remote("work", i) for i in range(8)]
    _wait_until(lambda: len(ray.get(doomed_worker.calls.remote())) > 0, "requests held on the doomed worker")
    ray.kill(doomed_worker)

    results = ray.get(refs, timeout=_WAIT_BOUND_S)
    assert sorted(tag for _, tag in results) == list(range(8))
    assert {worker for worker, _ in results} == {survivor}
    assert ray.get(registry.live_workers.remote()) == [survivor]


def test_worker_errors_propagate_without_removing_the_worker(make_registry):
    registry = make_registry()
    name, _ = _start_worker("erring")
    _register(registry, name)
    with pytest.raises(ValueError, match="bad request"):
        ray.get(registry.submit.remote("fail"))
    assert ray.get(registry.live_workers.remote()) == [name]
    (row,) = ray.get(registry.status.remote())
    assert "bad request" in row.last_error and row.healthy


def test_deregistered_worker_gets_no_requests(make_registry):
    registry = make_registry()
    (a, worker_a), (b, _) = _start_worker("a"), _start_worker("b")
    _register(registry, a, b)
    ray.get(registry.deregister.remote(a))
    assert ray.get(registry.live_workers.remote()) == [b]
    results = ray.get([registry.submit.remote("work", i) for i in range(4)])
    assert {worker for worker, _ in results} == {b}
    assert ray.get(worker_a.calls.remote()) == []
    assert [row.name for row in ray.get(registry.status.remote())] == [b]


def test_register_unknown_actor_names_the_registry(make_registry):
    registry = make_registry()
    with pytest.raises(WorkerPoolError, match="generation-registry: cannot register no-such-worker"):
        ray.get(registry.register.remote("no-such-worker"))


def test_broadcast_reaches_every_live_worker_and_drops_dead_ones(make_registry):
    registry = make_registry()
    (a, _), (b, worker_b) = _start_worker("a"), _start_worker("b")
    _register(registry, a, b)
    assert ray.get(registry.broadcast.remote("set_version", 5)) == {a: 5, b: 5}
    assert {row.name: row.weight_version for row in ray.get(registry.status.remote())} == {a: 5, b: 5}

    ray.kill(worker_b)
    assert ray.get(registry.broadcast.remote("set_version", 6)) == {a: 6}
    assert ray.get(registry.live_workers.remote()) == [a]
    with pytest.raises(WorkerPoolError, match=f"broadcast fail failed on {a}"):
        ray.get(registry.broadcast.remote("fail"))


def test_status_marks_an_unresponsive_worker_unhealthy(make_registry):
    registry = make_registry(health=HealthCheckConfig(health_timeout_s=1.0, health_check_interval_s=3600.0))
    (fast, _), (slow, slow_worker) = _start_worker("fast"), _start_worker("slow")
    _register(registry, fast, slow)
    ray.get(slow_worker.set_health_delay.remote(3600.0))
    rows = {row.name: row for row in ray.get(registry.status.remote(), timeout=_WAIT_BOUND_S)}
    assert rows[fast].healthy and rows[fast].last_error == ""
    assert not rows[slow].healthy
    assert "health() did not answer within 1.0 s" in rows[slow].last_error
    assert ray.get(registry.live_workers.remote()) == sorted([fast, slow])


def test_periodic_health_check_drops_a_dead_idle_worker(make_registry):
    registry = make_registry(health=HealthCheckConfig(health_check_interval_s=0.2, health_timeout_s=10.0))
    (a, worker_a), (b, _) = _start_worker("a"), _start_worker("b")
    _register(registry, a, b)
    ray.kill(worker_a)
    _wait_until(lambda: ray.get(registry.live_workers.remote()) == [b], "the health check to drop the dead worker")


def _update(version: int, initial: bool = False) -> WeightUpdate:
    return WeightUpdate(version=version, initial=initial)  # no tensors: FakeWorker only reads the version


def test_a_joining_worker_loads_the_published_weights_before_it_is_ready(make_registry):
    registry = make_registry()
    (early, early_worker) = _start_worker("early")
    _register(registry, early)
    assert ray.get(registry.publish.remote(_update(3))) == {early: 3}
    assert ray.get(early_worker.lifecycle.remote()) == ["ready", "update v3"]

    late, late_worker = _start_worker("late")
    assert ray.get(registry.register.remote(late)) == 3
    assert ray.get(late_worker.lifecycle.remote()) == ["update v3", "ready"]  # weights first, then READY
    assert {row.name: (row.weight_version, row.state) for row in ray.get(registry.status.remote())} == {
        early: (3, "READY"), late: (3, "READY")}
    # Requests reach it only now, and it serves v3: nothing it samples would be dropped as stale.
    ray.get(registry.deregister.remote(early))
    assert ray.get(registry.submit.remote("work", "x"), timeout=_WAIT_BOUND_S) == (late, "x")


def test_an_initial_publish_replaces_a_newer_version_and_a_registering_worker_follows(make_registry):
    registry = make_registry()
    ray.get(registry.publish.remote(_update(0, initial=True)))  # a new run restarts the version count
    name, worker = _start_worker("newer")
    ray.get(worker.set_version.remote(7))  # left over from an earlier run
    assert ray.get(registry.register.remote(name)) == 0


@ray.remote(num_cpus=0)
class _WeightOwner:
    """Owns objects as a trainer rank owns its pushed shards: they go when it exits."""

    def put(self) -> list[Any]:
        return [ray.put(b"weights")]


def test_a_worker_joining_after_the_trainer_exited_registers_at_its_own_version(make_registry):
    registry = make_registry()
    owner = _WeightOwner.remote()
    refs = ray.get(owner.put.remote())
    ray.get(registry.publish.remote(WeightUpdate(version=6, shard_refs=refs)))  # no worker yet: nothing fetched
    ray.kill(owner)  # the trainer exits; its objects are lost
    name, worker = _start_worker("late", fetch=True)
    assert ray.get(registry.register.remote(name), timeout=_WAIT_BOUND_S) == -1
    assert ray.get(worker.lifecycle.remote()) == ["update v6", "ready"]
    assert ray.get(registry.live_workers.remote()) == [name]
    other, other_worker = _start_worker("later", fetch=True)  # the lost update is forgotten: no second try
    assert ray.get(registry.register.remote(other), timeout=_WAIT_BOUND_S) == -1
    assert ray.get(other_worker.lifecycle.remote()) == ["ready"]


def test_publish_drops_and_kills_a_worker_that_fails_or_misses_the_deadline(make_registry):
    registry = make_registry(weight_update_timeout_s=5.0)
    (good, good_worker), (bad, bad_worker) = _start_worker("good"), _start_worker("bad", failing_update=True)
    (slow, slow_worker) = _start_worker("slow", update_delay_s=3600.0)
    # So that only the slow worker's own delay can exceed the deadline, not the first import.
    ray.get([w.warm.remote(_update(0)) for w in (good_worker, bad_worker, slow_worker)])
    _register(registry, good, bad, slow)
    assert ray.get(registry.publish.remote(_update(1)), timeout=_WAIT_BOUND_S) == {good: 1}
    assert ray.get(registry.live_workers.remote()) == [good]
    for handle in (bad_worker, slow_worker):  # killed, so their dispatchers restart them
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.health.remote(), timeout=_WAIT_BOUND_S)


def test_publish_fails_loudly_when_every_worker_rejects_the_update(make_registry):
    registry = make_registry()
    (a, _), (b, _) = _start_worker("a", failing_update=True), _start_worker("b", failing_update=True)
    _register(registry, a, b)
    with pytest.raises(WorkerPoolError, match="publish v2 failed on every worker"):
        ray.get(registry.publish.remote(_update(2)), timeout=_WAIT_BOUND_S)


def test_a_registering_worker_that_cannot_load_the_weights_is_refused(make_registry):
    registry = make_registry()
    ray.get(registry.publish.remote(_update(4)))
    name, _ = _start_worker("cannot-load", failing_update=True)
    with pytest.raises(WorkerPoolError, match=f"cannot register {name}: loading the published weights v4 failed"):
        ray.get(registry.register.remote(name))
    assert ray.get(registry.live_workers.remote()) == []


def test_a_failed_worker_is_failed_over_like_a_dead_one_and_counted(make_registry):
    # The worker answers with WorkerFailedError (as a generation worker whose engine died does):
    # the registry drops it and re-sends the request, which a worker registering later serves.
    registry = make_registry(no_worker_timeout_s=_WAIT_BOUND_S)
    (broken, broken_worker), (healthy, _) = _start_worker("broken", broken=True), _start_worker("healthy")
    _register(registry, broken)
    ref = registry.submit.remote("work", "x")
    _wait_until(lambda: ray.get(registry.live_workers.remote()) == [], "the registry to drop the FAILED worker")
    assert ray.get(broken_worker.calls.remote()) == ["x"]
    _register(registry, healthy)
    assert ray.get(ref, timeout=_WAIT_BOUND_S) == (healthy, "x")
    assert ray.get(registry.counters.remote()) == {"redispatched_requests": 1}


def test_health_checks_drop_a_worker_that_reports_failed_and_registration_refuses_it(make_registry):
    registry = make_registry(health=HealthCheckConfig(health_check_interval_s=0.2, health_timeout_s=10.0))
    (a, worker_a), (b, _) = _start_worker("a"), _start_worker("b")
    _register(registry, a, b)
    ray.get(worker_a.fail_with.remote("self-check failed: canary"))
    _wait_until(lambda: ray.get(registry.live_workers.remote()) == [b], "the health check to drop the FAILED worker")
    with pytest.raises(WorkerPoolError, match=f"cannot register {a}: kind='generation' state=FAILED self-check failed"):
        ray.get(registry.register.remote(a))


# --- The batched path: lease_many through BatchedRegistryClient (what the batcher uses) ---------


async def _await_until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + _WAIT_BOUND_S
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _submit_batch(client: BatchedRegistryClient, tags: list[Any], costs: list[int] | None = None) -> list[Any]:
    """One task per request, all started in one loop turn: they leave in one lease_many call."""
    costs = costs or [1] * len(tags)
    return [asyncio.ensure_future(client.submit("work", tag, cost=cost)) for tag, cost in zip(tags, costs)]


def _settled_rows(registry: Any) -> list[Any]:
    """The registry's status once every reservation is back: a caller gets its answer from the
    worker first and reports it to the registry just after (release_many)."""
    _wait_until(lambda: all(r.inflight_requests == 0 for r in ray.get(registry.status.remote())),
                "every answered request to be reported back")
    return ray.get(registry.status.remote())


async def _calls(*workers: Any) -> list[list[Any]]:
    return [await w.calls.remote() for w in workers]


async def _has_calls(count: int, *workers: Any) -> bool:
    """The workers have received `count` requests between them."""
    return sum(len(c) for c in await _calls(*workers)) == count


def _run(scenario: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, 3 * _WAIT_BOUND_S))


def test_a_batch_goes_least_loaded_in_one_call_per_worker(make_registry):
    registry = make_registry()
    (a, worker_a), (b, worker_b) = _start_worker("a", held=True), _start_worker("b", held=True)
    _register(registry, a, b)
    tags = ["big", 0, 1, 2, 3]

    async def scenario() -> list[Any]:
        tasks = _submit_batch(BatchedRegistryClient(registry), tags, costs=[10, 1, 1, 1, 1])
        await _await_until(lambda: _has_calls(5, worker_a, worker_b), "all five requests at the workers")
        calls = dict(zip((a, b), await _calls(worker_a, worker_b)))
        big_worker = a if "big" in calls[a] else b
        other = b if big_worker == a else a
        assert calls[big_worker] == ["big"], "cost-1 requests went to the worker carrying cost 10"
        assert sorted(calls[other]) == [0, 1, 2, 3]
        sizes = {a: await worker_a.batch_sizes.remote(), b: await worker_b.batch_sizes.remote()}
        assert sizes == {big_worker: [1], other: [4]}, "a worker got its share of the batch in more than one call"
        await worker_a.open_gate.remote()
        await worker_b.open_gate.remote()
        results = await asyncio.gather(*tasks)
        assert [tag for _, tag in results] == tags, "a request got another one's answer"
        assert [name for name, _ in results] == [big_worker] + [other] * 4

    _run(scenario())
    rows = _settled_rows(registry)
    assert sorted((r.requests_served, r.inflight_requests, r.inflight_cost) for r in rows) == [(1, 0, 0), (4, 0, 0)]


async def _equals(ref: Any, expected: Any) -> bool:
    return await ref == expected


def test_a_batch_on_a_worker_killed_mid_batch_completes_on_the_other(make_registry):
    registry = make_registry()
    (doomed, doomed_worker), (survivor, survivor_worker) = _start_worker("doomed", held=True), _start_worker("survivor")
    _register(registry, doomed, survivor)

    async def scenario() -> list[Any]:
        tasks = _submit_batch(BatchedRegistryClient(registry), list(range(8)))
        await _await_until(lambda: _has_calls(4, doomed_worker), "half the batch held on the doomed worker")
        held = await doomed_worker.calls.remote()
        ray.kill(doomed_worker)
        results = await asyncio.gather(*tasks)
        assert [tag for _, tag in results] == list(range(8))
        assert {name for name, tag in results if tag in held} == {survivor}
        return held

    held = _run(scenario())
    assert len(held) == 4
    assert ray.get(registry.live_workers.remote()) == [survivor]
    assert ray.get(registry.counters.remote()) == {"redispatched_requests": 4}
    # The four failed-over requests travelled together, in one call.
    assert ray.get(survivor_worker.batch_sizes.remote()) == [4, 4]
    (row,) = _settled_rows(registry)
    assert (row.inflight_requests, row.inflight_cost, row.requests_served) == (0, 0, 8)


def test_batched_requests_on_a_failed_worker_wait_for_a_new_one(make_registry):
    # Each request answers WorkerFailedError (its engine died): dropped, re-sent, served later.
    registry = make_registry(no_worker_timeout_s=_WAIT_BOUND_S)
    (broken, broken_worker), (healthy, _) = _start_worker("broken", broken=True), _start_worker("healthy")
    _register(registry, broken)

    async def scenario() -> list[Any]:
        tasks = _submit_batch(BatchedRegistryClient(registry), ["x", "y"])
        await _await_until(lambda: _equals(registry.live_workers.remote(), []), "the FAILED worker to be dropped")
        await registry.register.remote(healthy)
        return await asyncio.gather(*tasks)

    assert _run(scenario()) == [(healthy, "x"), (healthy, "y")]
    assert sorted(ray.get(broken_worker.calls.remote())) == ["x", "y"]
    assert ray.get(registry.counters.remote()) == {"redispatched_requests": 2}


def test_a_batched_request_error_reaches_only_its_caller(make_registry):
    registry = make_registry()
    name, _ = _start_worker("erring")
    _register(registry, name)

    async def scenario() -> list[Any]:
        tasks = _submit_batch(BatchedRegistryClient(registry), ["ok-1", _BAD_TAG, "ok-2"])
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, bad, last = _run(scenario())
    assert (first, last) == ((name, "ok-1"), (name, "ok-2"))
    assert isinstance(bad, ValueError) and "bad request" in str(bad)
    assert ray.get(registry.live_workers.remote()) == [name]
    (row,) = _settled_rows(registry)
    assert "bad request" in row.last_error and row.healthy and row.requests_served == 2


def test_cancelling_batched_requests_frees_their_places(make_registry):
    registry = make_registry(max_inflight_cost_per_worker=1)
    name, worker = _start_worker("cancel", held=True)
    _register(registry, name)

    async def scenario() -> None:
        client = BatchedRegistryClient(registry)
        running, queued = _submit_batch(client, ["running", "queued"])
        await _await_until(lambda: _equals(registry.queued_requests.remote(), 1), "the second request to queue")
        queued.cancel()
        await _await_until(lambda: _equals(registry.queued_requests.remote(), 0), "the cancelled request to leave")
        # A running request's cost comes back at once when it is cancelled, as with submit.
        running.cancel()
        await _await_until(lambda: _inflight_cost_is(registry, 0), "the cancelled running request's cost back")
        (after,) = _submit_batch(client, ["after"])
        await _await_until(lambda: _has_calls(2, worker), "the next request to reach the worker")
        await worker.open_gate.remote()
        assert await after == (name, "after")

    _run(scenario())
    assert ray.get(worker.calls.remote()) == ["running", "after"]
    (row,) = _settled_rows(registry)
    assert (row.inflight_requests, row.inflight_cost) == (0, 0)


async def _inflight_cost_is(registry: Any, cost: int) -> bool:
    return [row.inflight_cost for row in await registry.status.remote()] == [cost]


def test_serve_many_runs_only_allowed_methods_and_reports_each_outcome():
    class Target:
        async def echo(self, value: int) -> int:
            if value < 0:
                raise ValueError(f"negative {value}")
            return value

        async def shutdown(self) -> None:
            raise AssertionError("must not run")

    async def collect(method: str, calls: list[tuple[Any, ...]]) -> dict[int, tuple[bool, Any]]:
        out: dict[int, tuple[bool, Any]] = {}
        async for chunk in serve_many(Target(), ("echo",), method, Bundle(calls)):
            out.update({i: (ok, value) for i, ok, value in chunk.items})
        return out

    outcomes = asyncio.run(collect("echo", [(1,), (-2,), (3,)]))
    assert {i: ok for i, (ok, _) in outcomes.items()} == {0: True, 1: False, 2: True}
    assert (outcomes[0][1], outcomes[2][1]) == (1, 3) and "negative -2" in str(outcomes[1][1])
    with pytest.raises(ValueError, match="'shutdown' is not one of"):
        asyncio.run(collect("shutdown", [()]))


# Real engines: small enough for CPU (a fixed KV cache avoids the RAM-fraction sizing that fails
# on a busy machine), long enough completions that requests are still running when a worker dies.
_ENGINE_KV_CACHE_BYTES = 64 << 20
_ENGINE_MAX_MODEL_LEN = 256
_ENGINE_START_BOUND_S = 900.0
_ROLLOUTS_PER_PROMPT = 2
_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def real_workers(ray_local, tiny_model_dir):
    """Two GenerationWorkerActors on the tiny model, started together (~1 min each on 2 cores)."""
    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.launch.ray_env import actor_runtime_env
    from vllm_worker import GenerationWorkerActor, GenerationWorkerConfig

    config = GenerationWorkerConfig(
        model_path=str(tiny_model_dir), engine=EngineConfig(
            max_num_seqs=16, gpu_memory_utilization=0.08, kv_cache_memory_bytes=_ENGINE_KV_CACHE_BYTES,
            max_model_len=_ENGINE_MAX_MODEL_LEN, enforce_eager=True, dtype="float32"),
        verification=VerificationConfig(global_num_verifiers=1),
    )
    workers = {}
    for index in range(2):
        name = worker_actor_name(GENERATION, index)
        workers[name] = GenerationWorkerActor.options(
            name=name, namespace=RAY_NAMESPACE, runtime_env=actor_runtime_env()
        ).remote(name, config)
    ray.get([w.start.remote() for w in workers.values()], timeout=_ENGINE_START_BOUND_S)
    yield workers
    for worker in workers.values():
        ray.kill(worker)


def _inflight(worker: Any) -> int:
    return ray.get(worker.health.remote()).inflight_requests


@pytest.mark.vllm
def test_a_real_worker_joining_a_running_job_serves_the_published_weights(make_registry, real_workers,
                                                                          tiny_model_dir):
    """The seen failure: a replacement joined at version -1 and its rollouts were dropped as stale.
    Now registration loads the published version first, so its very first rollouts carry it."""
    from safetensors.torch import load_file

    from async_grpo.config.sampling import SamplingConfig
    from async_grpo.weights.update import state_dict_to_blobs
    from sample_processing_utils import Sample

    registry = make_registry()
    (first, _), (joiner, joiner_worker) = real_workers.items()
    _register(registry, first)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    update = WeightUpdate(version=5, shard_refs=[ray.put(state_dict_to_blobs(weights))])
    assert ray.get(registry.publish.remote(update), timeout=_WAIT_BOUND_S) == {first: 5}

    assert ray.get(registry.register.remote(joiner), timeout=_WAIT_BOUND_S) == 5
    health = ray.get(joiner_worker.health.remote())
    assert (health.weight_version, health.state) == (5, "READY")
    ray.get(registry.deregister.remote(first))  # every request now goes to the joiner
    sampling = SamplingConfig(n=2, max_tokens=4, seed=0)
    rollouts = ray.get(registry.submit.remote("generate", Sample(input_token_ids=[1, 2, 3], gt_answer="1", prompt_id=0),
                                              sampling, cost=sampling.n), timeout=_WAIT_BOUND_S)
    assert [r.weight_version for r in rollouts] == [5, 5]  # within any max_lag of step 5: none stale


@pytest.mark.vllm
def test_real_workers_spread_fail_over_and_report_a_dead_pool(make_registry, real_workers, tiny_model_dir):
    from async_grpo.config.sampling import SamplingConfig
    from sample_processing_utils import Sample
    from setup_model import load_tokenizer

    timeout_s = 5.0
    registry = make_registry(no_worker_timeout_s=timeout_s)
    (first, first_worker), (second, second_worker) = real_workers.items()
    _register(registry, first, second)
    tokenizer = load_tokenizer(tiny_model_dir)
    sampling = SamplingConfig(n=_ROLLOUTS_PER_PROMPT, max_tokens=_MAX_TOKENS, seed=0)

    def submit(count: int) -> list[Any]:
        return [
            registry.submit.remote(
                "generate", Sample(input_token_ids=tokenizer.encode(f"{i}+{i}="), gt_answer=str(2 * i), prompt_id=i),
                sampling, cost=sampling.n,
            )
            for i in range(count)
        ]

    def check(groups: list[list[Any]]) -> None:
        for group in groups:
            assert len(group) == sampling.n and all(s.output_token_ids for s in group)

    check(ray.get(submit(6), timeout=_WAIT_BOUND_S))
    served = {row.name: row.requests_served for row in ray.get(registry.status.remote())}
    assert sum(served.values()) == 6 and min(served.values()) >= 1, served

    # Engine death is worker death: SIGKILL only the first worker's engine-core process. Its
    # requests fail over to the second worker, and the first reports FAILED and leaves the pool.
    refs = submit(6)
    _wait_until(lambda: _inflight(first_worker) > 0, f"requests running on {first}")
    for core in engine_core_processes(first_worker):
        os.kill(core.pid, signal.SIGKILL)
    check(ray.get(refs, timeout=_WAIT_BOUND_S))
    assert ray.get(registry.live_workers.remote()) == [second]
    health = ray.get(first_worker.health.remote())  # the actor itself lives on
    assert health.state == "FAILED" and "engine died" in health.detail and not health.healthy, health
    assert ray.get(registry.counters.remote())["redispatched_requests"] >= 1

    refs = submit(4)
    _wait_until(lambda: _inflight(second_worker) > 0, f"requests running on {second}")
    ray.kill(second_worker)
    for ref in refs:
        with pytest.raises(WorkerPoolError, match=f"generation-registry: no live workers for {timeout_s} s"):
            ray.get(ref, timeout=_WAIT_BOUND_S)
