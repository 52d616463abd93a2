"""local_cluster's stopping of the trainer: the whole process group goes, children included.

torchrun's ranks are children of torchrun; killing torchrun alone orphans them. The trainer is
therefore started as a process-group leader and stopped with stop_process_group. These tests use
a stand-in tree (a leader that starts a child, both sleeping) instead of torchrun, and one whose
members ignore SIGTERM, to check the SIGKILL fallback.
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import time

import pytest

from async_grpo.config.worker_options import VerificationConfig
from async_grpo.launch.local_processes import stop_process_group

# Leader: start a child that sleeps (optionally ignoring SIGTERM), print its pid, sleep.
_TREE = """
import signal, subprocess, sys, time
ignore = sys.argv[1] == "ignore"
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\\n"
    "if sys.argv[1] in ('ignore', 'own-session'): signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "time.sleep(600)", sys.argv[1]], start_new_session=sys.argv[1] == "own-session")
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _start_tree(mode: str) -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen([sys.executable, "-c", _TREE, mode], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child_pid = int(leader.stdout.readline())
    assert _alive(leader.pid) and _alive(child_pid)
    return leader, child_pid


_HANG_BOUND_S = 60.0


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.system
def test_stop_reaches_the_children_of_the_leader() -> None:
    leader, child_pid = _start_tree("obey")
    stop_process_group(leader, grace_s=10.0)
    assert leader.returncode is not None
    assert _wait_gone(child_pid), "the leader's child outlived stop_process_group"


@pytest.mark.system
def test_members_ignoring_sigterm_are_killed_after_the_grace_period() -> None:
    leader, child_pid = _start_tree("ignore")
    started = time.monotonic()
    stop_process_group(leader, grace_s=1.0)
    # Without the SIGKILL after the grace period the stop would never return (the members ignore
    # SIGTERM); the bound only catches that, with room for a loaded machine (it takes ~1 s).
    assert time.monotonic() - started < _HANG_BOUND_S
    assert leader.returncode == -9
    assert _wait_gone(child_pid)


@pytest.mark.system
def test_a_child_in_its_own_session_is_stopped_too() -> None:
    # As torch 2.13's torchrun starts each rank: a new session, outside the leader's process group
    # (and this one ignores SIGTERM, so only the final SIGKILL by pid can stop it).
    leader, child_pid = _start_tree("own-session")
    assert os.getsid(child_pid) != os.getsid(leader.pid)
    stop_process_group(leader, grace_s=1.0)
    assert _wait_gone(child_pid), "a rank in its own session outlived stop_process_group"


@pytest.mark.system
def test_stopping_a_finished_group_is_a_no_op() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    done.wait()
    stop_process_group(done, grace_s=1.0)
    assert done.returncode == 0


def test_the_add_worker_command_joins_this_cluster_on_loopback_and_parses(tmp_path) -> None:
    import shlex

    from async_grpo.config.run_config import load_config
    from local_cluster import LocalCluster, LocalClusterConfig
    from worker_dispatcher import DispatcherConfig

    cluster = LocalCluster(LocalClusterConfig(model_path=str(tmp_path / "model"), run_dir=str(tmp_path / "run"),
                                              host_gpus=0), cuda=False)
    cluster.address = "127.0.0.1:6380"  # as __enter__ sets it
    for kind in ("generation", "logprob"):
        words = shlex.split(cluster.add_worker_command(kind))
        env = dict(w.split("=", 1) for w in words[:3])
        assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and env["RAY_ADDRESS"] == "127.0.0.1:6380"
        assert words[3] == sys.executable and words[4].endswith("worker_dispatcher.py")
        parsed = load_config(DispatcherConfig, words[5:])
        assert parsed.mode == kind and parsed.model_path == str(tmp_path / "model")
        assert words[5:] == cluster.dispatcher_args(kind)  # the same flags the cluster's own workers got


def test_dispatchers_get_the_launchers_engine_and_batching_sections(tmp_path) -> None:
    from async_grpo.config.run_config import load_config
    from async_grpo.config.worker_options import EngineConfig, LogprobBatchingConfig
    from local_cluster import LOCAL_ENGINE, LocalCluster, LocalClusterConfig, local_engine
    from worker_dispatcher import DispatcherConfig, generation_worker_config, logprob_worker_config

    engine = local_engine(max_num_seqs=64, enforce_eager=True, max_lora_rank=8)
    # A CPU host's plan, whatever this host lists (the CUDA choices: test_placement.py).
    config = LocalClusterConfig(model_path="m", run_dir=str(tmp_path), engine=engine, host_gpus=0,
                                verification=VerificationConfig(global_num_verifiers=1),
                                batching=LogprobBatchingConfig(max_tokens_per_forward=4096))
    cluster = LocalCluster(config, cuda=False)
    generation = load_config(DispatcherConfig, cluster.dispatcher_args("generation"))
    assert generation.engine == generation_worker_config(generation).engine == engine
    assert generation.verification.global_num_verifiers == 1
    for kind in ("logprob", "reference"):
        worker = logprob_worker_config(load_config(DispatcherConfig, cluster.dispatcher_args(kind)))
        assert worker.batching == LogprobBatchingConfig(max_tokens_per_forward=4096) and worker.dtype == "float32"
    # The launcher's CPU defaults, as the hand-written flags gave them before the sections existed:
    # on a CPU host the default engine resolves to them (on CUDA to bf16 and the plan's share).
    assert LOCAL_ENGINE == EngineConfig(max_num_seqs=256)
    default_cluster = LocalCluster(LocalClusterConfig(model_path="m", run_dir=str(tmp_path), host_gpus=0), cuda=False)
    assert default_cluster.engine == EngineConfig(dtype="float32", kv_cache_memory_bytes=256 * 2**20,
                                                  max_model_len=512, max_num_seqs=256)
    assert default_cluster.dispatcher_args("logprob")[-4:] == ["--dtype", "float32", "--max_tokens_per_forward", "8192"]
    flags = load_config(LocalClusterConfig, ["--model_path", "m", "--run_dir", "r", "--max_num_seqs", "3",
                                             "--max_tokens_per_forward", "77", "--host_gpus", "0"])
    assert LocalCluster(flags, cuda=False).engine == local_engine(max_num_seqs=3) and flags.batching.max_tokens_per_forward == 77


# What Ray relays from a worker actor into its dispatcher's stdout, from another thread.
_RAY_FRAGMENT = "\x1b[36m(LogprobWorkerActor pid=28241)\x1b[0m 2026-11-29 16:52:21,997 INFO lifecycle: READY"


class _RecordingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)

    def flush(self) -> None:
        self.flushes += 1


def test_a_dispatcher_writes_its_registration_line_and_newline_in_one_call() -> None:
    from async_grpo.launch.dispatcher_logs import REGISTERED_LINE, write_line

    stream = _RecordingStream()
    write_line(REGISTERED_LINE.format(name="logprob-worker-1"), stream)
    # print() writes the newline apart, and a relayed line landing in between hid it (a CI failure).
    assert stream.writes == ["worker logprob-worker-1 registered\n"] and stream.flushes == 1


def test_a_registration_line_is_found_after_relayed_output_on_its_line_and_only_whole() -> None:
    from async_grpo.launch.dispatcher_logs import registered_worker

    assert registered_worker("Connected to Ray cluster.\nworker logprob-worker-1 registered\n") == "logprob-worker-1"
    assert registered_worker(f"{_RAY_FRAGMENT}worker logprob-worker-1 registered\n") == "logprob-worker-1"
    # Text and newline written apart with Ray's line in between: not a registration line.
    assert registered_worker(f"worker logprob-worker-1 registered{_RAY_FRAGMENT}\n\n") is None
    assert registered_worker("worker logprob-worker-1 deregistered and stopped\n") is None
    assert registered_worker("2026-11-29 INFO local_cluster: logprob-0 worker registered\n") is None


class _Running:
    returncode = None

    def poll(self) -> None:
        return None


def test_the_launcher_sees_a_registration_behind_relayed_output(tmp_path) -> None:
    from local_cluster import LocalCluster, LocalClusterConfig

    log = tmp_path / "logprob-0_worker.log"
    log.write_text(f"starting logprob-worker-1\n{_RAY_FRAGMENT}worker logprob-worker-1 registered\n")
    cluster = LocalCluster(LocalClusterConfig(model_path=str(tmp_path / "model"), run_dir=str(tmp_path / "run"),
                                              worker_start_timeout_s=5.0, host_gpus=0), cuda=False)
    cluster._dispatchers = [("logprob-0", _Running(), log)]
    cluster._wait_registered()  # a TimeoutError after 5 s when the line is missed

    log.write_text(f"worker logprob-worker-1 registered{_RAY_FRAGMENT}\n\n")
    cluster.config = dataclasses.replace(cluster.config, worker_start_timeout_s=0.5)
    with pytest.raises(TimeoutError, match="logprob-0 worker did not register within"):
        cluster._wait_registered()


def test_a_schedulers_gpu_subset_is_where_the_plan_places(tmp_path, tiny_model_dir,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A job given GPUs 4-7 of an 8-GPU node plans for four, and its children see those four by
    their names: the workers 4,5 and the trainer 6,7, never GPUs 0-3 (another job's)."""
    from local_cluster import LocalCluster, LocalClusterConfig

    monkeypatch.setenv("ASYNC_GRPO_HOST_GPUS", "8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cluster = LocalCluster(LocalClusterConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path)), cuda=False)
    placement = cluster.placement
    assert placement.host_gpus == 4 and placement.worker_gpus == (0, 1) and placement.trainer_gpus == (2, 3)
    assert cluster.head_env()["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert cluster.trainer_env(2)["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")  # a scheduler that names GPUs by UUID
    cluster = LocalCluster(LocalClusterConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path)), cuda=False)
    assert cluster.placement.host_gpus == 2 and cluster.head_env()["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert cluster.trainer_env(1)["CUDA_VISIBLE_DEVICES"] == "GPU-b"


def test_the_launcher_refuses_a_compiling_engine_without_a_compiler(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from local_cluster import LocalClusterConfig, check_engine_compile, local_engine

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    compiling = LocalClusterConfig(model_path="m", run_dir=str(tmp_path), engine=local_engine(enforce_eager=False))
    with pytest.raises(SystemExit) as exited:
        check_engine_compile(compiling, cuda=False)
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert "no-such-compiler-here" in err and "--enforce_eager true" in err
    check_engine_compile(dataclasses.replace(compiling, engine=local_engine(enforce_eager=True)), cuda=False)


def test_the_launcher_refuses_a_judged_reward_without_judge_workers(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """One line, exit 2, before Ray, a worker or the run directory exists."""
    import local_cluster

    trainer = ["--config", "configs/demo.yaml", "--data.path", "p.jsonl", "--eval.data.path", "e.jsonl",
               "--sampling.reward.functions", "judge"]
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        local_cluster.main(["--model_path", "m", "--run_dir", str(run_dir), "--", *trainer])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert "names the judge" in err and "--judge_workers" in err
    assert not run_dir.exists()
    local_cluster.check_judge_pool(local_cluster.PROGRAM, judge_workers=1, uses_judge=True)  # passes
    local_cluster.check_judge_pool(local_cluster.PROGRAM, judge_workers=0, uses_judge=False)


def test_judge_workers_load_their_own_model_or_the_policys(tiny_model_dir, tmp_path) -> None:
    from async_grpo.config.worker_options import JudgeServingConfig
    from local_cluster import LocalCluster, LocalClusterConfig

    def args(**judge) -> list[str]:
        config = LocalClusterConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path), judge_workers=1, **judge)
        assert config.worker_counts["judge"] == 1
        return LocalCluster(config, cuda=False).dispatcher_args("judge", 0)

    shared = args()
    assert shared[:4] == ["--mode", "judge", "--model_path", str(tiny_model_dir)]
    assert "--max_tokens_per_forward" in shared and "--max_num_seqs" in shared  # batching and engine options
    own = args(judge_model_path="rm", judge=JudgeServingConfig(judge_kind="reward_model"))
    assert own[:4] == ["--mode", "judge", "--model_path", "rm"]
    assert own[own.index("--judge_kind") + 1] == "reward_model"
