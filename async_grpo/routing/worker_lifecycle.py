"""A worker's lifecycle: its states, the record it keeps of them, and what health() reports.

INIT (loading, self-check, weight catch-up) -> READY (registered; the registry sends requests)
-> RUNNING (has served one) -> FINISH (shut down cleanly), or FAILED from any state (engine
died, weight update failed; never serves again). Both worker kinds embed a WorkerLifecycle;
the registry reads the WorkerHealth their health() builds from it.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass, field

from async_grpo.routing.batch_calls import WorkerFailedError

logger = logging.getLogger(__name__)


class WorkerState(str, enum.Enum):
    """Where a worker is in its life. Only READY and RUNNING workers get requests."""

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
