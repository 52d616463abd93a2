"""Option sections that the workers, their dispatcher and the local launcher share.

Each section is declared once, here: its fields, types, docstrings and validation. The worker
configs (vllm_worker.GenerationWorkerConfig, logprob_worker.LogprobWorkerConfig), the dispatcher
(worker_dispatcher.DispatcherConfig) and the local launcher (local_cluster.LocalClusterConfig)
embed them with `run_config.flattened`, so their fields stay top-level flags (`--max_num_seqs`,
`--max_tokens_per_forward`), a launcher may give them defaults of its own, and the dispatcher
hands its sections to the worker as they are. A new vLLM option is one field in EngineConfig
plus the line in GenerationWorker.start that passes it to vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from setup_model import VLLM_LORA_RANKS

# vLLM's own default share of accelerator memory (EngineArgs.gpu_memory_utilization), used when
# EngineConfig.gpu_memory_utilization is None.
VLLM_GPU_MEMORY_UTILIZATION = 0.9


# EngineConfig.weight_transfer -> the backend name vLLM's WeightTransferEngineFactory knows it
# by (ours registers in weight_transfer_engine.py, OBJECT_STORE_BACKEND there).
WEIGHT_TRANSFER_BACKENDS = {"object_store": "grpo_object_store", "nccl": "nccl", "nccl_m2n": "nccl_m2n", "ipc": "ipc"}
OBJECT_STORE_TRANSFER = "object_store"


def check_weight_transfer_device(weight_transfer: str, has_cuda: bool) -> None:
    """ValueError naming the field when a CUDA-only weight_transfer is asked of a node without CUDA."""
    if weight_transfer != OBJECT_STORE_TRANSFER and not has_cuda:
        raise ValueError(f"EngineConfig.weight_transfer {weight_transfer!r} is one of vLLM's CUDA engines and this "
                         f"node has no CUDA: use 'object_store'")


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """The vLLM engine of a generation worker."""

    tensor_parallel_size: int = 1
    """GPUs one engine spans (a dispatcher's actor reserves that many GPUs on GPU nodes)."""
    max_num_seqs: int = 128
    """Most sequences the engine schedules in one step (continuous-batching width)."""
    gpu_memory_utilization: float | None = None
    """Fraction of accelerator memory vLLM may use; on the CPU backend, the fraction of RAM
    reserved for the KV cache. None: vLLM's default, 0.9, except that a dispatcher on a node
    without CUDA given neither this nor kv_cache_memory_bytes sizes the KV cache itself
    (worker_dispatcher.cpu_kv_cache_bytes)."""
    kv_cache_memory_bytes: int | None = None
    """Explicit KV-cache size in bytes, overriding gpu_memory_utilization. Useful on the CPU
    backend, where the utilization fraction is of the NUMA node's RAM and must also cover the
    engine process's own memory, so small fractions fail at start."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; None takes the model's own limit."""
    enforce_eager: bool = False
    """Skip CUDA-graph capture and torch.compile: faster start, slower decoding (vLLM's 'init
    engine' step, 2 cores: 8.7 s compiled on the demo's tiny model, 0.04-0.2 s eager on the
    tests' tiny model)."""
    dtype: str = "auto"
    """Dtype the engine serves the model in ('auto' follows the checkpoint, except that vLLM's CPU
    backend serves an fp32 checkpoint in bf16). worker_dispatcher.py and local_cluster.py give
    the same value to logprob workers, whose 'auto' is the trainer's compute dtype (bfloat16 on
    a GPU node, float32 on CPU) and which accept 'auto', 'float32', 'bfloat16' or 'float16'."""
    engine_seed: int = 0
    """Seed of the engine's own random state (unseeded requests draw from it)."""
    cpu_in_process_executor: bool = True
    """On vLLM's CPU backend with tensor_parallel_size 1, run the model inside the engine-core
    process (vLLM's 'uni' executor). vLLM-CPU otherwise forces its 'mp' executor, whose extra
    worker process busy-polls shared memory for a second after every step: on a 512-rollout
    demo step, 1.45 CPU-seconds against 0.26 in process, at the same latency (measured on the
    2-core machine), CPU that the trainer ranks sharing the machine then lack. No effect on GPUs,
    where vLLM already runs a single-GPU engine in process."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Which distribution `sampling_logprobs` come from: the model's raw softmax (what the
    trainer's logprob pass computes) or the one after temperature/top-p (the true sampler)."""
    max_lora_rank: int = 0
    """Serve a LoRA-trained policy (trainer's model.lora): the largest adapter rank the engine
    accepts, one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512 (at least model.lora.r). 0: LoRA
    off; the worker then takes full-weight updates only."""

    weight_transfer: Literal["object_store", "nccl", "nccl_m2n", "ipc"] = "object_store"
    """How pushed full weights reach the engine, through vLLM's weight-transfer API:
    'object_store' (ours, any device: the worker fetches the update from Ray's object store and
    streams it into the engine bucket by bucket through anonymous memory files), or, on CUDA
    only, one of vLLM's engines: 'nccl' (trainer rank 0 broadcasts the gathered weights),
    'nccl_m2n' (every trainer rank sends its own FSDP shards), 'ipc' (CUDA IPC handles, trainer
    and engine on the same GPUs). LoRA adapters always load as vLLM adapters."""
    openai_endpoint_port: int | None = None
    """Serve an OpenAI-compatible endpoint over this engine (openai_endpoint.py: /v1/chat/completions,
    /inference/v1/generate, /v1/models, with exact token ids, logprobs and weight versions) on
    127.0.0.1 only, e.g. for verifiers environments' train client. None: off; 0: a free port
    (the worker logs it and its health detail names it; use 0 when several workers share a node);
    else that port. Requests count in the worker's stats and wait out weight pushes."""

    def __post_init__(self) -> None:
        if self.weight_transfer not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"EngineConfig.weight_transfer must be one of {tuple(WEIGHT_TRANSFER_BACKENDS)}, "
                             f"got {self.weight_transfer!r}")
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

    max_tokens_per_forward: int = 16384
    """Token budget of one packed logprob forward (prompt + output tokens of all samples in it);
    not the trainer's max_tokens_per_gpu, its minibatch budget. A single sample longer than this
    still runs, alone, and is counted in stats().oversized_samples. Attention cost follows each
    sample's own length (flash_attention_2, or packed_attention's packed_sdpa without
    flash-attn), so larger budgets amortise more per-forward overhead;
    benchmarks/logprob_batching.py sweeps it (on the 2-core CPU: 1.0x / 1.19x / 1.27x at 512 /
    1024 / 2048 tokens)."""
    max_wait_ms: float = 20.0
    """How long the first queued request waits for company before its batch runs even if not full.
    0 runs whatever is queued as soon as the previous batch is done."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_forward < 1:
            raise ValueError(
                f"LogprobBatchingConfig.max_tokens_per_forward must be >= 1, got {self.max_tokens_per_forward}")
        if self.max_wait_ms < 0:
            raise ValueError(f"LogprobBatchingConfig.max_wait_ms must be >= 0, got {self.max_wait_ms}")
