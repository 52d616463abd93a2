"""Run the whole system on one machine: a private Ray head, inference workers, the trainer.

    python local_cluster.py [launcher flags] -- [trainer_core.py flags]
    python local_cluster.py --nproc_per_node 2 -- --config configs/demo.yaml --run_dir runs/demo

It starts a Ray head owned by this process (bound to 127.0.0.1, dashboard off), launches the
workers exactly as an operator would (`python worker_dispatcher.py --mode ...`, one process
each, waiting for `worker <name> registered`), runs `torchrun trainer_core.py`, and stops
everything it started on exit, Ctrl-C or failure. Owning the head in-process (rather than
`ray start` / `ray stop`) means stopping never touches another Ray cluster on the machine.

The console (docs/console.md) gets two start-up lines, warnings (its dispatchers' too) and the
trainer's progress and summary; every INFO line goes to <run_dir>/run.log, and each worker's
output (Ray's and vLLM's start-up included) to <log_dir>/<kind>-<i>_worker.log. The trainer's
--log_level sets this console's level too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import psutil

from async_grpo.config.run_config import config_to_flags, flattened, load_config, split_passthrough
from async_grpo.config.worker_options import (
    EngineConfig, HealthCheckConfig, LogprobBatchingConfig, RestartConfig, VerificationConfig,
)
from async_grpo.launch.ray_env import (
    LOOPBACK_ONLY_ENV, RAY_NAMESPACE, REPO_ROOT, actor_runtime_env, repo_pythonpath, use_loopback_only_ray,
)

if TYPE_CHECKING:
    from async_grpo.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

REGISTERED_MARKER = "registered"  # worker_dispatcher prints `worker <name> registered` when ready
_POLL_S = 0.5  # how often the launcher looks at dispatcher logs while waiting
_STOP_GRACE_S = 30.0  # how long a stopped trainer gets to exit before SIGKILL
# Dispatcher log lines the launcher repeats on its console as warnings: the dispatcher's own
# warnings and errors (a failed health check, a replacement starting) and its restart and give-up
# lines (worker_dispatcher's RESTARTING_LINE and final failure lines). vLLM's and Ray's lines in
# the same file, warnings included, stay there. Group 1: the dispatcher's message.
_RELAYED_LINE = re.compile(r"^\S+ \S+ (?:WARNING|ERROR|CRITICAL) __main__: (.*)$"
                           r"|^(worker \S+ restarting \(.*|.*; giving up after .*|.*; not restarting it: .*)$")


# The engine on one CPU machine shared with the trainer:
# - dtype float32, as the CPU trainer computes: vLLM's 'auto' would serve an fp32 checkpoint in
#   bf16, which CPUs without bf16 instructions emulate slowly, and whose sampling logprobs then
#   differ from the trainer's (~6e-3 per token on the demo). The logprob workers get it too.
# - a 256 MiB KV cache, set explicitly: the CPU build otherwise reserves a fraction of one NUMA
#   node's RAM minus what the process already uses, which fails on a busy machine.
# - max_model_len 512 and 256 sequences per step: the launcher's sizes for the tiny demo model
#   since it was written (the demo's prompt + completion budget is far below 512 tokens); no
#   measurement behind them is recorded.
LOCAL_ENGINE = EngineConfig(dtype="float32", kv_cache_memory_bytes=256 * 2**20, max_model_len=512, max_num_seqs=256)
# The launcher's logprob budget since it was written (half the worker's default; the demo's
# minibatch budget, max_tokens_per_gpu, is 4096); no measurement behind it is recorded.
LOCAL_BATCHING = LogprobBatchingConfig(max_tokens_per_forward=8192)


def local_engine(**changes: Any) -> EngineConfig:
    """LOCAL_ENGINE with `changes` (e.g. a test's smaller KV cache), for LocalClusterConfig(engine=...)."""
    return dataclasses.replace(LOCAL_ENGINE, **changes)


@dataclass(kw_only=True, frozen=True)
class LocalClusterConfig:
    """What to start on this machine."""

    model_path: str
    """Model the inference workers load (the trainer's --model.model_path)."""
    run_dir: str = ""
    """The trainer's run directory (its --run_dir), when this launcher starts the trainer."""
    log_dir: str = ""
    """Where dispatcher logs go; '' means run_dir."""
    nproc_per_node: int = 2
    """Trainer ranks (torchrun's --nproc_per_node)."""
    generation_workers: int = 1
    """Generation workers (each its own vLLM engine)."""
    logprob_workers: int = 1
    """Logprob workers (0 when the run uses logprob_role: none)."""
    reference_workers: int = 0
    """Reference-pool workers on model_path (`--mode reference`), for a trainer with
    logprob_role old_policy and reference_pool true."""
    teacher_workers: int = 0
    """Teacher workers on teacher_model_path (`--mode teacher`), for a trainer with distill.teacher."""
    teacher_model_path: str = ""
    """The teacher's model folder (needed when teacher_workers > 0)."""
    num_cpus: int = 8
    """CPU slots Ray advertises (actors are light; real cores are shared)."""
    engine: EngineConfig = flattened(LOCAL_ENGINE)
    """The generation engines' options (worker_options.EngineConfig), with this machine's
    defaults (LOCAL_ENGINE); their dtype is the logprob workers' too."""
    verification: VerificationConfig = flattened(VerificationConfig())
    """The generation workers' math-verify pool (worker_options.VerificationConfig)."""
    batching: LogprobBatchingConfig = flattened(LOCAL_BATCHING)
    """How the logprob workers pack requests (worker_options.LogprobBatchingConfig)."""
    worker_start_timeout_s: float = 600.0
    """Give up if a worker has not registered by then (vLLM on CPU takes ~1 min)."""
    health: HealthCheckConfig = flattened(HealthCheckConfig())
    """How each dispatcher probes its worker (worker_options.HealthCheckConfig)."""
    restart: RestartConfig = flattened(RestartConfig())
    """How each dispatcher replaces a worker that failed (worker_options.RestartConfig)."""

    @property
    def total_workers(self) -> int:
        """Workers of every kind: each takes one GPU on a GPU machine."""
        return self.generation_workers + self.logprob_workers + self.reference_workers + self.teacher_workers

    def __post_init__(self) -> None:
        if not self.log_dir:
            if not self.run_dir:
                raise ValueError("LocalClusterConfig needs run_dir (--run_dir) or log_dir")
            object.__setattr__(self, "log_dir", self.run_dir)
        if self.nproc_per_node < 1:
            raise ValueError(f"LocalClusterConfig.nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.generation_workers < 1:
            raise ValueError(f"LocalClusterConfig.generation_workers must be >= 1, got {self.generation_workers}")
        for name in ("logprob_workers", "reference_workers", "teacher_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"LocalClusterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.teacher_workers and not self.teacher_model_path:
            raise ValueError("LocalClusterConfig.teacher_workers needs teacher_model_path (--teacher_model_path)")




# A LocalCluster's processes (its Ray head's GCS, raylet and workers, the dispatchers, torchrun and
# the ranks) keep their temporary files in a folder the cluster removes when it stops. What they
# left in the system temp folder otherwise, on every clean stop (benchmarks/soak.py, RESULTS.md):
# each vLLM engine's three IPC sockets (vLLM binds them itself and never unlinks them), the
# verifier pool's multiprocessing folder (pymp-*: Ray ends the actor without its exit handlers)
# and torchrun's torchelastic_* log folder; and a worker killed mid-run leaves whatever it held.
# The folder is named after the launcher's pid, so that the next LocalCluster removes the folders
# of launchers that died without stopping (SIGKILL).
RUN_TEMP_PREFIX = "grpo-local-"


def _make_run_temp_dir() -> str:
    """A new temp folder `grpo-local-<this pid>-*`, after removing those whose launcher is gone."""
    for folder in Path(tempfile.gettempdir()).glob(f"{RUN_TEMP_PREFIX}*-*"):
        owner = folder.name[len(RUN_TEMP_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            logger.info("removing %s, left by a local cluster that did not stop (pid %s)", folder, owner)
            shutil.rmtree(folder, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{RUN_TEMP_PREFIX}{os.getpid()}-")

# glibc malloc settings for every process of a local run (an operator's own values win): a fixed
# 256 KiB mmap threshold and trim threshold, as benchmarks/realistic_run.py sets. By default glibc
# raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), so later
# blocks of that size come from the heap, whose freed pages stay resident: over steps 50-300 of
# the soak the vLLM engine core's heap ([heap] in smaps) grew 548 -> 705 MiB and its RSS 1.09-1.14x;
# with these, 217 -> 249 MiB and 1.03x (benchmarks/soak.py, RESULTS.md). Ray's GCS and raylet
# run on jemalloc and ignore them.
GLIBC_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024), "MALLOC_TRIM_THRESHOLD_": str(256 * 1024)}


def run_environment(temp_dir: str) -> dict[str, str]:
    """Variables set for every process a LocalCluster starts: GLIBC_MALLOC_ENV, and
    TMPDIR=temp_dir with the two caches that live under the temp folder kept where they are: Ray's
    session folder (its logs; RAY_TMPDIR wins over TMPDIR in Ray) and torch inductor's compile
    cache (TORCHINDUCTOR_CACHE_DIR; torch's default path, which vLLM's CPU engine uses)."""
    system_temp = tempfile.gettempdir()
    return {
        **{name: os.environ.get(name, value) for name, value in GLIBC_MALLOC_ENV.items()},
        "TMPDIR": temp_dir,
        "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", system_temp),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(system_temp, f"torchinductor_{getpass.getuser()}")),
    }


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ updated with `values` inside the block, restored after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class GpuPlan:
    """Which of this machine's GPUs a LocalCluster gives Ray (its workers) and which the trainer:
    disjoint, so no worker's vLLM engine lands on a trainer rank's GPU. Empty on a CPU machine."""

    worker_gpus: str = ""
    """CUDA_VISIBLE_DEVICES of the Ray head: the GPUs Ray hands out, one per worker."""
    trainer_gpus: str = ""
    """CUDA_VISIBLE_DEVICES of the trainer: one GPU per rank, none of them known to Ray."""


def plan_gpus(host_gpus: int, workers: int, trainer_ranks: int) -> GpuPlan:
    """Split `host_gpus` GPUs: the first `workers` for Ray, the next `trainer_ranks` for the
    trainer. ValueError (one line) when there are too few; an empty plan on a CPU machine."""
    if host_gpus == 0:
        return GpuPlan()
    if host_gpus < workers + trainer_ranks:
        raise ValueError(f"this machine has {host_gpus} GPU(s); the local cluster needs one per worker ({workers}) "
                         f"and one per trainer rank ({trainer_ranks}): start fewer workers or ranks")
    ids = [str(i) for i in range(workers + trainer_ranks)]
    return GpuPlan(worker_gpus=",".join(ids[:workers]), trainer_gpus=",".join(ids[workers:]))


def init_local_ray(*, num_cpus: int, namespace: str, log_to_driver: bool, num_gpus: int = 0) -> str:
    """Start a private Ray head owned by this process; returns its GCS address.

    Loopback only (use_loopback_only_ray), dashboard off, this repository importable in every
    worker, and Ray's own metrics off: nothing reads them here, and their OpenTelemetry collector
    thread once segfaulted a fresh actor process during start-up (Ray 2.60, a demo run on
    2026-11-21). Task events off (`task_events_report_interval_ms: 0`, "0 disables the task
    event recording and reporting" in Ray's config): only the dashboard's task list and the
    state API read them, both off here, and the system makes ~145 actor calls per demo step;
    keeping Ray's last 100,000 grew the GCS from 57 to 190 MB over 300 steps, keeping the last
    10,000 still 58 -> 68 MB, and with none 30.1 -> 30.3 MB (benchmarks/soak.py,
    RESULTS.md). LocalCluster and the tests' Ray fixture both start their heads here.
    """
    import ray

    use_loopback_only_ray()
    ray.init(
        # 'local': always a new head. With no address Ray joins RAY_ADDRESS, or else any Ray
        # cluster running on the machine (it looks for GCS processes), and then refuses num_cpus.
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        namespace=namespace,
        runtime_env=actor_runtime_env(),
        _system_config={"enable_metrics_collection": False, "task_events_report_interval_ms": 0},
        log_to_driver=log_to_driver,
    )
    return ray.get_runtime_context().gcs_address


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for torchrun's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def relayed(line: str) -> str | None:
    """The part of a dispatcher log line that the launcher repeats as a warning (None: not one)."""
    match = _RELAYED_LINE.match(line.rstrip("\n"))
    return None if match is None else match.group(1) or match.group(2)


class DispatcherLogRelay:
    """Follows the dispatcher logs and logs their `relayed` lines as warnings of this process, so
    that a failing or replaced worker shows on the launcher's console (its log stays in the file)."""

    def __init__(self, logs: list[tuple[str, Path]]) -> None:
        self._logs = logs
        self._offsets = {path: 0 for _, path in logs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="dispatcher-log-relay", daemon=True)

    def poll(self) -> None:
        """Relay the complete lines written since the last poll."""
        for label, path in self._logs:
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets[path])
                    chunk = f.read()
            except OSError:  # not created yet, or removed with the run
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            self._offsets[path] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                message = relayed(line)
                if message is not None:
                    logger.warning("%s worker: %s", label, message)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Relay what is left, then stop following."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.poll()

    def _follow(self) -> None:
        while not self._stop.wait(_POLL_S):
            self.poll()


class LocalCluster:
    """Context manager owning a Ray head and the dispatcher processes started into it."""

    def __init__(self, config: LocalClusterConfig) -> None:
        self.config = config
        self.address = ""
        self.temp_dir = ""
        self.gpus = GpuPlan()
        self._dispatchers: list[tuple[str, subprocess.Popen, Path]] = []
        self._relay: DispatcherLogRelay | None = None

    def __enter__(self) -> "LocalCluster":
        Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
        # tempfile also fixes this process's own temp folder (it caches it) before TMPDIR changes.
        self.gpus = self._plan_gpus()
        self.temp_dir = _make_run_temp_dir()
        head_env = run_environment(self.temp_dir)
        if self.gpus.worker_gpus:  # Ray reads the head's CUDA_VISIBLE_DEVICES to know which GPUs it owns
            head_env["CUDA_VISIBLE_DEVICES"] = self.gpus.worker_gpus
        try:
            with _environ(head_env):  # the head's processes inherit it when they start
                self.address = init_local_ray(num_cpus=self.config.num_cpus, namespace=RAY_NAMESPACE,
                                              log_to_driver=False,
                                              num_gpus=len(self.gpus.worker_gpus.split(",")) if self.gpus.worker_gpus else 0)
        except BaseException:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise
        logger.info("Ray head at %s (127.0.0.1 only, no dashboard); temporary files in %s", self.address,
                    self.temp_dir)
        return self

    def _plan_gpus(self) -> GpuPlan:
        from async_grpo.trainer.fsdp_setup import host_gpu_count

        plan = plan_gpus(host_gpu_count(), self.config.total_workers, self.config.nproc_per_node)
        if plan.worker_gpus:
            logger.info("GPUs: workers %s (through Ray), trainer %s", plan.worker_gpus, plan.trainer_gpus)
        return plan

    def env(self) -> dict[str, str]:
        """Environment for child processes: join this cluster, import this repo."""
        env = dict(os.environ)
        env.update(run_environment(self.temp_dir))
        env["RAY_ADDRESS"] = self.address
        env["PYTHONPATH"] = repo_pythonpath(env.get("PYTHONPATH", ""))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def dispatcher_args(self, kind: str) -> list[str]:
        """worker_dispatcher.py's flags for one worker of `kind` ('generation', 'logprob',
        'reference' or 'teacher'; the teacher loads teacher_model_path, the others model_path):
        the sections this config shares with the dispatcher, as flags (run_config.config_to_flags),
        where they differ from the dispatcher's defaults."""
        c = self.config
        common = ["--mode", kind, "--model_path", c.teacher_model_path if kind == "teacher" else c.model_path,
                  *config_to_flags(c.health), *config_to_flags(c.restart)]
        if kind == "generation":
            return common + config_to_flags(c.verification) + config_to_flags(c.engine)
        if kind in ("logprob", "reference", "teacher"):
            return common + ["--dtype", c.engine.dtype] + config_to_flags(c.batching)
        raise ValueError(f"unknown worker kind {kind!r}")

    def add_worker_command(self, kind: str) -> str:
        """The shell command that adds one more worker of `kind` to this running cluster, from any
        shell on this machine: the head's address, loopback-only Ray (without it a new process
        looks for the head on the routable address and retries forever) and this repository."""
        env = {**LOOPBACK_ONLY_ENV, "RAY_ADDRESS": self.address, "PYTHONPATH": str(REPO_ROOT)}
        words = [*(f"{k}={v}" for k, v in env.items()), sys.executable, str(REPO_ROOT / "worker_dispatcher.py"),
                 *self.dispatcher_args(kind)]
        return shlex.join(words)

    def start_workers(self) -> None:
        """Dispatch every configured worker, wait until each has registered, and print how to add more."""
        c = self.config
        counts = {"generation": c.generation_workers, "logprob": c.logprob_workers,
                  "reference": c.reference_workers, "teacher": c.teacher_workers}
        for kind, count in counts.items():
            for i in range(count):
                self._dispatch(f"{kind}-{i}", self.dispatcher_args(kind))
        self._relay = DispatcherLogRelay([(label, log) for label, _, log in self._dispatchers])
        self._relay.start()
        self._wait_registered()
        for kind, count in counts.items():
            if count:
                logger.info("to add a %s worker to this cluster, run:\n  %s", kind, self.add_worker_command(kind))

    def _dispatch(self, label: str, args: list[str]) -> None:
        log = Path(self.config.log_dir) / f"{label}_worker.log"
        handle = log.open("w")
        process = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "worker_dispatcher.py"), *args],
            stdout=handle, stderr=subprocess.STDOUT, env=self.env(), cwd=REPO_ROOT,
        )
        self._dispatchers.append((label, process, log))
        logger.info("dispatching %s worker (log: %s)", label, log)

    def _wait_registered(self) -> None:
        """Until every dispatcher's worker has registered; a dispatcher that exits first fails the
        start at once (not after the workers listed before it are up)."""
        deadline = time.monotonic() + self.config.worker_start_timeout_s
        pending = list(self._dispatchers)
        while pending and time.monotonic() < deadline:
            for label, process, log in list(pending):
                text = log.read_text(errors="replace")
                if any(line.startswith("worker ") and line.rstrip().endswith(REGISTERED_MARKER)
                       for line in text.splitlines()):
                    logger.info("%s worker registered", label)
                    pending.remove((label, process, log))
                elif process.poll() is not None:
                    raise RuntimeError(f"{label} dispatcher exited with {process.returncode} before registering; "
                                       f"last lines of {log}:\n{_tail(text)}")
            if pending:
                time.sleep(_POLL_S)
        if pending:
            label, _, log = pending[0]
            raise TimeoutError(f"{label} worker did not register within {self.config.worker_start_timeout_s:.0f} s; "
                               f"see {log}:\n{_tail(log.read_text(errors='replace'))}")

    def run_trainer(self, trainer_args: list[str], nproc_per_node: int, timeout_s: float | None = None,
                    log_path: Path | None = None) -> int:
        """torchrun trainer_core.py on this machine; returns its exit code."""
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            str(REPO_ROOT / "trainer_core.py"), "--ray_address", self.address, *trainer_args,
        ]
        logger.info("starting trainer: %s", " ".join(command[2:]))
        out = log_path.open("w") if log_path else None
        # Its own process group, so that stopping reaches torchrun *and* every rank: killing
        # torchrun alone would orphan the ranks, which then wait on the batcher for up to
        # message_timeout_s.
        env = self.env()
        if self.gpus.trainer_gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus.trainer_gpus
        if nproc_per_node > 1:
            # The value torchrun sets itself for several ranks, given here so that torchrun does
            # not print its five-line banner about it on the console.
            env.setdefault("OMP_NUM_THREADS", "1")
        process = subprocess.Popen(command, env=env, cwd=REPO_ROOT, start_new_session=True,
                                   stdout=out, stderr=subprocess.STDOUT if out else None)
        try:
            return process.wait(timeout=timeout_s)
        except BaseException:  # Ctrl-C, SIGTERM (see main), timeout
            stop_process_group(process)
            raise
        finally:
            if out:
                out.close()

    def __exit__(self, *exc_info) -> None:
        import ray

        try:
            if self._relay is not None:  # before the dispatchers stop: their shutdown is no news
                self._relay.stop()
            for _, process, _ in self._dispatchers:
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)  # the dispatcher deregisters and stops its actor
            for label, process, _ in self._dispatchers:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    logger.warning("%s dispatcher did not stop on SIGINT; killing it", label)
                    process.kill()
            ray.shutdown()
        finally:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        logger.info("local cluster stopped")


def _descendants(pid: int) -> set[int]:
    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _signal_pids(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def stop_process_group(process: subprocess.Popen, grace_s: float = _STOP_GRACE_S) -> None:
    """SIGTERM the process group `process` leads and every descendant, SIGKILL whatever is left
    after grace_s.

    Descendants are signalled by pid as well: torch 2.13's torchrun starts each rank in a session
    of its own, outside the leader's group, and once torchrun exits they are no longer its
    children; so they are collected before the first signal and again before the last.
    """
    tree = _descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    _signal_pids(tree, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("trainer did not stop within %.0f s of SIGTERM; killing it", grace_s)
    tree |= _descendants(process.pid)
    try:  # the leader may be gone while ranks linger: the group still exists then
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _signal_pids({pid for pid in tree if psutil.pid_exists(pid)}, signal.SIGKILL)
    process.wait()


def _interrupt_on_sigterm() -> None:
    """Make SIGTERM (kill, a scheduler's stop) unwind like Ctrl-C, so every cleanup runs."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    own, trainer_args = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    config = load_config(LocalClusterConfig, own, description=__doc__)
    if not config.run_dir:
        raise SystemExit("local_cluster.py: --run_dir is required (the trainer's run directory)")
    trainer_args = ["--run_dir", config.run_dir, "--model.model_path", config.model_path, *trainer_args]
    check_environment(config)
    trainer_config = load_trainer_config(trainer_args)  # prints its one line and exits 2 itself
    config = with_trainer_transfer(config, trainer_config.transfer.weight_transfer)
    setup_logging(config, trainer_config)
    from async_grpo.telemetry.console import CONSOLE, LOG_FILE
    check_trainer_inputs(trainer_config, max_lora_rank=config.engine.max_lora_rank)
    if config.teacher_workers:
        check_teacher_model(config.teacher_model_path, config.model_path)
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)  # the checks passed: run.log can start
    _interrupt_on_sigterm()
    logger.info("starting Ray (127.0.0.1 only), %s, then the trainer (%d ranks); logs in %s", _workers_text(config),
                config.nproc_per_node, config.log_dir, extra=CONSOLE)
    with LocalCluster(config) as cluster:
        started = time.monotonic()
        cluster.start_workers()
        logger.info("workers ready after %.0f s; starting the trainer (every INFO line in %s)",
                    time.monotonic() - started, Path(config.run_dir) / LOG_FILE, extra=CONSOLE)
        return cluster.run_trainer(trainer_args, config.nproc_per_node)


def load_trainer_config(trainer_args: list[str]) -> TrainerConfig:
    """The trainer's config, as the trainer will load it (exit 2 with one line if it does not)."""
    from trainer_core import load_trainer_config as load

    return load(trainer_args)


def with_trainer_transfer(config: LocalClusterConfig, weight_transfer: str) -> LocalClusterConfig:
    """`config` with the generation engines' weight_transfer set to the trainer's
    transfer.weight_transfer: both ends must name the same backend, so a user sets the trainer's
    and the launcher hands it to the workers. Exit 2 with one line when the launcher's own
    --weight_transfer was set to another backend."""
    own = config.engine.weight_transfer
    if own == weight_transfer:
        return config
    if own != LOCAL_ENGINE.weight_transfer:
        exit_config_error(f"--weight_transfer {own!r} (the generation engines) differs from the trainer's "
                          f"--transfer.weight_transfer {weight_transfer!r}: set the trainer's alone, the launcher "
                          "passes it on")
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, weight_transfer=weight_transfer))


def setup_logging(config: LocalClusterConfig, trainer_config: TrainerConfig) -> None:
    """The launcher's console follows the trainer's log_level; its INFO lines go to the run's
    run.log, beside rank 0's."""
    import importlib

    from async_grpo.telemetry.console import LOG_FILE, configure_logging

    importlib.import_module("ray")  # Ray installs its own log handler when imported: import it first

    configure_logging(trainer_config.log_level, log_file=Path(config.run_dir) / LOG_FILE, tag="[launcher] ")


def _workers_text(config: LocalClusterConfig) -> str:
    """'2 workers (1 generation, 1 logprob)'."""
    counts = {"generation": config.generation_workers, "logprob": config.logprob_workers,
              "reference": config.reference_workers, "teacher": config.teacher_workers}
    kinds = ", ".join(f"{count} {kind}" for kind, count in counts.items() if count)
    return f"{config.total_workers} worker{'s' if config.total_workers != 1 else ''} ({kinds})"


def exit_config_error(message: str) -> NoReturn:
    """Print one line naming the launcher and exit with the trainer's config-error status (2),
    before Ray or any worker starts."""
    from trainer_core import CONFIG_ERROR_EXIT

    print(f"local_cluster.py: {message}", file=sys.stderr, flush=True)
    raise SystemExit(CONFIG_ERROR_EXIT)


def check_environment(config: LocalClusterConfig) -> None:
    """Installed versions and the GPU split, before Ray or any worker starts; exit 2 with one line."""
    from async_grpo.config.versions import WORKER_REQUIREMENTS, VersionError, check_versions
    from async_grpo.trainer.fsdp_setup import host_gpu_count

    try:
        check_versions(WORKER_REQUIREMENTS)
        plan_gpus(host_gpu_count(), config.total_workers, config.nproc_per_node)
    except (VersionError, ValueError) as error:
        exit_config_error(str(error))


def check_teacher_model(teacher_path: str, student_path: str) -> None:
    """The teacher folder loads and shares the student's tokenizer (what the trainer checks again
    against the running teacher workers); exit 2 with one line naming both models otherwise."""
    from setup_model import ModelPathError, check_model_dir, load_tokenizer, tokenizer_fingerprint

    try:
        check_model_dir(teacher_path)
        same = tokenizer_fingerprint(load_tokenizer(teacher_path)) == tokenizer_fingerprint(load_tokenizer(student_path))
    except ModelPathError as error:
        exit_config_error(f"teacher: {error}")
    if not same:
        exit_config_error(f"the teacher ({teacher_path}) and the student ({student_path}) have different "
                          "tokenizers; distillation needs one tokenizer for both")


def check_trainer_inputs(trainer_config: TrainerConfig, max_lora_rank: int = 0) -> None:
    """Load the trainer's model folder, prompts and evaluation file as the trainer will, before
    Ray or any worker starts; exit 2 with one line on the first problem (also when the trainer
    trains LoRA adapters the generation workers, max_lora_rank, could not serve)."""
    from async_grpo.trainer.run_inputs import InputError, load_run_inputs
    from setup_model import vllm_lora_rank

    started = time.monotonic()
    lora_r = trainer_config.model.lora.r
    if lora_r > max_lora_rank:
        exit_config_error(f"the trainer's model.lora.r={lora_r} needs generation workers that serve LoRA "
                          f"adapters: pass --max_lora_rank {vllm_lora_rank(lora_r)}")
    try:
        inputs = load_run_inputs(trainer_config, with_evaluator=True)
    except InputError as error:
        exit_config_error(str(error))
    logger.info("trainer inputs checked in %.1f s: %d prompts", time.monotonic() - started, len(inputs.prompts))


# Exit status of a run stopped by Ctrl-C or SIGTERM (the shell's 128 + SIGINT).
INTERRUPTED_EXIT = 130


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # LocalCluster's exit has stopped the trainer, the workers and Ray by now
        print("local_cluster.py: interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
