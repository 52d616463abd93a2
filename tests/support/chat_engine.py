"""What the real-engine multi-turn tests share (test_multi_turn_vllm, test_verifiers_vllm,
test_verifiers_env_vllm): the tiny chat model they sample from, the small float32 CPU engine they
run it on, and the check that the trainer's packed logprob pass gives every sampled token the
logprob the engine sampled it with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from async_grpo.config.worker_options import EngineConfig, VerificationConfig
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from sample_processing_utils import Sample, get_input_for_logprobs
from setup_model import TokenLogprobModel, load_causal_lm
from vllm_worker import GenerationWorkerConfig

LOGPROB_ATOL = 1e-4  # float32 vLLM CPU against the HF model (as tests/inference/test_vllm_worker.py)


def tiny_chat_model(directory: Path) -> Path:
    """A tiny Qwen2 with the BPE chat tokenizer (ChatML template), written under directory."""
    return write_tiny_model(directory, TinyModelConfig(tokenizer="bpe"))


def chat_worker_config(model_dir: Path, *, max_model_len: int = 512, **engine: Any) -> GenerationWorkerConfig:
    """A generation worker on a small eager float32 engine (64 MiB of KV cache, 8 sequences)."""
    engine_config = EngineConfig(max_num_seqs=8, gpu_memory_utilization=0.1, kv_cache_memory_bytes=64 << 20,
                                 max_model_len=max_model_len, enforce_eager=True, dtype="float32", **engine)
    return GenerationWorkerConfig(model_path=str(model_dir), engine=engine_config, verification=VerificationConfig(global_num_verifiers=1))


def assert_trainer_logprobs_match_engine(model_dir: Path, samples: list[Sample]) -> None:
    """The trainer's logprobs of the samples' sampled tokens (packed, observation tokens masked)
    equal the engine's sampling logprobs within LOGPROB_ATOL: the context the trainer scores is the
    engine's, token for token."""
    model = TokenLogprobModel(load_causal_lm(model_dir)).eval()
    with torch.no_grad():
        logprobs, _ = model.score(get_input_for_logprobs(samples))
    engine = torch.tensor([x for s in samples for x in s.sampling_logprobs])
    assert logprobs.shape == engine.shape
    diff = (logprobs.float() - engine).abs().max().item()
    print(f"largest |trainer - engine| logprob over {engine.numel()} sampled tokens: {diff:.2e}")
    assert diff <= LOGPROB_ATOL
