"""What a weight push's prefix-cache reset costs against the KV cache's size, on vLLM's own block pool.

    .venv/bin/python -m benchmarks.prefix_cache_reset
    .venv/bin/python -m benchmarks.prefix_cache_reset --smoke true

Every weight push resets the engine's prefix cache (cached KV computed with the old weights must
never be reused): vLLM's `BlockPool.reset_prefix_cache` walks every block of the cache in Python,
whether it holds anything or not. This times that walk on pools of `--block_counts` blocks
(median of `--reps`, each on a fresh pool; the cost per block is the slope over the sizes), then prints what it costs a push for the demo
model on one 80 GiB GPU two ways: the engine given vLLM's default share (0.92 of the card) and the
engine sized to the run (async_grpo/launch/kv_cache_plan.py). The last line:
`prefix_cache_reset: ns_per_block=.. sized_blocks=.. sized_ms=.. card_blocks=.. card_ms=.. ratio=..`
(ratio: the card-sized reset over the run-sized one).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from async_grpo.launch.kv_cache_plan import BLOCK_TOKENS, RunLoad, kv_bytes_per_token, size_engine
from async_grpo.demo_assets.tiny_model import PRESETS
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging, summary_line

logger = logging.getLogger("benchmarks.prefix_cache_reset")

GiB = 2**30
CARD_BYTES = 80 * GiB
VLLM_DEFAULT_SHARE = 0.92
BF16_BYTES = 2
SMOKE = {"block_counts": (1_000, 10_000), "reps": 1}


@dataclass(kw_only=True, frozen=True)
class ResetBenchConfig:
    """The command line of benchmarks/prefix_cache_reset.py."""

    block_counts: tuple[int, ...] = (10_000, 100_000, 1_000_000, 4_000_000)
    """Pool sizes to time (blocks of 16 tokens)."""
    reps: int = 3
    """Timed resets per size, each on a fresh pool; the median is reported."""
    sequences_in_flight: int = 512
    """The demo's: (max_lag 0 + 1) x 2 ranks x 16 prompts x 16 samples."""
    max_model_len: int = 20
    """The demo's longest sample: 16 prompt tokens + 4 response tokens."""
    smoke: bool = False
    """Two small pools, one rep: checks the command; its figures mean nothing."""


def time_reset(blocks: int) -> float:
    """Seconds one reset_prefix_cache takes on a fresh pool of `blocks` blocks (all free)."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=blocks, enable_caching=True, hash_block_size=BLOCK_TOKENS)
    began = time.perf_counter()
    if not pool.reset_prefix_cache():
        raise RuntimeError(f"vLLM refused to reset a pool of {blocks} free blocks")
    return time.perf_counter() - began


def demo_blocks(config: ResetBenchConfig) -> tuple[int, int]:
    """Blocks of the demo model's cache on an 80 GiB card: sized to the run, and at vLLM's default share."""
    demo = PRESETS["tiny"]
    head_dim = demo.hidden_size // demo.num_heads
    token_bytes = kv_bytes_per_token(demo.num_layers, demo.num_kv_heads, head_dim, BF16_BYTES)
    load = RunLoad(sequences_in_flight=config.sequences_in_flight, max_model_len=config.max_model_len)
    vocab = 128  # the demo's character tokenizer; the weights are a rounding error against a card
    sized = size_engine(load, kv_token_bytes=token_bytes, weight_bytes=0, vocab_size=vocab,
                        share_bytes=int(VLLM_DEFAULT_SHARE * CARD_BYTES))
    card_blocks = int(VLLM_DEFAULT_SHARE * CARD_BYTES) // (BLOCK_TOKENS * token_bytes)
    return sized.blocks, card_blocks


def main(argv: list[str] | None = None) -> None:
    config = apply_smoke(load_bench_config(ResetBenchConfig, argv, description=__doc__), SMOKE)
    setup_logging()
    times = []
    for blocks in config.block_counts:
        times.append(statistics.median(time_reset(blocks) for _ in range(config.reps)))
        print(f"blocks={blocks} reset_ms={times[-1] * 1e3:.3f} ns_per_block={times[-1] / blocks * 1e9:.1f}", flush=True)
    # The cost per block is the slope over the pool sizes: a fixed part (the call, a log line) stays out of it.
    ns = statistics.linear_regression(config.block_counts, times).slope * 1e9
    sized, card = demo_blocks(config)
    sized_ms, card_ms = sized * ns / 1e6, card * ns / 1e6
    print(summary_line("prefix_cache_reset", {
        "ns_per_block": f"{ns:.1f}", "sized_blocks": sized, "sized_ms": f"{sized_ms:.3f}", "card_blocks": card,
        "card_ms": f"{card_ms:.1f}", "ratio": f"{card_ms / sized_ms:.0f}"}), flush=True)


if __name__ == "__main__":
    main()
