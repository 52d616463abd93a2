"""A generation worker as the engine tests set it up: its small float32 CPU engine and worker
config, and the models it serves: the tiny model rewired into an answering model whose completions
vary (so rewards do), and seeded perturbed copies (a weight push that shows in every logprob); plus
the reward math-verify itself gives a completion. Shared by tests/inference/test_vllm_worker.py,
tests/trainer/test_evaluation.py and tests/rollouts/test_token_versions_engine.py; the engine-core
processes under a worker actor, for tests/routing/test_registry.py too."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from async_grpo.config.worker_options import EngineConfig, FailedSamplesConfig, VerificationConfig
from setup_model import load_causal_lm, load_tokenizer
from vllm_worker import GenerationWorkerConfig

# A few MiB of KV cache hold every sequence these tests run; a fixed size avoids the CPU
# backend's RAM-fraction sizing, which fails when other processes use the machine.
TEST_KV_CACHE_BYTES = 64 << 20
TEST_MAX_MODEL_LEN = 256
# Short enough that the hostile test finishes quickly, long enough for ordinary answers on a busy
# 2-core machine (they take milliseconds).
TEST_VERIFIER_TIMEOUT_S = 3.0
# Noise scale of perturbed_copy: it moves the tiny model's logprobs by ~1 nat.
PERTURBATION_SCALE = 0.1
# The answering model (see write_answering_model) samples each token independently from these
# logits (all other tokens: 0), so its completions are answers like '7', '37 3' or '' and the
# rewards of a group differ; the EOS share also leaves some completions truncated at max_tokens.
ANSWER_LOGITS = {"7": 6.5, "3": 6.3, " ": 5.5}
EOS_LOGIT = 6.3
# Added to hidden dimension 0 of every token embedding: it dominates the residual stream, so the
# final RMSNorm output is ~constant there and the lm_head column 0 alone sets the logits.
EMBED_OFFSET = 100.0


def worker_config(model_dir: Path, failed_samples_path: Path | None = None, engine: dict[str, Any] | None = None,
                  **overrides: Any) -> GenerationWorkerConfig:
    """The tests' worker config; `engine` changes fields of its EngineConfig."""
    engine_fields: dict[str, Any] = dict(
        max_num_seqs=16,
        gpu_memory_utilization=0.1,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        max_model_len=TEST_MAX_MODEL_LEN,
        enforce_eager=True,
        dtype="float32",
    )
    fields: dict[str, Any] = dict(
        model_path=str(model_dir),
        engine=EngineConfig(**{**engine_fields, **(engine or {})}),
        verification=VerificationConfig(global_num_verifiers=1, verifier_timeout_s=TEST_VERIFIER_TIMEOUT_S),
        failed_samples=FailedSamplesConfig() if failed_samples_path is None else FailedSamplesConfig(
            write_failed_generation_samples=True, failed_samples_path=str(failed_samples_path)),
    )
    return GenerationWorkerConfig(**{**fields, **overrides})


def write_answering_model(src: Path, dst: Path) -> Path:
    """The tiny model rewired into a context-free sampler over ANSWER_LOGITS and EOS."""
    tokenizer = load_tokenizer(src)
    model = load_causal_lm(src)
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = EMBED_OFFSET
        # RMSNorm of a vector dominated by dim 0 is ~sqrt(hidden) there: scale it to 1, drop the rest.
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0 / math.sqrt(hidden)
        model.lm_head.weight.zero_()
        for text, logit in ANSWER_LOGITS.items():
            (token,) = tokenizer.encode(text)
            model.lm_head.weight[token, 0] = logit
        model.lm_head.weight[tokenizer.eos_token_id, 0] = EOS_LOGIT
    shutil.copytree(src, dst)
    model.save_pretrained(dst)
    return dst


def expected_reward(output_text: str, gt_answer: str) -> float:
    """math-verify's verdict, computed here directly (gold given as LaTeX, as the pool does)."""
    from math_verify import parse, verify

    return 1.0 if verify(parse(f"${gt_answer}$"), parse(output_text)) else 0.0


def perturbed_copy(model_dir: Path, out_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Add seeded noise to every weight, save the model to out_dir, return its state dict."""
    model = load_causal_lm(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(PERTURBATION_SCALE * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out_dir)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


# Run on an actor through `__ray_call__`: its process id (a lambda travels by value).
_pid = lambda _actor: os.getpid()  # noqa: E731


def engine_core_processes(worker: Any) -> list[Any]:
    """The vLLM engine-core process(es) (psutil.Process, titled VLLM::EngineCore) under a
    generation worker actor."""
    import psutil
    import ray

    children = psutil.Process(ray.get(worker.__ray_call__.remote(_pid))).children(recursive=True)
    cores = [c for c in children if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
    assert cores, f"no engine-core process among {[(c.pid, c.name()) for c in children]}"
    return cores
