"""The trainer's memory estimate (async_grpo/launch/placement.py) against measurements on the CPU:
what autograd keeps per token in a decoder layer (in fp32 and bf16), and the peak memory of a real
training step (issue 56, item 3), and a context-parallel rank's layer (issue 59, item 4)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from async_grpo.launch.placement import (
    BF16_BYTES, FP32_BYTES, ModelShape, RunShape, head_activation_bytes, layer_activation_bytes, trainer_memory,
)
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from async_grpo.model.context_parallel import ContextGroup
from benchmarks import step_memory
from benchmarks.packed_samples import draw_packed_samples
from benchmarks.step_memory import measure_step, saved_bytes_per_token
from sample_processing_utils import PackedBatch, post_process_batch
from setup_model import TokenLogprobModel, load_causal_lm

# The estimate may exceed what is measured by this much, and never fall short of it.
ESTIMATE_SLACK = 1.15
# A small shape with Qwen2's proportions (gated MLP 4 x hidden, grouped KV heads, tied embeddings)
# whose step is measured in seconds; at this many tokens the activations outweigh the logit chunks.
SMALL_SHAPE = TinyModelConfig(hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2, num_layers=2,
                              vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=4096)
STEP_TOKENS = 2048
CHUNK_SIZE = 1024


def _batch(num_tokens: int, vocab_size: int) -> PackedBatch:
    return post_process_batch(draw_packed_samples(num_tokens, vocab_size, min_prompt=64, max_prompt=512,
                                                  output_median=512.0, output_sigma=0.75, max_output=2048, seed=0))


def _shape(model_dir: Path) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def _assert_holds(estimate: float, measured: float, what: str) -> None:
    assert measured <= estimate <= ESTIMATE_SLACK * measured, (
        f"{what}: estimate {estimate:,.0f} against measured {measured:,.0f} (ratio {estimate / measured:.3f}; "
        f"allowed 1 to {ESTIMATE_SLACK})")


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("small-qwen2"), SMALL_SHAPE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_estimate_is_what_autograd_keeps(small_model_dir: Path, dtype: torch.dtype) -> None:
    causal_lm = load_causal_lm(small_model_dir, dtype=dtype)
    causal_lm.config.use_cache = False
    saved = saved_bytes_per_token(causal_lm, _batch(1024, SMALL_SHAPE.vocab_size).inputs, CHUNK_SIZE)
    shape, dtype_bytes = _shape(small_model_dir), BF16_BYTES if dtype == torch.bfloat16 else FP32_BYTES
    last_layer = f"layer{SMALL_SHAPE.num_layers - 1}"  # the first layer also saves what all layers share
    _assert_holds(layer_activation_bytes(shape, dtype_bytes), saved[last_layer], f"{dtype} layer")
    assert saved["outside"] <= head_activation_bytes(shape, dtype_bytes)


def test_a_context_parallel_layer_keeps_what_the_estimate_says(small_model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a group of 4, in one process: SMALL_SHAPE's 2 key/value heads are repeated twice
    for the split, and each rank keeps its heads' share of the whole stream. The all-to-alls stand
    in by returning what this rank sends (every rank's share has the same shape when the stream's
    1,024 tokens split evenly), so the saved tensors have the shapes a real group's would."""
    size = 4
    group = ContextGroup(size=size, rank=0, all_to_all=lambda chunks, rows: list(chunks), sum_over_group=lambda t: t)
    monkeypatch.setattr(step_memory, "TokenLogprobModel", partial(TokenLogprobModel, context=group))
    causal_lm = load_causal_lm(small_model_dir, dtype=torch.float32)
    causal_lm.config.use_cache = False
    saved = saved_bytes_per_token(causal_lm, _batch(1024, SMALL_SHAPE.vocab_size).inputs, CHUNK_SIZE)
    per_rank_token = size * saved[f"layer{SMALL_SHAPE.num_layers - 1}"]  # measured per token of the stream
    shape = _shape(small_model_dir)
    _assert_holds(layer_activation_bytes(shape, FP32_BYTES, context_parallel=size), per_rank_token, "cp 4 layer")
    assert per_rank_token > layer_activation_bytes(shape, FP32_BYTES)  # the repeated keys and values are seen


@pytest.mark.system  # each measurement runs in a fresh process
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_measured_training_step_stays_within_the_estimate(small_model_dir: Path, checkpointing: bool) -> None:
    peak = measure_step(str(small_model_dir), _batch(STEP_TOKENS, SMALL_SHAPE.vocab_size), CHUNK_SIZE, checkpointing,
                        threads=1)
    shape = _shape(small_model_dir)
    assert peak.num_params == shape.num_params
    run = RunShape(trainer_ranks=1, max_tokens_per_gpu=STEP_TOKENS, logprob_chunk_size=CHUNK_SIZE,
                   gradient_checkpointing=checkpointing, compute_dtype_bytes=FP32_BYTES)
    # What the step adds to the weights and moments: fp32 gradients and the pass's activations.
    _assert_holds(FP32_BYTES * shape.num_params + trainer_memory(shape, run).activations, peak.pass_bytes,
                  f"step (checkpointing {checkpointing})")
