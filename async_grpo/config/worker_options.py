"""Option sections that more than one entry point takes: the workers, their dispatcher, the
local launcher, the trainer.

Each option is declared once, here: its field, type, docstring and validation. The worker
configs (vllm_worker.GenerationWorkerConfig, logprob_worker.LogprobWorkerConfig), the dispatcher
(worker_dispatcher.DispatcherConfig), the local launcher (local_cluster.LocalClusterConfig) and
the trainer (TrainerConfig: RayConnectionConfig) embed them with `run_config.flattened`, so their
fields stay top-level flags (`--max_num_seqs`, `--global_num_verifiers`), an embedder may give
a section defaults of its own (a default instance), and the dispatcher hands its sections to the
worker as they are. Because the dispatcher loads every section before it joins Ray, a bad value
is one line and exit 2 there, not a traceback in the worker. A new vLLM option is one field in
EngineConfig plus the line in GenerationWorker.start that passes it to vLLM. The options the
trainer and the workers both read (EngineTransferConfig, PromptSharingConfig) are declared here
too: the trainer's sections extend them, the workers embed them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Literal, TypeVar

# vLLM 0.32 serves LoRA adapters of these ranks only (vllm.config.lora.MaxLoRARanks): an engine's
# max_lora_rank must be one of them, and a trained adapter's r at most that (setup_model.LoraConfig).
T = TypeVar("T")

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds an adapter of rank r."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest ({max(VLLM_LORA_RANKS)})")

# vLLM's own default share of accelerator memory (vLLM 0.32's CacheConfig.gpu_memory_utilization,
# vllm/config/cache.py), used when EngineConfig.gpu_memory_utilization is None.
VLLM_GPU_MEMORY_UTILIZATION = 0.92


# EngineTransferConfig.weight_transfer -> the backend name vLLM's WeightTransferEngineFactory knows it
# by (ours registers in weights/worker_transfer_backend.py, OBJECT_STORE_BACKEND there).
WEIGHT_TRANSFER_BACKENDS = {"object_store": "grpo_object_store", "nccl": "nccl", "nccl_m2n": "nccl_m2n", "ipc": "ipc"}
OBJECT_STORE_TRANSFER = "object_store"


def check_weight_transfer_device(weight_transfer: str, has_cuda: bool) -> None:
    """ValueError naming the field when a CUDA-only weight_transfer is asked of a node without CUDA."""
    if weight_transfer != OBJECT_STORE_TRANSFER and not has_cuda:
        raise ValueError(f"weight_transfer {weight_transfer!r} is one of vLLM's CUDA engines and this "
                         f"node has no CUDA: use 'object_store'")


# The Python packages each CUDA transfer imports beyond torch, on both sides of a push: vLLM's
# weight-transfer classes (the trainer's requirements, requirements_fsdp.txt, hold no vLLM), and
# for nccl_m2n NVIDIA's nccl.m2n, which vLLM does not install.
TRANSFER_PACKAGES = {"nccl": ("vllm",), "nccl_m2n": ("vllm", "nccl.m2n"), "ipc": ("vllm",)}
PACKAGE_SOURCES = {
    "vllm": "pip install -r requirements_base.txt (vllm==0.32.0) on this node",
    "nccl.m2n": "NVIDIA's nccl-extensions and nccl4py (github.com/NVIDIA/nccl-extensions; NCCL >= 2.30.5, "
                "VLLM_NCCL_SO_PATH set to the libnccl.so it links)",
}


def module_available(name: str) -> bool:
    """Whether `name` (dotted) can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package raises instead of answering None
        return False


def check_transfer_packages(weight_transfer: str, where: str,
                            available: Callable[[str], bool] = module_available) -> None:
    """ValueError (one line) when a package `weight_transfer` needs cannot be imported in this
    process (`where` names it: 'trainer', a worker's name); object_store needs none."""
    missing = [name for name in TRANSFER_PACKAGES.get(weight_transfer, ()) if not available(name)]
    if missing:
        how = "; ".join(f"{name}: {PACKAGE_SOURCES[name]}" for name in missing)
        raise ValueError(f"weight_transfer {weight_transfer!r} needs {', '.join(missing)} importable in the {where}, "
                         f"and it is not ({how}), or use 'object_store'")


# ---- Options the trainer and the workers both read: each declared once, here. The trainer's
# sections extend them (TrainerTransferConfig, setup_model.ModelConfig: --transfer.weight_transfer,
# --model.share_prompts); the workers and their dispatcher embed them flat (--weight_transfer,
# --share_prompts); the local launcher hands the trainer's to the workers it starts.

@dataclass(kw_only=True, frozen=True)
class EngineTransferConfig:
    """How the trainer's full weights reach the generation engines; both ends must name the same."""

    # 'object_store' is ours: the worker fetches the update from Ray's object store and streams it
    # into the engine bucket by bucket through anonymous memory files. The CUDA ones are vLLM's:
    # 'nccl' (trainer rank 0 broadcasts the gathered weights), 'nccl_m2n' (every trainer rank sends
    # its own FSDP shards), 'ipc' (CUDA IPC handles). LoRA adapters always load as vLLM adapters.
    weight_transfer: Literal["object_store", "nccl", "nccl_m2n", "ipc"] = "object_store"
    """How pushed full weights reach the engines (vLLM's weight-transfer API): 'object_store' (any
    device, through Ray's object store), or on CUDA only 'nccl', 'nccl_m2n' (per-rank FSDP shards)
    or 'ipc' (trainer and engine on the same GPUs). Workers started by hand need the trainer's."""

    def __post_init__(self) -> None:
        if self.weight_transfer not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"{type(self).__name__}.weight_transfer must be one of {tuple(WEIGHT_TRANSFER_BACKENDS)}, "
                             f"got {self.weight_transfer!r}")


@dataclass(kw_only=True, frozen=True)
class PromptSharingConfig:
    """Whether a packed forward lays a prompt out once before its answers, on the trainer and on
    the logprob workers alike (the same logprobs, bit for bit)."""

    share_prompts: bool = False
    """Pack the answers of one prompt after a single copy of it (sample_processing_utils): the
    same logprobs from fewer tokens. Needs the packed_sdpa or packed_varlen attention (None then
    picks packed_sdpa)."""


def shared_part(record: type[T], config: Any) -> T:
    """The `record` (one of the shared option records above) that `config`, a section extending
    it, holds: e.g. the EngineTransferConfig of the trainer's TrainerTransferConfig."""
    return record(**{f.name: getattr(config, f.name) for f in dataclasses.fields(record)})


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """The vLLM engine of a generation worker."""

    tensor_parallel_size: int = 1
    """GPUs one engine spans (a dispatcher's actor reserves that many GPUs on GPU nodes)."""
    max_num_seqs: int = 128
    """Most sequences the engine schedules in one step (continuous-batching width)."""
    gpu_memory_utilization: float | None = None
    """Fraction of accelerator memory vLLM may use; on the CPU backend, the fraction of RAM
    reserved for the KV cache. None: vLLM's default, 0.92, except that a dispatcher on a node
    without CUDA given neither this nor kv_cache_memory_bytes sizes the KV cache itself
    (worker_dispatcher.cpu_kv_cache_bytes)."""
    kv_cache_memory_bytes: int | None = None
    """Explicit KV-cache size in bytes, overriding gpu_memory_utilization. Useful on the CPU
    backend, where the utilization fraction is of the NUMA node's RAM and must also cover the
    engine process's own memory, so small fractions fail at start."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; None takes the model's own limit."""
    # vLLM's 'init engine' step on 2 cores: 8.7 s compiled on the demo's tiny model, 0.04-0.2 s
    # eager on the tests'. Eager also turns torch.compile off in the engine-core process, whose
    # sampler would otherwise build two inductor kernels (g++) on its first sampled batch
    # (inference/engine_process.engine_process_env; docs/notes/test_suite_time.md, "What each engine
    # start and trainer launch cost").
    enforce_eager: bool = False
    """Skip CUDA-graph capture and torch.compile, in the engine-core process too: a faster start,
    slower decoding. Worth it where engines start often and decode little (tests, smoke runs);
    fork_engine_core needs it."""
    # 'auto' on CPU is float32, what the CPU trainer computes in: vLLM's own 'auto' would pick
    # bf16, which crashes vLLM 0.32's CPU build on AMX CPUs (inference/engine_dtype.py). On GPU,
    # vLLM's 'auto' serves an fp32 checkpoint in bfloat16 (Ampere and newer) and others in their
    # own dtype; the local launcher passes bfloat16 on CUDA, the trainer's compute dtype.
    # worker_dispatcher.py and local_cluster.py give the same value to logprob workers.
    dtype: str = "auto"
    """Dtype the engine, and a logprob worker, serves the model in. 'auto': float32 on CPU, vLLM's
    'auto' on GPU; a logprob worker's 'auto' is the trainer's compute dtype (bfloat16 on a GPU
    node), and it takes 'auto', 'float32', 'bfloat16' or 'float16' only."""
    engine_seed: int = 0
    """Seed of the engine's own random state (unseeded requests draw from it)."""
    # Forked, a worker starts several seconds sooner with the same seeded rollouts, but its
    # generation steps run up to ~15% slower (benchmarks/RESULTS.md, "A generation worker's start:
    # engine core spawned vs forked"): a trade made for an eager engine, which is chosen for its
    # start. A compiled or GPU engine always spawns, as does one whose torch OpenMP runtime cannot
    # release its threads before the fork (inference/engine_process.py says why).
    fork_engine_core: bool = True
    """On vLLM's CPU backend with enforce_eager, start the engine-core process as a fork of the
    worker's process, which has torch and vLLM imported, instead of vLLM's spawn: a faster start,
    slower steps. false (for a long eager run): vLLM's spawn everywhere."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Which distribution `sampling_logprobs` come from: the model's raw softmax (what the
    trainer's logprob pass computes) or the one after temperature/top-p (the true sampler)."""
    max_lora_rank: int = 0
    """Serve a LoRA-trained policy (trainer's model.lora): the largest adapter rank the engine
    accepts, one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512 (at least model.lora.r). 0: LoRA
    off; the worker then takes full-weight updates only."""

    # openai_endpoint.py serves /v1/chat/completions, /inference/v1/generate and /v1/models, with
    # exact token ids, logprobs and weight versions (e.g. for verifiers environments' train
    # client). Its requests count in the worker's stats and wait out weight pushes.
    openai_endpoint_port: int | None = None
    """Port of an OpenAI-compatible endpoint over this engine, on 127.0.0.1 only (openai_endpoint.py).
    None: off; 0: a free port, logged and named in the worker's health detail (use 0 when several
    workers share a node); else that port."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization must be in (0, 1] or None, got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_bytes must be >= 1 or None, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2 or None, got {self.max_model_len}")
        if not self.dtype:
            raise ValueError("EngineConfig.dtype must be a dtype name or 'auto', got ''")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"EngineConfig.logprobs_mode unknown: {self.logprobs_mode!r}")
        if self.openai_endpoint_port is not None and not 0 <= self.openai_endpoint_port < 65536:
            raise ValueError(f"EngineConfig.openai_endpoint_port must be None (off) or in [0, 65536), "
                             f"got {self.openai_endpoint_port}")
        if self.max_lora_rank and self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"EngineConfig.max_lora_rank must be 0 (off) or one of {VLLM_LORA_RANKS}, "
                             f"got {self.max_lora_rank}")

    @property
    def memory_fraction(self) -> float:
        """gpu_memory_utilization as vLLM takes it (None: vLLM's default)."""
        return VLLM_GPU_MEMORY_UTILIZATION if self.gpu_memory_utilization is None else self.gpu_memory_utilization


@dataclass(kw_only=True, frozen=True)
class LogprobBatchingConfig:
    """How a logprob worker packs queued requests into forwards."""

    # Attention cost follows each sample's own length (flash_attention_2, or packed_attention's
    # packed_sdpa without flash-attn), so larger budgets amortise more per-forward overhead;
    # benchmarks/logprob_batching.py sweeps it (benchmarks/RESULTS.md, "Logprob worker: batched vs
    # one-at-a-time").
    max_tokens_per_forward: int = 16384
    """Token budget of one packed logprob forward (prompt + output tokens of all its samples; not
    the trainer's max_tokens_per_gpu). A longer sample still runs, alone, counted in
    stats().oversized_samples. Larger: fewer forwards, more memory each."""
    max_wait_ms: float = 20.0
    """How long the first queued request waits for company before its batch runs even if not full.
    0 runs whatever is queued as soon as the previous batch is done."""
    def __post_init__(self) -> None:
        if self.max_tokens_per_forward < 1:
            raise ValueError(
                f"LogprobBatchingConfig.max_tokens_per_forward must be >= 1, got {self.max_tokens_per_forward}")
        if self.max_wait_ms < 0:
            raise ValueError(f"LogprobBatchingConfig.max_wait_ms must be >= 0, got {self.max_wait_ms}")


@dataclass(kw_only=True, frozen=True)
class VerificationConfig:
    """The cluster-wide math-verify pool that generation workers score with (created by the first
    worker to ask; later workers join it as it is)."""

    # Without nodes that offer `verification_slot`, the pool runs in one process outside Ray's
    # accounting (math_verify_cluster.VerifierPoolActor).
    global_num_verifiers: int | None = None
    """Processes of the pool, each taking one `verification_slot` resource on the nodes that offer
    it (capped at the slots offered). None: one per usable core, 2 to 32
    (math_verify_pool.VerifierPoolConfig), so a few slow verifications cannot hold up the rest."""
    verifier_timeout_s: float | None = None
    """Hard deadline per verification; a verifier that passes it is killed and the reward is 0.
    None: math_verify_pool.VerifierPoolConfig's default (1 s, from the measured clean p99)."""

    def __post_init__(self) -> None:
        if self.global_num_verifiers is not None and self.global_num_verifiers < 1:
            raise ValueError(f"VerificationConfig.global_num_verifiers must be >= 1 or None, got "
                             f"{self.global_num_verifiers}")
        if self.verifier_timeout_s is not None and not self.verifier_timeout_s > 0:
            raise ValueError(f"VerificationConfig.verifier_timeout_s must be > 0 or None, got "
                             f"{self.verifier_timeout_s}")


DEFAULT_FAILED_SAMPLES_PATH = "failed_generation_samples.jsonl"


@dataclass(kw_only=True, frozen=True)
class FailedSamplesConfig:
    """Where a generation worker writes the samples whose generation or scoring failed."""

    write_failed_generation_samples: bool = False
    """Append every sample whose generation or scoring failed, with its error, to
    failed_samples_path (JSONL)."""
    failed_samples_path: str = DEFAULT_FAILED_SAMPLES_PATH
    """The JSONL file; a relative path resolves against the dispatcher's working directory."""

    def __post_init__(self) -> None:
        if not self.failed_samples_path:
            raise ValueError("FailedSamplesConfig.failed_samples_path must be a file path, got ''")

    @property
    def path(self) -> str | None:
        """The file to write, or None when writing is off."""
        return self.failed_samples_path if self.write_failed_generation_samples else None


@dataclass(kw_only=True, frozen=True)
class HealthCheckConfig:
    """How a watcher (a dispatcher over its worker, a registry over its pool) probes a worker's
    health()."""

    health_check_interval_s: float = 10.0
    """Seconds between health() probes of a worker."""
    health_timeout_s: float = 60.0
    """How long one health() call may take before the watcher counts it unanswered (a dispatcher
    logs the worker as unresponsive; a registry drops it, with a stricter default of its own)."""

    def __post_init__(self) -> None:
        for name in ("health_check_interval_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HealthCheckConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass(kw_only=True, frozen=True)
class RestartConfig:
    """How a dispatcher replaces its worker after it died or reported FAILED while serving."""

    # A worker that fails to start or register is not replaced: such failures (a bad flag, too
    # little memory, a model that does not load) repeat, so the dispatcher reports the cause once.
    max_restarts: int = 3
    """How many times the worker is replaced before the dispatcher gives up and exits 1 (0: exit
    on the first failure). A worker that fails to start or register exits 1 at once."""
    restart_backoff_s: float = 5.0
    """Wait before the first restart; it doubles on each further one, up to 60 s."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"RestartConfig.max_restarts must be >= 0, got {self.max_restarts}")
        if self.restart_backoff_s < 0:
            raise ValueError(f"RestartConfig.restart_backoff_s must be >= 0, got {self.restart_backoff_s}")


@dataclass(kw_only=True, frozen=True)
class RayConnectionConfig:
    """How a process joins a running Ray cluster (the trainer, a dispatcher, `status`)."""

    ray_address: str = "auto"
    """Cluster to join when RAY_ADDRESS is unset; 'auto': the last one `ray start` started on this
    machine."""
    connect_timeout_s: float = 30.0
    """Give up (exit 1, one line) if the Ray head does not accept this process by then: no
    cluster, an unreachable head, a missing or wrong auth token."""

    def __post_init__(self) -> None:
        if not self.ray_address:
            raise ValueError("RayConnectionConfig.ray_address must be 'auto' or host:port, got ''")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"RayConnectionConfig.connect_timeout_s must be > 0, got {self.connect_timeout_s}")


JudgeKind = Literal["generative", "reward_model"]
JUDGE_KINDS: tuple[str, ...] = ("generative", "reward_model")


@dataclass(kw_only=True, frozen=True)
class JudgeServingConfig:
    """How a judge worker answers judge requests (`worker_dispatcher.py --mode judge`)."""

    judge_kind: JudgeKind = "generative"
    """generative: a vLLM engine (the engine options) writes a reply to the judge's chat, read by
    sampling.reward.judge.verdict; reward_model: an HF sequence-classification head (one label)
    scores the chat, batched to max_tokens_per_forward, its score the reply (read with verdict: number)."""

    def __post_init__(self) -> None:
        if self.judge_kind not in JUDGE_KINDS:
            raise ValueError(f"JudgeServingConfig.judge_kind must be one of {list(JUDGE_KINDS)}, got {self.judge_kind!r}")
