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

import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_grpo.config.run_config import (
    ConfigError, config_to_flags, derived, exit_config_error, flattened, load_config, split_passthrough,
)
from async_grpo.config.worker_options import (
    EngineConfig, EngineTransferConfig, HealthCheckConfig, JudgeServingConfig, LogprobBatchingConfig,
    PromptSharingConfig, RestartConfig, VerificationConfig, shared_part,
)
from async_grpo.launch.context_plan import check_context_plan
from async_grpo.launch.cpu_plan import CpuPlan, CpuPlanConfig, pinned_thread, plan_cpu, usable_core_ids
from async_grpo.launch.dispatcher_logs import DispatcherLogRelay, registered_worker
from async_grpo.launch.engine_defaults import CPU_ENGINE, LAUNCHER_MAX_NUM_SEQS, judge_engine, resolve_engine
from async_grpo.runtime.host_gpus import HostGpuError, gpu_memory_bytes, planned_gpus
from async_grpo.launch.local_processes import free_port, make_run_temp_dir, run_environment, stop_process_group
from async_grpo.launch.pool_checks import check_judge_pool, check_teacher_model
from async_grpo.runtime.processes import environ
from async_grpo.launch.placement import (
    BF16_BYTES, FP32_BYTES, ModelShape, Placement, PlacementError, RunShape, check_transfer_placement,
    default_trainer_ranks, plan_placement,
)
from async_grpo.launch.process_tuning import thread_env
from async_grpo.launch.ray_cluster import init_local_ray
from async_grpo.config.actor_names import RAY_NAMESPACE
from async_grpo.launch.ray_env import REPO_ROOT, repo_pythonpath
from async_grpo.runtime.ray_access import LOOPBACK_ONLY_ENV

if TYPE_CHECKING:
    from async_grpo.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)
PROGRAM = "local_cluster.py"  # how its one-line errors name it

_POLL_S = 0.5  # how often the launcher looks at dispatcher logs while waiting


# The launcher's engine default: 256 sequences per step; dtype, KV cache and max_model_len are
# left unset and chosen per device when the cluster starts (resolve_engine), each choice logged.
LOCAL_ENGINE = EngineConfig(max_num_seqs=LAUNCHER_MAX_NUM_SEQS)
# The launcher's logprob budget since it was written (half the worker's default; the demo's
# minibatch budget, max_tokens_per_gpu, is 4096); no measurement behind it is recorded.
LOCAL_BATCHING = LogprobBatchingConfig(max_tokens_per_forward=8192)


def local_engine(**changes: Any) -> EngineConfig:
    """The launcher's CPU engine (LOCAL_ENGINE with CPU_ENGINE) with `changes` (e.g. a test's
    smaller KV cache), for LocalClusterConfig(engine=...)."""
    return dataclasses.replace(LOCAL_ENGINE, **{**CPU_ENGINE, **changes})


@dataclass(kw_only=True, frozen=True)
class LocalClusterConfig:
    """What to start on this machine."""

    model_path: str
    """Model the inference workers load (the trainer's --model.model_path)."""
    run_dir: str = ""
    """The trainer's run directory (its --run_dir), when this launcher starts the trainer."""
    log_dir: str = ""
    """Where dispatcher logs go; '' means run_dir."""
    nproc_per_node: int | None = None
    """Trainer ranks (torchrun's --nproc_per_node). None: 2 on a CPU host; with GPUs, one per GPU
    the workers leave, and 1 on one or two GPUs (the placement plan)."""
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
    judge_workers: int = 0
    """Judge workers (`--mode judge`, a frozen model of their own) for a reward that names the judge."""
    judge_model_path: str = ""
    """The judge's model folder; '': model_path (the policy's checkpoint, in an engine of its own)."""
    judge: JudgeServingConfig = flattened(JudgeServingConfig())
    """A generative judge or a reward-model head (worker_options.JudgeServingConfig)."""
    num_cpus: int = 8
    """CPU slots Ray advertises (actors are light; real cores are shared)."""
    engine: EngineConfig = flattened(LOCAL_ENGINE)
    """The generation engines' options (worker_options.EngineConfig), with this machine's
    defaults (LOCAL_ENGINE); their dtype is the logprob workers' too."""
    verification: VerificationConfig = flattened(VerificationConfig())
    """The generation workers' math-verify pool (worker_options.VerificationConfig)."""
    batching: LogprobBatchingConfig = flattened(LOCAL_BATCHING)
    """How the logprob workers pack requests (worker_options.LogprobBatchingConfig)."""
    transfer: EngineTransferConfig = derived(EngineTransferConfig(), "the trainer: --transfer.weight_transfer after --")
    """The generation engines' weight transfer: the trainer's --transfer.weight_transfer, set by
    with_trainer_settings (no flag here: the option has one source)."""
    sharing: PromptSharingConfig = derived(PromptSharingConfig(), "the trainer: --model.share_prompts after --")
    """The logprob workers' prompt sharing: the trainer's --model.share_prompts, set by
    with_trainer_settings."""
    worker_start_timeout_s: float = 600.0
    """Give up if a worker has not registered by then (vLLM on CPU takes ~1 min)."""
    health: HealthCheckConfig = flattened(HealthCheckConfig())
    """How each dispatcher probes its worker (worker_options.HealthCheckConfig)."""
    restart: RestartConfig = flattened(RestartConfig())
    """How each dispatcher replaces a worker that failed (worker_options.RestartConfig)."""
    host_gpus: int | None = None
    """Plan for this many GPUs instead of those the NVIDIA driver lists: for --dry_run of another
    machine's plan, or, on a machine without CUDA, to run the plan on Ray's fake GPUs (how the
    tests check placement on CPU). 0 forces the CPU plan."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU that the plan assumes; None: what CUDA reports for GPU 0 (80 GiB when
    host_gpus names GPUs this machine lacks)."""
    tune_processes: bool = True
    """Per-kind process settings (async_grpo/launch/process_tuning.py): Ray's jemalloc for the
    generation path, intra-op threads from the machine's cores. False: every process on glibc with
    fixed 256 KiB malloc thresholds (benchmarks/step_profile.py's baseline)."""
    cpu: CpuPlanConfig = flattened(CpuPlanConfig())
    """How a CPU run's processes share the host's cores (launch/cpu_plan.py; --cpu_split split: their own)."""
    dry_run: bool = False
    """Print the placement plan and the engine settings it implies, then exit without starting
    anything."""

    @property
    def worker_counts(self) -> dict[str, int]:
        """Workers to start of each kind ('generation', 'logprob', 'reference', 'teacher', 'judge'), in start order."""
        return {"generation": self.generation_workers, "logprob": self.logprob_workers,
                "reference": self.reference_workers, "teacher": self.teacher_workers, "judge": self.judge_workers}

    @property
    def total_workers(self) -> int:
        """Workers of every kind: each takes one GPU on a GPU machine."""
        return sum(self.worker_counts.values())

    def __post_init__(self) -> None:
        if not self.log_dir:
            if not self.run_dir:
                raise ValueError("LocalClusterConfig needs run_dir (--run_dir) or log_dir")
            object.__setattr__(self, "log_dir", self.run_dir)
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ValueError(f"LocalClusterConfig.nproc_per_node must be >= 1 or None, got {self.nproc_per_node}")
        if self.host_gpus is not None and self.host_gpus < 0:
            raise ValueError(f"LocalClusterConfig.host_gpus must be >= 0 or None, got {self.host_gpus}")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ValueError(f"LocalClusterConfig.gpu_memory_gib must be > 0 or None, got {self.gpu_memory_gib}")
        if self.generation_workers < 1:
            raise ValueError(f"LocalClusterConfig.generation_workers must be >= 1, got {self.generation_workers}")
        for name in ("logprob_workers", "reference_workers", "teacher_workers", "judge_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"LocalClusterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.teacher_workers and not self.teacher_model_path:
            raise ValueError("LocalClusterConfig.teacher_workers needs teacher_model_path (--teacher_model_path)")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def plan_for(config: LocalClusterConfig, trainer_config: TrainerConfig | None = None) -> tuple[Placement, RunShape]:
    """The placement of this run (PlacementError when it does not fit), and what it was planned for;
    without the trainer's config, its defaults stand in for the token budget and model options,
    and the engines' KV cache is not sized to the run."""
    gpus = planned_gpus(config.host_gpus).count
    memory = gpu_memory_bytes(gpus, config.gpu_memory_gib)
    model_options = trainer_config.model if trainer_config is not None else None
    ranks = config.nproc_per_node or default_trainer_ranks(
        gpus, config.generation_workers * config.engine.tensor_parallel_size + config.total_workers
        - config.generation_workers)
    run = RunShape(
        trainer_ranks=ranks,
        max_tokens_per_gpu=trainer_config.experience.max_tokens_per_gpu if trainer_config is not None else 8192,
        logprob_chunk_size=model_options.logprob_chunk_size if model_options else 1024,
        gradient_checkpointing=model_options.gradient_checkpointing if model_options else False,
        generation_workers=config.generation_workers, tensor_parallel_size=config.engine.tensor_parallel_size,
        logprob_workers=config.total_workers - config.generation_workers, judge_workers=config.judge_workers,
        max_tokens_per_forward=config.batching.max_tokens_per_forward,
        context_parallel=model_options.context_parallel if model_options else 1,
        **(_run_load(trainer_config, ranks) if trainer_config is not None else {}))
    if gpus == 0 and run.context_parallel == 1:
        return Placement(), run
    shape = ModelShape.from_hf_config(json.loads((Path(config.model_path) / "config.json").read_text()))
    check_context_plan(gpus, memory, shape, run)  # cp's heads, ranks and the smallest cp that fits, first
    return plan_placement(gpus, memory, shape, run), run


def _run_load(trainer_config: TrainerConfig, ranks: int) -> dict[str, int]:
    """RunShape's fields for what the trainer can have in flight and computes in: sequences at
    once ((max_lag + 1) steps of every consumer's prompts x n: a rank's, or a context-parallel
    group's), the longest sample, the compute dtype."""
    experience = trainer_config.experience
    steps, consumers = experience.max_lag + 1, ranks // trainer_config.model.context_parallel
    return dict(sequences_in_flight=steps * consumers * trainer_config.prompts_per_rank * experience.sampling.n,
                max_model_len=trainer_config.longest_sample,
                compute_dtype_bytes=BF16_BYTES if trainer_config.model.mixed_precision else FP32_BYTES)


class LocalCluster:
    """Context manager owning a Ray head and the dispatcher processes started into it."""

    def __init__(self, config: LocalClusterConfig, placement: Placement | None = None,
                 longest_sample: int | None = None, cuda: bool | None = None, cpu_plan: CpuPlan | None = None) -> None:
        """`placement`, `cpu_plan`: where everything goes, on GPUs and on the CPU's cores (main
        passes the plans it printed); None plans from this host and the config alone. `longest_sample`: the run's longest prompt + response,
        the engines' max_model_len on CUDA. `cuda`: whether the engines run on CUDA (None: whether
        this machine has it; a plan on Ray's fake GPUs runs CPU engines)."""
        self.config = config
        self.placement = placement if placement is not None else plan_for(config)[0]
        self.cpu_plan = cpu_plan or cpu_plan_for(config, self.placement)
        self.gpus = planned_gpus(config.host_gpus)
        cuda = cuda_available() if cuda is None else cuda
        self.engine, self.engine_choices = resolve_engine(config.engine, self.placement, cuda, longest_sample)
        self.judge_engine = judge_engine(config.engine, self.engine, self.placement, cuda)
        self.address = ""
        self.temp_dir = ""
        self._dispatchers: list[tuple[str, subprocess.Popen, Path]] = []
        self._relay: DispatcherLogRelay | None = None

    def __enter__(self) -> "LocalCluster":
        Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
        for line in self.engine_choices:
            logger.info("%s", line)
        # tempfile also fixes this process's own temp folder (it caches it) before TMPDIR changes.
        self.temp_dir = make_run_temp_dir()
        try:
            # The head's processes (and the actors its raylet starts) inherit its environment and cores.
            with environ(self.head_env()), pinned_thread(self.cpu_plan.pinned(self.cpu_plan.driver)):
                self.address = init_local_ray(num_cpus=self.config.num_cpus, namespace=RAY_NAMESPACE,
                                              log_to_driver=False, num_gpus=len(self.placement.worker_gpus))
        except BaseException:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise
        logger.info("Ray head at %s (127.0.0.1 only, no dashboard); temporary files in %s", self.address,
                    self.temp_dir)
        return self

    def head_env(self) -> dict[str, str]:
        """What the Ray head starts with: the run's process settings and, on GPUs, the workers'
        GPUs (Ray reads the head's CUDA_VISIBLE_DEVICES to know which GPUs it may hand out)."""
        env = run_environment(self.temp_dir, self.config.tune_processes)
        if self.placement.worker_gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus.child_visible_devices(self.placement.worker_gpus)
        return env

    def env(self) -> dict[str, str]:
        """Environment for child processes: join this cluster, import this repo."""
        env = dict(os.environ)
        env.update(run_environment(self.temp_dir, self.config.tune_processes))
        env["RAY_ADDRESS"] = self.address
        env["PYTHONPATH"] = repo_pythonpath(env.get("PYTHONPATH", ""))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def dispatcher_args(self, kind: str, index: int = 0) -> list[str]:
        """worker_dispatcher.py's flags for worker `index` of `kind` ('generation', 'logprob',
        'reference', 'teacher' or 'judge'; the teacher and the judge load their own model paths):
        the sections this config shares with the dispatcher, as flags (run_config.config_to_flags),
        where they differ from the dispatcher's defaults."""
        c = self.config
        path = {"teacher": c.teacher_model_path, "judge": c.judge_model_path}.get(kind) or c.model_path
        common = ["--mode", kind, "--model_path", path,
                  *config_to_flags(c.health), *config_to_flags(c.restart)]
        if not c.tune_processes:
            common += ["--tune_processes", "false"]
        else:
            common += ["--threads", str(self.cpu_plan.threads_of(f"{kind}-{index}"))]
        if self.placement.on_gpu and self.placement.worker_gpu_share < 1:
            common += ["--num_gpus", f"{self.placement.worker_gpu_share:g}"]
        if kind == "generation":
            return [*common, *config_to_flags(c.verification), *config_to_flags(self.engine),
                    *config_to_flags(c.transfer)]
        if kind == "judge":  # a generative judge's engine (judge_engine), a reward-model head's batching
            return [*common, *config_to_flags(c.judge), *config_to_flags(self.judge_engine),
                    *config_to_flags(c.batching)]
        if kind in ("logprob", "reference", "teacher"):
            return [*common, "--dtype", self.engine.dtype, *config_to_flags(c.batching), *config_to_flags(c.sharing)]
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
        counts = self.config.worker_counts
        # Workers sharing a GPU start one at a time: vLLM checks at start that its share of the
        # GPU is free, and its memory profiling fails if another process frees memory meanwhile.
        one_by_one = self.placement.on_gpu and self.placement.worker_gpu_share < 1
        for kind, count in counts.items():
            for i in range(count):
                self._dispatch(f"{kind}-{i}", self.dispatcher_args(kind, i))
                if one_by_one:
                    self._wait_registered()
        self._relay = DispatcherLogRelay([(label, log) for label, _, log in self._dispatchers])
        self._relay.start()
        self._wait_registered()
        for kind, count in counts.items():
            if count:
                logger.info("to add a %s worker to this cluster, run:\n  %s", kind, self.add_worker_command(kind))

    def _dispatch(self, label: str, args: list[str]) -> None:
        log = Path(self.config.log_dir) / f"{label}_worker.log"
        handle = log.open("w")
        with pinned_thread(self.cpu_plan.pinned(self.cpu_plan.driver)):  # its worker's cores go in its env
            process = subprocess.Popen([sys.executable, str(REPO_ROOT / "worker_dispatcher.py"), *args],
                                       stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                       env={**self.env(), **self.cpu_plan.dispatcher_env(label)})
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
                if registered_worker(text) is not None:
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

    def trainer_env(self, nproc_per_node: int) -> dict[str, str]:
        """The environment run_trainer gives torchrun (and so each of its nproc_per_node ranks): this
        cluster's (env), the trainer's GPUs, and each rank's intra-op threads."""
        env = self.env()
        if self.placement.trainer_gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus.child_visible_devices(self.placement.trainer_gpus)
        env.update(thread_env(self.cpu_plan.trainer_threads(nproc_per_node), self.config.tune_processes))
        if nproc_per_node > 1:
            # The value torchrun sets itself for several ranks, given here (when no thread count
            # is) so that torchrun does not print its five-line banner about it on the console.
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

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
        with pinned_thread(self.cpu_plan.pinned(self.cpu_plan.trainer)):  # torchrun's ranks inherit the cores
            process = subprocess.Popen(command, env=self.trainer_env(nproc_per_node), cwd=REPO_ROOT,
                                       start_new_session=True, stdout=out, stderr=subprocess.STDOUT if out else None)
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


def _interrupt_on_sigterm() -> None:
    """Make SIGTERM (kill, a scheduler's stop) unwind like Ctrl-C, so every cleanup runs."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    own, trainer_args = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    try:
        config = load_config(LocalClusterConfig, own, description=__doc__)
    except ConfigError as error:  # a value its field refuses, or no --run_dir / --log_dir
        exit_config_error(PROGRAM, str(error))
    if not config.run_dir:
        exit_config_error(PROGRAM, "--run_dir is required (the trainer's run directory)")
    trainer_args = ["--run_dir", config.run_dir, "--model.model_path", config.model_path, *trainer_args]
    check_environment(config)
    trainer_config = load_trainer_config(trainer_args)  # prints its one line and exits 2 itself
    check_judge_pool(PROGRAM, config.judge_workers, trainer_config.experience.sampling.reward.uses_judge)
    config = with_trainer_settings(config, trainer_config)
    placement, run, cpu_plan = plan_or_exit(config, trainer_config)
    # A dry run shows the plan of the machine it describes: a GPU plan gets the CUDA engine settings.
    cuda = cuda_available() or (config.dry_run and placement.on_gpu)
    cluster = LocalCluster(config, placement, trainer_config.longest_sample, cuda=cuda, cpu_plan=cpu_plan)
    cpu_lines = cpu_plan.lines() if not placement.on_gpu else []
    plan_lines = placement.lines(run) + cpu_lines + cluster.engine_choices
    if config.dry_run:
        print("\n".join(plan_lines), flush=True)
        return 0
    check_engine_compile(config, cuda)
    setup_logging(config, trainer_config)
    from async_grpo.telemetry.console import CONSOLE, LOG_FILE
    check_trainer_inputs(trainer_config, max_lora_rank=config.engine.max_lora_rank)
    if config.teacher_workers:
        check_teacher_model(PROGRAM, config.teacher_model_path, config.model_path)
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)  # the checks passed: run.log can start
    _interrupt_on_sigterm()
    for line in plan_lines:  # one record each: every console line carries its clock; the default plan's
        logger.info("%s", line, extra=CONSOLE if cpu_plan.split or line not in cpu_lines else None)  # in run.log
    logger.info("starting Ray (127.0.0.1 only), %s, then the trainer (%d ranks); logs in %s", _workers_text(config),
                run.trainer_ranks, config.log_dir, extra=CONSOLE)
    with cluster:
        started = time.monotonic()
        cluster.start_workers()
        logger.info("workers ready after %.0f s; starting the trainer (every INFO line in %s)",
                    time.monotonic() - started, Path(config.run_dir) / LOG_FILE, extra=CONSOLE)
        return cluster.run_trainer(trainer_args, run.trainer_ranks)


def plan_or_exit(config: LocalClusterConfig, trainer_config: TrainerConfig) -> tuple[Placement, RunShape, CpuPlan]:
    """The placement plan, checked against the trainer's weight transfer, and the CPU plan; exit 2
    with one line when the run does not fit, the transfer cannot work on it, or the cores not split."""
    try:
        placement, run = plan_for(config, trainer_config)
        check_transfer_placement(trainer_config.transfer.weight_transfer, placement)
        return placement, run, cpu_plan_for(config, placement, run.trainer_ranks)
    except (PlacementError, HostGpuError, ValueError, OSError) as error:
        exit_config_error(PROGRAM, str(error))


def cpu_plan_for(config: LocalClusterConfig, placement: Placement, ranks: int | None = None) -> CpuPlan:
    """The CPU plan (launch/cpu_plan.py) on this host's usable cores; CpuPlanError when its split cannot be made."""
    return plan_cpu(config.cpu, usable_core_ids(), config.worker_counts, ranks or config.nproc_per_node or 2,
                    placement.host_gpus)


def load_trainer_config(trainer_args: list[str]) -> TrainerConfig:
    """The trainer's config, as the trainer will load it (exit 2 with one line if it does not)."""
    from trainer_core import load_trainer_config as load

    return load(trainer_args)


def with_trainer_settings(config: LocalClusterConfig, trainer_config: TrainerConfig) -> LocalClusterConfig:
    """`config` with the options its workers read from the trainer's config (the weight-transfer
    backend, prompt sharing; each declared once, in worker_options), so both ends agree."""
    return dataclasses.replace(config, transfer=shared_part(EngineTransferConfig, trainer_config.transfer),
                               sharing=shared_part(PromptSharingConfig, trainer_config.model))


def setup_logging(config: LocalClusterConfig, trainer_config: TrainerConfig) -> None:
    """The launcher's console follows the trainer's log_level; its INFO lines go to the run's
    run.log, beside rank 0's."""
    import importlib

    from async_grpo.telemetry.console import LOG_FILE, configure_logging

    importlib.import_module("ray")  # Ray installs its own log handler when imported: import it first

    configure_logging(trainer_config.log_level, log_file=Path(config.run_dir) / LOG_FILE, tag="[launcher] ")


def _workers_text(config: LocalClusterConfig) -> str:
    """'2 workers (1 generation, 1 logprob)'."""
    kinds = ", ".join(f"{count} {kind}" for kind, count in config.worker_counts.items() if count)
    return f"{config.total_workers} worker{'s' if config.total_workers != 1 else ''} ({kinds})"


def check_environment(config: LocalClusterConfig) -> None:
    """Installed versions, before Ray or any worker starts; exit 2 with one line."""
    from async_grpo.config.versions import WORKER_REQUIREMENTS, VersionError, check_versions

    try:
        check_versions(WORKER_REQUIREMENTS)
    except VersionError as error:
        exit_config_error(PROGRAM, str(error))


def check_engine_compile(config: LocalClusterConfig, cuda: bool) -> None:
    """A compiling engine (enforce_eager false) needs a C compiler and Python's headers on this
    host: exit 2 with one line naming what is missing, before Ray or any worker starts."""
    from async_grpo.runtime.compile_needs import missing_compile_needs

    message = missing_compile_needs(config.engine.enforce_eager, on_cpu=not cuda)
    if message:
        exit_config_error(PROGRAM, message)


def check_trainer_inputs(trainer_config: TrainerConfig, max_lora_rank: int = 0) -> None:
    """Load the trainer's model folder, prompts and evaluation file as the trainer will, before
    Ray or any worker starts; exit 2 with one line on the first problem (also when the trainer
    trains LoRA adapters the generation workers, max_lora_rank, could not serve)."""
    from async_grpo.config.worker_options import vllm_lora_rank
    from async_grpo.trainer.run_inputs import InputError, load_run_inputs

    started = time.monotonic()
    lora_r = trainer_config.model.lora.r
    if lora_r > max_lora_rank:
        exit_config_error(PROGRAM, f"the trainer's model.lora.r={lora_r} needs generation workers that serve "
                                   f"LoRA adapters: pass --max_lora_rank {vllm_lora_rank(lora_r)}")
    try:
        inputs = load_run_inputs(trainer_config, with_evaluator=True)
    except InputError as error:
        exit_config_error(PROGRAM, str(error))
    logger.info("trainer inputs checked in %.1f s: %d prompts", time.monotonic() - started, len(inputs.prompts))


# Exit status of a run stopped by Ctrl-C or SIGTERM (the shell's 128 + SIGINT).
INTERRUPTED_EXIT = 130


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # LocalCluster's exit has stopped the trainer, the workers and Ray by now
        print("local_cluster.py: interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
