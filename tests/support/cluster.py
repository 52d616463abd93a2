"""The tests' local cluster (local_cluster.LocalCluster, workers started through
worker_dispatcher.py): one factory for its config, with each module's differences passed in, and
the demo's trainer run on it. Used by the whole-system modules (end-to-end, LoRA end-to-end, the
algorithm options, crash-resume, chaos). The demo cluster (`demo_cluster`) is one such cluster
shared by the modules in SHARED_CLUSTER_MODULES, kept from one to the next.

    @pytest.fixture(scope="module")
    def cluster(demo_assets, tmp_path_factory):
        config = cluster_config(demo_assets / "model", tmp_path_factory.mktemp("worker-logs"))
        with started_cluster(config) as running:
            yield running
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_grpo.config.worker_options import EngineConfig, VerificationConfig
from async_grpo.runtime.host_gpus import host_gpu_count
from async_grpo.launch.placement import default_trainer_ranks
from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE, registry_name
from async_grpo.telemetry.metrics import read_metrics
from local_cluster import LOCAL_ENGINE, LocalCluster, LocalClusterConfig, cuda_available, local_engine
from support.forked_ranks import run_ranks
from support.paths import REPO_ROOT
from support.ray_session import session_ray_set_aside

DEMO_CLUSTER_WORKERS = 4  # generation, logprob, reference, teacher
# Trainer ranks, as the launcher's plan gives them on this host: 2 on a CPU host, 1 on one or two
# GPUs (colocated with the workers on one), a GPU each for the rest of a larger host.
WORLD_SIZE = default_trainer_ranks(host_gpu_count(), DEMO_CLUSTER_WORKERS)
# Small steps keep each run to tens of seconds on 2 cores: 2 ranks x 4 prompts x 4 rollouts.
FAST_RUN = ["--prompts_per_rank", "4", "--sampling.n", "4", "--sampling.max_tokens", "4",
            "--max_tokens_per_gpu", "256", "--progress_bar", "false", "--tensorboard", "false",
            "--data.max_prompt_tokens", "16", "--eval.every", "0"]
TRAINER_TIMEOUT_S = 600
# A 128 MiB KV cache holds every sequence of FAST_RUN; uncompiled (enforce_eager): compiling costs
# ~12 s of an engine's start on 2 cores and buys little on runs of 4-token completions.
ENGINE = dict(kv_cache_memory_bytes=128 * 2**20, max_num_seqs=256, max_model_len=64, enforce_eager=True)


def cluster_engine(**changes: Any) -> EngineConfig:
    """The tests' engine with `changes`: the launcher's CPU engine on a CPU host; on CUDA its
    default, whose dtype (bf16) and GPU share the launcher picks as for any run."""
    if cuda_available():
        return dataclasses.replace(LOCAL_ENGINE, **changes)
    return local_engine(**changes)


def cluster_config(model_path: str | Path, log_dir: str | Path, *, engine: dict[str, Any] | None = None,
                   **changes: Any) -> LocalClusterConfig:
    """One generation and one logprob worker on model_path, 8 CPUs, one verifier process, WORLD_SIZE
    trainer ranks, the launcher's engine with ENGINE's settings (cluster_engine); `engine` changes
    engine fields, `changes` the cluster's (e.g. logprob_workers=0, teacher_workers=1)."""
    fields: dict[str, Any] = dict(
        model_path=str(model_path), log_dir=str(log_dir), generation_workers=1, logprob_workers=1, num_cpus=8,
        nproc_per_node=WORLD_SIZE, verification=VerificationConfig(global_num_verifiers=1),
        engine=cluster_engine(**{**ENGINE, **(engine or {})}),
    )
    return LocalClusterConfig(**{**fields, **changes})


@contextlib.contextmanager
def started_cluster(config: LocalClusterConfig) -> Iterator[LocalCluster]:
    """The cluster with its workers started; stopped (workers, Ray head) when the block ends. The
    session's Ray connection, if a module before held one, is set aside meanwhile."""
    with session_ray_set_aside(), LocalCluster(config) as running:
        running.start_workers()
        yield running


SHARED_CLUSTER_MODULES = ("test_benchmarks_smoke.py", "test_end_to_end.py", "test_crash_resume.py")
"""Modules whose runs share the demo cluster: the benchmarks' smokes that can attach to a running
cluster, the end-to-end module and the crash-resume module. scripts/test.sh runs them one after
the other in one pytest process, so the cluster starts once (a start costs a Ray head and four
workers, ~45 CPU-s); tests/conftest.py stops it as soon as the next test is in another module."""


class _DemoCluster:
    """The shared demo cluster, started on first use and stopped by `stop`."""

    def __init__(self) -> None:
        self._running: contextlib.ExitStack | None = None
        self.cluster: LocalCluster | None = None

    def get(self, demo_assets: Path, log_dir: Path) -> LocalCluster:
        if self.cluster is None:
            model = demo_assets / "model"
            config = cluster_config(model, log_dir, reference_workers=1, teacher_workers=1,
                                    teacher_model_path=str(model))
            with contextlib.ExitStack() as stack:
                self.cluster = stack.enter_context(started_cluster(config))
                self._running = stack.pop_all()
        return self.cluster

    def stop(self) -> None:
        running, self._running, self.cluster = self._running, None, None
        if running is not None:
            running.close()


_DEMO_CLUSTER = _DemoCluster()


def demo_cluster(demo_assets: Path, log_dir: Path) -> LocalCluster:
    """Every service a run can use, on the demo model: a generation, an old-policy logprob, a
    reference and a teacher worker (cluster_config's engine and verifier). Started on the first
    call (its dispatchers log under `log_dir`); later calls get the same cluster until
    stop_demo_cluster."""
    return _DEMO_CLUSTER.get(demo_assets, log_dir)


def stop_demo_cluster() -> None:
    """Stop the demo cluster if it runs (tests/conftest.py: before a test of another module)."""
    _DEMO_CLUSTER.stop()


def run_forked_trainer(cluster: LocalCluster, args: list[str], logs: list[Path]) -> None:
    """trainer_core.py with `args` on len(logs) ranks joined to `cluster`, each logging to its own
    file; fails the test with each rank's output unless every rank exits 0.

    The ranks are forked from support.forked_ranks' preloaded process, with the environment
    LocalCluster.run_trainer gives torchrun and the variables torchrun gives each rank, instead of
    started by torchrun: ~9 CPU-s less a two-rank run (each rank's imports of torch and
    transformers, and torchrun's own). Launches under torchrun stay where they are the point: the
    cluster path, the crash-resume kills, and (through LocalCluster.run_trainer) the chaos test, the
    demos and the benchmarks' smokes."""
    run_ranks(REPO_ROOT / "trainer_core.py", ["--ray_address", cluster.address, *args], len(logs), TRAINER_TIMEOUT_S,
              env=cluster.trainer_env(len(logs)), logs=logs)


def train(cluster: LocalCluster, demo_assets: Path, run_dir: Path, *extra: str) -> list[dict]:
    """The demo's trainer on WORLD_SIZE ranks joined to `cluster` (run_forked_trainer):
    configs/demo.yaml on the demo's model and data, FAST_RUN, then `extra`. Returns the run's
    metrics. Each rank logs to its own file beside run_dir (a resumed run keeps the first's)."""
    launch = len(list(run_dir.parent.glob(f"{run_dir.name}.trainer-*.rank0.log")))
    logs = [run_dir.parent / f"{run_dir.name}.trainer-{launch}.rank{rank}.log" for rank in range(WORLD_SIZE)]
    run_forked_trainer(cluster, ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--run_dir", str(run_dir),
                                 "--model.model_path", str(demo_assets / "model"),
                                 "--data.path", str(demo_assets / "arithmetic.jsonl"), *FAST_RUN, *extra], logs)
    return read_metrics(run_dir / "metrics.jsonl")


def generation_versions() -> list[int]:
    """Each generation worker's weight version, from the generation registry's status."""
    import ray

    registry = ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE)
    return [status.weight_version for status in ray.get(registry.status.remote())]
