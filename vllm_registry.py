"""Worker registries: one detached Ray actor per worker kind that routes requests to live workers.

Generation workers and logprob workers each join a pool named after their kind
("generation-registry", "logprob-registry"). The first dispatcher of a kind creates the pool's
registry; every later caller gets the same actor back. Callers never talk to workers directly:

    registry = get_or_create_registry(GENERATION)
    samples = await registry.submit.remote("generate", sample, sampling, cost=sampling.n)
    versions = await registry.broadcast.remote("update_weights", update)

`submit` sends each request to the live worker with the least outstanding cost (sequences or
tokens in flight), waits while every worker is at its cap, and re-sends a request whose worker
died to another one. With no worker alive it waits `no_worker_timeout_s` for one to register,
then raises an error that names the registry, so a caller never hangs silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "async-grpo"
GENERATION = "generation"
LOGPROB = "logprob"
WORKER_KINDS = (GENERATION, LOGPROB)


def _check_kind(kind: str) -> str:
    if kind not in WORKER_KINDS:
        raise ValueError(f"unknown worker kind {kind!r}; expected one of {WORKER_KINDS}")
    return kind


def registry_name(kind: str) -> str:
    """Ray actor name of the registry of one worker kind, e.g. 'generation-registry'."""
    return f"{_check_kind(kind)}-registry"


def worker_actor_name(kind: str, index: int) -> str:
    """Ray actor name of one worker, e.g. 'generation-worker-0' (what `ray list actors` shows)."""
    if index < 0:
        raise ValueError(f"worker index must be >= 0, got {index}")
    return f"{_check_kind(kind)}-worker-{index}"


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

    def __post_init__(self) -> None:
        if self.max_inflight_cost_per_worker < 1:
            raise ValueError(
                f"RegistryConfig.max_inflight_cost_per_worker must be >= 1, got {self.max_inflight_cost_per_worker}"
            )
        for name in ("no_worker_timeout_s", "health_check_interval_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RegistryConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries_per_request < 0:
            raise ValueError(f"RegistryConfig.max_retries_per_request must be >= 0, got {self.max_retries_per_request}")
