"""The path users take on a real cluster, run the way they run it: `ray start --head`, a second
Ray node, a `worker_dispatcher.py` per (fake) GPU on each node, `torchrun trainer_core.py`,
`ray list actors` and `worker_dispatcher.py status`; then the failure only a cluster has, a node
lost mid-run.

Everything stays on 127.0.0.1 (Ray's single-machine mode, LOOPBACK_ONLY_ENV). That mode refuses
`ray start --address` for a second node, so the second node is started by tests/programs/ray_node.py, as
Ray's own test cluster starts one; the dispatchers and the trainer join both nodes exactly as they
would join a real cluster (RAY_ADDRESS, the dispatcher's --ray_temp_dir naming its node).

Ray's defaults are kept: token authentication is on because a token exists (here in a file of
the test's, named by RAY_AUTH_TOKEN_PATH, so that ~/.ray is never touched), and RAY_AUTH_MODE is
*not* set for the project's processes: the entry points must turn it on themselves
(ray_access.join_cluster). Only Ray's own CLI (`ray list actors`) gets RAY_AUTH_MODE=token, as the
docs/cluster.md tells operators to export.

GPU placement uses Ray's fake GPUs: the head advertises GPUs 0-2 (CUDA_VISIBLE_DEVICES=0,1,2 at
`ray start`, docs/cluster.md's layout: a generation, a logprob and a judge worker), the trainer runs
with CUDA_VISIBLE_DEVICES=3,4, and the second node advertises one GPU. The judge is a reward-model
head (no engine to start) scoring every answer as a monitor, weight 0, beside math-verify. Every process the test starts is stopped by the test; nothing else is
touched (never `ray stop`).

    .venv/bin/python -m pytest tests/system/test_cluster_path.py -q
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from async_grpo.launch.ray_env import repo_pythonpath
from async_grpo.runtime.ray_access import LOOPBACK_ONLY_ENV, PROMPT_STOP_ENV
from async_grpo.telemetry.metrics import read_metrics
from local_cluster import cuda_available
from support.paths import PROGRAMS, REPO_ROOT
from support.process_output import OutputLog
from support.torchrun_launch import free_port

pytestmark = [
    pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system,
    # Four GPUs are faked with Ray's resources for CPU engines; a CUDA build would start its engines
    # on GPUs the host may not have. On a GPU host the whole-system tests place by the real plan.
    pytest.mark.skipif(cuda_available(), reason="fakes four GPUs with Ray's resources: CPU hosts only"),
]

DISPATCHER = str(REPO_ROOT / "worker_dispatcher.py")
RAY_CLI = str(Path(sys.executable).parent / "ray")
HEAD_GPUS = "0,1,2"  # what Ray may hand to workers on the head node
TRAINER_GPUS = "3,4"  # kept out of Ray's reach: the trainer's
SECOND_NODE_GPUS = 1
# Bounds that only keep a broken run from hanging the suite (an engine starts in ~1 min on 2 cores).
_START_BOUND_S = 180.0
_REGISTER_BOUND_S = 600.0
_EXIT_BOUND_S = 120.0
_TRAINER_BOUND_S = 900.0
# A join that fails must end the process instead of looping: the checks themselves take at most
# connect_timeout_s (30 s) plus the 5 s TCP probe, and the refusals below answer at once; the rest
# is interpreter start-up and input loading, which on a busy 2-core machine took up to 35 s. This
# bound only catches a process that hangs, as the old ones did.
_BAD_INPUT_BOUND_S = _EXIT_BOUND_S
# The bad-input processes run two at a time: each is mostly one interpreter starting (one core)
# or waiting on a refused connection, so two fit the 2-core machine, and each still gets a core.
_PARALLEL_JOINS = 2
# A short run whose steps outlast the node removal: 2 ranks x 4 prompts x 4 rollouts per step.
NUM_STEPS = 8
REMOVE_AFTER_STEP = 2
PROMPTS_PER_RANK, ROLLOUTS = 4, 4
WORLD_SIZE = 2
FAST_RUN = ["--prompts_per_rank", str(PROMPTS_PER_RANK), "--sampling.n", str(ROLLOUTS), "--sampling.max_tokens", "4",
            "--max_tokens_per_gpu", "256", "--progress_bar", "false", "--tensorboard", "false",
            "--data.max_prompt_tokens", "16", "--eval.every", "0", "--checkpoint_every", "0",
            "--num_steps", str(NUM_STEPS), "--optim.total_steps", str(NUM_STEPS)]
_WORKER_FLAGS = ["--dtype", "float32", "--health_check_interval_s", "1"]
_GENERATION_FLAGS = ["--mode", "generation", "--max_num_seqs", "64", "--max_model_len", "64",
                     "--global_num_verifiers", "1", "--enforce_eager", "--restart_backoff_s", "1"]
_KV_CACHE_BYTES = 64 << 20
# The judge as a monitor (weight 0): every answer scored by the reward-model head, the reward
# math-verify's alone. An untrained head's score is any number: the range only has to hold it.
JUDGED_RUN = ["--sampling.reward.functions", "async_grpo.rewards.math_verifier:math_verify_reward", "judge",
              "--sampling.reward.weights", "1", "0", "--sampling.reward.judge.verdict", "number",
              "--sampling.reward.judge.low", "-1e6", "--sampling.reward.judge.high", "1e6",
              "--sampling.reward.judge.system", "", "--sampling.reward.judge.user", "{prompt}{completion}"]


def _write_reward_model(demo_model: Path, out: Path) -> Path:
    """A reward-model checkpoint: the demo's model shape with a one-label head (random), its
    tokenizer with the judge demo's chat template."""
    import torch
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from async_grpo.demo_assets.arithmetic_judge import add_judge_chat_template
    from setup_model import load_tokenizer

    config = AutoConfig.from_pretrained(demo_model)
    config.num_labels = 1
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    load_tokenizer(demo_model).save_pretrained(out)
    return add_judge_chat_template(out)


def _base_env(token_path: Path) -> dict[str, str]:
    """What every process of the cluster inherits: loopback-only Ray, this repository, the
    token's file; never RAY_AUTH_MODE or RAY_ADDRESS from the test process (its own local Ray
    fixture sets the mode), so the entry points must find their way themselves."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    return {**env, **LOOPBACK_ONLY_ENV, "PYTHONPATH": repo_pythonpath(), "PYTHONUNBUFFERED": "1",
            "RAY_AUTH_TOKEN_PATH": str(token_path)}


@dataclass
class Cluster:
    """The processes the test started, and how to reach them."""

    env: dict[str, str]
    """Environment of a process joining the cluster (RAY_ADDRESS set, RAY_AUTH_MODE not)."""
    address: str
    head_temp: str
    second_temp: str
    root: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    second_node: subprocess.Popen | None = None

    def start(self, args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, OutputLog]:
        # stdin a pipe: CI runs with no standard input, and tests/programs/ray_node.py stops its node at EOF.
        process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=env or self.env, cwd=REPO_ROOT, start_new_session=True)
        self.processes.append(process)
        return process, OutputLog(process)

    def dispatcher(self, model: Path, *flags: str, temp_dir: str = "") -> tuple[subprocess.Popen, OutputLog]:
        node = ["--ray_temp_dir", temp_dir] if temp_dir else []
        return self.start([sys.executable, DISPATCHER, "--model_path", str(model), *_WORKER_FLAGS, *node, *flags])


def _wait_line(log: OutputLog, process: subprocess.Popen, text: str, bound_s: float) -> None:
    log.wait_for_match(rf".*{re.escape(text)}.*", process, bound_s)


def _stop(process: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A `ray start --head` on 127.0.0.1 with token auth and two fake GPUs, and a second node with one."""
    root = Path(tempfile.mkdtemp(prefix="rcp", dir="/tmp"))  # short: Ray's socket paths must fit 107 chars
    token = root / "auth_token"
    token.write_text(secrets.token_hex(32))
    address = f"127.0.0.1:{free_port()}"
    running = Cluster(env={**_base_env(token), "RAY_ADDRESS": address}, address=address,
                      head_temp=str(root / "h"), second_temp=str(root / "n"), root=root)
    try:
        head, head_log = running.start(
            [RAY_CLI, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", address.rsplit(":", 1)[1], "--num-cpus", "8", "--num-gpus", str(len(HEAD_GPUS.split(","))),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port()), "--temp-dir", running.head_temp],
            env={**_base_env(token), **PROMPT_STOP_ENV, "CUDA_VISIBLE_DEVICES": HEAD_GPUS})
        _wait_line(head_log, head, "Ray runtime started", _START_BOUND_S)
        assert any("Token authentication is enabled" in line for line in head_log.lines), head_log.tail()
        second, second_log = running.start(
            [sys.executable, str(PROGRAMS / "ray_node.py"), "--address", address,
             "--temp_dir", running.second_temp, "--num_cpus", "4", "--num_gpus", str(SECOND_NODE_GPUS)],
            env={**_base_env(token), "RAY_AUTH_MODE": "token"})  # a raylet is Ray's own process
        _wait_line(second_log, second, "NODE-UP", _START_BOUND_S)
        running.second_node = second
        yield running
    finally:
        for process in reversed(running.processes):
            _stop(process, signal.SIGTERM)
        shutil.rmtree(root, ignore_errors=True)


def _remove_second_node(cluster: Cluster) -> list[str]:
    """Kill every process of the second node at once, as when a machine is lost; returns those
    still alive afterwards (its raylet's workers, their vLLM engine cores: none should be)."""
    node = cluster.second_node
    assert node is not None
    processes = psutil.Process(node.pid).children(recursive=True)
    os.kill(node.pid, signal.SIGTERM)  # tests/programs/ray_node.py kills the node's processes on SIGTERM
    node.wait(timeout=_EXIT_BOUND_S)
    _, alive = psutil.wait_procs(processes, timeout=_EXIT_BOUND_S)
    survivors = []
    for process in alive:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:  # dead, waiting for a parent to reap it
                survivors.append(f"{process.pid} {process.name()}")
        except psutil.NoSuchProcess:
            pass
    return survivors


def _joins(command: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    return done.returncode, done.stderr, time.monotonic() - began


def _project_lines(stderr: str) -> list[str]:
    """The lines our entry points print (Ray's C++ logger prints its own, prefixed with '[')."""
    return [line for line in stderr.splitlines() if line.startswith(("trainer_core.py:", "worker_dispatcher.py:"))]


def test_bad_cluster_input_gets_one_line_quickly(cluster: Cluster, demo_assets: Path, tmp_path: Path) -> None:
    """A wrong address, an unreachable head, a missing token, a wrong token: the trainer and the
    dispatcher each say so in one line and exit non-zero, well within the bound, instead of looping."""
    empty_home = tmp_path / "home"
    empty_home.mkdir()
    no_token = {**cluster.env, "HOME": str(empty_home)}
    no_token.pop("RAY_AUTH_TOKEN_PATH")
    wrong_token = {**cluster.env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    wrong_token.pop("RAY_AUTH_TOKEN_PATH")
    unreachable = {**cluster.env, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    malformed = {**cluster.env, "RAY_ADDRESS": "no-port-here"}
    def trainer(case: str) -> list[str]:  # a run folder per case: they run side by side
        return [sys.executable, str(REPO_ROOT / "trainer_core.py"), "--config", str(REPO_ROOT / "configs" / "demo.yaml"),
                "--model.model_path", str(demo_assets / "model"), "--data.path", str(demo_assets / "arithmetic.jsonl"),
                "--run_dir", str(tmp_path / "run" / case.replace(" ", "_")), "--eval.every", "0"]

    status = [sys.executable, DISPATCHER, "status"]
    cases = {"no token": (no_token, "requires a Ray auth token and this process has none"),
             "wrong token": (wrong_token, "refused this process's Ray auth token"),
             "unreachable": (unreachable, "cannot reach the Ray head"),
             "malformed": (malformed, "is not host:port")}
    jobs = [(case, env, expected, command, prefix) for case, (env, expected) in cases.items()
            for command, prefix in ((trainer(case), "trainer_core.py:"), (status, "worker_dispatcher.py:"))]
    with ThreadPoolExecutor(max_workers=_PARALLEL_JOINS) as pool:
        results = list(pool.map(lambda job: _joins(job[3], job[1]), jobs))
    for (case, _, expected, _, prefix), (code, stderr, took) in zip(jobs, results):
        lines = _project_lines(stderr)
        assert code != 0 and len(lines) == 1 and expected in lines[0] and lines[0].startswith(prefix), \
            f"{case}, {prefix} exit {code}:\n{stderr[-3000:]}"
        assert took < _BAD_INPUT_BOUND_S, f"{case}, {prefix}: {took:.1f} s"
    # A model folder missing on the dispatcher's node: one line, before it joins the cluster.
    code, stderr, _ = _joins([sys.executable, DISPATCHER, "--model_path", str(tmp_path / "absent"), "--mode",
                              "generation"], cluster.env)
    assert code == 2 and len(_project_lines(stderr)) == 1 and "absent" in stderr, stderr


@dataclass
class Run:
    """What the cluster run showed, for the assertions below."""

    cli_actors: str = ""
    status: str = ""
    kv_log: str = ""
    busy_gpu: tuple[int, str, float] = (0, "", 0.0)
    trainer_code: int = -1
    trainer_log: str = ""
    metrics: list[dict] = field(default_factory=list)
    second_dispatcher: tuple[int | None, str] = (None, "")
    survivors_alive: bool = False
    second_node_survivors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def run(cluster: Cluster, demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Dispatchers on both nodes, a busy-GPU refusal, ray list actors, status, then a trainer run
    during which the second node is removed."""
    model = demo_assets / "model"
    seen = Run()
    head_gen, head_gen_log = cluster.dispatcher(model, *_GENERATION_FLAGS)  # KV cache: the CPU default
    head_lp, head_lp_log = cluster.dispatcher(model, "--mode", "logprob", "--max_tokens_per_forward", "4096")
    # The second node's one GPU is shared by hand (--num_gpus 0.5): its engine and a reference worker.
    second_gen, second_gen_log = cluster.dispatcher(model, *_GENERATION_FLAGS, "--kv_cache_memory_bytes",
                                                    str(_KV_CACHE_BYTES), "--num_gpus", "0.5",
                                                    temp_dir=cluster.second_temp)
    second_ref, second_ref_log = cluster.dispatcher(model, "--mode", "reference", "--num_gpus", "0.5",
                                                    temp_dir=cluster.second_temp)
    reward_model = _write_reward_model(model, tmp_path_factory.mktemp("reward-model"))
    judge, judge_log = cluster.dispatcher(reward_model, "--mode", "judge", "--judge_kind", "reward_model")
    # Ray's relayed worker output can precede the line on the same line (dispatcher_logs.REGISTERED_PATTERN).
    registered = r".*worker (\S+) registered"
    for process, log in ((head_gen, head_gen_log), (head_lp, head_lp_log), (second_gen, second_gen_log),
                         (second_ref, second_ref_log), (judge, judge_log)):
        log.wait_for_match(registered, process, _REGISTER_BOUND_S)
    seen.kv_log = next(line for line in head_gen_log.lines if "CPU node: vLLM KV cache" in line)

    # Every head GPU is held now: one more GPU worker there must fail fast and say why.
    began = time.monotonic()
    busy = subprocess.run([sys.executable, DISPATCHER, "--model_path", str(model), "--mode", "reference",
                           "--start_timeout_s", "5"], capture_output=True, text=True, env=cluster.env,
                          cwd=REPO_ROOT, timeout=_EXIT_BOUND_S)
    seen.busy_gpu = (busy.returncode, busy.stdout + busy.stderr, time.monotonic() - began)

    cli_env = {**cluster.env, "RAY_AUTH_MODE": "token"}  # docs/cluster.md's export for Ray's own CLI
    seen.cli_actors = subprocess.run([RAY_CLI, "list", "actors", "--filter", "state=ALIVE", "--limit", "1000"],
                                     capture_output=True, text=True, env=cli_env, timeout=_EXIT_BOUND_S).stdout
    seen.status = subprocess.run([sys.executable, DISPATCHER, "status"], capture_output=True, text=True,
                                 env=cluster.env, timeout=_EXIT_BOUND_S).stdout

    run_dir = tmp_path_factory.mktemp("cluster-run") / "run"
    trainer_env = {**cluster.env, "CUDA_VISIBLE_DEVICES": TRAINER_GPUS}
    trainer, trainer_log = cluster.start(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD_SIZE}", "--master_addr=127.0.0.1",
         f"--master_port={free_port()}", str(REPO_ROOT / "trainer_core.py"),
         "--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--run_dir", str(run_dir),
         "--model.model_path", str(model), "--data.path", str(demo_assets / "arithmetic.jsonl"), *FAST_RUN,
         *JUDGED_RUN],
        env=trainer_env)
    metrics_file = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + _TRAINER_BOUND_S
    while not (metrics_file.exists() and len(read_metrics(metrics_file)) > REMOVE_AFTER_STEP):
        assert trainer.poll() is None, f"trainer exited {trainer.returncode}:\n{_rank_errors(trainer_log)}"
        assert time.monotonic() < deadline, f"trainer did not reach step {REMOVE_AFTER_STEP}:\n{trainer_log.tail()}"
        time.sleep(0.5)
    seen.second_node_survivors = _remove_second_node(cluster)
    try:
        seen.trainer_code = trainer.wait(timeout=_TRAINER_BOUND_S)
    except subprocess.TimeoutExpired:
        _stop(trainer, signal.SIGTERM)
    seen.trainer_log = _rank_errors(trainer_log)
    seen.metrics = read_metrics(metrics_file) if metrics_file.exists() else []
    try:
        second_gen.wait(timeout=_EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pass
    seen.second_dispatcher = (second_gen.poll(), second_gen_log.tail(30))
    try:
        second_ref.wait(timeout=_EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pass
    seen.survivors_alive = all(process.poll() is None for process in (head_gen, head_lp, judge))
    for process in (head_gen, head_lp, judge):
        _stop(process)
    return seen


def _rank_errors(log: OutputLog) -> str:
    """The trainer's output without torchrun's closing summary, which hides the rank's own error."""
    time.sleep(2.0)  # let the pump thread take the last lines
    lines = [line for line in log.lines if "torch/distributed/elastic" not in line]
    return "\n".join(lines[-120:])


def test_cpu_node_gets_a_logged_kv_cache_default(run: Run) -> None:
    assert re.search(r"CPU node: vLLM KV cache \d+\.\d+ GiB \(1/8 of the \d+\.\d+ GiB free", run.kv_log), run.kv_log


def test_ray_list_actors_and_status_show_every_worker(run: Run) -> None:
    workers = ["generation-worker-0", "generation-worker-1", "logprob-worker-0", "reference-worker-0", "judge-worker-0"]
    for name in [*workers, "generation-registry", "logprob-registry", "reference-registry", "judge-registry"]:
        assert name in run.cli_actors, run.cli_actors
    rows = {line.split()[1]: line.split() for line in run.status.splitlines()[1:] if line.split()[1:2]}
    assert set(workers) <= set(rows), run.status
    for name in workers:
        assert rows[name][4] == "READY" and rows[name][-1] == "ok", run.status


def test_worker_gpus_are_disjoint_and_not_the_trainers(run: Run) -> None:
    rows = [line.split() for line in run.status.splitlines()[1:] if "-worker-" in line]
    head_node = next(row[2] for row in rows if row[1] == "logprob-worker-0")
    held = [(row[2], gpu) for row in rows if row[2] == head_node for gpu in row[3].split(",")]  # (node, GPU id)
    assert len(held) == len(set(held)) == len(HEAD_GPUS.split(",")), run.status
    nodes = {row[2] for row in rows}
    assert len(nodes) == 2, f"workers should run on both nodes: {run.status}"
    head_gpus = {gpu for _, gpu in held}
    assert head_gpus == set(HEAD_GPUS.split(",")) and not head_gpus & set(TRAINER_GPUS.split(",")), run.status


def test_hand_started_workers_share_a_gpu_with_a_fraction(run: Run) -> None:
    """--num_gpus 0.5 on the one-GPU second node: its engine and its reference worker both hold GPU 0."""
    rows = [line.split() for line in run.status.splitlines()[1:] if "-worker-" in line]
    head_node = next(row[2] for row in rows if row[1] == "logprob-worker-0")
    second = sorted((row[1].rsplit("-", 2)[0], row[3]) for row in rows if row[2] != head_node)
    assert second == [("generation", "0"), ("reference", "0")], run.status


def test_a_worker_asking_for_a_held_gpu_fails_fast_and_says_why(run: Run) -> None:
    code, output, took = run.busy_gpu
    assert code == 1 and "no free GPU on node" in output and "held by" in output, output[-3000:]
    # The head's three workers (which generation worker landed on the head is Ray's choice).
    holder = r"(generation-worker-\d|logprob-worker-0|judge-worker-0) \(GPU \d\)"
    assert re.search(rf"held by {holder}, {holder}, {holder}", output), output[-3000:]
    assert took < _BAD_INPUT_BOUND_S, f"{took:.1f} s"


def test_run_finishes_after_losing_a_node_and_every_prompt_is_trained_or_counted(run: Run) -> None:
    assert run.trainer_code == 0, run.trainer_log
    assert [m["step"] for m in run.metrics] == list(range(NUM_STEPS)), run.trainer_log
    for m in run.metrics:
        prompts = m["counts/samples"] / ROLLOUTS + m.get("counts/timed_out_prompts", 0)
        assert prompts == WORLD_SIZE * PROMPTS_PER_RANK, json.dumps(m)
        # the judge (a monitor) scored the step's answers, and its work reached the step's metrics
        assert m.get("judge/requests", 0) >= m["counts/samples"], json.dumps(m)
    assert all("reward/judge" in m and m["judge/tokens_in"] > 0 for m in run.metrics if m["counts/samples"])
    assert run.survivors_alive, "the head's dispatchers must keep serving"


def test_the_lost_nodes_dispatcher_exits_with_a_clear_reason(run: Run) -> None:
    assert not run.second_node_survivors, f"processes of the lost node still alive: {run.second_node_survivors}"
    code, tail = run.second_dispatcher
    assert code == 1, tail
    assert "left the Ray cluster" in tail and "its own node only" in tail, tail


def test_a_local_cluster_starts_its_own_head_beside_a_running_cluster(cluster: Cluster) -> None:
    """local_cluster.py (the demo, the tests) next to a `ray start` cluster, even with RAY_ADDRESS
    pointing at it: it must start a private head, not join (or fail to join) the running one."""
    probe = ("from async_grpo.launch.ray_cluster import init_local_ray\n"
             "print('HEAD', init_local_ray(num_cpus=1, namespace='local-probe', log_to_driver=False))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=cluster.env,
                          cwd=REPO_ROOT, timeout=_EXIT_BOUND_S)
    heads = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("HEAD ")]
    assert done.returncode == 0 and heads and heads[0] != cluster.address, done.stdout + done.stderr[-3000:]
