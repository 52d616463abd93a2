"""`python worker_dispatcher.py status`: every pool's workers, read from the registries by name.

The dispatcher's command line parses `status` and hands the rest here. The command joins the
running cluster, creates no registry, and prints status_table's table with a note for each pool
that is missing, empty or queueing requests; it exits 0 if any registry exists, else 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from async_grpo.config.run_config import flattened, load_config
from async_grpo.config.versions import RAY, check_versions
from async_grpo.config.worker_options import RayConnectionConfig
from async_grpo.runtime.ray_access import join_cluster
from async_grpo.config.actor_names import RAY_NAMESPACE, WORKER_KINDS, registry_name
from async_grpo.launch.status_table import format_status

STATUS_COMMAND = "status"


@dataclass(kw_only=True, frozen=True)
class StatusConfig:
    """`python worker_dispatcher.py status`: print every pool's workers."""

    connection: RayConnectionConfig = flattened(RayConnectionConfig())
    """Which cluster to join and how long to try (worker_options.RayConnectionConfig)."""


def print_status(connection: RayConnectionConfig) -> int:
    """Print every existing registry's workers (creates no registry); 0 if any registry exists."""
    # RAY_ADDRESS wins over connection.ray_address, as in the dispatcher (ray_access.join_cluster).
    join_cluster(connection.ray_address, namespace=RAY_NAMESPACE, timeout_s=connection.connect_timeout_s,
                 log_to_driver=False, temp_dir="")
    rows: list[Any] = []  # vllm_registry.WorkerStatus records
    notes: list[str] = []
    found = 0
    for kind in WORKER_KINDS:
        try:
            registry = ray.get_actor(registry_name(kind), namespace=RAY_NAMESPACE)
        except ValueError:
            notes.append(f"{registry_name(kind)}: not running")
            continue
        found += 1
        kind_rows = ray.get(registry.status.remote())
        if not kind_rows:
            notes.append(f"{registry_name(kind)}: no live workers")
        queued = ray.get(registry.queued_requests.remote())
        if queued:
            notes.append(f"{registry_name(kind)}: {queued} requests queued for capacity")
        rows.extend(kind_rows)
    if rows:
        print(format_status(rows))
    for note in notes:
        print(note)
    return 0 if found else 1


def run_status(args: Sequence[str]) -> int:
    """The command: Ray's version checked, StatusConfig's flags parsed from `args`, the pools
    printed. ClusterJoinError and VersionError reach the caller, which prints them as one line."""
    check_versions((RAY,))
    status = load_config(StatusConfig, list(args), description=StatusConfig.__doc__)
    return print_status(status.connection)
