"""Training throughput of the trainer's own step: packed tokens/s and model FLOPs utilisation (MFU).

    .venv/bin/python -m benchmarks.trainer_throughput          # qwen2.5-0.5b, 16384 tokens per rank
    torchrun --nproc_per_node=2 -m benchmarks.trainer_throughput --preset qwen2.5-0.5b \\
        --tokens_per_rank 2048 --gradient_checkpointing                  # 2 FSDP ranks (gloo on CPU)
    .venv/bin/python -m benchmarks.trainer_throughput --preset qwen2.5-0.5b --model.num_layers 2 \\
        --model.hidden_size 128 --model.num_heads 2 --model.intermediate_size 256 \\
        --tokens_per_rank 512 --warmup 1 --steps 2                       # a seconds-long check

What runs is the trainer's code path: rank 0 writes a random-init checkpoint of the preset
(tiny_model.write_tiny_model; or --model_path reads an existing one), every rank builds it with
fsdp_setup.build_training_model (FSDP2, fp32 master weights; on CUDA bf16 compute through
ModelConfig.mixed_precision, flash_attention_2 when flash-attn imports, else packed_sdpa, NCCL;
on CPU fp32, packed_sdpa, gloo) and optimizer.build_optimizer (AdamW). Each rank draws synthetic
rollouts of realistic lengths (prompts uniform in [min_prompt, max_prompt], outputs log-normal
around output_median, capped at max_output) packed to exactly tokens_per_rank tokens per
minibatch. One step = for each of minibatches_per_step minibatches: post_process_batch,
TokenLogprobModel forward (chunked logprobs), grpo_loss (KL on), backward; then the trainer's
gradient step (divide by the step's sample count, clip, AdamW step, zero grads), as
policy_update.take_gradient_step does (its module reaches Ray, which the GPU machine
lacks). `warmup` untimed steps, then `steps` timed ones; the median step is reported.

FLOPs (model FLOPs: what the model needs, not what gradient checkpointing recomputes), per step:

    6 * N * T  +  6 * d * V * O  +  6 * L * (n_heads * head_dim) * sum_i len_i^2

N: non-embedding parameters (decoder layers and final norm); T: packed tokens; d: hidden size;
V: vocabulary rows; O: output tokens (the trainer applies lm_head to output positions only, so
prompts cost no lm_head work); L: layers; len_i: each packed sample's length. This is the
PaLM paper's model-FLOPs count (Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T per token,
the formula of nanoGPT's `estimate_mfu`) with two changes for packed causal training: attention
is counted per sample (each attends only within itself: 12 L H Q len_i per token, len_i tokens
-> 12 L H Q len_i^2) and halved for the causal mask (causal kernels such as flash-attention and
packed_sdpa's is_causal sdpa skip the upper triangle); and the lm_head's 6 d V term counts only
scored tokens.

MFU = achieved FLOPs/s / peak FLOPs/s of all ranks. Peak: on CUDA the GPU's dense bf16 figure
(GPU_PEAK_BF16_TFLOPS by device name, or --peak_tflops); on CPU no datasheet figure applies, so
each rank times a large fp32 torch.mm in the same run (all ranks at once, with the threads the
ranks train with) and MFU is reported against the sum: `peak_source=measured_cpu_fp32_matmul`.
On CUDA the measured bf16 matmul rate is printed too (`matmul_tflops`), an achievable ceiling.

The last line (rank 0) is key=value pairs, starting `tokens_per_s=... mfu=...`, with the settings.
"""

from __future__ import annotations

import logging
import math
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from async_grpo.demo_assets.tiny_model import PRESETS, ShapeOverrides, model_shape, write_tiny_model
from async_grpo.trainer.fsdp_setup import DistInfo, build_training_model, init_distributed
from async_grpo.trainer.optimizer import OptimConfig, build_optimizer
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging
from benchmarks.packed_samples import draw_packed_samples, training_flops
from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import Sample, post_process_batch
from setup_model import ModelConfig, TokenLogprobModel

logger = logging.getLogger("benchmarks.trainer_throughput")

# Dense (not sparse) bf16 tensor-core peaks, in TFLOPS: half the "BF16 Tensor Core ... with
# sparsity" figures of NVIDIA's spec tables (nvidia.com/en-us/data-center/h100/: SXM 1,979, PCIe
# 1,513, NVL 1,671; nvidia.com/en-us/data-center/h200/: SXM 1,979, NVL 1,671; A100 datasheet:
# 312 dense). The first name contained in torch.cuda.get_device_name() wins, so the PCIe/NVL
# variants come before the bare "H100"/"H200" (SXM).
GPU_PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # SXM
    ("A100", 312.0),
)
LOSS_CONFIG = LossConfig(kl_coef=0.05)  # the demo's KL weight: the KL term runs as in a real step
MATMUL_REPS = 5  # timings of the peak matmul; the fastest counts
CUDA_MATMULS_PER_TIMING = 20  # one GPU matmul is too short to time on its own
BYTES_PER_GIB = 2**30


SMOKE = {"preset": "tiny", "tokens_per_rank": 256, "steps": 1, "warmup": 0, "peak_tflops": 1.0}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """What to measure: the command line of `benchmarks/trainer_throughput.py`."""

    preset: str = "qwen2.5-0.5b"
    """Model shape (tiny_model.PRESETS): 'qwen2.5-0.5b', 'qwen2.5-1.5b', 'tiny'."""
    model: ShapeOverrides = ShapeOverrides()
    """Fields replacing the preset's (--model.num_layers 2 ...), for small checks."""
    model_path: str = ""
    """An existing HF checkpoint to train instead of writing the preset (then preset/model are ignored)."""
    tokens_per_rank: int = 16384
    """Packed tokens (prompt + output) in each minibatch of each rank: the trainer's max_tokens_per_gpu."""
    minibatches_per_step: int = 1
    """Minibatches each rank runs forward/backward on before every optimizer step."""
    min_prompt: int = 64
    """Shortest prompt, tokens."""
    max_prompt: int = 512
    """Longest prompt, tokens."""
    output_median: float = 1024.0
    """Median output length (log-normal), tokens."""
    output_sigma: float = 0.75
    """Log-normal sigma of output lengths."""
    max_output: int = 4096
    """Outputs are cut here, as max_tokens cuts rollouts."""
    warmup: int = 2
    """Untimed steps first (allocator warm-up, kernel selection)."""
    steps: int = 5
    """Timed steps; the median is reported."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (ModelConfig.gradient_checkpointing)."""
    mixed_precision: bool = True
    """On CUDA: bf16 compute, fp32 master weights (ModelConfig.mixed_precision). CPU: always fp32."""
    attn_implementation: str = ""
    """'' picks the trainer's default (flash_attention_2 if importable on CUDA, else packed_sdpa)."""
    logprob_chunk_size: int = 1024
    """Output tokens per lm_head chunk (ModelConfig.logprob_chunk_size)."""
    lr: float = 1e-6
    """AdamW learning rate (small: the random weights should stay finite over the steps)."""
    peak_tflops: float = 0.0
    """Peak per device for MFU, TFLOPS; 0: the GPU table by device name, or the measured CPU matmul."""
    matmul_size: int = 0
    """Side of the square matmul timed for the measured peak; 0: 8192 on CUDA, 2048 on CPU."""
    seed: int = 0
    """Seed of the sample draw (rank r draws minibatch i with seed + 1000 r + i); the weights take --model.seed."""

    smoke: bool = False
    """Smoke mode: the tiny model, 256 tokens per rank, 1 step, no warm-up, no peak measurement (SMOKE); checks
    that the command still runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        if not self.model_path and self.preset not in PRESETS:
            raise ValueError(f"BenchConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.tokens_per_rank < 2:
            raise ValueError(f"BenchConfig.tokens_per_rank must be >= 2, got {self.tokens_per_rank}")
        if self.minibatches_per_step < 1:
            raise ValueError(f"BenchConfig.minibatches_per_step must be >= 1, got {self.minibatches_per_step}")
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError(f"BenchConfig.min_prompt must be in [1, max_prompt], got {self.min_prompt}")
        if self.output_median < 1 or self.output_sigma < 0 or self.max_output < 1:
            raise ValueError("BenchConfig: output_median >= 1, output_sigma >= 0 and max_output >= 1 required")
        if self.warmup < 0 or self.steps < 1:
            raise ValueError(f"BenchConfig: warmup >= 0 and steps >= 1 required, got {self.warmup}, {self.steps}")
        if self.peak_tflops < 0 or self.matmul_size < 0:
            raise ValueError("BenchConfig: peak_tflops and matmul_size must be >= 0")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """Fastest of MATMUL_REPS timings of a size x size x size torch.mm, in TFLOPS (2 n^3 per mm)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    per_timing = CUDA_MATMULS_PER_TIMING if device.type == "cuda" else 1
    torch.mm(a, b)
    _sync(device)
    best = math.inf
    for _ in range(MATMUL_REPS):
        start = time.perf_counter()
        for _ in range(per_timing):
            torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 * per_timing / best / 1e12


def gpu_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known GPU, by name; None if not in GPU_PEAK_BF16_TFLOPS."""
    return next((peak for name, peak in GPU_PEAK_BF16_TFLOPS if name in device_name), None)


def _model_dir(config: BenchConfig, dist: DistInfo, workdir: Path) -> str:
    """Rank 0 writes the preset's checkpoint (or takes --model_path); every rank gets the path."""
    path = [config.model_path]
    if not config.model_path and dist.is_main:
        shape = model_shape(config.preset, config.model)
        path = [str(write_tiny_model(workdir / "model", shape))]
    if dist.world_size > 1:
        torch_dist.broadcast_object_list(path, src=0)
    return path[0]


def _shape_facts(model: TokenLogprobModel) -> dict[str, int]:
    """What the FLOPs formula needs, read from the built model (global sizes of FSDP's DTensors)."""
    causal_lm = model.causal_lm
    hf = causal_lm.config
    embedding_ids = {id(causal_lm.get_input_embeddings().weight), id(causal_lm.get_output_embeddings().weight)}
    params = list(model.parameters())
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return {
        "params": sum(p.numel() for p in params),
        "non_embedding_params": sum(p.numel() for p in params if id(p) not in embedding_ids),
        "hidden_size": hf.hidden_size,
        "vocab_size": hf.vocab_size,
        "num_layers": hf.num_hidden_layers,
        "attention_width": hf.num_attention_heads * head_dim,
    }


def train_step(model: TokenLogprobModel, optimizer: torch.optim.Optimizer, minibatches: list[list[Sample]],
               step_samples: int, dist: DistInfo) -> None:
    """One optimizer step over this rank's minibatches, as policy_update's train_on_step and
    take_gradient_step run it (loss x world_size, gradients / the step's sample count, clip)."""
    for samples in minibatches:
        batch = post_process_batch(samples)
        logprobs, _ = model.score(batch.inputs)
        loss, _ = grpo_loss(logprobs, batch, LOSS_CONFIG)
        (loss * dist.world_size).backward()
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(step_samples)
    torch.nn.utils.clip_grad_norm_(model.parameters(), OptimConfig().max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _all_reduce(value: float, op: torch_dist.ReduceOp, dist: DistInfo) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=dist.device)
    if dist.world_size > 1:
        torch_dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def _peak_memory_gib(dist: DistInfo) -> float:
    """This rank's peak: CUDA allocator high-water mark on GPU, the process's max RSS on CPU."""
    if dist.device.type == "cuda":
        return torch.cuda.max_memory_allocated(dist.device) / BYTES_PER_GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / BYTES_PER_GIB  # ru_maxrss: KiB on Linux


def _peak(config: BenchConfig, dist: DistInfo, compute_dtype: torch.dtype) -> tuple[float, str, float]:
    """(peak TFLOPS of all ranks together, where it comes from, measured matmul TFLOPS of all ranks)."""
    size = config.matmul_size or (8192 if dist.device.type == "cuda" else 2048)
    if dist.world_size > 1:
        torch_dist.barrier()  # all ranks time at once: on a shared CPU they compete, as in training
    measured = _all_reduce(measure_matmul_tflops(dist.device, compute_dtype, size), torch_dist.ReduceOp.SUM, dist)
    if config.peak_tflops:
        return config.peak_tflops * dist.world_size, "given", measured
    if dist.device.type == "cuda":
        name = torch.cuda.get_device_name(dist.device)
        table = gpu_peak_tflops(name)
        if table is None:
            raise ValueError(f"no bf16 peak known for {name!r}: pass --peak_tflops")
        return table * dist.world_size, f"datasheet_bf16_dense:{name.replace(' ', '_')}", measured
    return measured, f"measured_cpu_{str(compute_dtype).removeprefix('torch.')}_matmul", measured


def run(config: BenchConfig, dist: DistInfo, workdir: Path) -> dict[str, float | int | str]:
    torch.manual_seed(config.seed)
    model_config = ModelConfig(
        model_path=_model_dir(config, dist, workdir),
        logprob_chunk_size=config.logprob_chunk_size,
        gradient_checkpointing=config.gradient_checkpointing,
        attn_implementation=config.attn_implementation or None,
        mixed_precision=config.mixed_precision,
    )
    model = build_training_model(model_config, dist)
    optimizer = build_optimizer(model, OptimConfig(lr=config.lr))
    facts = _shape_facts(model)
    minibatches = [
        draw_packed_samples(
            config.tokens_per_rank, facts["vocab_size"], min_prompt=config.min_prompt, max_prompt=config.max_prompt,
            output_median=config.output_median, output_sigma=config.output_sigma, max_output=config.max_output,
            seed=config.seed + 1000 * dist.rank + i,
        )
        for i in range(config.minibatches_per_step)
    ]
    step_samples = int(_all_reduce(sum(len(mb) for mb in minibatches), torch_dist.ReduceOp.SUM, dist))
    flops = [training_flops(
        non_embedding_params=facts["non_embedding_params"], hidden_size=facts["hidden_size"],
        vocab_size=facts["vocab_size"], num_layers=facts["num_layers"], attention_width=facts["attention_width"],
        sample_lengths=[s.num_tokens for s in mb], output_tokens=sum(len(s.output_token_ids) for s in mb),
    ) for mb in minibatches]
    step_flops = _all_reduce(sum(f.total for f in flops), torch_dist.ReduceOp.SUM, dist)
    attention_flops = _all_reduce(sum(f.attention for f in flops), torch_dist.ReduceOp.SUM, dist)
    lm_head_flops = _all_reduce(sum(f.lm_head for f in flops), torch_dist.ReduceOp.SUM, dist)
    step_tokens = config.tokens_per_rank * config.minibatches_per_step * dist.world_size
    compute_dtype = torch.bfloat16 if dist.device.type == "cuda" and config.mixed_precision else torch.float32
    peak_total, peak_source, matmul_total = _peak(config, dist, compute_dtype)

    for _ in range(config.warmup):
        train_step(model, optimizer, minibatches, step_samples, dist)
    times = []
    for _ in range(config.steps):
        _sync(dist.device)
        start = time.perf_counter()
        train_step(model, optimizer, minibatches, step_samples, dist)
        _sync(dist.device)
        times.append(_all_reduce(time.perf_counter() - start, torch_dist.ReduceOp.MAX, dist))
    step_s = statistics.median(times)
    achieved = step_flops / step_s
    samples_per_rank = [len(mb) for mb in minibatches]
    return {
        "tokens_per_s": step_tokens / step_s,
        "mfu": achieved / (peak_total * 1e12),
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": peak_total,
        "peak_source": peak_source,
        "matmul_tflops": matmul_total,
        "mfu_vs_matmul": achieved / (matmul_total * 1e12),
        "step_s": step_s,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_step": step_tokens,
        "tokens_per_rank": config.tokens_per_rank,
        "minibatches_per_step": config.minibatches_per_step,
        "samples_per_minibatch_rank0": samples_per_rank[0],
        "output_tokens_rank0": sum(len(s.output_token_ids) for s in minibatches[0]),
        "attention_flop_frac": attention_flops / step_flops,
        "lm_head_flop_frac": lm_head_flops / step_flops,
        "params": facts["params"],
        "non_embedding_params": facts["non_embedding_params"],
        "peak_mem_gib_max_rank": _all_reduce(_peak_memory_gib(dist), torch_dist.ReduceOp.MAX, dist),
        "world_size": dist.world_size,
        "device": dist.device.type,
        "backend": dist.backend,
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "attn": model.causal_lm.config._attn_implementation,
        "gradient_checkpointing": config.gradient_checkpointing,
        "threads_per_rank": torch.get_num_threads(),
        "warmup": config.warmup,
        "steps": config.steps,
        "model": config.model_path or config.preset,
    }


def format_result(result: dict[str, float | int | str]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())


def main(argv: list[str] | None = None) -> None:
    config = load_bench_config(BenchConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging(logging.WARNING)
    dist = init_distributed()
    workdir = Path(tempfile.mkdtemp(prefix="bench-trainer-throughput-")) if dist.is_main else Path()
    try:
        result = run(config, dist, workdir)
        if dist.is_main:
            print(format_result(result), flush=True)
        if dist.world_size > 1:
            torch_dist.barrier()  # rank 0 removes the checkpoint only once no rank reads it
    finally:
        if dist.is_main:
            shutil.rmtree(workdir, ignore_errors=True)
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
