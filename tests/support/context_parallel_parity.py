"""The context-parallel parity check, shared by tests/trainer/test_context_parallel.py (gloo, ranks
forked from the rank server) and tests/trainer/test_gpu_context_parallel.py (NCCL under torchrun):
the samples and their hand-written per-sample reference, the spec that
tests/programs/context_parallel_worker.py runs (both passes, split and unsplit, on the same
minibatches), and the loss and gradient checks against the unsplit pass."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from sample_processing_utils import Sample
from support.lora_adapters import LORA
from support.paths import PROGRAMS

WORKER = PROGRAMS / "context_parallel_worker.py"
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5  # of the parameter's largest gradient entry
LOGPROB_ATOL = 1e-5  # packed and split against one sample at a time: float rounding only
MAX_TOKENS = 24  # Dr. GRPO's constant divisor: samples x this
POLICY_VERSION = 5  # the decoupled case: samples of version 4 are stale
# (prompt, output) lengths. Minibatch 0 (31 + 32 tokens, shares of ~16 in 4 chunks) mixes samples
# longer than a chunk, crossing the split, with ones inside one chunk; minibatch 1 is one long
# sample over every chunk; in minibatch 2 (9 tokens) one rank scores no output token.
SHAPES = [[(4, 14), (3, 2), (5, 3), (2, 19), (3, 4), (3, 2)], [(6, 40)], [(8, 1)]]
SHAPES_FLAT = [shape for minibatch in SHAPES for shape in minibatch]
GRPO = {"kl_coef": 0.05, "is_mode": "tis", "is_cap": 1.5, "decoupled": True}
GSPO = {"ratio_level": "sequence", "seq_clip_low": 0.05, "seq_clip_high": 0.05, "kl_coef": 0.05}
CASES = [
    {"name": "grpo", "model": "gqa", "loss": GRPO, "policy_version": POLICY_VERSION},
    {"name": "gspo", "model": "gqa", "loss": GSPO},
    {"name": "dr_grpo", "model": "gqa", "loss": {"aggregation": "constant", "kl_coef": 0.05}},
    {"name": "token_mean", "model": "gqa", "loss": {"aggregation": "token_mean", "kl_coef": 0.05, "is_mode": "mis",
                                                     "is_cap": 1.5}},
    {"name": "sliding_window", "model": "sliding", "loss": GRPO, "policy_version": POLICY_VERSION},
    {"name": "lora", "model": "lora", "loss": GRPO, "policy_version": POLICY_VERSION},
    {"name": "gspo_unreduced", "model": "gqa", "loss": GSPO, "sum_over_group": False},
]
"""Per case: the model (gqa: one key/value head for 4 query heads, fewer than the 2 ranks), the
LossConfig fields, and sum_over_group False for GSPO with its per-sample sums left unreduced (a
broken split, which the checks must catch)."""
PASSING = [case["name"] for case in CASES if case.get("sum_over_group", True)]


def write_gqa_model(out_dir: Path) -> Path:
    """The tiny model with one key/value head for 4 query heads: fewer than the 2 ranks."""
    from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model

    return write_tiny_model(out_dir, TinyModelConfig(num_kv_heads=1))


def per_sample_logprobs(model_dir: Path, samples: list[Sample]) -> list[torch.Tensor]:
    """Hand-written reference: each sample alone through the plain HF model (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor(sample.input_token_ids + sample.output_token_ids)
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
            prompt = len(sample.input_token_ids)
            out.append(torch.log_softmax(logits[prompt - 1:], dim=-1).gather(
                -1, torch.tensor(sample.output_token_ids)[:, None])[:, 0])
    return out


def parity_samples(model_dir: Path, copies: int) -> list[Sample]:
    """`copies` x the samples of SHAPES with sampler, old-policy and reference logprobs near the
    model's own (so some ratios clip and some do not), advantages of both signs, and stale and
    fresh tokens."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    gen = torch.Generator().manual_seed(11)
    samples = []
    for index, (prompt, output) in enumerate(SHAPES_FLAT * copies):
        samples.append(Sample(input_token_ids=torch.randint(2, vocab, (prompt,), generator=gen).tolist(),
                              output_token_ids=torch.randint(2, vocab, (output,), generator=gen).tolist(),
                              gt_answer="", prompt_id=index, advantage=[1.0, -0.5, 0.8][index % 3],
                              weight_version=POLICY_VERSION - index % 2))
    for sample, logprobs in zip(samples, per_sample_logprobs(model_dir, samples)):
        def near(scale: float) -> list[float]:
            return (logprobs + scale * torch.randn(logprobs.shape, generator=gen)).tolist()
        sample.sampling_logprobs, sample.old_logprobs, sample.ref_logprobs = near(0.3), near(0.1), near(0.3)
        if len(sample.output_token_ids) > 2:  # a rollout that straddles a weight push
            half = len(sample.output_token_ids) // 2
            sample.token_versions = [(POLICY_VERSION - 1, half), (POLICY_VERSION, len(sample.output_token_ids) - half)]
    return samples


def minibatches(offset: int = 0) -> list[list[int]]:
    """SHAPES' minibatches as lists of sample indices, from `offset` on."""
    out, start = [], offset
    for minibatch in SHAPES:
        out.append(list(range(start, start + len(minibatch))))
        start += len(minibatch)
    return out


def write_spec(out: Path, models: dict[str, Path], samples: list[Sample], group_minibatches: list,
               cases: list[dict], context_parallel: int) -> list[str]:
    """Write the worker's SPEC.json into `out` (created); returns the worker's arguments."""
    out.mkdir()
    plain = {"lora": None, "adapter_dir": None, "gradient_checkpointing": False, "fsdp_per_layer_min_params": 10_000_000}
    model_specs = {
        # One FSDP unit per layer, each recomputed in backward: collectives inside FSDP's hooks.
        "gqa": {**plain, "model_path": str(models["gqa"]), "gradient_checkpointing": True,
                "fsdp_per_layer_min_params": 0},
        "sliding": {**plain, "model_path": str(models.get("sliding"))},
        "lora": {**plain, "model_path": str(models["gqa"]), "lora": LORA, "adapter_dir": str(models.get("adapter"))},
    }
    used = sorted({case["model"] for case in cases})
    spec = {"context_parallel": context_parallel, "samples": [asdict(s) for s in samples],
            "group_minibatches": group_minibatches, "models": [{"tag": tag, **model_specs[tag]} for tag in used],
            "cases": [{"policy_version": None, "sum_over_group": True, "max_tokens": MAX_TOKENS, **case}
                      for case in cases]}
    (out / "spec.json").write_text(json.dumps(spec))
    return ["--spec", str(out / "spec.json"), "--out_dir", str(out)]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def grad_error(split: dict[str, torch.Tensor], unsplit: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest per-parameter |split - unsplit| / max |unsplit|, and which parameter."""
    assert split.keys() == unsplit.keys() and split
    worst = max((float((split[n] - unsplit[n]).abs().max() / unsplit[n].abs().max().clamp_min(1e-12)), n)
                for n in split)
    return worst


def case_result(out: Path, name: str) -> dict:
    """What the worker's rank 0 wrote for one case: both passes' loss, metrics, logprobs, gradients."""
    return torch.load(out / f"{name}.pt")


def check_loss_and_gradients(result: dict, name: str) -> None:
    """The split pass's loss within LOSS_RTOL of the unsplit one's, every gradient within GRAD_RTOL."""
    split, unsplit = result["split"], result["unsplit"]
    assert abs(unsplit["loss"]) > 0.1, "a loss near zero would make the relative check vacuous"
    assert relative(split["loss"], unsplit["loss"]) <= LOSS_RTOL, (split["loss"], unsplit["loss"])
    error, where = grad_error(split["grads"], unsplit["grads"])
    assert error <= GRAD_RTOL, f"{name}: gradient of {where} off by {error:.2e} of its largest entry"
    assert all(g.abs().max() > 0 for g in unsplit["grads"].values())
