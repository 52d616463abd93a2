"""Packed vs right-padded training step on the same samples: how much does packing save?

    cd /work/main && .venv/bin/python -m benchmarks.packing             # ~1-2 min on 2 CPU cores
    .venv/bin/python -m benchmarks.packing --num_samples 32 --reps 7  # see --help for the rest

Writes a random-init Qwen2 wider than the tiny test model to a temporary folder (no network),
draws prompt lengths uniformly and output lengths log-normally (most rollouts short, a long tail),
then times one training step on each layout:

- packed: one [T] stream through TokenLogprobModel (positions restart per sample, no padding),
  chunked lm_head on output positions only, grpo_loss, backward; attention is --packed_attn
  (default packed_attention.PACKED_SDPA, what the trainer uses without flash-attn);
- padded: [B, L] right-padded batch through the plain HF forward with attention_mask (its own
  copy of the model, always plain "sdpa"), logits of the output positions, log_softmax, gather,
  the same grpo_loss, backward.

Each side is warmed up, then the two are timed alternately `--reps` times (so both see the same
background load); medians are reported. Both sides' losses are compared first, so the two steps
provably compute the same thing. The last line is key=value pairs: speedup=<padded s / packed s>
(wall clock), cpu_speedup (the same from CPU time, steadier on a busy machine) and each side's
real-token fraction among them, and packed_attn.

Reading the numbers: packing saves the linear layers' work on padding. With plain "sdpa"
(`--packed_attn sdpa`, what the trainer used before PACKED_SDPA) transformers runs a packed stream
as one [T, T] attention under a block-diagonal mask, so attention work grows with T^2 rather than
sum(len_i^2) and gives much of that saving back; PACKED_SDPA (like flash_attention_2's varlen
kernel) attends within each sample only. packed_over_padded_attn_pairs is the ratio of
query-key pairs the packed side computes to the padded side's.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from async_grpo.model.packed_attention import PACKED_SDPA, PACKED_VARLEN
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from benchmarks.harness import apply_smoke, interleaved_medians, load_bench_config, setup_logging
from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import PackedBatch, Sample, post_process_batch
from setup_model import TokenLogprobModel, load_causal_lm

logger = logging.getLogger("benchmarks.packing")

# The two layouts sum the same fp32 terms in different orders; anything beyond this is a bug.
LOSS_MATCH_RTOL = 1e-4
# In bf16 the two layouts' matmuls round differently (8 bits of mantissa, ~4e-3 per value): a few
# percent of the loss, still far below what a lost sample or a cross-sample leak gives.
BF16_LOSS_MATCH_RTOL = 3e-2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOSS_CONFIG = LossConfig(kl_coef=0.05, is_mode="tis", is_cap=2.0)
PADDED_ATTN = "sdpa"  # the baseline: transformers' own sdpa with the padding mask


SMOKE = {"num_samples": 4, "reps": 1, "warmup": 0, "num_layers": 1}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """What to measure: the command line of `python -m benchmarks.packing`."""

    num_samples: int = 16
    """Samples in the batch (rollouts of one minibatch)."""
    min_prompt: int = 16
    """Shortest prompt, tokens."""
    max_prompt: int = 96
    """Longest prompt, tokens."""
    output_median: float = 64.0
    """Median output length (log-normal), tokens."""
    output_sigma: float = 1.0
    """Log-normal sigma of output lengths: 1.0 gives a p90/median ratio of about 3.6."""
    max_output: int = 640
    """Output lengths are cut here, as max_tokens cuts rollouts."""
    hidden_size: int = 384
    """Model width (the tiny test model has 128)."""
    num_layers: int = 4
    """Decoder layers."""
    intermediate_size: int = 1024
    """MLP width."""
    warmup: int = 1
    """Untimed steps per side before timing."""
    reps: int = 3
    """Timed steps per side; the median is reported."""
    seed: int = 0
    """Seed of the model weights and the sample draw."""
    packed_attn: str = PACKED_SDPA
    """attn_implementation of the packed side; 'sdpa' measures transformers' block-mask path."""
    threads: int = 1
    """torch intra-op threads. One by default: on a shared machine a single thread's CPU time
    measures the work without OpenMP threads spinning while a sibling is descheduled."""
    device: str = "cpu"
    """'cpu' or 'cuda' (scripts/gpu_check.sh: packed against padded on the GPU)."""
    dtype: str = "float32"
    """Parameter dtype of both copies: 'float32' or 'bfloat16' (on CUDA, with --packed_attn
    packed_varlen for the flash-attention varlen kernel)."""

    smoke: bool = False
    """Smoke mode: 4 samples, 1 layer, 1 repetition (SMOKE); checks that the command still runs, its figures mean
    nothing."""

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"BenchConfig.num_samples must be >= 1, got {self.num_samples}")
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError(f"BenchConfig.min_prompt must be in [1, max_prompt], got {self.min_prompt}")
        if self.output_median < 1 or self.output_sigma < 0 or self.max_output < 1:
            raise ValueError("BenchConfig.output_median >= 1, output_sigma >= 0, max_output >= 1 required")
        if self.threads < 1:
            raise ValueError(f"BenchConfig.threads must be >= 1, got {self.threads}")
        if self.reps < 1 or self.warmup < 0:
            raise ValueError(f"BenchConfig.reps must be >= 1 and warmup >= 0, got {self.reps}, {self.warmup}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"BenchConfig.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"BenchConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")


def draw_samples(config: BenchConfig, vocab: int) -> list[Sample]:
    """Random tokens; log-normal output lengths; logprobs near 0 so the loss is well defined."""
    gen = torch.Generator().manual_seed(config.seed)
    log_lengths = torch.randn(config.num_samples, generator=gen) * config.output_sigma
    output_lengths = (config.output_median * log_lengths.exp()).round().clamp(1, config.max_output).long()
    samples = []
    for i, output_len in enumerate(output_lengths.tolist()):
        prompt_len = int(torch.randint(config.min_prompt, config.max_prompt + 1, (1,), generator=gen))
        logprobs = (-torch.rand(output_len, generator=gen)).tolist()
        samples.append(Sample(
            input_token_ids=torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
            output_token_ids=torch.randint(0, vocab, (output_len,), generator=gen).tolist(),
            gt_answer="", prompt_id=i, advantage=float(torch.randn(1, generator=gen)),
            sampling_logprobs=logprobs, ref_logprobs=logprobs,
        ))
    return samples


@dataclass(slots=True)
class PaddedInputs:
    """Right-padded batch and where each output token's prediction sits in it."""

    input_ids: torch.Tensor
    """[B, L] token ids, 0 in padding."""
    attention_mask: torch.Tensor
    """[B, L] 1 for real tokens."""
    rows: torch.Tensor
    """[O] batch row of each output token's predicting position (packed order)."""
    cols: torch.Tensor
    """[O] column of that position."""
    targets: torch.Tensor
    """[O] the output tokens."""


def pad_samples(samples: list[Sample], device: torch.device = torch.device("cpu")) -> PaddedInputs:
    seqs = [s.input_token_ids + s.output_token_ids for s in samples]
    max_len = max(len(seq) for seq in seqs)
    input_ids = torch.zeros(len(seqs), max_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    rows, cols, targets = [], [], []
    for row, (seq, s) in enumerate(zip(seqs, samples)):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
        prompt_len, output_len = len(s.input_token_ids), len(s.output_token_ids)
        rows += [row] * output_len
        cols += range(prompt_len - 1, prompt_len - 1 + output_len)  # position before each output token
        targets += s.output_token_ids
    return PaddedInputs(*(t.to(device) for t in (input_ids, attention_mask, torch.tensor(rows), torch.tensor(cols),
                                                  torch.tensor(targets))))


def packed_step(model: TokenLogprobModel, batch: PackedBatch) -> float:
    logprobs, _ = model.score(batch.inputs)
    loss, _ = grpo_loss(logprobs, batch, LOSS_CONFIG)
    loss.backward()
    return loss.item()


def padded_step(causal_lm: torch.nn.Module, padded: PaddedInputs, batch: PackedBatch) -> float:
    logits = causal_lm(input_ids=padded.input_ids, attention_mask=padded.attention_mask, use_cache=False).logits
    log_p = torch.log_softmax(logits[padded.rows, padded.cols].float(), dim=-1)
    logprobs = log_p.gather(1, padded.targets[:, None])[:, 0]
    loss, _ = grpo_loss(logprobs, batch, LOSS_CONFIG)
    loss.backward()
    return loss.item()


def run(config: BenchConfig, model_dir: Path) -> dict[str, float]:
    write_tiny_model(model_dir, TinyModelConfig(
        hidden_size=config.hidden_size, num_layers=config.num_layers, num_heads=config.hidden_size // 64,
        num_kv_heads=2, intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_prompt + config.max_output, seed=config.seed,
    ))
    # Two copies of the same checkpoint, so that each side runs its own attention implementation.
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    causal_lm = load_causal_lm(model_dir, device=device, dtype=dtype, attn_implementation=config.packed_attn).train()
    padded_lm = load_causal_lm(model_dir, device=device, dtype=dtype, attn_implementation=PADDED_ATTN).train()
    model = TokenLogprobModel(causal_lm)
    both = torch.nn.ModuleList([model, padded_lm])
    samples = draw_samples(config, causal_lm.config.vocab_size)
    batch, padded = post_process_batch(samples), pad_samples(samples, device)

    packed_loss, padded_loss = packed_step(model, batch), padded_step(padded_lm, padded, batch)
    both.zero_grad(set_to_none=True)
    rtol = LOSS_MATCH_RTOL if dtype == torch.float32 else BF16_LOSS_MATCH_RTOL
    if abs(packed_loss - padded_loss) > rtol * max(1.0, abs(padded_loss)):
        raise RuntimeError(f"packed loss {packed_loss} != padded loss {padded_loss}: the layouts disagree")

    medians = interleaved_medians(
        {"packed": lambda: packed_step(model, batch), "padded": lambda: padded_step(padded_lm, padded, batch)},
        both, warmup=config.warmup, reps=config.reps, cuda=config.device == "cuda",
    )
    packed_time, padded_time = medians["packed"], medians["padded"]
    real_tokens = batch.num_tokens
    # The varlen implementations attend within each sample; plain 'sdpa' sees one [T, T] square.
    sample_lengths = [s.num_tokens for s in samples]
    per_sample = config.packed_attn in (PACKED_SDPA, PACKED_VARLEN, "flash_attention_2")
    packed_pairs = sum(n * n for n in sample_lengths) if per_sample else real_tokens**2
    return {
        "speedup": padded_time.wall_s / packed_time.wall_s,
        "cpu_speedup": padded_time.cpu_s / packed_time.cpu_s,
        "packed_s": packed_time.wall_s,
        "padded_s": padded_time.wall_s,
        "packed_cpu_s": packed_time.cpu_s,
        "padded_cpu_s": padded_time.cpu_s,
        "packed_real_token_frac": real_tokens / batch.inputs.input_ids.numel(),
        "padded_real_token_frac": real_tokens / padded.input_ids.numel(),
        # The padded batch is B x [L, L] for sdpa: above 1, packing pays back some of its saving.
        "packed_over_padded_attn_pairs": packed_pairs / (padded.input_ids.shape[0] * padded.input_ids.shape[1] ** 2),
        "num_samples": len(samples),
        "real_tokens": real_tokens,
        "padded_tokens": padded.input_ids.numel(),
        "output_tokens": int(batch.advantages.numel()),
        "params_m": sum(p.numel() for p in causal_lm.parameters()) / 1e6,
        "threads": torch.get_num_threads(),
        "packed_attn": config.packed_attn,
        "device": config.device,
        "dtype": config.dtype,
    }


def main(argv: list[str] | None = None) -> None:
    config = load_bench_config(BenchConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging(logging.WARNING)
    torch.set_num_threads(config.threads)
    with tempfile.TemporaryDirectory(prefix="bench-packing-") as tmp:
        result = run(config, Path(tmp))
    print(
        f"{result['num_samples']} samples, {result['real_tokens']} real tokens "
        f"({result['output_tokens']} output); padded batch holds {result['padded_tokens']} positions; "
        f"model {result['params_m']:.1f}M params, {result['threads']} threads"
    )
    for side in ("packed", "padded"):
        print(
            f"{side}: {result[side + '_s']:.3f} s/step wall, {result[side + '_cpu_s']:.3f} s CPU, "
            f"real-token fraction {result[side + '_real_token_frac']:.3f}"
        )
    print(f"padded / packed time ratio: {result['speedup']:.2f}x wall, {result['cpu_speedup']:.2f}x CPU")
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
