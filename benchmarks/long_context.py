"""Long samples with context parallelism: peak memory per rank and step time, cp 1 against cp 2, one
sample of each length per step; and the longest sample a fixed per-rank token budget accepts.

    .venv/bin/python -m benchmarks.long_context                          # 0.5B shape, 2 layers, 4k/8k/16k
    .venv/bin/python -m benchmarks.long_context --layers 24 --lengths 4096 8192   # the full depth
    .venv/bin/python -m benchmarks.long_context --smoke true             # seconds: checks the command

What is compared: two ranks (forked from this process, FSDP2 over both, gloo on CPU), one model
built as a context-parallel trainer builds it (fsdp_setup.build_training_model with
context_parallel 2: the dp x cp mesh, Ulysses attention), run two ways on the same ranks:
- cp 1: two data-parallel ranks, each its own sample of `length` tokens (the model's context
  group off, as with model.context_parallel 1; the CPU attention is packed_sdpa either way);
- cp 2: one sample of `length` tokens split over the two ranks.
So "per rank" is what one device holds to train a sample of that length, with the same two
devices and the same FSDP sharding of weights, gradients and AdamW moments in both. A step is the
trainer's own code: post_process_batch, policy_update._forward_backward (model, grpo_loss of the
trainer's default loss with the group's sums, backward), policy_update.take_gradient_step with
policy_update.gradient_divisor. Samples are a `--prompt_tokens` prompt and a response filling the
rest (the lm_head runs on response tokens only). Each rank first runs a short warm-up step in
each mode (AdamW's moments exist afterwards; every code path has run once).

Memory per rank, on CPU: the growth of the rank's resident set over a step (VmHWM, reset through
/proc/self/clear_refs before it, less VmRSS just before it: activations, gathered weights,
gradients, logit chunks), with glibc's mmap and trim thresholds fixed in each rank
(process_tuning.FIXED_MALLOC_ENV's values, set through mallopt) so that freed blocks leave the
resident set; and the rank's whole peak RSS (interpreter, libraries, weight shards and moments
included). On CUDA (`--cuda true`, two GPUs): torch.cuda.max_memory_allocated over the step less
memory_allocated before it, and the whole max_memory_allocated. The printed ratios are cp2/cp1 of
the larger of the two ranks' figures. The depth defaults to 2 layers on the 2-core CPU: what cp
divides is each layer's activations, so the fixed part (embedding/lm_head gathering, logit
chunks) weighs more here than at the full 24 layers, and the header says so.

The longest sample that fits a fixed budget (`--budget_tokens` as max_tokens_per_gpu, prompt
budget `--prompt_tokens`): the largest data.max_prompt_tokens + sampling.max_tokens that
TrainerConfig accepts at model.context_parallel 1 and 2 (its own refusal rule, searched by
bisection), each checked on the batcher's packer (MinibatchPacker sized by
trainer_core.make_batcher_config for 2 ranks): a sample of that length is not oversized there.

The LAST line: `long_context: tokens=<longest length> mem_ratio=... rss_ratio=... step_ratio=...
longest_cp1=... longest_cp2=... longest_ratio=... layers=... peak_method=...`.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as torch_mp

from async_grpo.batching.batcher_config import ExperienceConfig
from async_grpo.batching.batcher_messages import EndOfStep
from async_grpo.batching.minibatch_packer import MinibatchPacker
from async_grpo.data.dataset import DatasetConfig
from async_grpo.demo_assets.tiny_model import PRESETS, ShapeOverrides, model_shape, write_tiny_model
from async_grpo.config.sampling import SamplingConfig
from async_grpo.launch.process_tuning import FIXED_MALLOC_ENV
from async_grpo.trainer.config import TrainerConfig
from async_grpo.trainer.fsdp_setup import DistInfo, build_training_model, init_distributed
from async_grpo.trainer.optimizer import build_optimizer
from async_grpo.trainer.policy_update import _forward_backward, gradient_divisor, take_gradient_step
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging, summary_line
from benchmarks.step_memory import KIB, reset_cpu_peak, rss_kib
from sample_processing_utils import Sample, post_process_batch
from setup_model import ModelConfig
from trainer_core import make_batcher_config

logger = logging.getLogger("benchmarks.long_context")

RANKS = 2  # cp 2 over both ranks against 2 data-parallel ranks
DIST_TIMEOUT_S = 3 * 3600.0  # a 16k-token step of one rank takes minutes on the CPU; the peer waits in collectives
GIB = 2**30
# glibc mallopt parameters (malloc.h): fixed thresholds, as FIXED_MALLOC_ENV sets them at a process's start.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
SAMPLING_LOGPROB = -1.0  # the sampler's logprob of every response token: ratios near 1, some clipped
RESULTS_FILE = "results.json"

SMOKE = {"preset": "tiny", "layers": 2, "lengths": (64,), "prompt_tokens": 8, "warmup_tokens": 32,
         "steps": 1, "budget_tokens": 256, "logprob_chunk_size": 16}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class LongContextConfig:
    """Command line of `python -m benchmarks.long_context`."""

    preset: str = "qwen2.5-0.5b"
    """Model shape (tiny_model.PRESETS); its heads must divide by 2."""
    layers: int = 2
    """Decoder layers (the preset's width, heads and vocabulary are kept); 0: the preset's own."""
    lengths: tuple[int, ...] = (4096, 8192, 16384)
    """Tokens per sample (prompt + response), one row each."""
    prompt_tokens: int = 256
    """Prompt tokens of every sample, and data.max_prompt_tokens of the budget search."""
    warmup_tokens: int = 512
    """Length of the warm-up sample (one untimed step per mode before the rows)."""
    steps: int = 1
    """Timed steps per length and mode; the step time is their median, the memory the first's."""
    gradient_checkpointing: bool = False
    """model.gradient_checkpointing (the trainer's default: off)."""
    logprob_chunk_size: int = 1024
    """model.logprob_chunk_size (the trainer's default)."""
    budget_tokens: int = 16384
    """max_tokens_per_gpu of the longest-accepted-sample search."""
    threads_per_rank: int = 1
    """torch intra-op threads of each rank (2 ranks on the 2-core machine: 1)."""
    cuda: bool = False
    """Each rank on its own GPU with NCCL (needs two GPUs); default: CPU and gloo, GPUs hidden."""
    seed: int = 0
    """Seed of the token draw (the weights take the preset's seed)."""

    smoke: bool = False
    """Smoke mode: the tiny model, one 64-token row (SMOKE); checks that the command still runs, its figures
    mean nothing."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"LongContextConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.layers < 0:
            raise ValueError(f"LongContextConfig.layers must be >= 0, got {self.layers}")
        if not self.lengths or min(self.lengths) <= self.prompt_tokens:
            raise ValueError(f"LongContextConfig.lengths must be given and each above prompt_tokens={self.prompt_tokens}")
        if self.prompt_tokens < 1 or self.warmup_tokens <= self.prompt_tokens:
            raise ValueError("LongContextConfig: prompt_tokens >= 1 and warmup_tokens > prompt_tokens required")
        for name in ("steps", "budget_tokens", "logprob_chunk_size", "threads_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"LongContextConfig.{name} must be >= 1, got {getattr(self, name)}")


# ---- the trainer's config and step ---------------------------------------------------------------

def trainer_config(model_path: str, cp: int, budget: int, prompt_tokens: int, max_tokens: int,
                   model: ModelConfig | None = None) -> TrainerConfig:
    """A TrainerConfig for `cp`: its refusal rules (sample budget, context parallelism) run as in
    a real run. max_lag 0: the samples are fresh, so the loss needs no old-policy logprobs."""
    model = replace(model or ModelConfig(model_path=model_path), context_parallel=cp)
    experience = ExperienceConfig(max_tokens_per_gpu=budget, max_lag=0, sampling=SamplingConfig(max_tokens=max_tokens))
    return TrainerConfig(model=model, data=DatasetConfig(path="unused.jsonl", max_prompt_tokens=prompt_tokens),
                         experience=experience)


def draw_sample(length: int, prompt_tokens: int, vocab: int, seed: int) -> Sample:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
    response = length - prompt_tokens
    return Sample(input_token_ids=ids[:prompt_tokens], output_token_ids=ids[prompt_tokens:], gt_answer="",
                  sampling_logprobs=[SAMPLING_LOGPROB] * response, advantage=1.0 if seed % 2 else -1.0,
                  weight_version=0)


def trainer_step(model: Any, optimizer: torch.optim.Optimizer, samples: list[Sample], step_samples: list[Sample],
                 config: TrainerConfig, dist: DistInfo) -> None:
    """One optimizer step as trainer_core runs it: this rank's minibatch (`samples`) forward and
    backward, then the gradient step divided over the whole step's samples (`step_samples`)."""
    batch = post_process_batch(samples)
    _forward_backward(model, batch, 1.0, 0, config, dist)
    end = EndOfStep(step=0, num_samples=len(step_samples), num_tokens=sum(s.num_tokens for s in step_samples),
                    num_output_tokens=sum(s.num_sampled_tokens for s in step_samples))
    take_gradient_step(model, optimizer, gradient_divisor(end, config), config.optim.max_grad_norm)


# ---- one rank ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """One rank's step at one length and mode."""

    step_s: float
    """Median wall seconds of the timed steps (the slower rank's, as each step ends in collectives)."""
    growth_bytes: int
    """Peak over the step less what was in use before it (see the module docstring)."""
    peak_bytes: int
    """The rank's whole peak during the step (RSS, or CUDA allocated)."""


def _fix_malloc_thresholds() -> None:
    """FIXED_MALLOC_ENV's thresholds in this (forked) process: the environment is read at start only."""
    libc = ctypes.CDLL("libc.so.6")
    for parameter, variable in ((_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"), (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_")):
        if not libc.mallopt(parameter, int(FIXED_MALLOC_ENV[variable])):
            raise RuntimeError(f"mallopt({parameter}) refused")


def _measure(step: Any, dist: DistInfo, steps: int) -> Measured:
    """Run `step` `steps` times; the first one's memory, the median time (max over ranks)."""
    cuda = dist.device.type == "cuda"
    times, growth, peak = [], 0, 0
    for index in range(steps):
        gc.collect()
        torch_dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = rss_kib("VmRSS") * KIB
            if not reset_cpu_peak():
                raise RuntimeError("/proc/self/clear_refs refused: no per-step peak RSS on this kernel")
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dist.device)
        torch_dist.all_reduce(elapsed, op=torch_dist.ReduceOp.MAX)
        times.append(float(elapsed.item()))
        if index == 0:
            peak = torch.cuda.max_memory_allocated() if cuda else rss_kib("VmHWM") * KIB
            growth = peak - before
    return Measured(step_s=statistics.median(times), growth_bytes=growth, peak_bytes=peak)


def _model_path(config: LongContextConfig, dist: DistInfo, workdir: Path) -> str:
    """Rank 0 writes the random-weight model; every rank gets its folder."""
    path = [""]
    if dist.is_main:
        overrides = ShapeOverrides(num_layers=config.layers or None, tokenizer="char")  # no tokenizer is needed
        path = [str(write_tiny_model(workdir / "model", model_shape(config.preset, overrides)))]
    torch_dist.broadcast_object_list(path, src=0)
    return path[0]


def _rank(rank: int, config: LongContextConfig, port: int, workdir: str) -> None:
    """One rank (a forked child): build the model, warm up, measure every length in both modes;
    rank 0 writes every rank's figures to workdir/RESULTS_FILE."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_WORLD_SIZE=str(RANKS),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not config.cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    _fix_malloc_thresholds()
    torch.set_num_threads(config.threads_per_rank)
    setup_logging(logging.WARNING)
    dist = init_distributed(DIST_TIMEOUT_S, context_parallel=RANKS)
    model_path = _model_path(config, dist, Path(workdir))
    model_config = ModelConfig(model_path=model_path, gradient_checkpointing=config.gradient_checkpointing,
                               logprob_chunk_size=config.logprob_chunk_size)
    model = build_training_model(model_config, dist)
    vocab = model.causal_lm.config.vocab_size
    group = model.context
    longest = max(config.lengths)
    modes = {  # cp -> (its TrainerConfig, its DistInfo, the model's context group)
        1: (trainer_config(model_path, 1, longest, config.prompt_tokens, longest - config.prompt_tokens,
                           model_config), replace(dist, context_parallel=1), None),
        RANKS: (trainer_config(model_path, RANKS, -(-longest // RANKS), config.prompt_tokens,
                               longest - config.prompt_tokens, model_config), dist, group),
    }
    optimizer = build_optimizer(model, modes[1][0].optim)

    def run(cp: int, length: int, steps: int) -> Measured:
        trainer, mode_dist, context = modes[cp]
        ranks_samples = [draw_sample(length, config.prompt_tokens, vocab, config.seed + 1000 * length + r)
                         for r in range(RANKS // cp)]  # one sample per data-parallel group
        mine = [ranks_samples[mode_dist.data_rank]]
        model.context = context
        try:
            return _measure(lambda: trainer_step(model, optimizer, mine, ranks_samples, trainer, mode_dist),
                            dist, steps)
        finally:
            model.context = group

    for cp in modes:
        run(cp, config.warmup_tokens, 1)
    rows = []
    for length in config.lengths:
        for cp in modes:
            measured = run(cp, length, config.steps)
            every_rank: list[Any] = [None] * RANKS
            torch_dist.all_gather_object(every_rank, measured.__dict__)
            rows.append({"length": length, "cp": cp, "ranks": every_rank})
            if dist.is_main:
                logger.warning("length %d cp %d: %s", length, cp, every_rank)
    if dist.is_main:
        layers = model.causal_lm.config.num_hidden_layers
        (Path(workdir) / RESULTS_FILE).write_text(json.dumps({
            "rows": rows, "layers": layers, "device": dist.device.type, "backend": dist.backend,
            "attn": model.causal_lm.config._attn_implementation}))
    torch_dist.barrier()
    torch_dist.destroy_process_group()


# ---- the parent ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def longest_accepted(cp: int, budget: int, prompt_tokens: int) -> int:
    """The longest sample (data.max_prompt_tokens + sampling.max_tokens) TrainerConfig accepts at
    max_tokens_per_gpu=budget and model.context_parallel=cp, by bisection on sampling.max_tokens."""
    def accepted(max_tokens: int) -> bool:
        try:
            trainer_config("unused", cp, budget, prompt_tokens, max_tokens)
        except ValueError as error:
            if "below" not in str(error):  # only the budget rule may refuse here
                raise
            return False
        return True

    low, high = 0, cp * budget + 1  # accepted(low) (or nothing is), refused(high)
    if not accepted(1):
        return 0
    low = 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepted(middle) else (low, middle)
    return prompt_tokens + low


def packer_takes(cp: int, budget: int, prompt_tokens: int, length: int) -> bool:
    """Whether the batcher's packer, sized as trainer_core sizes it for RANKS ranks, takes a
    sample of `length` tokens without counting it oversized."""
    batcher = make_batcher_config(trainer_config("unused", cp, budget, prompt_tokens, length - prompt_tokens), RANKS)
    packer = MinibatchPacker(step=0, world_size=batcher.groups, max_tokens_per_gpu=batcher.group_tokens)
    packer.add(Sample(input_token_ids=[1] * prompt_tokens, output_token_ids=[2] * (length - prompt_tokens),
                      gt_answer=""))
    packer.finish()
    return packer.oversized_samples == 0


def _larger(row: dict, key: str) -> float:
    return max(rank[key] for rank in row["ranks"])


def report(config: LongContextConfig, results: dict) -> dict[str, Any]:
    """Print the per-length table and the budget search; returns the summary figures."""
    method = "cuda_max_memory_allocated" if results["device"] == "cuda" else "rss_vmhwm_clear_refs"
    preset = PRESETS[config.preset]
    print(f"long_context: {config.preset} shape (hidden {preset.hidden_size}, {preset.num_heads} heads, "
          f"{preset.num_kv_heads} KV heads, intermediate {preset.intermediate_size}) at {results['layers']} of its "
          f"{preset.num_layers} layers; {RANKS} ranks, {results['device']}/{results['backend']}, {results['attn']}, "
          f"fp32, gradient checkpointing {config.gradient_checkpointing}; one sample per data-parallel group "
          f"({config.prompt_tokens}-token prompt); memory: {method} (GiB = 2^30 bytes; the larger rank's)")
    print(f"{'tokens':>7} {'cp1_step_gib':>12} {'cp2_step_gib':>12} {'mem_ratio':>9} {'cp1_rss_gib':>11} "
          f"{'cp2_rss_gib':>11} {'rss_ratio':>9} {'cp1_step_s':>10} {'cp2_step_s':>10} {'step_ratio':>10}")
    by_key = {(row["length"], row["cp"]): row for row in results["rows"]}
    figures: dict[str, Any] = {}
    for length in config.lengths:
        one, two = by_key[(length, 1)], by_key[(length, RANKS)]
        growth = [_larger(row, "growth_bytes") / GIB for row in (one, two)]
        peak = [_larger(row, "peak_bytes") / GIB for row in (one, two)]
        step = [_larger(row, "step_s") for row in (one, two)]
        figures = {"tokens": length, "mem_ratio": round(growth[1] / growth[0], 3),
                   "rss_ratio": round(peak[1] / peak[0], 3), "step_ratio": round(step[1] / step[0], 3)}
        print(f"{length:>7} {growth[0]:>12.3f} {growth[1]:>12.3f} {figures['mem_ratio']:>9.3f} {peak[0]:>11.3f} "
              f"{peak[1]:>11.3f} {figures['rss_ratio']:>9.3f} {step[0]:>10.1f} {step[1]:>10.1f} "
              f"{figures['step_ratio']:>10.3f}")
    longest = {cp: longest_accepted(cp, config.budget_tokens, config.prompt_tokens) for cp in (1, RANKS)}
    packed = {cp: packer_takes(cp, config.budget_tokens, config.prompt_tokens, longest[cp]) for cp in longest}
    print(f"longest sample TrainerConfig accepts at max_tokens_per_gpu={config.budget_tokens} "
          f"(data.max_prompt_tokens={config.prompt_tokens}): cp1 {longest[1]} tokens, cp2 {longest[RANKS]} tokens; "
          f"the batcher's packer for {RANKS} ranks takes each without counting it oversized: {packed}")
    return {**figures, "longest_cp1": longest[1], "longest_cp2": longest[RANKS],
            "longest_ratio": round(longest[RANKS] / longest[1], 3), "packer_takes": all(packed.values()),
            "layers": results["layers"], "peak_method": method}


def main(argv: list[str] | None = None) -> None:
    config = apply_smoke(load_bench_config(LongContextConfig, argv, description=__doc__), SMOKE)
    setup_logging(logging.WARNING)
    workdir = tempfile.mkdtemp(prefix="bench-long-context-")
    try:
        # Forked, not spawned: the ranks start with this process's imports (torch, transformers,
        # the trainer's modules) already loaded; nothing here has run torch's thread pools yet.
        torch_mp.start_processes(_rank, args=(config, _free_port(), workdir), nprocs=RANKS, start_method="fork")
        results = json.loads((Path(workdir) / RESULTS_FILE).read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(summary_line("long_context", report(config, results)), flush=True)


if __name__ == "__main__":
    main()
