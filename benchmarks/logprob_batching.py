"""Logprob worker throughput: packed batches of concurrent requests vs one sample per forward.

    cd /work/main && .venv/bin/python -m benchmarks.logprob_batching
    .venv/bin/python -m benchmarks.logprob_batching --num_samples 96 --budgets 1024 512 2048 --repeats 3
    .venv/bin/python -m benchmarks.logprob_batching --attn_implementation sdpa  # the block-mask path

For each model shape (the bundled tiny Qwen2, and a wider one: hidden 512, 4 layers),
random-init weights are written to a temporary folder and the same random samples are scored by
LogprobWorkers in two modes:

- sequential: each compute_logprobs call awaited before the next (one sample per forward);
- batched: all calls in flight at once, packed into forwards of <= max_tokens_per_forward tokens,
  once per budget in --budgets.

Every worker uses max_wait_ms=0 (sequential requests would otherwise wait for company that never
comes). Throughput is packed tokens (prompt + output) per second of wall time, best of the
repeats, with the modes alternating so that load from other processes hits both. The last line is
key=value pairs: `speedup` is the wider model's batched/sequential ratio at the first budget,
`tiny_speedup` the tiny model's, `speedup_by_budget` the wider model's at every budget,
`cpu_speedup`/`tiny_cpu_speedup` the same ratios from this process's CPU time (steadier on a
shared machine), and `attn` the attention implementation the workers ran.

`--engine model` measures the same two modes without the worker (no Ray: the GPU machine has
none): TokenLogprobModel.score on each sample alone, against packed forwards of <= budget tokens
(samples in order, a new forward when the next would overflow), in the dtype the worker would
use (bf16 on CUDA, fp32 on CPU), synchronised before each clock read. It isolates the model's
side of the ratio (no queueing, no asyncio); its summary line carries `engine=model`.

Workers use setup_model's default attention unless --attn_implementation names one: without
flash-attn that is PACKED_SDPA, which attends within each packed sample, so attention work follows
the sum of each sample's square. With plain "sdpa" a packed forward attends over its whole T x T
token square under a block-diagonal mask, so attention work grows with the square of the budget
and a large budget can be slower than no batching; the budget sweep shows either behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable

import torch
from transformers import AutoConfig

from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging
from sample_processing_utils import Sample, get_input_for_logprobs
from setup_model import TokenLogprobModel, default_attn_implementation, load_causal_lm

if TYPE_CHECKING:  # the worker imports Ray; --engine model runs without it
    from logprob_worker import LogprobWorker

TINY_SHAPE = TinyModelConfig()
WIDE_SHAPE = TinyModelConfig(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1408)
WARMUP_SAMPLES = 4  # first forwards pay one-off allocation and kernel-selection costs


SMOKE = {"num_samples": 4, "budgets": [256], "repeats": 1, "min_prompt": 2, "max_prompt": 8, "min_output": 2,
         "max_output": 8}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """Workload of one benchmark run: the command line of `python -m benchmarks.logprob_batching`."""

    num_samples: int = 64
    """Samples scored per mode and repeat."""
    min_prompt: int = 16
    """Shortest prompt, in tokens."""
    max_prompt: int = 96
    """Longest prompt, in tokens."""
    min_output: int = 32
    """Shortest output, in tokens."""
    max_output: int = 192
    """Longest output, in tokens."""
    budgets: tuple[int, ...] = (512, 1024, 2048)
    """Token budgets (max_tokens_per_forward) of the batched mode; the first is the one `speedup`
    reports (512: the CPU sweet spot under plain sdpa, kept so results stay comparable)."""
    repeats: int = 2
    """Timed passes per mode; the best is reported."""
    seed: int = 0
    """Seed of the random samples."""
    attn_implementation: str | None = None
    """Workers' attn_implementation; None: setup_model.default_attn_implementation for the device."""
    engine: str = "worker"
    """'worker': real LogprobWorkers (needs Ray); 'model': TokenLogprobModel.score directly (no Ray)."""

    smoke: bool = False
    """Smoke mode: 4 short samples, one budget, 1 repeat (SMOKE); checks that the command still runs, its figures
    mean nothing."""

    def __post_init__(self) -> None:
        for name in ("num_samples", "min_prompt", "min_output", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"BenchConfig.budgets must be non-empty and >= 1, got {self.budgets}")
        if self.max_prompt < self.min_prompt:
            raise ValueError(f"BenchConfig.max_prompt {self.max_prompt} < min_prompt {self.min_prompt}")
        if self.max_output < self.min_output:
            raise ValueError(f"BenchConfig.max_output {self.max_output} < min_output {self.min_output}")
        if self.engine not in ("worker", "model"):
            raise ValueError(f"BenchConfig.engine must be 'worker' or 'model', got {self.engine!r}")


@dataclass(slots=True)
class ShapeResult:
    """Throughput of one model shape: one sample per forward, and batched at each budget."""

    sequential_tok_s: float
    batched_tok_s: dict[int, float]
    """Budget -> batched throughput."""
    sequential_cpu_s: float
    """CPU seconds of the best sequential pass (this process, all threads)."""
    batched_cpu_s: dict[int, float]
    """Budget -> CPU seconds of the best batched pass."""
    forwards: dict[int, int]
    """Budget -> forwards of one batched pass."""
    max_abs_diff: float
    """Largest |batched - sequential| logprob over all budgets: the modes must agree."""

    def speedup(self, budget: int) -> float:
        return self.batched_tok_s[budget] / self.sequential_tok_s

    def cpu_speedup(self, budget: int) -> float:
        return self.sequential_cpu_s / self.batched_cpu_s[budget]


def build_samples(config: BenchConfig, vocab_size: int) -> list[Sample]:
    rng = random.Random(config.seed)
    return [
        Sample(
            input_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randint(config.min_prompt, config.max_prompt))],
            gt_answer="",
            prompt_id=i,
            output_token_ids=[rng.randrange(vocab_size) for _ in range(rng.randint(config.min_output, config.max_output))],
        )
        for i in range(config.num_samples)
    ]


async def _sequential(worker: LogprobWorker, samples: list[Sample]) -> list[list[float]]:
    return [await worker.compute_logprobs(s) for s in samples]


async def _batched(worker: LogprobWorker, samples: list[Sample]) -> list[list[float]]:
    return list(await asyncio.gather(*(worker.compute_logprobs(s) for s in samples)))


async def _timed(coro: Awaitable[list[list[float]]]) -> tuple[float, float, list[list[float]]]:
    """(wall seconds, CPU seconds of this process, results)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    results = await coro
    return time.perf_counter() - started, time.process_time() - cpu_started, results


def _max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((torch.tensor(x) - torch.tensor(y)).abs().max().item() for x, y in zip(a, b))


def _worker(label: str, model_dir: Path, budget: int, attn_implementation: str | None) -> LogprobWorker:
    from async_grpo.config.worker_options import LogprobBatchingConfig
    from logprob_worker import LogprobWorker, LogprobWorkerConfig

    # max_wait_ms=0: the sequential mode would otherwise wait for company on every request, and
    # the batched mode queues all its requests before the first batch forms anyway.
    config = LogprobWorkerConfig(
        model_path=str(model_dir), batching=LogprobBatchingConfig(max_tokens_per_forward=budget, max_wait_ms=0.0),
        attn_implementation=attn_implementation,
    )
    return LogprobWorker(f"logprob-bench-{label}-{budget}", config)


async def measure(label: str, model_dir: Path, samples: list[Sample], config: BenchConfig) -> ShapeResult:
    """Best-of-repeats throughput; the modes alternate so load from other processes hits both."""
    num_tokens = sum(s.num_tokens for s in samples)
    attn = config.attn_implementation
    sequential_worker = _worker(label, model_dir, max(config.budgets), attn)
    batched_workers = {budget: _worker(label, model_dir, budget, attn) for budget in config.budgets}
    for worker in [sequential_worker, *batched_workers.values()]:
        await _batched(worker, samples[:WARMUP_SAMPLES])
    best_sequential, best_batched = float("inf"), {b: float("inf") for b in config.budgets}
    cpu_sequential, cpu_batched = float("inf"), {b: float("inf") for b in config.budgets}
    forwards, diff = {}, 0.0
    for _ in range(config.repeats):
        seconds, cpu_seconds, reference = await _timed(_sequential(sequential_worker, samples))
        best_sequential, cpu_sequential = min(best_sequential, seconds), min(cpu_sequential, cpu_seconds)
        for budget, worker in batched_workers.items():
            before = worker.stats().batches
            seconds, cpu_seconds, results = await _timed(_batched(worker, samples))
            best_batched[budget] = min(best_batched[budget], seconds)
            cpu_batched[budget] = min(cpu_batched[budget], cpu_seconds)
            forwards[budget] = worker.stats().batches - before
            diff = max(diff, _max_abs_diff(results, reference))
    for worker in [sequential_worker, *batched_workers.values()]:
        await worker.shutdown()
    return ShapeResult(
        sequential_tok_s=num_tokens / best_sequential,
        batched_tok_s={b: num_tokens / s for b, s in best_batched.items()},
        sequential_cpu_s=cpu_sequential,
        batched_cpu_s=cpu_batched,
        forwards=forwards,
        max_abs_diff=diff,
    )


def _packs(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Samples in order, a new pack when the next would take this one past `budget` tokens."""
    packs: list[list[Sample]] = [[]]
    for sample in samples:
        if packs[-1] and sum(s.num_tokens for s in packs[-1]) + sample.num_tokens > budget:
            packs.append([])
        packs[-1].append(sample)
    return packs


def _score_packs(model: TokenLogprobModel, packs: list[list[Sample]], device: torch.device) -> list[list[float]]:
    out: list[list[float]] = []
    with torch.inference_mode():
        for pack in packs:
            inputs = get_input_for_logprobs(pack)
            logprobs = model.score(inputs)[0].float().cpu()
            out.extend(part.tolist() for part in torch.split(logprobs, inputs.output_lengths))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def measure_model(model_dir: Path, samples: list[Sample], config: BenchConfig, device: torch.device) -> ShapeResult:
    """--engine model: the two modes through TokenLogprobModel.score, alternating, best of repeats."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = TokenLogprobModel(load_causal_lm(model_dir, device=device, dtype=dtype,
                                             attn_implementation=config.attn_implementation)).eval()
    num_tokens = sum(s.num_tokens for s in samples)
    modes = {0: [[s] for s in samples], **{b: _packs(samples, b) for b in config.budgets}}
    for packs in modes.values():
        _score_packs(model, packs[:WARMUP_SAMPLES], device)
    wall = {mode: float("inf") for mode in modes}
    cpu = dict(wall)
    diff, reference = 0.0, None
    for _ in range(config.repeats):
        for mode, packs in modes.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            results = _score_packs(model, packs, device)
            wall[mode] = min(wall[mode], time.perf_counter() - started)
            cpu[mode] = min(cpu[mode], time.process_time() - cpu_started)
            reference = results if mode == 0 else reference
            diff = max(diff, _max_abs_diff(results, reference))
    return ShapeResult(
        sequential_tok_s=num_tokens / wall[0], batched_tok_s={b: num_tokens / wall[b] for b in config.budgets},
        sequential_cpu_s=cpu[0], batched_cpu_s={b: cpu[b] for b in config.budgets},
        forwards={b: len(modes[b]) for b in config.budgets}, max_abs_diff=diff,
    )


def run_shape(label: str, shape: TinyModelConfig, config: BenchConfig, workdir: Path,
              device: torch.device) -> ShapeResult:
    model_dir = write_tiny_model(workdir / label, shape)
    vocab_size = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    samples = build_samples(config, vocab_size)
    if config.engine == "model":
        result = measure_model(model_dir, samples, config, device)
    else:
        result = asyncio.run(measure(label, model_dir, samples, config))
    tokens = sum(s.num_tokens for s in samples)
    print(
        f"{label}: hidden={shape.hidden_size} layers={shape.num_layers} samples={len(samples)} tokens={tokens} "
        f"max |batched - sequential| {result.max_abs_diff:.1e}\n"
        f"  one sample per forward: {result.sequential_tok_s:10,.0f} tok/s ({len(samples)} forwards)",
        flush=True,
    )
    for budget in sorted(config.budgets):
        print(
            f"  batched, budget {budget:5d}: {result.batched_tok_s[budget]:10,.0f} tok/s "
            f"({result.forwards[budget]} forwards)  speedup {result.speedup(budget):.2f}x wall, "
            f"{result.cpu_speedup(budget):.2f}x CPU",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> None:
    config = load_bench_config(BenchConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging(logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the worker's device "auto"
    attn = config.attn_implementation or default_attn_implementation(device)
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, attn {attn}, "
          f"engine {config.engine}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = run_shape("tiny", TINY_SHAPE, config, Path(tmp), device)
        wide = run_shape("wide", WIDE_SHAPE, config, Path(tmp), device)
    budget = config.budgets[0]
    by_budget = ",".join(f"{b}:{wide.speedup(b):.2f}" for b in sorted(config.budgets))
    print(
        f"speedup={wide.speedup(budget):.2f} tiny_speedup={tiny.speedup(budget):.2f} budget={budget} "
        f"batched_tok_s={wide.batched_tok_s[budget]:.0f} sequential_tok_s={wide.sequential_tok_s:.0f} "
        f"tiny_batched_tok_s={tiny.batched_tok_s[budget]:.0f} tiny_sequential_tok_s={tiny.sequential_tok_s:.0f} "
        f"speedup_by_budget={by_budget} cpu_speedup={wide.cpu_speedup(budget):.2f} "
        f"tiny_cpu_speedup={tiny.cpu_speedup(budget):.2f} attn={attn} device={device} engine={config.engine} "
        f"num_samples={config.num_samples} max_abs_diff={max(tiny.max_abs_diff, wide.max_abs_diff):.1e}"
    )


if __name__ == "__main__":
    main()
