"""Start one inference worker on this node, register it with its pool, and keep it alive.

Run one dispatcher per worker, on the node that should host it, after the Ray cluster is up
(`ray start --head ...` on the head, `ray start --address=<head>:6379` elsewhere):

    python worker_dispatcher.py --model_path /dev/shm/qwen7b-math-base --mode generation \
        --tensor_parallel_size 1 --max_num_seqs 128 --global_num_verifiers 100 \
        --write_failed_generation_samples | tee generation_worker_0.log &
    torchrun --nproc_per_node=1 --master_port=12347 worker_dispatcher.py \
        --model_path /dev/shm/qwen7b-math-base --mode logprob | tee logprob_worker_0.log &

(`--mode reference` starts a logprob worker on the frozen reference model, for runs whose logprob
workers compute old-policy logprobs and that need reference logprobs too: trainer
`logprob_role: old_policy` with `reference_pool: true`. `--mode judge` starts a judge of the
reward named `judge`: `--judge_kind generative` a vLLM engine, `reward_model` an HF
sequence-classification head; a judge never receives weight pushes.)

Each dispatcher joins the cluster (RAY_ADDRESS, else --ray_address), gets or creates the
registry of its kind, claims the next free worker name ("generation-worker-3"), starts the
worker actor pinned to this node with the repository on its PYTHONPATH, waits for its engine,
registers it and prints `worker <name> registered`. Registration loads the weights the trainer
last published, so a worker joining a running job never serves old weights. Start training once
every worker has printed that line. The dispatcher then supervises its worker: when the worker
dies or reports itself FAILED (engine died, weight update failed or timed out), it logs why,
removes what the worker left in /dev/shm, and starts a new one under a new name (up to
--max_restarts times, waiting --restart_backoff_s, doubling); after that it exits 1. On Ctrl-C /
SIGTERM it deregisters the worker, stops it and exits 0. The worker is owned by the dispatcher,
so killing the dispatcher outright takes the worker with it (the registry then drops it at its
next health check or failed request).

Operators see every pool's workers with (async_grpo/launch/status_command.py):

    python worker_dispatcher.py status

Ray has no authentication unless its token auth is on: run clusters on a trusted network only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from async_grpo.config.model_path import ModelPathError, check_model_dir
from async_grpo.config.run_config import CONFIG_ERROR_EXIT, ConfigError, flattened, load_config
from async_grpo.config.versions import (
    LOGPROB_WORKER_REQUIREMENTS, WORKER_REQUIREMENTS, VersionError, check_versions,
)
from async_grpo.config.worker_options import (
    VLLM_GPU_MEMORY_UTILIZATION, EngineConfig, EngineTransferConfig, FailedSamplesConfig, HealthCheckConfig,
    JudgeServingConfig, LogprobBatchingConfig, PromptSharingConfig, RayConnectionConfig, RestartConfig, VerificationConfig,
    check_transfer_packages, check_weight_transfer_device,
)
from async_grpo.inference.engine_dtype import AUTO_DTYPE, dtype_choice_line, resolve_engine_dtype
from async_grpo.launch.dispatcher_logs import REGISTERED_LINE, write_line
from async_grpo.launch.local_processes import StopFlag
from async_grpo.runtime.processes import exit_without_teardown
from async_grpo.launch.node_resources import (
    CPU_KV_CACHE_MAX_BYTES, CPU_KV_CACHE_MIN_BYTES, NODE_ID_CHARS, NodeLostError, actor_exists, cpu_kv_cache_bytes,
    gpu_holders, gpus_per_worker, node_alive, node_gpu_count, node_runs_cuda,
)
from async_grpo.launch.process_tuning import thread_env, worker_env
from async_grpo.runtime.ray_access import ClusterJoinError, join_cluster, shared_memory_owner
from async_grpo.config.actor_names import GENERATION, JUDGE, RAY_NAMESPACE, WORKER_KINDS, registry_name, worker_actor_name
from async_grpo.launch.ray_env import actor_runtime_env
from async_grpo.launch.status_command import STATUS_COMMAND, run_status
from vllm_registry import RegistryConfig, WorkerState, get_or_create_registry

logger = logging.getLogger(__name__)

RESTARTING_LINE = "worker {name} restarting ({restart} of {max_restarts}): {reason}"
_MAX_BACKOFF_S = 60.0
# A worker holds a request's cost while it also scores the finished group, so a cap of twice
# the engine's batch keeps the engine fed while earlier groups are being verified.
_GENERATION_CAP_PER_SEQ_SLOT = 2
# Likewise for logprob workers: one token-budgeted batch running and one filling.
_LOGPROB_CAP_PER_BATCH = 2
# How many indices to try before concluding that names are not being freed (a registry that
# restarted hands out indices from 0 again while older workers still hold them).
_MAX_NAME_ATTEMPTS = 1000
_STOP_POLL_S = 1.0  # how often a long wait checks whether Ctrl-C / SIGTERM arrived
_TEARDOWN_TIMEOUT_S = 30.0  # bound on each cleanup call, so a wedged worker cannot block exit


@dataclass(kw_only=True, frozen=True)
class DispatcherConfig:
    """One dispatcher: which worker to start, how, and how to watch it.

    The engine and batching options are the workers' own sections (worker_options), embedded
    flat (`--max_num_seqs`, `--max_tokens_per_forward`) and handed to the worker as they are.
    """

    mode: str = ""
    """Worker kind: 'generation' (vLLM rollouts + rewards), 'logprob' (reference or old-policy
    logprobs), 'reference' (the frozen reference model), 'teacher' (a distillation teacher) or
    'judge' (the reward's model judge); the last three never receive weight pushes."""
    model_path: str = ""
    """Hugging Face model folder, readable at the same path on this node."""
    engine: EngineConfig = flattened(EngineConfig())
    """Generation: the vLLM engine's options (its dtype also serves logprob workers)."""
    transfer: EngineTransferConfig = flattened(EngineTransferConfig())
    """Generation: how the trainer's full weights reach the engine (the trainer's
    --transfer.weight_transfer; the local launcher passes it on)."""
    batching: LogprobBatchingConfig = flattened(LogprobBatchingConfig())
    """Logprob (and a reward-model judge): how requests are packed into forwards."""
    judge: JudgeServingConfig = flattened(JudgeServingConfig())
    """Judge: a generative judge or a reward-model head (worker_options.JudgeServingConfig)."""
    sharing: PromptSharingConfig = flattened(PromptSharingConfig())
    """Logprob: whether a forward lays a prompt out once (the trainer's --model.share_prompts;
    the local launcher passes it on)."""
    verification: VerificationConfig = flattened(VerificationConfig())
    """Generation: the cluster-wide math-verify pool (worker_options.VerificationConfig)."""
    failed_samples: FailedSamplesConfig = flattened(FailedSamplesConfig())
    """Generation: where samples whose generation or scoring failed go (worker_options.FailedSamplesConfig)."""
    num_cpus: float = 1.0
    """CPUs the worker actor reserves in Ray's accounting."""
    tune_processes: bool = True
    """Give the worker its kind's process settings (async_grpo/launch/process_tuning.py: Ray's
    jemalloc for a generation worker and its engine core). False: none."""
    threads: int | None = None
    """Intra-op threads of the worker (OMP_NUM_THREADS, MKL_NUM_THREADS; the vLLM engine core
    inherits them). None: Ray's default for an actor, its num_cpus (1). The local launcher gives
    each compute process its share of the machine's cores (process_tuning.threads_per_process)."""
    # The local launcher's plan shares GPUs so on one or two GPUs. A shared GPU needs the engine's
    # memory sized because vLLM's default takes 0.92 of the GPU.
    num_gpus: float | None = None
    """GPUs the worker takes in Ray's accounting on a GPU node. None: the engine's
    tensor_parallel_size, else 1. A fraction below 1 shares a GPU; a generation worker then needs
    --gpu_memory_utilization or --kv_cache_memory_bytes sized to fit beside the others."""
    connection: RayConnectionConfig = flattened(RayConnectionConfig())
    """Which cluster to join and how long to try (worker_options.RayConnectionConfig)."""
    ray_temp_dir: str = ""
    """The Ray node to run on, by its temp folder (`ray start --temp-dir`), when several Ray nodes
    share this machine's address; '': Ray's choice (the head node, where there is one)."""
    start_timeout_s: float = 1800.0
    """Give up (exit 1) if the worker is not started by then (no free GPU on this node, stuck
    loading)."""
    health: HealthCheckConfig = flattened(HealthCheckConfig())
    """How often the dispatcher probes its worker (worker_options.HealthCheckConfig)."""
    restart: RestartConfig = flattened(RestartConfig())
    """How the dispatcher replaces a worker that failed while serving (worker_options.RestartConfig)."""

    def __post_init__(self) -> None:
        if self.mode not in WORKER_KINDS:
            raise ValueError(f"DispatcherConfig.mode must be one of {WORKER_KINDS}, got {self.mode!r}")
        if not self.model_path:
            raise ValueError("DispatcherConfig.model_path must be set (--model_path)")
        if self.mode != GENERATION and self.engine.tensor_parallel_size != 1:
            raise ValueError(f"DispatcherConfig.tensor_parallel_size must be 1 in {self.mode} mode (one device per worker)")
        if self.num_cpus < 0:
            raise ValueError(f"DispatcherConfig.num_cpus must be >= 0, got {self.num_cpus}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"DispatcherConfig.threads must be >= 1 or None, got {self.threads}")
        if self.num_gpus is not None and not 0 < self.num_gpus:
            raise ValueError(f"DispatcherConfig.num_gpus must be > 0 or None (whole GPUs), got {self.num_gpus}")
        if self.num_gpus is not None and self.num_gpus < 1 and self.engine.tensor_parallel_size != 1:
            raise ValueError(f"DispatcherConfig.num_gpus {self.num_gpus} shares a GPU, which an engine of "
                             f"tensor_parallel_size {self.engine.tensor_parallel_size} cannot do")
        if not self.start_timeout_s > 0:
            raise ValueError(f"DispatcherConfig.start_timeout_s must be > 0, got {self.start_timeout_s}")


def generation_worker_config(cfg: DispatcherConfig, cuda: bool = True) -> Any:
    """vllm_worker.GenerationWorkerConfig for this dispatcher (paths made absolute for the
    actor), its engine chosen for this node (engine_for_node)."""
    from vllm_worker import GenerationWorkerConfig

    failed = dataclasses.replace(cfg.failed_samples,
                                 failed_samples_path=str(Path(cfg.failed_samples.failed_samples_path).resolve()))
    return GenerationWorkerConfig(
        model_path=str(Path(cfg.model_path).resolve()), engine=engine_for_node(cfg.engine, cuda),
        transfer=cfg.transfer, failed_samples=failed, verification=cfg.verification,
    )


def judge_worker_config(cfg: DispatcherConfig, cuda: bool = True) -> Any:
    """judge_worker.JudgeWorkerConfig for this dispatcher: a generative judge's engine chosen for
    this node as a generation worker's is (engine_for_node); the path made absolute."""
    from async_grpo.inference.judge_worker import JudgeWorkerConfig

    engine = engine_for_node(cfg.engine, cuda) if cfg.judge.judge_kind == "generative" else cfg.engine
    return JudgeWorkerConfig(model_path=str(Path(cfg.model_path).resolve()), serving=cfg.judge, engine=engine,
                             batching=cfg.batching)


def engine_for_node(engine: EngineConfig, cuda: bool) -> EngineConfig:
    """`engine` as a vLLM engine on this node starts it: on a node without CUDA (`cuda` False) its
    dtype 'auto' becomes float32 (inference/engine_dtype.py) and, with no KV-cache size or memory
    fraction given, the KV cache gets cpu_kv_cache_bytes of the memory free now; both choices are logged."""
    if not cuda and engine.dtype == AUTO_DTYPE:
        engine = dataclasses.replace(engine, dtype=resolve_engine_dtype(engine.dtype, on_cpu=True))
        logger.info("CPU node: %s", dtype_choice_line(AUTO_DTYPE, engine.dtype, on_cpu=True))
    if not cuda and engine.kv_cache_memory_bytes is None and engine.gpu_memory_utilization is None:
        import psutil

        available = psutil.virtual_memory().available
        engine = dataclasses.replace(engine, kv_cache_memory_bytes=cpu_kv_cache_bytes(available))
        logger.info("CPU node: vLLM KV cache %.2f GiB (1/8 of the %.2f GiB free, within [%.2f, %.0f] GiB; "
                    "--kv_cache_memory_bytes or --gpu_memory_utilization to change)",
                    engine.kv_cache_memory_bytes / 2**30, available / 2**30, CPU_KV_CACHE_MIN_BYTES / 2**30,
                    CPU_KV_CACHE_MAX_BYTES / 2**30)
    return engine


def logprob_worker_config(cfg: DispatcherConfig) -> Any:
    """logprob_worker.LogprobWorkerConfig for this dispatcher, in the engine's dtype.

    The device is 'auto', resolved in the actor: the GPU Ray grants it (it sees only that one, as
    cuda:0) where CUDA works, else the CPU (Ray's fake GPUs on a CPU node included).
    """
    from logprob_worker import LogprobWorkerConfig

    return LogprobWorkerConfig(model_path=str(Path(cfg.model_path).resolve()), device="auto", kind=cfg.mode,
                               batching=cfg.batching, sharing=cfg.sharing, dtype=cfg.engine.dtype)


def registry_config_for(mode: str, worker_config: Any) -> RegistryConfig:
    """Per-worker cap in the pool's cost unit: sequences (generation, judge: a judge request is
    one) or tokens (logprob)."""
    if mode in (GENERATION, JUDGE):
        return RegistryConfig(max_inflight_cost_per_worker=_GENERATION_CAP_PER_SEQ_SLOT * worker_config.engine.max_num_seqs)
    return RegistryConfig(max_inflight_cost_per_worker=_LOGPROB_CAP_PER_BATCH * worker_config.batching.max_tokens_per_forward)


def _judge_engine(cfg: DispatcherConfig) -> bool:
    """The dispatcher starts a generative judge (a vLLM engine)."""
    return cfg.mode == JUDGE and cfg.judge.judge_kind == "generative"


def check_shared_gpu_memory(cfg: DispatcherConfig, cuda: bool) -> None:
    """ValueError when a generation worker shares a CUDA GPU (--num_gpus below 1) with vLLM's
    default memory share, which would claim 0.92 of the GPU and fail beside the other processes."""
    engine = cfg.engine
    sharing = cfg.num_gpus is not None and cfg.num_gpus < 1
    if (cuda and sharing and (cfg.mode == GENERATION or _judge_engine(cfg)) and engine.gpu_memory_utilization is None
            and engine.kv_cache_memory_bytes is None):
        raise ValueError(f"--num_gpus {cfg.num_gpus:g} shares a GPU, and vLLM's default gpu_memory_utilization "
                         f"({VLLM_GPU_MEMORY_UTILIZATION}) takes nearly all of it: set --gpu_memory_utilization to "
                         f"this engine's share of the GPU's memory")


def check_engine_transfer(cfg: DispatcherConfig, cuda: bool) -> None:
    """ValueError (one line) when this node cannot serve the generation engine's weight transfer:
    a CUDA transfer without CUDA, or a package it imports missing (nccl_m2n's nccl.m2n)."""
    if cfg.mode == GENERATION:
        check_weight_transfer_device(cfg.transfer.weight_transfer, has_cuda=cuda)
        check_transfer_packages(cfg.transfer.weight_transfer, "generation worker's node")


def claim_worker_name(registry: ActorHandle, kind: str) -> str:
    """The first registry-allocated worker name that no live actor holds."""
    for _ in range(_MAX_NAME_ATTEMPTS):
        name = worker_actor_name(kind, ray.get(registry.allocate_index.remote()))
        if not actor_exists(name):
            return name
    raise RuntimeError(f"{registry_name(kind)}: no free worker name after {_MAX_NAME_ATTEMPTS} indices")


# vLLM's ipc weight transfer sends CUDA IPC handles (torch classes and dtypes) to the engine-core
# process through its msgpack encoder, which refuses them unless this is set (vLLM 0.32's own
# examples/rl/rlhf_ipc.py sets it on the engine's actor); the handles come from the trainer,
# a process of the same run.
IPC_TRANSFER_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def worker_runtime_env(cfg: DispatcherConfig) -> dict[str, Any]:
    """The worker actor's runtime env: this repository importable, its kind's process settings
    (process_tuning.worker_env), and IPC_TRANSFER_ENV for a generation worker whose engine
    receives weights over vLLM's ipc transfer."""
    runtime_env = actor_runtime_env()
    runtime_env["env_vars"] = {**runtime_env["env_vars"], **worker_env(cfg.mode, cfg.tune_processes)}
    if cfg.threads is not None:
        runtime_env["env_vars"].update(thread_env(cfg.threads, tune=True))
    if cfg.mode == GENERATION and cfg.transfer.weight_transfer == "ipc":
        runtime_env["env_vars"] = {**runtime_env["env_vars"], **IPC_TRANSFER_ENV}
    return runtime_env


def create_worker_actor(cfg: DispatcherConfig, name: str, worker_config: Any, node_id: str, gpus: float) -> ActorHandle:
    """The worker actor, pinned to this node, importing this repository (vLLM's engine-core too)."""
    if cfg.mode == GENERATION:
        from vllm_worker import GenerationWorkerActor as actor_class
    elif cfg.mode == JUDGE:
        from async_grpo.inference.judge_worker import JudgeWorkerActor as actor_class
    else:
        from logprob_worker import LogprobWorkerActor as actor_class
    return actor_class.options(
        name=name,
        namespace=RAY_NAMESPACE,
        num_cpus=cfg.num_cpus,
        num_gpus=gpus,
        max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        runtime_env=worker_runtime_env(cfg),
    ).remote(name, worker_config)


def wait_placed(actor: ActorHandle, name: str, spec: "WorkerSpec", timeout_s: float, stop: StopFlag) -> bool:
    """Block until Ray has placed and constructed the worker actor (True) or a stop signal arrives
    (False). Without this bound a worker asking for a GPU that another actor holds waits in Ray's
    queue forever, saying nothing: RuntimeError naming the node and who holds its GPUs instead."""
    ref = actor.health.remote()  # answers once the actor exists on the node
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        ready, _ = ray.wait([ref], timeout=_STOP_POLL_S)
        if ready:
            return True
        if time.monotonic() > deadline:
            node = spec.node_id[:NODE_ID_CHARS]
            if not spec.gpus:
                raise RuntimeError(f"worker {name} was not placed on node {node} within {timeout_s:.0f} s "
                                   f"(its CPUs are taken, or the worker is still loading its model)")
            held_by = ", ".join(gpu_holders(spec.node_id)) or "actors outside the worker pools"
            raise RuntimeError(f"no free GPU on node {node} for worker {name} within {timeout_s:.0f} s: it needs "
                               f"{spec.gpus} of the node's {node_gpu_count(spec.node_id)}, held by {held_by}")
    return False


def wait_started(actor: ActorHandle, name: str, timeout_s: float, stop: StopFlag) -> bool:
    """Block until the worker's start() returns (True) or a stop signal arrives (False).

    Raises RuntimeError naming the worker if it fails, dies or does not start in time.
    """
    ref = actor.start.remote()
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        ready, _ = ray.wait([ref], timeout=_STOP_POLL_S)
        if ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                raise RuntimeError(f"worker {name} failed to start: {_root_error(err)}") from err
            return True
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"worker {name} not started after {timeout_s:.0f} s (unschedulable on this node, or stuck loading)"
            )
    return False


class WorkerDiedError(RuntimeError):
    """The dispatcher's worker died (`actor_dead`) or reported itself FAILED while serving."""

    def __init__(self, message: str, *, actor_dead: bool) -> None:
        super().__init__(message)
        self.actor_dead = actor_dead


def ensure_registered(kind: str, name: str, registry_config: RegistryConfig) -> None:
    """Register the worker again if its registry lost it (the registry was restarted, or dropped
    the worker after a transient error); a failure is logged and retried at the next check."""
    registry = get_or_create_registry(kind, registry_config)
    try:
        if name not in ray.get(registry.live_workers.remote()):
            logger.warning("worker %s was not registered with %s; registering again", name, registry_name(kind))
            ray.get(registry.register.remote(name))
    except ray.exceptions.RayError as err:
        logger.warning("could not check or renew %s's registration: %s", name, err)


def keep_alive(
    cfg: DispatcherConfig, actor: ActorHandle, name: str, registry_config: RegistryConfig, stop: StopFlag,
    node_id: str = "",
) -> None:
    """Watch the worker until a stop signal; raise WorkerDiedError if it dies, NodeLostError if
    the whole node (`node_id`) left the cluster."""
    while not stop.wait(cfg.health.health_check_interval_s):
        try:
            health = ray.get(actor.health.remote(), timeout=cfg.health.health_timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning("worker %s did not answer health() within %.0f s", name, cfg.health.health_timeout_s)
            continue
        except ray.exceptions.RayError as err:
            if node_id and not node_alive(node_id):
                raise NodeLostError.of(node_id, name) from err
            if isinstance(err, ray.exceptions.RayActorError):
                raise WorkerDiedError(f"worker {name} died: {err}", actor_dead=True) from err
            logger.warning("health() of worker %s failed: %s", name, _one_line(err))
            continue
        if health.state == WorkerState.FAILED:
            raise WorkerDiedError(f"worker {name} FAILED: {health.detail}", actor_dead=False)
        if not health.healthy:
            logger.warning("worker %s reports itself unhealthy: %s", name, health.detail)
            continue
        ensure_registered(cfg.mode, name, registry_config)


def _best_effort(what: str, call: Any) -> None:
    try:
        ray.get(call, timeout=_TEARDOWN_TIMEOUT_S)
    except Exception as err:
        logger.warning("%s failed: %s", what, err)


def teardown(kind: str, actor: ActorHandle, name: str, worker_died: bool) -> None:
    """Deregister the worker (no new requests), stop its engine, kill the actor, and remove the
    weight files it left in shared memory."""
    if actor_exists(registry_name(kind)):
        registry = ray.get_actor(registry_name(kind), namespace=RAY_NAMESPACE)
        _best_effort(f"deregistering {name}", registry.deregister.remote(name))
    if not worker_died:
        _best_effort(f"shutting down {name}", actor.shutdown.remote())
        ray.kill(actor)
    if kind == GENERATION:
        from async_grpo.weights.worker_bucket_files import remove_weight_files

        for path in remove_weight_files(shared_memory_owner(name)):
            logger.warning("removed %s, left by %s", path, name)
    write_line(f"worker {name} deregistered{'' if worker_died else ' and stopped'}", sys.stdout)


def connect(connection: RayConnectionConfig, log_to_driver: bool, temp_dir: str = "") -> None:
    """Join the running cluster (RAY_ADDRESS wins over connection.ray_address, as in Ray itself),
    with token auth on when a token exists; ClusterJoinError (one line) when it cannot
    (ray_access.join_cluster). `temp_dir` picks this machine's Ray node by its temp folder when
    several share its address."""
    join_cluster(connection.ray_address, namespace=RAY_NAMESPACE, timeout_s=connection.connect_timeout_s,
                 log_to_driver=log_to_driver, temp_dir=temp_dir)


@dataclass(frozen=True)
class WorkerSpec:
    """What every (re)start of this dispatcher's worker uses."""

    worker_config: Any
    gpus: float
    node_id: str
    registry_config: RegistryConfig


NOT_RESTARTING_LINE = ("{failure}; not restarting it: a failure before READY (bad flag, too little memory, "
                       "a model that does not load, no free GPU) repeats on every start")


def serve(cfg: DispatcherConfig) -> int:
    """Start, register and supervise the worker, replacing it when it fails after READY; the exit code."""
    # Worker logs show up in this process's output.
    connect(cfg.connection, log_to_driver=True, temp_dir=cfg.ray_temp_dir)
    stop = StopFlag()
    stop.install()  # after ray.init, so these handlers are the ones in force
    node_id = ray.get_runtime_context().get_node_id()
    try:
        gpus = gpus_per_worker(cfg.mode, cfg.engine.tensor_parallel_size, node_gpu_count(node_id), cfg.num_gpus)
    except ValueError as err:
        write_line(f"worker_dispatcher.py: node {node_id[:NODE_ID_CHARS]}: {err}", sys.stderr)
        return 1
    if cfg.mode == GENERATION:
        worker_config = generation_worker_config(cfg, cuda=node_runs_cuda())
    elif cfg.mode == JUDGE:
        worker_config = judge_worker_config(cfg, cuda=node_runs_cuda())
    else:
        worker_config = logprob_worker_config(cfg)
    spec = WorkerSpec(worker_config=worker_config, gpus=gpus, node_id=node_id,
                      registry_config=registry_config_for(cfg.mode, worker_config))
    restarts = 0
    while True:
        try:
            life = run_worker(cfg, spec, stop)
        except NodeLostError as err:
            write_line(f"worker_dispatcher.py: {err}", sys.stderr)
            return 1
        if life.failure is None:
            return 0
        if not node_alive(node_id):  # the worker died with its node: a replacement has nowhere to run
            write_line(f"worker_dispatcher.py: {NodeLostError.of(node_id, life.name, life.failure)}", sys.stderr)
            return 1
        if not life.was_ready:
            write_line(NOT_RESTARTING_LINE.format(failure=life.failure), sys.stderr)
            return 1
        if restarts >= cfg.restart.max_restarts:
            write_line(f"{life.failure}; giving up after {restarts} restart(s) "
                       f"(--max_restarts {cfg.restart.max_restarts})", sys.stderr)
            return 1
        restarts += 1
        delay = min(cfg.restart.restart_backoff_s * 2 ** (restarts - 1), _MAX_BACKOFF_S)
        write_line(RESTARTING_LINE.format(name=life.name, restart=restarts, max_restarts=cfg.restart.max_restarts,
                                          reason=life.failure), sys.stdout)
        logger.warning("starting a replacement for %s in %.0f s", life.name, delay)
        if stop.wait(delay):
            return 0


@dataclass(frozen=True)
class WorkerLife:
    """How one worker's life under this dispatcher ended."""

    name: str
    failure: str | None
    """None: stopped by a signal; else why it failed, in one line."""
    was_ready: bool
    """It registered (READY) before it failed: a crash worth a replacement, not a start-up error."""


def run_worker(cfg: DispatcherConfig, spec: WorkerSpec, stop: StopFlag) -> WorkerLife:
    """One worker's life: start, register, watch until a stop signal or its failure. The worker
    is torn down either way."""
    registry = get_or_create_registry(cfg.mode, spec.registry_config)
    name = claim_worker_name(registry, cfg.mode)
    local_rank = os.environ.get("LOCAL_RANK")
    logger.info("starting %s on node %s (gpus=%g%s)", name, spec.node_id, spec.gpus,
                f", LOCAL_RANK={local_rank}" if local_rank else "")
    actor, died, ready, placed = None, False, False, False
    try:
        actor = create_worker_actor(cfg, name, spec.worker_config, spec.node_id, spec.gpus)
        placed = wait_placed(actor, name, spec, cfg.start_timeout_s, stop)
        if placed and wait_started(actor, name, cfg.start_timeout_s, stop):
            try:  # loads the latest published weights, then the worker is READY
                version = ray.get(registry.register.remote(name))
            except ray.exceptions.RayError as err:
                raise RuntimeError(f"worker {name} could not register: {_root_error(err)}") from err
            ready = True
            write_line(REGISTERED_LINE.format(name=name), sys.stdout)
            logger.info("worker %s READY at weight version %d on GPU(s) %s", name, version,
                        ray.get(actor.health.remote()).gpu_ids or "none")
            keep_alive(cfg, actor, name, spec.registry_config, stop, spec.node_id)
        return WorkerLife(name, None, was_ready=ready)
    except NodeLostError:
        died = True  # nothing left to stop; the registry drops the worker at its next failed call
        raise
    except WorkerDiedError as err:
        died = err.actor_dead
        logger.error("%s", err)
        return WorkerLife(name, _one_line(err), was_ready=ready)
    except RuntimeError as err:
        logger.error("%s", err)
        return WorkerLife(name, _one_line(err), was_ready=ready)
    finally:
        if actor is not None and not placed:
            ray.kill(actor)  # still queued for resources: nothing to deregister or shut down
        elif actor is not None:
            teardown(cfg.mode, actor, name, worker_died=died)


def _root_error(error: ray.exceptions.RayError) -> BaseException:
    """The exception raised inside the actor (a RayTaskError wraps it with the whole remote
    traceback), else the Ray error itself (the actor died, Ray could not schedule it)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _one_line(error: BaseException, limit: int = 600) -> str:
    """An error as one line of at most `limit` characters (Ray's messages span many lines)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """`worker_dispatcher.py [serve] --mode ... --model_path ...` or `worker_dispatcher.py status`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and args[0] in ("serve", STATUS_COMMAND) else "serve"
    try:
        if command == STATUS_COMMAND:
            return run_status(args)
        try:
            cfg = load_config(DispatcherConfig, args, description=__doc__)
            check_versions(WORKER_REQUIREMENTS if cfg.mode == GENERATION or _judge_engine(cfg)
                           else LOGPROB_WORKER_REQUIREMENTS)
            check_model_dir(cfg.model_path)  # before joining the cluster or starting an engine
            cuda = node_runs_cuda()
            check_shared_gpu_memory(cfg, cuda)
            check_engine_transfer(cfg, cuda)
        except (ConfigError, ModelPathError, VersionError, ValueError) as err:
            print(f"worker_dispatcher.py: {err}", file=sys.stderr, flush=True)
            return CONFIG_ERROR_EXIT
        return serve(cfg)
    except (ClusterJoinError, VersionError) as err:
        print(f"worker_dispatcher.py: {err}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    # main() has stopped its worker and deregistered it (or failed before starting one): the
    # interpreter's own teardown would only add ~1 s of exit to every dispatcher (local_processes).
    exit_without_teardown(main())
