"""A GPU engine's KV cache sized to the run it serves (async_grpo/launch/kv_cache_plan.py), checked
against sizes worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from async_grpo.config.worker_options import EngineConfig
from async_grpo.launch.engine_defaults import LAUNCHER_MAX_NUM_SEQS, resolve_engine
from async_grpo.launch.kv_cache_plan import (
    ENGINE_RUNTIME_BYTES, RunLoad, kv_bytes_per_token, size_engine,
)
from async_grpo.launch.placement import ModelShape, RunShape, plan_placement

GiB = 2**30
# The demo model: 2 layers, 2 KV heads of width 32, served in bf16.
DEMO_TOKEN_BYTES = 2 * 2 * 2 * 32 * 2  # key and value x layers x KV heads x head width x bytes
# The demo's step: 2 ranks x 16 prompts x 16 samples, max_lag 0, samples of at most 16 + 4 tokens.
DEMO_LOAD = RunLoad(sequences_in_flight=512, max_model_len=20)


def test_bytes_per_token_are_a_key_and_a_value_per_layer_and_kv_head() -> None:
    assert kv_bytes_per_token(num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=2) == DEMO_TOKEN_BYTES
    # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64, bf16: 12 KiB a token.
    assert kv_bytes_per_token(num_layers=24, num_kv_heads=2, head_dim=64, dtype_bytes=2) == 12 * 1024


def test_the_demo_gets_its_sequences_with_headroom_in_whole_blocks() -> None:
    sizing = size_engine(DEMO_LOAD, kv_token_bytes=DEMO_TOKEN_BYTES, weight_bytes=640_000, vocab_size=128,
                         share_bytes=int(0.92 * 80 * GiB))
    # 20 tokens take 2 blocks of 16; 512 sequences x 2 blocks x 1.25 headroom.
    assert sizing.blocks == 1280 and sizing.kv_cache_bytes == 1280 * 16 * DEMO_TOKEN_BYTES
    assert sizing.max_num_seqs == 512 and not sizing.capped
    sampler = 512 * 128 * 4 * 2  # fp32 logits and a working copy per sequence
    assert sizing.engine_bytes == 640_000 + sizing.kv_cache_bytes + ENGINE_RUNTIME_BYTES + sampler


def test_the_cache_does_not_grow_with_the_card() -> None:
    """What a push walks (the blocks) is the run's, whatever memory the GPU has."""
    sizes = {size_engine(DEMO_LOAD, kv_token_bytes=DEMO_TOKEN_BYTES, weight_bytes=0, vocab_size=128,
                         share_bytes=int(0.92 * memory * GiB)).blocks for memory in (24, 80, 141)}
    assert sizes == {1280}


def test_engines_split_the_runs_sequences() -> None:
    two = RunLoad(sequences_in_flight=513, max_model_len=20, generation_workers=2)
    assert two.sequences_per_engine == 257
    assert size_engine(two, kv_token_bytes=DEMO_TOKEN_BYTES, weight_bytes=0, vocab_size=128,
                       share_bytes=80 * GiB).max_num_seqs == 257


def test_a_share_too_small_for_the_run_holds_what_it_can() -> None:
    # Qwen2.5-0.5B's bytes a token, 1,024 samples of 8k tokens: ~110 GiB, far over a 20 GiB share.
    load = RunLoad(sequences_in_flight=1024, max_model_len=8192)
    sizing = size_engine(load, kv_token_bytes=12 * 1024, weight_bytes=1 * GiB, vocab_size=151_936,
                         share_bytes=20 * GiB)
    assert sizing.capped and 0 < sizing.max_num_seqs < 1024 and sizing.engine_bytes <= 20 * GiB
    per_sequence = 512 * 16 * 12 * 1024 * 1.25  # 512 blocks of 16 tokens, with headroom
    assert sizing.kv_cache_bytes >= (sizing.max_num_seqs - 1) * per_sequence


def test_a_run_without_sequences_is_refused() -> None:
    with pytest.raises(ValueError, match="a run load needs sequences and a length"):
        size_engine(RunLoad(sequences_in_flight=0, max_model_len=20), kv_token_bytes=1, weight_bytes=0,
                    vocab_size=1, share_bytes=GiB)


# The plan with the run's load: Qwen2.5-0.5B, 2 steps in flight (max_lag 1) of 8 prompts x 8 samples
# on one rank, samples of up to 1,536 tokens.
QWEN_0_5B = ModelShape.from_hf_config({
    "hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864,
    "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True})
LOADED_RUN = RunShape(trainer_ranks=1, max_tokens_per_gpu=8192, generation_workers=1, logprob_workers=1,
                      sequences_in_flight=2 * 8 * 8, max_model_len=1536)


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_plan_gives_an_engine_what_its_run_holds(gpus: int) -> None:
    unsized = plan_placement(gpus, 80 * GiB, QWEN_0_5B, dataclasses.replace(LOADED_RUN, sequences_in_flight=0))
    plan = plan_placement(gpus, 80 * GiB, QWEN_0_5B, LOADED_RUN)
    sizing = plan.engine_sizing
    assert unsized.engine_sizing is None and sizing is not None and not sizing.capped
    # 128 sequences of 96 blocks (1,536 / 16) with 1.25 headroom, 12 KiB a token in bf16.
    assert sizing.blocks == 15_360 and sizing.kv_cache_bytes == 15_360 * 16 * 12 * 1024
    assert sizing.max_num_seqs == 128
    assert plan.engine_memory_fraction == pytest.approx(sizing.engine_bytes / (80 * GiB), abs=1e-3)
    assert plan.engine_memory_fraction < (unsized.engine_memory_fraction or 0.92)
    assert any("KV cache 2.81 GiB (15360 blocks of 16 tokens" in line and "max_num_seqs 128" in line
               for line in plan.lines(LOADED_RUN))


def test_cuda_engines_take_the_sized_cache_unless_the_user_set_one() -> None:
    plan = plan_placement(1, 80 * GiB, QWEN_0_5B, LOADED_RUN)
    engine, (line,) = resolve_engine(EngineConfig(max_num_seqs=LAUNCHER_MAX_NUM_SEQS), plan, cuda=True,
                                     longest_sample=1536)
    assert (engine.kv_cache_memory_bytes, engine.max_num_seqs) == (plan.engine_sizing.kv_cache_bytes, 128)
    assert engine.gpu_memory_utilization == plan.engine_memory_fraction
    assert "max_num_seqs 128 (what the KV cache holds)" in line
    # A KV size of the user's keeps its own, with the plan's share for vLLM's start-up check.
    mine, _ = resolve_engine(EngineConfig(kv_cache_memory_bytes=GiB, max_num_seqs=64), plan, cuda=True,
                             longest_sample=1536)
    assert (mine.kv_cache_memory_bytes, mine.max_num_seqs, mine.gpu_memory_utilization) == (
        GiB, 64, plan.engine_memory_fraction)
    # A share of the user's: vLLM sizes the cache within it, as the user asked.
    share, _ = resolve_engine(EngineConfig(gpu_memory_utilization=0.5), plan, cuda=True, longest_sample=1536)
    assert share.kv_cache_memory_bytes is None and share.gpu_memory_utilization == 0.5


def test_a_capped_engine_leaves_its_cache_to_vllms_profile() -> None:
    """A share smaller than the run's need: the plan's share, vLLM's own profile inside it."""
    tight = dataclasses.replace(LOADED_RUN, sequences_in_flight=4096)
    plan = plan_placement(1, 80 * GiB, QWEN_0_5B, tight)
    assert plan.engine_sizing.capped and "capped by the plan's share" in plan.engine_sizing.line()
    engine, _ = resolve_engine(EngineConfig(max_num_seqs=LAUNCHER_MAX_NUM_SEQS), plan, cuda=True, longest_sample=1536)
    assert engine.kv_cache_memory_bytes is None and engine.gpu_memory_utilization == plan.engine_memory_fraction
    assert engine.max_num_seqs == plan.engine_sizing.max_num_seqs < 4096
