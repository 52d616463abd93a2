"""Chaos: SIGKILL a generation, a logprob and a judge worker mid-run; the pools heal and no prompt is lost.

A local cluster with 2 generation, 2 logprob and 2 judge workers, each under its own
worker_dispatcher.py, and `torchrun --nproc_per_node=2 trainer_core.py`; every answer is also
sent to the judge (an untrained tiny judge, weighted 0: the pool is under test, not its verdicts).
While the trainer runs, the test SIGKILLs one worker process of each kind at steps drawn from a
seeded RNG (the seed is in every failure message), and right after the first kill adds a third
generation worker with the command
local_cluster.py prints. The engines run uncompiled (enforce_eager: ~8 s less per engine start)
and the dispatchers check their worker every second: the lifecycle is under test, not the
engine's speed. It then checks:
- the run finishes (exit 0), and every step accounts for all of its rollouts: trained, or
  counted as stale, timed out, missing or dropped for their logprobs' weight version;
- each dispatcher replaced its killed worker (a new name registered), and the added worker
  registered; the replacements and the added worker serve: a second short run (one rank) puts
  requests on them; no judge request was lost to the kill (no judge failure of kind crash:
  the registry re-sent the killed judge's requests);
- after the cluster stops, no worker or engine-core process is left, no weight file remains
  in shared memory, and the folder the cluster's processes kept their temporary files in (the
  killed workers' too) is gone; a folder left by a launcher that died is removed at the start.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from async_grpo.config.worker_options import HealthCheckConfig, RestartConfig
from async_grpo.demo_assets.arithmetic_data import write_arithmetic_dataset
from async_grpo.demo_assets.arithmetic_judge import add_judge_chat_template
from async_grpo.launch.dispatcher_logs import REGISTERED_PATTERN
from async_grpo.launch.local_processes import RUN_TEMP_PREFIX
from async_grpo.config.actor_names import GENERATION, JUDGE, LOGPROB, RAY_NAMESPACE, registry_name, worker_actor_name
from async_grpo.telemetry.metrics import read_metrics
from async_grpo.weights.worker_bucket_files import weights_file_dir
from local_cluster import LocalCluster
from support.cluster import WORLD_SIZE, cluster_config
from support.ray_session import session_ray_set_aside

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system]

SEED = 11
NUM_STEPS = 10
N = 4
RUN = ["--prompts_per_rank", "2", "--sampling.n", str(N), "--sampling.max_tokens", "4", "--max_tokens_per_gpu", "256",
       "--data.max_prompt_tokens", "16", "--progress_bar", "false", "--tensorboard", "false", "--eval.every", "0",
       "--max_lag", "1", "--logprob_role", "reference", "--checkpoint_at_end", "false"]
# Every answer goes to the judge pool as a monitor (weight 0): its replies (an untrained model's)
# neither enter the reward nor mask, so the accounting below is the same as without it.
JUDGED = ["--sampling.reward.functions", "judge", "async_grpo.rewards.math_verifier:math_verify_reward",
          "--sampling.reward.weights", "0", "1", "--sampling.reward.judge.max_tokens", "4",
          "--sampling.reward.judge.retries", "0", "--sampling.reward.judge.system", "",
          "--sampling.reward.judge.user", "{prompt}{completion}"]
KINDS = (GENERATION, LOGPROB, JUDGE)
TRAINER_TIMEOUT_S = 900
# Bounds that only keep a broken run from hanging the suite (an engine starts in ~1 min on 2 cores).
RESTART_BOUND_S = 600.0
STEP_BOUND_S = 600.0
# Dispatchers notice a dead worker within a second and replace it a second later (their defaults:
# 10 s and 5 s), so that the replacements' start is not spent waiting.
HEALTH_CHECK_INTERVAL_S = 1.0
RESTART_BACKOFF_S = 1.0

# Run on an actor through `__ray_call__`: its process id (a lambda travels by value).
_pid = lambda _actor: os.getpid()  # noqa: E731


def _actor_pid(name: str) -> int:
    import ray

    return ray.get(ray.get_actor(name, namespace=RAY_NAMESPACE).__ray_call__.remote(_pid))


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait(condition: Any, what: str, bound_s: float, context: str) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"{context}: timed out waiting for {what}"
        time.sleep(0.5)


def _registered_names(log_dir: Path) -> dict[str, list[str]]:
    """Worker names each dispatcher log announced, in order."""
    return {log.name: REGISTERED_PATTERN.findall(log.read_text(errors="replace")) for log in sorted(log_dir.glob("*_worker.log"))}


def _served(kind: str) -> dict[str, int]:
    import ray

    registry = ray.get_actor(registry_name(kind), namespace=RAY_NAMESPACE)
    return {row.name: row.requests_served for row in ray.get(registry.status.remote())}


def _check_every_rollout_accounted_for(records: list[dict], context: str) -> None:
    assert [r["step"] for r in records] == list(range(NUM_STEPS)), context
    for r in records:
        rollouts = r["batcher/num_prompts"] * N
        accounted = (r["batcher/num_samples"] + r["batcher/dropped_stale"] + r["batcher/dropped_logprob_version"]
                     + r["batcher/timed_out_prompts"] * N + r["batcher/missing_rollouts"])
        assert r["batcher/num_prompts"] == 4 and accounted == rollouts, f"{context}: step {r['step']}: {r}"


def _with_descendants(pids: set[int]) -> set[int]:
    """`pids` and every live descendant (a generation actor's vLLM engine-core process, ...)."""
    found = set(pids)
    for pid in pids:
        try:
            found |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return found


def _add_worker(cluster: LocalCluster, kind: str, log: Path) -> subprocess.Popen:
    """Run the command local_cluster.py prints to add a worker, as an operator would from another shell."""
    with log.open("w") as out:
        # `exec env ...`: the printed command, with the shell replaced by the dispatcher, so that the
        # SIGINT and the exit code below are the dispatcher's own.
        return subprocess.Popen("exec env " + cluster.add_worker_command(kind), shell=True, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _kill_if_running(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def _judge_model(model_dir: Path, out: Path) -> Path:
    """A copy of model_dir with the judge demo's chat template (a judge renders its chats with one)."""
    shutil.copytree(model_dir, out)
    return add_judge_chat_template(out)


def test_killed_workers_are_replaced_and_no_prompt_is_lost(tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    kill_at = {GENERATION: rng.randint(1, 3), LOGPROB: rng.randint(4, 6)}
    kill_at[JUDGE] = rng.randint(2, 5)
    context = f"seed {SEED}, kills at steps {kill_at}"
    data = write_arithmetic_dataset(tmp_path / "arithmetic.jsonl", 200, seed=SEED)
    log_dir = tmp_path / "logs"
    config = cluster_config(
        tiny_model_dir, log_dir, generation_workers=2, logprob_workers=2, judge_workers=2,
        judge_model_path=str(_judge_model(tiny_model_dir, tmp_path / "judge")),
        health=HealthCheckConfig(health_check_interval_s=HEALTH_CHECK_INTERVAL_S),
        engine={"kv_cache_memory_bytes": 64 * 2**20, "max_num_seqs": 64, "dtype": "float32"},
        restart=RestartConfig(restart_backoff_s=RESTART_BACKOFF_S),
    )
    killed: dict[str, int] = {}
    victim_pids: set[int] = set()
    added_log = tmp_path / "added_worker.log"
    # The temporary folder of a launcher that died without stopping (a pid no longer running).
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    orphan = Path(tempfile.gettempdir()) / f"{RUN_TEMP_PREFIX}{ended.pid}-chaos"
    orphan.mkdir()
    # LocalCluster owns its own Ray head: a session's shared ray_local connection is set aside.
    with session_ray_set_aside(), LocalCluster(config) as cluster, contextlib.ExitStack() as cleanup:
        assert not orphan.exists(), "a dead launcher's temporary folder outlived the next cluster's start"
        cluster.start_workers()
        # The cluster's processes keep their temporary files in its own folder (vLLM's IPC sockets
        # at least), which goes when the cluster stops: checked after the kills, at the end.
        temp_dir = Path(cluster.temp_dir)
        assert any(path.is_socket() for path in temp_dir.iterdir()), f"no vLLM socket in {temp_dir}"
        actor_pids = {_actor_pid(worker_actor_name(kind, i)) for kind in KINDS for i in range(2)}
        run_dir = tmp_path / "run"
        args = ["--run_dir", str(run_dir), "--model.model_path", str(tiny_model_dir), "--data.path", str(data),
                "--num_steps", str(NUM_STEPS), *RUN, *JUDGED]
        result: dict[str, int] = {}
        trainer = threading.Thread(target=lambda: result.update(code=cluster.run_trainer(
            args, nproc_per_node=WORLD_SIZE, timeout_s=TRAINER_TIMEOUT_S, log_path=tmp_path / "trainer.log")))
        trainer.start()
        for kind, step in sorted(kill_at.items(), key=lambda item: item[1]):
            _wait(lambda: _steps_logged(run_dir) >= step or not trainer.is_alive(), f"step {step}", STEP_BOUND_S,
                  context)
            victim = worker_actor_name(kind, 0)
            killed[kind] = _actor_pid(victim)
            victim_pids |= _with_descendants({killed[kind]})  # its engine core must not outlive it
            os.kill(killed[kind], signal.SIGKILL)
            if kind == GENERATION:
                # A third generation worker joins with the command local_cluster.py prints while the
                # run goes on; its engine starts beside the replacement's.
                added = _add_worker(cluster, GENERATION, added_log)
                cleanup.callback(_kill_if_running, added)
        trainer.join(TRAINER_TIMEOUT_S)
        assert result.get("code") == 0, f"{context}: trainer exited {result}:\n" + \
            "\n".join((tmp_path / "trainer.log").read_text().splitlines()[-40:])
        records = read_metrics(run_dir / "metrics.jsonl")
        _check_every_rollout_accounted_for(records, context)
        # Truncated answers take the fixed truncated_reward unscored; the others go to the judge.
        assert any("reward/judge" in r for r in records), f"{context}: no answer was judged: {records}"
        crashes = {r["step"]: r[key] for r in records for key in r if key.startswith("counts/reward_failures/judge/crash")}
        assert not crashes, f"{context}: judge requests lost to the kill (crash failures per step): {crashes}"

        # Each killed worker's dispatcher (whichever log announced the victim: dispatchers claim
        # names in no fixed order) registered a replacement under a new name.
        def dispatcher_of(victim: str) -> str:
            return next(log for log, names in _registered_names(log_dir).items() if names[:1] == [victim])

        logs = {kind: dispatcher_of(worker_actor_name(kind, 0)) for kind in KINDS}
        _wait(lambda: all(len(_registered_names(log_dir)[logs[kind]]) == 2 for kind in logs),
              "the replacements to register", RESTART_BOUND_S, context)
        names = _registered_names(log_dir)
        replacements = {kind: names[logs[kind]][1] for kind in KINDS}
        for kind, name in replacements.items():
            assert name not in (worker_actor_name(kind, 0), worker_actor_name(kind, 1)), f"{context}: {names}"
            log = (log_dir / logs[kind]).read_text(errors="replace")
            assert f"worker {worker_actor_name(kind, 0)} restarting (1 of 3)" in log, f"{context}: {log[-2000:]}"

        # The added worker registered too.
        _wait(lambda: REGISTERED_PATTERN.search(added_log.read_text(errors="replace")) is not None or added.poll() is not None,
              "the added worker to register", RESTART_BOUND_S, context)
        match = REGISTERED_PATTERN.search(added_log.read_text(errors="replace"))
        assert match, f"{context}: the added worker did not register:\n{added_log.read_text()[-3000:]}"
        replacements["added"] = match.group(1)

        # The replacements and the added worker serve: a second run's requests reach them. One rank
        # with both ranks' prompts: the same requests per step, one rank's start-up less.
        second = tmp_path / "run2"
        code = cluster.run_trainer(["--run_dir", str(second), "--model.model_path", str(tiny_model_dir),
                                    "--data.path", str(data), "--num_steps", "3", *RUN, *JUDGED,
                                    "--prompts_per_rank", "4"],
                                   nproc_per_node=1, timeout_s=TRAINER_TIMEOUT_S, log_path=tmp_path / "trainer2.log")
        assert code == 0, f"{context}: second run exited {code}"
        for kind, name in replacements.items():
            served = _served(kind if kind in (LOGPROB, JUDGE) else GENERATION)
            assert served.get(name, 0) >= 1, f"{context}: {kind} worker {name} served nothing: {served}"
        actor_pids |= {_actor_pid(name) for name in replacements.values()}
        run_pids = _with_descendants(actor_pids) | victim_pids  # every worker and engine core of the run
        generation_names = [worker_actor_name(GENERATION, i) for i in range(2)] + \
            [replacements[GENERATION], replacements["added"]]
        added.send_signal(signal.SIGINT)  # its dispatcher deregisters and stops its worker
        assert added.wait(timeout=120) == 0, added_log.read_text()[-3000:]

    # Everything the cluster started is gone, and no weight file of its generation workers is left in
    # shared memory (other runs' are not this run's to judge: a concurrent test_dispatcher writes one).
    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def all_gone() -> bool:
        return not any(alive(pid) for pid in run_pids)
    _wait(all_gone, "the cluster's processes to exit", 60.0, context)
    leftovers = sorted(path for name in generation_names for path in weights_file_dir().glob(f"grpo-weights-*{name}-v*"))
    assert not leftovers, f"{context}: weight files left behind: {leftovers}"
    assert not temp_dir.exists(), f"{context}: the cluster's temporary folder is left: {sorted(temp_dir.iterdir())}"
