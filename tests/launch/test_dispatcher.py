"""worker_dispatcher.py as an operator runs it: against a `ray start` head, with a real vLLM worker.

The test owns its Ray head (`ray start --head --block` in its own temp dir, bound to 127.0.0.1,
no dashboard) and stops it by terminating that one process, which takes down exactly the Ray
processes it started (at once: PROMPT_STOP_ENV); other clusters on the machine are never touched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from async_grpo.config.run_config import ConfigError, load_config
from async_grpo.config.worker_options import EngineConfig, LogprobBatchingConfig
from async_grpo.launch.dispatcher_logs import REGISTERED_LINE
from async_grpo.config.actor_names import GENERATION, LOGPROB, registry_name, worker_actor_name
from async_grpo.launch.ray_env import repo_pythonpath
from async_grpo.runtime.ray_access import LOOPBACK_ONLY_ENV, PROMPT_STOP_ENV
from async_grpo.launch.status_table import format_status
from support.paths import REPO_ROOT
from support.process_output import OutputLog
from support.torchrun_launch import free_port
from worker_dispatcher import DispatcherConfig

DISPATCHER = str(REPO_ROOT / "worker_dispatcher.py")
# Bounds that only keep a broken run from hanging the suite (engine start is ~1 min on 2 cores).
_CLUSTER_START_BOUND_S = 120.0
_REGISTER_BOUND_S = 600.0
_EXIT_BOUND_S = 120.0
_KV_CACHE_BYTES = 64 << 20  # the tiny model needs little KV cache; a fixed size starts reliably on CPU
_MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, str]]:
    """A private `ray start` head; yields the environment for processes that should join it."""
    temp_dir = tempfile.mkdtemp(prefix="rdt", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
    address = f"127.0.0.1:{free_port()}"
    # LOOPBACK_ONLY_ENV: --node-ip-address 127.0.0.1 alone still listens on all interfaces.
    env = {**os.environ, **LOOPBACK_ONLY_ENV, "PYTHONPATH": repo_pythonpath(), "PYTHONUNBUFFERED": "1"}
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            "--node-ip-address", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
            "--include-dashboard=false", "--num-cpus", "4", "--temp-dir", temp_dir,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**env, **PROMPT_STOP_ENV},
    )
    log = OutputLog(head)
    try:
        deadline = time.monotonic() + _CLUSTER_START_BOUND_S
        while not any("Ray runtime started" in line for line in log.lines):
            assert head.poll() is None, f"ray start exited {head.returncode}:\n{log.tail()}"
            assert time.monotonic() < deadline, f"ray head not up:\n{log.tail()}"
            time.sleep(0.5)
        yield {**env, "RAY_ADDRESS": address}
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=_EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


# Run in a child process: joining a cluster switches Ray's auth mode for the whole process.
# Token auth on (a token exists) before `ray` is imported, as the dispatcher does for itself.
_LIST_NAMED_ACTORS = """
from async_grpo.runtime import ray_access; ray_access.use_ray_token_auth_if_available()
import json, worker_dispatcher, ray
worker_dispatcher.connect(worker_dispatcher.RayConnectionConfig(), log_to_driver=False)
print(json.dumps(sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["namespace"] == worker_dispatcher.RAY_NAMESPACE)))
"""


_KILL_ACTOR = """
from async_grpo.runtime import ray_access; ray_access.use_ray_token_auth_if_available()
import sys, worker_dispatcher, ray
worker_dispatcher.connect(worker_dispatcher.RayConnectionConfig(), log_to_driver=False)
ray.kill(ray.get_actor(sys.argv[1], namespace=worker_dispatcher.RAY_NAMESPACE))
"""


def _kill_actor(env: dict[str, str], name: str) -> None:
    """SIGKILL-equivalent death of one worker actor, from outside its dispatcher."""
    subprocess.run([sys.executable, "-c", _KILL_ACTOR, name], env=env, check=True, timeout=_EXIT_BOUND_S)


def _named_actors(env: dict[str, str]) -> list[str]:
    """Live named actors of the project namespace: what `ray list actors | grep ALIVE` shows.

    (`ray list actors` itself is served by the dashboard, which local runs keep off.)
    """
    done = subprocess.run(
        [sys.executable, "-c", _LIST_NAMED_ACTORS], capture_output=True, text=True, env=env, timeout=_EXIT_BOUND_S
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_token_auth_turns_on_only_when_a_token_exists_and_the_mode_is_unset(tmp_path):
    from async_grpo.runtime.ray_access import ray_auth_token_exists, use_ray_token_auth_if_available

    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    assert not ray_auth_token_exists(env)
    assert not use_ray_token_auth_if_available(env) and "RAY_AUTH_MODE" not in env

    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("t" * 32)
    assert use_ray_token_auth_if_available(env) and env["RAY_AUTH_MODE"] == "token"

    explicit = {"HOME": str(home), "RAY_AUTH_MODE": "disabled"}  # an explicit mode always wins
    assert not use_ray_token_auth_if_available(explicit) and explicit["RAY_AUTH_MODE"] == "disabled"

    elsewhere = tmp_path / "token"
    elsewhere.write_text("t" * 32)
    for env in ({"HOME": "/nonexistent", "RAY_AUTH_TOKEN_PATH": str(elsewhere)},
                {"HOME": "/nonexistent", "RAY_AUTH_TOKEN": "t" * 32}):
        assert use_ray_token_auth_if_available(env) and env["RAY_AUTH_MODE"] == "token"
    missing = {"HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "absent")}
    assert not ray_auth_token_exists(missing)


@pytest.mark.system
def test_importing_the_dispatcher_leaves_the_auth_mode_alone(tmp_path):
    # Importing must not set RAY_AUTH_MODE: every child of the importer (a Ray head's GCS started
    # by ray.init in a test process) would inherit token mode while the importer's Ray, imported
    # earlier, stayed in disabled mode, and could then not reach its own GCS.
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 32)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import os, worker_dispatcher; print(os.environ.get('RAY_AUTH_MODE'))"],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=_EXIT_BOUND_S)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "None", done.stdout + done.stderr


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="DispatcherConfig.mode"):
        DispatcherConfig(mode="trainer", model_path="m")
    with pytest.raises(ValueError, match="DispatcherConfig.tensor_parallel_size"):
        DispatcherConfig(mode="logprob", model_path="m", engine=EngineConfig(tensor_parallel_size=2))


def test_dtype_reaches_each_worker_config_and_unset_keeps_their_defaults():
    from worker_dispatcher import generation_worker_config, logprob_worker_config

    def dispatcher(mode: str, *flags: str) -> DispatcherConfig:
        return load_config(DispatcherConfig, ["--mode", mode, "--model_path", "m", *flags])

    assert generation_worker_config(dispatcher("generation")).engine.dtype == "auto"
    assert generation_worker_config(dispatcher("generation", "--dtype", "float32")).engine.dtype == "float32"
    assert logprob_worker_config(dispatcher("logprob")).dtype == "auto"
    assert logprob_worker_config(dispatcher("logprob", "--dtype", "bfloat16")).dtype == "bfloat16"
    with pytest.raises(ValueError, match="LogprobWorkerConfig.dtype"):
        logprob_worker_config(dispatcher("logprob", "--dtype", "int8"))


def test_the_engine_and_batching_sections_reach_the_workers_as_given():
    from worker_dispatcher import generation_worker_config, logprob_worker_config, registry_config_for

    flags = ["--model_path", "m", "--max_num_seqs", "8", "--kv_cache_memory_bytes", "1024", "--max_model_len", "64",
             "--enforce_eager", "--max_lora_rank", "16", "--max_tokens_per_forward", "512", "--max_wait_ms", "5"]
    cfg = load_config(DispatcherConfig, ["--mode", "generation", *flags])
    assert cfg.engine == EngineConfig(max_num_seqs=8, kv_cache_memory_bytes=1024, max_model_len=64, enforce_eager=True,
                                      max_lora_rank=16)
    worker = generation_worker_config(cfg, cuda=False)  # a KV-cache size given: no CPU sizing
    assert worker.engine == dataclasses.replace(cfg.engine, dtype="float32")  # a CPU node serves 'auto' in fp32
    assert registry_config_for("generation", worker).max_inflight_cost_per_worker == 2 * 8
    logprob = logprob_worker_config(load_config(DispatcherConfig, ["--mode", "logprob", *flags]))
    assert logprob.batching == LogprobBatchingConfig(max_tokens_per_forward=512, max_wait_ms=5.0)
    assert registry_config_for("logprob", logprob).max_inflight_cost_per_worker == 2 * 512
    unset = generation_worker_config(load_config(DispatcherConfig, ["--mode", "generation", "--model_path", "m"]))
    assert unset.engine == EngineConfig()  # the worker's own defaults; on a CUDA node nothing is sized


def test_a_judge_dispatcher_gives_its_worker_the_engine_or_the_batching_of_its_kind():
    from worker_dispatcher import judge_worker_config, registry_config_for

    flags = ["--mode", "judge", "--model_path", "m", "--max_num_seqs", "8", "--kv_cache_memory_bytes", "1024",
             "--max_tokens_per_forward", "512"]
    generative = judge_worker_config(load_config(DispatcherConfig, flags), cuda=False)
    assert generative.serving.judge_kind == "generative" and generative.engine.dtype == "float32"  # CPU: fp32
    assert generative.engine.kv_cache_memory_bytes == 1024 and generative.batching.max_tokens_per_forward == 512
    assert registry_config_for("judge", generative).max_inflight_cost_per_worker == 2 * 8  # 1 per request
    head = judge_worker_config(load_config(DispatcherConfig, [*flags, "--judge_kind", "reward_model"]), cuda=False)
    assert head.serving.judge_kind == "reward_model" and head.engine.dtype == "auto"  # no engine to size
    with pytest.raises(ConfigError, match="judge_kind"):
        load_config(DispatcherConfig, [*flags, "--judge_kind", "critic"])


@pytest.mark.system
def test_dispatcher_registers_reports_and_stops_cleanly(ray_head, tiny_model_dir):
    """The lifecycle every mode shares (start, register, status, SIGINT, deregister), on a logprob
    worker: it starts in seconds where a vLLM engine takes a minute. A generation worker's start,
    registration and status row are checked by the replacement test below."""
    command = [
        sys.executable, DISPATCHER, "--model_path", str(tiny_model_dir), "--mode", LOGPROB,
        "--max_tokens_per_forward", "1024", "--health_check_interval_s", "1",
    ]
    dispatcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_head)
    log = OutputLog(dispatcher)
    name = worker_actor_name(LOGPROB, 0)
    try:
        log.wait_for_match(".*" + re.escape(REGISTERED_LINE.format(name=name)), dispatcher, _REGISTER_BOUND_S)

        status = subprocess.run(
            [sys.executable, DISPATCHER, "status"], capture_output=True, text=True, env=ray_head, timeout=_EXIT_BOUND_S
        )
        assert status.returncode == 0, status.stderr
        table = status.stdout.splitlines()
        assert table[0].split() == ["kind", "name", "node", "gpus", "state", "version", "uptime", "load", "in-flight",
                                    "served", "failed", "health"]
        (row,) = [line.split() for line in table if name in line]
        assert row[0] == LOGPROB and row[4] == "READY" and row[-1] == "ok", status.stdout

        actors = _named_actors(ray_head)
        assert name in actors and registry_name(LOGPROB) in actors, actors

        dispatcher.send_signal(signal.SIGINT)
        assert dispatcher.wait(timeout=_EXIT_BOUND_S) == 0, log.tail()
        log.wait_for(f"worker {name} deregistered and stopped", dispatcher, _EXIT_BOUND_S)

        after = subprocess.run(
            [sys.executable, DISPATCHER, "status"], capture_output=True, text=True, env=ray_head, timeout=_EXIT_BOUND_S
        )
        assert f"{registry_name(LOGPROB)}: no live workers" in after.stdout, after.stdout
        deadline = time.monotonic() + _EXIT_BOUND_S
        while name in (actors := _named_actors(ray_head)):
            assert time.monotonic() < deadline, f"{name} still alive after the dispatcher stopped: {actors}"
            time.sleep(1.0)
        assert registry_name(LOGPROB) in actors, "the detached registry must outlive its dispatcher"
    finally:
        if dispatcher.poll() is None:
            dispatcher.kill()
            dispatcher.wait()


@pytest.mark.vllm
def test_dispatcher_replaces_a_dead_worker_cleans_its_files_then_gives_up(ray_head, tiny_model_dir):
    from async_grpo.weights.worker_bucket_files import weights_file_dir

    command = [
        sys.executable, DISPATCHER, "--model_path", str(tiny_model_dir), "--mode", GENERATION,
        "--max_num_seqs", "4", "--global_num_verifiers", "1", "--kv_cache_memory_bytes", str(_KV_CACHE_BYTES),
        "--max_model_len", str(_MAX_MODEL_LEN), "--health_check_interval_s", "1",
        "--max_restarts", "1", "--restart_backoff_s", "0.5",
        "--enforce_eager",  # uncompiled: two engine starts, each ~8 s sooner; the lifecycle is under test
    ]
    dispatcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_head)
    log = OutputLog(dispatcher)
    registered = r".*worker (\S+) registered"  # after any relayed Ray output on the same line
    files: list[Path] = []
    try:
        first = log.wait_for_match(registered, dispatcher, _REGISTER_BOUND_S).group(1)
        # No --dtype: the engine's 'auto' serves float32 on a CPU node, so this start works on every
        # CPU kind (vLLM's CPU bf16 killed the worker on AMX CPUs); a CUDA node keeps vLLM's 'auto'.
        import torch

        expected = "engine dtype auto (as configured)" if torch.cuda.is_available() else "engine dtype auto -> float32"
        assert any(expected in line for line in log.lines), log.tail()
        # What a SIGKILL during update_weights leaves behind, filed under this cluster's tag; a
        # neighbour's file, and the same-named worker's of another cluster on this machine, must stay.
        from async_grpo.runtime.ray_access import cluster_tag

        owner, other_cluster = cluster_tag(ray_head["RAY_ADDRESS"]), cluster_tag("127.0.0.1:1")
        leftover = weights_file_dir() / f"grpo-weights-{owner}-{first}-v7-0123abcd.safetensors"
        neighbour = weights_file_dir() / f"grpo-weights-{owner}-{first}9-v7-0123abcd.safetensors"
        elsewhere = weights_file_dir() / f"grpo-weights-{other_cluster}-{first}-v7-0123abcd.safetensors"
        files = [leftover, neighbour, elsewhere]
        for path in files:
            path.write_bytes(b"weights")

        _kill_actor(ray_head, first)
        log.wait_for_match(rf"worker {first} restarting \(1 of 1\): worker {first} died: .*", dispatcher, _EXIT_BOUND_S)
        skip = len(log.lines)
        second = log.wait_for_match(registered, dispatcher, _REGISTER_BOUND_S, skip=skip).group(1)
        assert second != first
        assert not leftover.exists() and neighbour.exists() and elsewhere.exists()
        status = subprocess.run([sys.executable, DISPATCHER, "status"], capture_output=True, text=True,
                                env=ray_head, timeout=_EXIT_BOUND_S)
        (row,) = [line.split() for line in status.stdout.splitlines() if second in line]
        assert row[4] == "READY" and row[-1] == "ok", status.stdout

        _kill_actor(ray_head, second)  # the second death exhausts --max_restarts 1
        assert dispatcher.wait(timeout=_EXIT_BOUND_S) == 1, log.tail()
        log.wait_for_match(rf"worker {second} died: .*; giving up after 1 restart\(s\) \(--max_restarts 1\)",
                           dispatcher, _EXIT_BOUND_S)
    finally:
        for path in files:
            path.unlink(missing_ok=True)
        if dispatcher.poll() is None:
            dispatcher.kill()
            dispatcher.wait()


@pytest.mark.vllm
def test_a_start_up_failure_is_reported_once_with_its_root_cause_and_not_retried(ray_head, tiny_model_dir):
    """vLLM's CPU backend refuses to reserve 99% of the node's memory: the same error would come
    back on every restart, so the dispatcher prints the engine core's own error line once, exits 1
    and starts no replacement (its default --max_restarts is 3)."""
    command = [
        sys.executable, DISPATCHER, "--model_path", str(tiny_model_dir), "--mode", GENERATION,
        "--max_num_seqs", "4", "--global_num_verifiers", "1", "--gpu_memory_utilization", "0.99",
        "--max_model_len", str(_MAX_MODEL_LEN), "--enforce_eager",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=ray_head, timeout=_REGISTER_BOUND_S)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    (line,) = [text for text in done.stderr.splitlines() if "not restarting it" in text]
    assert "root cause: ValueError: Available memory on node" in line, line
    assert "restarting (" not in output, "a start-up failure must not be retried"


def test_status_table_format():
    from vllm_registry import WorkerStatus

    rows = [
        WorkerStatus(kind=GENERATION, name="generation-worker-0", node_id="ab" * 28, inflight_cost=3,
                     inflight_requests=1, requests_served=12, weight_version=4, healthy=True, last_error="",
                     state="RUNNING", uptime_s=3725.0, requests_failed=2, gpu_ids="3"),
        WorkerStatus(kind=GENERATION, name="generation-worker-1", node_id="cd" * 28, inflight_cost=0,
                     inflight_requests=0, requests_served=0, weight_version=-1, healthy=False,
                     last_error="health() did not answer within 10.0 s"),
    ]
    lines = format_status(rows).splitlines()
    assert lines[0].split() == ["kind", "name", "node", "gpus", "state", "version", "uptime", "load", "in-flight",
                                "served", "failed", "health"]
    assert lines[1].split() == [GENERATION, "generation-worker-0", "ab" * 6, "3", "RUNNING", "4", "1h02m", "3", "1",
                                "12", "2", "ok"]
    assert lines[2].split()[:11] == [GENERATION, "generation-worker-1", "cd" * 6, "-", "?", "-1", "0s", "0", "0", "0",
                                     "0"]
    assert lines[2].endswith("UNHEALTHY health() did not answer within 10.0 s")
