"""The local cluster a benchmark runs its trainers on: one it starts (LocalCluster, the recorded
commands), or one already running that it attaches to (`--attach <Ray address>`).

Attaching lets several runs share one cluster's start (a Ray head and a vLLM engine: ~50 CPU-s
and ~30 s on 2 cores): tests/system/test_benchmarks_smoke.py starts one cluster for the smokes
that need the same workers. The attached cluster is used as it is: this process checks that it has
the workers the benchmark's LocalClusterConfig asks for, launches its trainers on them, and leaves
them running when it ends.

    with local_cluster(cluster_config, config.attach) as cluster:
        run_trainer(cluster, args, run_dir)
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

from async_grpo.launch.local_processes import make_run_temp_dir
from async_grpo.runtime.processes import environ
from async_grpo.runtime.ray_access import join_cluster
from async_grpo.config.actor_names import RAY_NAMESPACE, registry_name
from local_cluster import LocalCluster, LocalClusterConfig

ATTACH_TIMEOUT_S = 30.0  # joining a running head on this machine takes ~1 s


@dataclass(kw_only=True, frozen=True)
class AttachConfig:
    """`--attach`, the flag of every benchmark that can run on a running cluster (embedded with
    run_config.flattened)."""

    attach: str = ""
    """Ray address of a running local cluster to run on instead of starting one: it must have the
    workers this benchmark's own cluster would start (checked before any trainer starts); '' starts
    a cluster."""


def missing_workers(wanted: dict[str, int]) -> list[str]:
    """'<n> <kind>' for each kind the connected cluster has fewer healthy workers of than `wanted`."""
    import ray

    missing = []
    for kind, count in wanted.items():
        if count == 0:
            continue
        try:
            registry = ray.get_actor(registry_name(kind), namespace=RAY_NAMESPACE)
            healthy = sum(status.healthy for status in ray.get(registry.status.remote()))
        except ValueError:  # no registry of that kind: no worker of it ever registered
            healthy = 0
        if healthy < count:
            missing.append(f"{count - healthy} {kind}")
    return missing


class AttachedCluster(LocalCluster):
    """LocalCluster's trainer launches on a cluster another process started and owns: nothing is
    started or stopped here but this process's connection and its trainers' temporary folder."""

    def __init__(self, config: LocalClusterConfig, address: str) -> None:
        super().__init__(config)
        self._attach_to = address

    def __enter__(self) -> "AttachedCluster":
        with environ({"RAY_ADDRESS": self._attach_to}):  # join_cluster prefers RAY_ADDRESS: make it this one
            self.address = join_cluster(self._attach_to, namespace=RAY_NAMESPACE, timeout_s=ATTACH_TIMEOUT_S,
                                        log_to_driver=False)
        missing = missing_workers(self.config.worker_counts)
        if missing:
            self._disconnect()
            raise RuntimeError(f"the cluster at {self._attach_to} lacks workers this run needs: {', '.join(missing)} "
                               f"(attach to a cluster started with them, or leave --attach out to start one)")
        self.temp_dir = make_run_temp_dir()
        return self

    def start_workers(self) -> None:
        raise RuntimeError("an attached cluster's workers are its owner's to start")

    def __exit__(self, *exc_info) -> None:
        self._disconnect()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    @staticmethod
    def _disconnect() -> None:
        import ray

        ray.shutdown()


@contextlib.contextmanager
def local_cluster(config: LocalClusterConfig, attach: str = "") -> Iterator[LocalCluster]:
    """A LocalCluster with its workers started (stopped when the block ends); with `attach`, the
    running cluster at that Ray address instead, checked for the workers `config` asks for."""
    if attach:
        with AttachedCluster(config, attach) as attached:
            yield attached
        return
    with LocalCluster(config) as cluster:
        cluster.start_workers()
        yield cluster
