"""The CPU plan (async_grpo/launch/cpu_plan.py): core sets and thread counts per process kind,
its one-line refusals, the launcher flags that choose it, and its affinity applied to processes
the launcher starts (issue 57, item 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_grpo.launch.cpu_plan import (
    CPU_CORES_ENV, CpuPlanConfig, CpuPlanError, core_list, parse_core_list, pinned_thread, plan_cpu,
)
from support.paths import REPO_ROOT

DEMO_WORKERS = {"generation": 1, "logprob": 1, "reference": 0, "teacher": 0}
SPLIT = CpuPlanConfig(cpu_split="split")


def test_shared_is_every_core_for_everyone_with_todays_thread_share() -> None:
    plan = plan_cpu(CpuPlanConfig(), range(16), DEMO_WORKERS, trainer_ranks=2)
    assert not plan.split and plan.pinned(plan.trainer) is None and plan.dispatcher_env("generation-0") == {}
    assert plan.worker_cores("generation-0") == plan.trainer == plan.driver == tuple(range(16))
    assert plan.threads_of("logprob-0") == 4 and plan.trainer_threads(2) == 4  # 16 cores // 4 compute processes
    assert plan.trainer_threads(6) == 2  # the ranks the trainer really starts count
    assert plan.lines() == ["cpu plan: shared, 16 usable cores (0-15): every process on all of them, 4 thread(s) per "
                            "compute process (4); --cpu_split split gives generation and training cores of their own"]


def test_two_cores_split_one_for_generation_and_one_for_training() -> None:
    plan = plan_cpu(SPLIT, (0, 1), DEMO_WORKERS, trainer_ranks=2)
    assert plan.split and plan.driver == (0,) and plan.trainer == (1,)
    assert plan.workers == {"generation-0": (0,), "logprob-0": (0,)}  # more workers than cores: they share
    assert plan.threads_of("generation-0") == plan.threads_of("logprob-0") == plan.trainer_threads(2) == 1
    assert plan.dispatcher_env("logprob-0") == {CPU_CORES_ENV: "0"} and plan.pinned(plan.trainer) == (1,)
    assert plan.lines() == [
        "cpu plan: split, 2 usable cores: generation 0 | training 1 (--cpu_generation_cores changes the split)",
        "  generation-0  cores 0        1 thread(s) (vLLM binds its OpenMP threads within them)",
        "  logprob-0     cores 0        1 thread(s)",
        "  trainer       cores 1        2 rank(s), 1 thread(s) each",
        "  driver        cores 0        Ray head, registries, batcher, verifier pool, dispatchers",
    ]


def test_enough_generation_cores_give_each_worker_a_slice_engines_first() -> None:
    workers = {"generation": 2, "logprob": 1, "reference": 0, "teacher": 0}
    plan = plan_cpu(CpuPlanConfig(cpu_split="split", cpu_generation_cores=7), range(16), workers, trainer_ranks=3)
    assert plan.workers == {"generation-0": (0, 1, 2), "generation-1": (3, 4), "logprob-0": (5, 6)}
    assert [plan.threads_of(label) for label in plan.workers] == [3, 2, 2]
    assert plan.trainer == tuple(range(7, 16)) and plan.trainer_threads(3) == 3
    assert plan.driver == tuple(range(7))


def test_the_default_split_is_half_the_usable_cores_whichever_they_are() -> None:
    plan = plan_cpu(SPLIT, (4, 5, 6, 7, 9), DEMO_WORKERS, trainer_ranks=1)
    assert plan.driver == (4, 5) and plan.trainer == (6, 7, 9) and plan.trainer_threads(1) == 3
    assert plan.workers == {"generation-0": (4,), "logprob-0": (5,)}


@pytest.mark.parametrize("config, cores, refusal", [
    (CpuPlanConfig(cpu_split="split", cpu_generation_cores=2), (0, 1),
     "--cpu_generation_cores 2 leaves training no core: this host has 2 usable cores (0-1); give generation 1 or fewer"),
    (CpuPlanConfig(cpu_split="split", cpu_generation_cores=9), range(8),
     "--cpu_generation_cores 9 leaves training no core: this host has 8 usable cores (0-7)"),
    (SPLIT, (3,), "--cpu_split split needs 2 usable cores or more (one per side), and this host has 1 (3)"),
])
def test_a_split_that_leaves_a_side_without_cores_is_one_line(config: CpuPlanConfig, cores, refusal: str) -> None:
    with pytest.raises(CpuPlanError) as failure:
        plan_cpu(config, cores, DEMO_WORKERS, trainer_ranks=2)
    assert str(failure.value).startswith(refusal) and "\n" not in str(failure.value)


def test_a_split_is_refused_on_a_gpu_plan_and_a_count_without_split() -> None:
    with pytest.raises(CpuPlanError, match="CPU-only run, and this plan uses 2 GPU"):
        plan_cpu(SPLIT, range(8), DEMO_WORKERS, trainer_ranks=1, host_gpus=2)
    with pytest.raises(ValueError, match="cpu_generation_cores needs cpu_split 'split'"):
        CpuPlanConfig(cpu_generation_cores=1)
    with pytest.raises(ValueError, match="cpu_generation_cores must be >= 1"):
        CpuPlanConfig(cpu_split="split", cpu_generation_cores=0)


def test_core_lists_read_and_write_as_taskset_does() -> None:
    assert core_list((6, 0, 1, 2, 3)) == "0-3,6" and core_list((1,)) == "1"
    assert parse_core_list("0-3,6") == {0, 1, 2, 3, 6}
    with pytest.raises(ValueError, match="not a core list"):
        parse_core_list("0-a")


def _launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: tuple[int, ...], *flags: str):
    """A LocalCluster (not started) planned for a host whose usable cores are `cores`."""
    import local_cluster
    from async_grpo.config.run_config import load_config

    monkeypatch.setattr(local_cluster, "usable_core_ids", lambda: cores)
    config = load_config(local_cluster.LocalClusterConfig, ["--model_path", "m", "--run_dir", str(tmp_path),
                                                            "--host_gpus", "0", *flags])
    return local_cluster.LocalCluster(config)


def test_the_launcher_flags_choose_the_split_and_the_workers_threads(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _launcher(tmp_path, monkeypatch, tuple(range(8)), "--cpu_split", "split", "--cpu_generation_cores", "4")
    args = cluster.dispatcher_args("generation", 0)
    assert args[args.index("--threads") + 1] == "2"  # 4 generation cores: 2 for the engine, 2 the logprob worker
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cluster.trainer_env(2)["OMP_NUM_THREADS"] == "2"  # 4 training cores, 2 ranks


def test_a_refused_split_exits_with_one_line_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     tiny_model_dir: Path) -> None:
    import local_cluster

    monkeypatch.setattr(local_cluster, "usable_core_ids", lambda: (0, 1))
    monkeypatch.setattr(local_cluster, "init_local_ray", lambda **_: pytest.fail("Ray started"))
    with pytest.raises(SystemExit) as exit_:
        local_cluster.main(["--model_path", str(tiny_model_dir), "--run_dir", str(tmp_path / "run"), "--cpu_split",
                            "split", "--cpu_generation_cores", "3", "--", "--config", str(REPO_ROOT / "configs/demo.yaml"),
                            "--data.path", str(tmp_path / "prompts.jsonl"), "--eval.every", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("local_cluster.py: --cpu_generation_cores 3 leaves training no core: this "
                                               "host has 2 usable cores (0-1); give generation 1 or fewer")


_AFFINITY_PROBE = ("import os; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0))), "
                   "os.environ.get('OMP_NUM_THREADS'))")


@pytest.mark.system
def test_a_process_started_from_a_pinned_thread_runs_on_those_cores() -> None:
    core = max(os.sched_getaffinity(0))
    with pinned_thread((core,)):
        done = subprocess.run([sys.executable, "-c", _AFFINITY_PROBE], capture_output=True, text=True, timeout=60)
    assert done.stdout.split()[0] == str(core), done.stdout + done.stderr
    assert os.sched_getaffinity(0) != {core} or len(os.sched_getaffinity(0)) == 1  # this thread's own cores back


@pytest.mark.system
def test_the_launchers_trainer_inherits_the_training_cores_and_threads(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """run_trainer starts torchrun: a stand-in command in its place sees what the ranks would."""
    import local_cluster

    cores = tuple(sorted(os.sched_getaffinity(0)))
    if len(cores) < 2:
        pytest.skip("a split needs two usable cores")
    cluster = _launcher(tmp_path, monkeypatch, cores, "--cpu_split", "split")
    cluster.temp_dir = str(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    log = tmp_path / "trainer.log"
    real_popen = subprocess.Popen

    def probe_instead(command, **kwargs):
        return real_popen([sys.executable, "-c", _AFFINITY_PROBE], **kwargs)

    monkeypatch.setattr(local_cluster.subprocess, "Popen", probe_instead)
    assert cluster.run_trainer([], nproc_per_node=1, log_path=log) == 0
    seen_cores, threads = log.read_text().split()
    assert seen_cores == core_list(cluster.cpu_plan.trainer) and threads == str(len(cluster.cpu_plan.trainer))


@pytest.mark.ray
def test_a_dispatchers_worker_actor_runs_on_its_cores(ray_local, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher's path: with CPU_CORES_ENV in its environment, the actors it creates with
    ray_env.actor_runtime_env run on those cores, every thread of their process."""
    from async_grpo.launch.ray_env import actor_runtime_env

    core = max(os.sched_getaffinity(0))
    monkeypatch.setenv(CPU_CORES_ENV, str(core))

    @ray_local.remote(num_cpus=0)
    class Probe:
        def affinities(self) -> list[set[int]]:
            return [os.sched_getaffinity(int(task)) for task in os.listdir("/proc/self/task")]

    probe = Probe.options(runtime_env=actor_runtime_env()).remote()
    affinities = ray_local.get(probe.affinities.remote(), timeout=120)
    ray_local.kill(probe)
    assert affinities and all(cores == {core} for cores in affinities), affinities
