"""Peak memory of a training pass: chunked logprobs (the trainer's) vs full [tokens, vocab] logits.

    .venv/bin/python -m benchmarks.memory                                   # head, 0.5B shape, 1k-8k tokens
    .venv/bin/python -m benchmarks.memory --scope model --token_counts 1024 2048 --gradient_checkpointing
    .venv/bin/python -m benchmarks.memory --model.hidden_size 64 --model.num_heads 4 --token_counts 256 512 \
        --check_tokens 128 --chunk_size 128                                   # seconds
    .venv/bin/python -m benchmarks.memory --scope model --against plan --model.num_layers 4 \
        --token_counts 2048 8192 [--gradient_checkpointing]   # a trainer step against the placement plan

One training pass = forward, GRPO loss (grpo_loss.grpo_loss, KL on), backward, on synthetic
rollouts of realistic lengths packed to exactly T tokens (trainer_throughput.draw_packed_samples,
post_process_batch). Two ways to score the output tokens:

- chunked: grpo_loss.chunked_token_logprobs, what the trainer and the logprob worker run:
  lm_head on `chunk_size` output positions at a time, each chunk recomputed in backward;
- full: the reference written here (full_logit_logprobs): [O, vocab] logits at once,
  log_softmax, gather, as a plain `model(...).logits` training loop does.

Scope (--scope): `head` (default) runs only what the two differ in: final hidden states of the
output positions [O, hidden] (a leaf with grad) -> lm_head [vocab, hidden] -> logprobs -> loss ->
backward (gradients of both); `model` runs the whole preset model (loaded with from_pretrained
from a checkpoint written once) through TokenLogprobModel for chunked, and the same decoder pass
followed by full logits for full. vocab is the preset's (151,936 for the Qwen2.5 shapes).

Each measurement runs in a fresh spawned process, so one measurement's allocations (and the
allocator's cached memory) never count in another's. What is reported is the growth of the
peak during the pass over the memory in use just before it (inputs, weights and model built):
- CPU: peak RSS, reset before the pass through /proc/self/clear_refs (Linux) and read from
  VmHWM; on machines where that reset is not allowed, the process's max RSS (ru_maxrss) since
  start minus the RSS before the pass (then setup must not peak above the pass);
- CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats (allocator view).

Before measuring, a check (one process, --check_tokens packed tokens, fp32) runs both ways on
the same inputs and raises unless they give the same logprobs and the same gradients (of the
hidden states and lm_head in head scope, of every parameter in model scope) to float rounding.

Output: the check's line, one line per token count (`tokens=T chunked_mib=.. full_mib=..
output_tokens=O ratio=<full_mib/chunked_mib> ...`, `failed` values where a measurement ran out of
memory), and last the settings.

Against the plan (--against plan, --scope model, CPU, fp32): no chunked/full comparison; instead
one trainer step per token count (benchmarks/step_memory.measure_step: a warm-up step, then
forward, GRPO loss, backward, clipping and AdamW on the preset's checkpoint, in a fresh process)
against async_grpo/launch/placement.py's estimate for one rank at that token budget in fp32. Per
row: `pass_mib` (the step's peak RSS over the weights and moments before it) beside its estimate
(fp32 gradients + trainer_activation_bytes) and `pass_ratio` = estimate / measured, then
`step_mib` (the weights and moments, counted from the tensors, plus pass_mib) beside the plan's
state + activations, and `step_ratio`. Before the rows, one `saved` line per compute dtype
(float32, bfloat16): the bytes per token autograd keeps in the last decoder layer and outside the
layers (step_memory.saved_bytes_per_token, --check_tokens tokens) against
placement.layer_activation_bytes and head_activation_bytes. The plan's FSDP2 gathers and
per-process overhead are GPU terms, not part of either comparison.

Reading the numbers: the full way's peak grows with O (a few fp32 [O, vocab] tensors live at
once: logits, log_softmax, their gradients); the chunked way's is flat in O, a few fp32
[chunk_size, vocab] tensors (the chunk's logits, cross-entropy's log-softmax, and the entropy's
log-probabilities, probabilities and product, then the recomputed chunk and its gradient in
backward). So below about 1.5 x chunk_size output tokens chunked needs *more* than full, and
the ratio rises about linearly beyond.
"""

from __future__ import annotations

import gc
import json
import logging
import resource
import tempfile
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal

import torch

from async_grpo.launch.placement import (
    FP32_BYTES, ModelShape, RunShape, head_activation_bytes, layer_activation_bytes, trainer_memory,
)
from async_grpo.demo_assets.tiny_model import (
    PRESETS, ShapeOverrides, TinyModelConfig, build_chat_tokenizer, build_tiny_tokenizer, model_shape, write_tiny_model,
)
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging
from benchmarks.packed_samples import draw_packed_samples, full_logit_logprobs
from benchmarks.step_memory import (
    StepPeak, in_fresh_process, measure_step, reset_cpu_peak, rss_kib, saved_bytes_per_token,
)
from grpo_loss import LossConfig, chunked_token_logprobs, grpo_loss
from sample_processing_utils import PackedBatch, post_process_batch
from setup_model import TokenLogprobModel, load_causal_lm

logger = logging.getLogger("benchmarks.memory")

LOSS_CONFIG = LossConfig(kl_coef=0.05)
VARIANTS = ("chunked", "full")
BYTES_PER_MIB = 2**20
# Largest allowed difference between the two ways in the (fp32) check: both sum the same terms,
# in a different order, so anything beyond float rounding is a bug.
LOGPROB_TOLERANCE = 1e-4  # absolute, in nats
GRAD_TOLERANCE = 1e-4  # relative to the gradient tensor's largest magnitude
CHECK_MIN_CHUNKS = 3  # the equality check spans at least this many chunks


SMOKE = {"model": ShapeOverrides(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, num_layers=1,
                                 vocab_size=256),
         "token_counts": [256], "check_tokens": 256, "chunk_size": 64}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """What to measure: the command line of `benchmarks/memory.py`."""

    preset: str = "qwen2.5-0.5b"
    """Model shape (tiny_model.PRESETS); its vocab_size sets the logits' width."""
    model: ShapeOverrides = ShapeOverrides()
    """Fields replacing the preset's (--model.hidden_size 64 ...), for small checks."""
    scope: Literal["head", "model"] = "head"
    """'head': hidden states -> lm_head -> loss -> backward; 'model': the whole model's pass."""
    token_counts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    """Packed tokens per pass (prompt + output), one measurement of each way per count."""
    chunk_size: int = 1024
    """Output tokens per lm_head chunk (ModelConfig.logprob_chunk_size's default)."""
    check_tokens: int = 512
    """Packed tokens of the equality check run before measuring."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: 'auto' is bfloat16 on CUDA (the trainer's mixed precision), float32 on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto': CUDA when available."""
    gradient_checkpointing: bool = False
    """Model scope: recompute each decoder layer in backward (ModelConfig.gradient_checkpointing)."""
    against: Literal["full", "plan"] = "full"
    """'full': the chunked logprobs against full logits; 'plan': a whole trainer step against the
    placement plan's estimate (needs --scope model; runs on the CPU in fp32)."""
    threads: int = 0
    """torch intra-op threads in each measuring process; 0 keeps torch's default."""
    min_prompt: int = 64
    """Shortest prompt, tokens."""
    max_prompt: int = 512
    """Longest prompt, tokens."""
    output_median: float = 1024.0
    """Median output length (log-normal), tokens."""
    output_sigma: float = 0.75
    """Log-normal sigma of output lengths."""
    max_output: int = 4096
    """Outputs are cut here."""
    seed: int = 0
    """Seed of weights, hidden states and samples."""

    smoke: bool = False
    """Smoke mode: a 1-layer, 64-wide model with a 256-token vocabulary, 256 tokens (SMOKE); checks that the
    command still runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"BenchConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if not self.token_counts or min(self.token_counts) < 2:
            raise ValueError(f"BenchConfig.token_counts must be non-empty, each >= 2, got {self.token_counts}")
        if self.check_tokens < 2 or self.chunk_size < 1 or self.threads < 0:
            raise ValueError("BenchConfig: check_tokens >= 2, chunk_size >= 1 and threads >= 0 required")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("BenchConfig.device is 'cuda' but CUDA is not available")
        if self.against == "plan" and (self.scope != "model" or self.device == "cuda" or self.dtype == "bfloat16"):
            raise ValueError("BenchConfig.against 'plan' measures the whole model on the CPU in fp32: it needs "
                             f"scope 'model', device auto/cpu and dtype auto/float32, got scope {self.scope!r}, "
                             f"device {self.device!r}, dtype {self.dtype!r}")


def resolve_device(config: BenchConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: BenchConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if config.dtype == "bfloat16" else torch.float32


@dataclass
class Pass:
    """Everything one training pass needs, built before memory is measured."""

    batch: PackedBatch
    logprobs: Callable[[str], torch.Tensor]
    """variant -> [O] logprobs of the output tokens (with grad)."""
    leaves: dict[str, torch.Tensor]
    """Tensors whose gradients the check compares."""


def _head_pass(config: BenchConfig, shape: TinyModelConfig, batch: PackedBatch, device: torch.device,
               dtype: torch.dtype) -> Pass:
    """Final hidden states of the output positions and a [vocab, hidden] lm_head, both with grad."""
    gen = torch.Generator().manual_seed(config.seed)
    lm_head = torch.nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(lm_head.weight.shape, generator=gen) * 0.02)  # Qwen2's init std
    lm_head = lm_head.to(device=device, dtype=dtype)
    num_outputs = int(batch.inputs.output_indices.numel())
    # RMS-normed hidden states have unit scale per feature (the final norm's gain starts at 1).
    hidden = torch.randn(num_outputs, shape.hidden_size, generator=gen).to(device=device, dtype=dtype)
    hidden.requires_grad_(True)
    labels = batch.inputs.targets.to(device)

    def logprobs(variant: str) -> torch.Tensor:
        if variant == "chunked":
            return chunked_token_logprobs(hidden, lm_head, labels, config.chunk_size)[0]
        return full_logit_logprobs(hidden, lm_head, labels)

    return Pass(batch=batch, logprobs=logprobs, leaves={"hidden_states": hidden, "lm_head.weight": lm_head.weight})


def _model_pass(config: BenchConfig, model_dir: str, batch: PackedBatch, device: torch.device,
                dtype: torch.dtype) -> Pass:
    """The checkpoint through TokenLogprobModel (chunked) or its decoder + full logits (full)."""
    causal_lm = load_causal_lm(model_dir, device=device, dtype=dtype)
    causal_lm.config.use_cache = False
    if config.gradient_checkpointing:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = TokenLogprobModel(causal_lm, logprob_chunk_size=config.chunk_size).train()
    inputs = batch.inputs
    input_ids, position_ids = inputs.input_ids.to(device), inputs.position_ids.to(device)
    targets, output_indices = inputs.targets.to(device), inputs.output_indices.to(device)

    def logprobs(variant: str) -> torch.Tensor:
        if variant == "chunked":
            return model(input_ids, position_ids, targets, output_indices)[0]
        hidden = causal_lm.get_decoder()(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), use_cache=False
        ).last_hidden_state[0]
        return full_logit_logprobs(hidden[output_indices], causal_lm.get_output_embeddings(), targets)

    return Pass(batch=batch, logprobs=logprobs, leaves=dict(model.named_parameters()))


def _shape_and_batch(config: BenchConfig, num_tokens: int) -> tuple[TinyModelConfig, PackedBatch]:
    """The model shape (vocab_size filled in) and the packed batch of num_tokens tokens."""
    shape = model_shape(config.preset, config.model)
    if shape.vocab_size is None:  # the tokenizer's size, as write_tiny_model makes it
        tokenizer = build_tiny_tokenizer() if shape.tokenizer == "char" else build_chat_tokenizer()
        shape = replace(shape, vocab_size=len(tokenizer))
    samples = draw_packed_samples(
        num_tokens, shape.vocab_size, min_prompt=config.min_prompt, max_prompt=config.max_prompt,
        output_median=config.output_median, output_sigma=config.output_sigma, max_output=config.max_output,
        seed=config.seed,
    )
    return shape, post_process_batch(samples)


def _build_pass(config: BenchConfig, num_tokens: int, model_dir: str) -> tuple[Pass, torch.device, torch.dtype]:
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    shape, batch = _shape_and_batch(config, num_tokens)
    if config.scope == "head":
        return _head_pass(config, shape, batch, device, dtype), device, dtype
    return _model_pass(config, model_dir, batch, device, dtype), device, dtype


def _train(training_pass: Pass, variant: str) -> torch.Tensor:
    """Forward, GRPO loss, backward; returns the logprobs (detached)."""
    logprobs = training_pass.logprobs(variant)
    loss, _ = grpo_loss(logprobs, training_pass.batch, LOSS_CONFIG)
    loss.backward()
    return logprobs.detach()


def measure(config: BenchConfig, variant: str, num_tokens: int, model_dir: str) -> dict[str, float | str]:
    """In a fresh process: build the pass, then the peak growth of memory over one training pass."""
    training_pass, device, _ = _build_pass(config, num_tokens, model_dir)
    gc.collect()
    start_time = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _train(training_pass, variant)
        torch.cuda.synchronize(device)
        peak, method = torch.cuda.max_memory_allocated(device) - before, "cuda_max_memory_allocated"
    else:
        before_kib = rss_kib("VmRSS")
        if reset_cpu_peak():
            _train(training_pass, variant)
            peak_kib, method = rss_kib("VmHWM"), "rss_peak_clear_refs"
        else:
            _train(training_pass, variant)
            peak_kib, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
        peak = (peak_kib - before_kib) * 1024
    return {
        "peak_mib": peak / BYTES_PER_MIB,
        "seconds": time.perf_counter() - start_time,
        "output_tokens": float(training_pass.batch.inputs.output_indices.numel()),
        "method": method,
    }


def check_equal(config: BenchConfig, model_dir: str) -> dict[str, float]:
    """In a fresh process: both ways on the same inputs; raise unless logprobs and gradients agree.

    The check runs in fp32 whatever --dtype says: it tests that the maths agree, and bf16 would
    bury that under rounding (a bf16 matmul over a chunk and over the whole may split its sums
    differently). The chunk size is cut to a third of the check's output tokens when larger, so
    that the check always crosses chunk boundaries (one chunk would be the full computation).
    """
    num_outputs = int(_shape_and_batch(config, config.check_tokens)[1].inputs.output_indices.numel())
    chunk_size = min(config.chunk_size, max(1, num_outputs // CHECK_MIN_CHUNKS))
    check_config = replace(config, chunk_size=chunk_size, dtype="float32")
    training_pass, _, _ = _build_pass(check_config, config.check_tokens, model_dir)
    results = {}
    for variant in VARIANTS:
        for leaf in training_pass.leaves.values():
            leaf.grad = None
        logprobs = _train(training_pass, variant)
        grads = {name: leaf.grad.detach().float().clone() for name, leaf in training_pass.leaves.items()}
        results[variant] = (logprobs.float(), grads)
    (chunked_lp, chunked_grads), (full_lp, full_grads) = results["chunked"], results["full"]
    logprob_diff = float((chunked_lp - full_lp).abs().max())
    grad_diff = max(
        float((chunked_grads[name] - full_grads[name]).abs().max() / full_grads[name].abs().max().clamp_min(1e-30))
        for name in full_grads
    )
    if not (logprob_diff <= LOGPROB_TOLERANCE and grad_diff <= GRAD_TOLERANCE):
        raise AssertionError(
            f"chunked and full logits disagree: max |logprob diff| {logprob_diff:.3g} (tolerance "
            f"{LOGPROB_TOLERANCE}), max relative gradient diff {grad_diff:.3g} (tolerance {GRAD_TOLERANCE})"
        )
    return {"max_logprob_diff": logprob_diff, "max_grad_rel_diff": grad_diff, "output_tokens": float(num_outputs),
            "chunk_size": float(chunk_size)}


def _measure_or_failure(config: BenchConfig, variant: str, num_tokens: int, model_dir: str) -> dict[str, float | str]:
    """measure() in a fresh process; an out-of-memory failure becomes a result, not a crash."""
    try:
        return in_fresh_process(measure, config, variant, num_tokens, model_dir)
    except BrokenProcessPool:  # killed, most likely by the kernel's OOM killer
        return {"failed": "killed"}
    except torch.cuda.OutOfMemoryError:
        return {"failed": "cuda_oom"}


def _format(value: float | str) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run(config: BenchConfig, model_dir: str) -> None:
    check = in_fresh_process(check_equal, config, model_dir)
    print(f"check tokens={config.check_tokens} " + " ".join(f"{k}={_format(v)}" for k, v in check.items())
          + " equal=true", flush=True)
    for num_tokens in sorted(config.token_counts):
        result = {variant: _measure_or_failure(config, variant, num_tokens, model_dir) for variant in VARIANTS}
        chunked, full = result["chunked"], result["full"]
        fields = {"tokens": num_tokens}
        for variant, measured in result.items():
            fields[f"{variant}_mib"] = measured.get("peak_mib", measured.get("failed"))
        for variant, measured in result.items():
            if "output_tokens" in measured:
                fields["output_tokens"] = int(measured["output_tokens"])
        if "peak_mib" in chunked and "peak_mib" in full:
            fields["ratio"] = full["peak_mib"] / chunked["peak_mib"]
        for variant, measured in result.items():
            if "seconds" in measured:
                fields[f"{variant}_s"] = measured["seconds"]
        fields["method"] = next((m["method"] for m in result.values() if "method" in m), "none")
        print(" ".join(f"{k}={_format(v)}" for k, v in fields.items()), flush=True)


def _saved_in_child(config: BenchConfig, model_dir: str, dtype: torch.dtype) -> dict[str, float]:
    """In a fresh process: saved_bytes_per_token of the checkpoint loaded in `dtype`."""
    if config.threads:
        torch.set_num_threads(config.threads)
    causal_lm = load_causal_lm(model_dir, dtype=dtype)
    causal_lm.config.use_cache = False
    batch = _shape_and_batch(config, config.check_tokens)[1]
    return saved_bytes_per_token(causal_lm, batch.inputs, config.chunk_size)


def _plan_shape(model_dir: str) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


def _print_saved(config: BenchConfig, model_dir: str, shape: ModelShape) -> None:
    """One line per compute dtype: autograd's saved bytes per token against the plan's count."""
    for dtype in (torch.float32, torch.bfloat16):
        saved = in_fresh_process(_saved_in_child, config, model_dir, dtype)
        dtype_bytes = torch.finfo(dtype).bits // 8
        layer, layer_estimate = saved[f"layer{shape.num_layers - 1}"], layer_activation_bytes(shape, dtype_bytes)
        outside, outside_estimate = saved.get("outside", 0.0), head_activation_bytes(shape, dtype_bytes)
        print(f"saved dtype={str(dtype).removeprefix('torch.')} tokens={config.check_tokens} "
              f"layer_bytes_per_token={layer:.0f} layer_estimate={layer_estimate} "
              f"layer_ratio={layer_estimate / layer:.3f} outside_bytes_per_token={outside:.0f} outside_estimate={outside_estimate}", flush=True)


def _step_or_failure(model_dir: str, batch: PackedBatch, config: BenchConfig) -> StepPeak | str:
    """measure_step, or 'killed' when the kernel's OOM killer ended it."""
    try:
        return measure_step(model_dir, batch, config.chunk_size, config.gradient_checkpointing, config.threads)
    except BrokenProcessPool:
        return "killed"


def run_against_plan(config: BenchConfig, model_dir: str) -> None:
    """The `saved` lines, then one row per token count: a measured step against the plan."""
    shape = _plan_shape(model_dir)
    _print_saved(config, model_dir, shape)
    for num_tokens in sorted(config.token_counts):
        batch = _shape_and_batch(config, num_tokens)[1]
        start_time = time.perf_counter()
        peak = _step_or_failure(model_dir, batch, config)
        fields: dict[str, float | str] = {"tokens": num_tokens}
        if isinstance(peak, str):
            print(" ".join(f"{k}={_format(v)}" for k, v in {**fields, "failed": peak}.items()), flush=True)
            continue
        run = RunShape(trainer_ranks=1, max_tokens_per_gpu=num_tokens, logprob_chunk_size=config.chunk_size,
                       gradient_checkpointing=config.gradient_checkpointing, compute_dtype_bytes=FP32_BYTES)
        estimate = trainer_memory(shape, run)
        pass_estimate = FP32_BYTES * shape.num_params + estimate.activations
        step_estimate = estimate.state + estimate.activations
        fields.update({
            "output_tokens": peak.output_tokens,
            "pass_mib": peak.pass_bytes / BYTES_PER_MIB, "pass_estimate_mib": pass_estimate / BYTES_PER_MIB,
            "pass_ratio": pass_estimate / peak.pass_bytes,
            "step_mib": peak.step_bytes / BYTES_PER_MIB, "step_estimate_mib": step_estimate / BYTES_PER_MIB,
            "step_ratio": step_estimate / peak.step_bytes,
            "activations_estimate_mib": estimate.activations / BYTES_PER_MIB,
            "seconds": time.perf_counter() - start_time, "method": peak.method,
        })
        print(" ".join(f"{k}={_format(v)}" for k, v in fields.items()), flush=True)


def main(argv: list[str] | None = None) -> None:
    config = load_bench_config(BenchConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging(logging.WARNING)
    shape = model_shape(config.preset, config.model)
    device = torch.device("cpu") if config.against == "plan" else resolve_device(config)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "model", shape)) if config.scope == "model" else ""
        if config.against == "plan":
            run_against_plan(config, model_dir)
        else:
            run(config, model_dir)
    print(
        f"scope={config.scope} preset={config.preset} hidden={shape.hidden_size} layers={shape.num_layers} "
        f"vocab={shape.vocab_size} chunk_size={config.chunk_size} device={device.type} "
        f"dtype={str(resolve_dtype(config, device)).removeprefix('torch.')} "
        f"gradient_checkpointing={config.gradient_checkpointing} against={config.against} "
        f"threads={config.threads or 'default'} "
        f"token_counts={','.join(map(str, sorted(config.token_counts)))}",
        flush=True,
    )


if __name__ == "__main__":
    main()
