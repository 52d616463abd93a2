"""Per-kind process settings (async_grpo/launch/process_tuning.py): Ray's jemalloc for the engine
side only when tuned (glibc's fixed malloc thresholds where Ray ships none), the fixed thresholds
for every process when not (the baseline), and an operator's own values always win (issue 37,
item 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_grpo.launch.process_tuning import FIXED_MALLOC_ENV, launcher_child_env, worker_env

FIXED = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "262144"}


@pytest.fixture(autouse=True)
def _no_operator_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*FIXED, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)


def _jemalloc() -> dict[str, str]:
    import ray

    path = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    assert path.is_file(), "this Ray build ships no jemalloc: the fallback is then what runs"
    return {"LD_PRELOAD": str(path)}


def test_the_fixed_thresholds_are_256_kib() -> None:
    assert FIXED_MALLOC_ENV == FIXED


def test_tuned_the_engine_side_alone_runs_on_jemalloc() -> None:
    assert launcher_child_env(tune=True) == {}  # trainer ranks, dispatchers, the Ray head
    assert worker_env("generation", tune=True) == _jemalloc()  # the actor and its vLLM engine core
    for kind in ("logprob", "reference", "teacher"):
        assert worker_env(kind, tune=True) == {}


def test_without_rays_jemalloc_the_engine_side_gets_the_fixed_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    from async_grpo.launch import process_tuning

    monkeypatch.setattr(process_tuning, "rays_jemalloc", lambda: None)
    assert worker_env("generation", tune=True) == FIXED


@pytest.mark.system
def test_jemalloc_is_loaded_into_a_process_started_with_that_environment() -> None:
    probe = "print(any('libjemalloc' in line for line in open('/proc/self/maps')))"
    env = {**os.environ, **worker_env("generation", tune=True)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stdout + done.stderr


def test_untuned_every_process_gets_them_as_before() -> None:
    assert launcher_child_env(tune=False) == FIXED
    assert all(worker_env(kind, tune=False) == {} for kind in ("generation", "logprob"))  # inherited instead


def test_the_operators_values_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert launcher_child_env(tune=False)["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc.so")
    assert worker_env("generation", tune=True) == {"LD_PRELOAD": "/opt/libtcmalloc.so"}


def test_the_dispatcher_gives_a_generation_actor_its_settings() -> None:
    from worker_dispatcher import DispatcherConfig, worker_runtime_env

    generation = DispatcherConfig(mode="generation", model_path="m")
    assert worker_runtime_env(generation)["env_vars"].items() >= _jemalloc().items()
    settings = {*FIXED, "LD_PRELOAD"}
    assert not settings & worker_runtime_env(DispatcherConfig(mode="logprob", model_path="m"))["env_vars"].keys()
    untuned = DispatcherConfig(mode="generation", model_path="m", tune_processes=False)
    assert not settings & worker_runtime_env(untuned)["env_vars"].keys()
    ipc = DispatcherConfig(mode="generation", model_path="m", transfer=generation.transfer.__class__(weight_transfer="ipc"))
    assert worker_runtime_env(ipc)["env_vars"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


@pytest.mark.parametrize("cores, processes, threads", [(2, 4, 1), (2, 1, 2), (16, 4, 4), (16, 5, 3), (1, 3, 1)])
def test_threads_share_the_cores_among_the_compute_processes(cores: int, processes: int, threads: int) -> None:
    from async_grpo.launch.process_tuning import threads_per_process

    assert threads_per_process(processes, cores) == threads


def test_thread_env_is_set_when_tuned_and_the_operator_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from async_grpo.launch.process_tuning import thread_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert thread_env(3, tune=True) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
    assert thread_env(3, tune=False) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert thread_env(3, tune=True)["OMP_NUM_THREADS"] == "8"


def test_the_launcher_gives_workers_and_ranks_their_share(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import local_cluster
    from local_cluster import LocalCluster, LocalClusterConfig

    monkeypatch.setattr(local_cluster, "usable_core_ids", lambda: tuple(range(16)))  # a 16-core machine
    cluster = LocalCluster(LocalClusterConfig(model_path="m", run_dir=str(tmp_path), host_gpus=0))  # 2 ranks, 2 workers
    assert cluster.cpu_plan.trainer_threads(2) == 4
    args = cluster.dispatcher_args("logprob")
    assert args[args.index("--threads") + 1] == "4"
    untuned = LocalCluster(LocalClusterConfig(model_path="m", run_dir=str(tmp_path), tune_processes=False, host_gpus=0))
    assert "--threads" not in untuned.dispatcher_args("generation")
