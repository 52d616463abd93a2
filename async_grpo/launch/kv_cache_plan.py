"""How much KV cache a generation engine on a GPU needs for the run it serves.

vLLM's default gives an engine whatever memory it is allowed (0.92 of a GPU), which for a small
model is millions of KV blocks: host memory for their bookkeeping, seconds to build them at
start, and a walk over every block at each weight push (vLLM's prefix-cache reset; the cost per
block is in benchmarks/RESULTS.md, "Prefix-cache reset against the KV cache's size"). A run can
only have so many sequences in flight: `(max_lag + 1)` steps of `ranks x prompts x n` samples,
each at most `max_model_len` tokens. The engine is given that, with headroom, and the share of the
GPU it implies; never more than the plan's share for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# vLLM's KV block on GPU holds 16 tokens (its default block_size): a sequence takes whole blocks.
BLOCK_TOKENS = 16
# Room over the run's own sequences: evaluation requests, retries of a failed worker's samples,
# and requests of the next step arriving before the last ones finish. vLLM preempts (queues)
# rather than fails when its cache is full, so the headroom buys speed, not correctness.
KV_HEADROOM = 1.25
# An engine's memory outside its weights and KV cache: CUDA context, CUDA graphs, the profile
# run's activations and allocator slack (vLLM's start-up check sizes its share from this).
ENGINE_RUNTIME_BYTES = 2 * 2**30
# The sampler's logits for a full batch: fp32 logits and a working copy per sequence.
SAMPLER_LOGIT_COPIES = 2
FP32_BYTES = 4


@dataclass(kw_only=True, frozen=True)
class RunLoad:
    """What a run can have in flight on its engines."""

    sequences_in_flight: int
    """Samples generated at once at most: (max_lag + 1) x trainer ranks x prompts per rank x n."""
    max_model_len: int
    """The longest sample (prompt + response) in tokens."""
    generation_workers: int = 1

    @property
    def sequences_per_engine(self) -> int:
        return math.ceil(self.sequences_in_flight / max(self.generation_workers, 1))


@dataclass(kw_only=True, frozen=True)
class EngineSizing:
    """One engine's KV cache and memory share, sized to its run."""

    kv_cache_bytes: int
    blocks: int
    max_num_seqs: int
    """Sequences the engine schedules at once: every sequence its cache holds."""
    engine_bytes: int
    """Weights, KV cache and the engine's runtime: what its gpu_memory_utilization must cover."""
    capped: bool
    """The run's need was more than the plan's share: the cache is what the share leaves."""

    def line(self) -> str:
        """The plan's line for it."""
        held = "capped by the plan's share" if self.capped else "sized to the run's sequences in flight"
        return (f"  vLLM     KV cache {self.kv_cache_bytes / 2**30:.2f} GiB ({self.blocks} blocks of {BLOCK_TOKENS} "
                f"tokens, {held}), max_num_seqs {self.max_num_seqs}")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """A key and a value vector per layer and KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def size_engine(load: RunLoad, *, kv_token_bytes: int, weight_bytes: int, vocab_size: int,
                share_bytes: int) -> EngineSizing:
    """The engine's cache for `load`, within `share_bytes` (the plan's most for one engine)."""
    if load.sequences_in_flight < 1 or load.max_model_len < 1:
        raise ValueError(f"a run load needs sequences and a length, got {load}")
    blocks_per_sequence = math.ceil(load.max_model_len / BLOCK_TOKENS)
    sequences = load.sequences_per_engine
    blocks = math.ceil(sequences * blocks_per_sequence * KV_HEADROOM)
    block_bytes = BLOCK_TOKENS * kv_token_bytes

    def runtime(max_num_seqs: int) -> int:
        return ENGINE_RUNTIME_BYTES + max_num_seqs * vocab_size * FP32_BYTES * SAMPLER_LOGIT_COPIES

    need = weight_bytes + blocks * block_bytes + runtime(sequences)
    if need <= share_bytes:
        return EngineSizing(kv_cache_bytes=blocks * block_bytes, blocks=blocks, max_num_seqs=sequences,
                            engine_bytes=need, capped=False)
    # The share cannot hold the run: as many whole sequences as it can.
    held = max(1, (share_bytes - weight_bytes - ENGINE_RUNTIME_BYTES)
               // (blocks_per_sequence * block_bytes * KV_HEADROOM + vocab_size * FP32_BYTES * SAMPLER_LOGIT_COPIES))
    held = int(min(held, sequences))
    blocks = math.ceil(held * blocks_per_sequence * KV_HEADROOM)
    return EngineSizing(kv_cache_bytes=blocks * block_bytes, blocks=blocks, max_num_seqs=held,
                        engine_bytes=min(share_bytes, weight_bytes + blocks * block_bytes + runtime(held)), capped=True)
