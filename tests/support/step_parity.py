"""One optimizer step of the system against a single-process, padded, hand-written GRPO step: the
samples, the reference step written from the loss's definition, the launch of the system's step
on two forked ranks (tests/programs/step_parity_worker.py, support.forked_ranks) and the checks with their tolerances. Shared by
tests/trainer/test_step_parity.py (whose docstring says what is compared and why these tolerances),
tests/trainer/test_multi_turn_parity.py (the same step on multi-turn samples) and
tests/model/test_gpu_model.py (the bf16 step against this fp32 reference)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from async_grpo.trainer.optimizer import OptimConfig
from grpo_loss import LossConfig
from sample_processing_utils import Sample
from support.paths import PROGRAMS
from support.forked_ranks import run_ranks

WORKER = PROGRAMS / "step_parity_worker.py"
WORLD_SIZE = 2
# Generous bound on the one launch (~20 s on 2 shared cores); it only stops a hung run.
LAUNCH_TIMEOUT_S = 600

# The step's batch: NUM_PROMPTS groups of GROUP_SIZE rollouts with varied prompt/output lengths.
NUM_PROMPTS, GROUP_SIZE = 6, 4
PROMPT_LEN_RANGE = (2, 13)  # [low, high) tokens
OUTPUT_LEN_RANGE = (1, 25)
MAX_OUTPUT_TOKENS = OUTPUT_LEN_RANGE[1] - 1  # sampling.max_tokens: the constant aggregation's normaliser
FIRST_TOKEN_ID = 2  # ids 0 and 1 are EOS and PAD in the tiny tokenizer: keep them out of samples
REF_LOGPROB_NOISE = 0.3  # reference logprobs = the starting model's + this x N(0, 1): a real KL
SAMPLING_LOGPROB_NOISE = 0.1  # the sampler's logprobs differ a little (read by metrics only)
ADVANTAGE_STD_EPS = 1e-6  # (r - mean) / (std + eps), as the generation worker's group advantage
# ~570 tokens over 2 ranks with a 56-token budget: 5-6 minibatches per rank, and one padding
# minibatch (loss weight 0) that evens out the ranks' counts.
MAX_TOKENS_PER_GPU = 56
REORDER_WINDOW = 16  # BatcherConfig's default best-fit window
MIN_MINIBATCHES_PER_RANK = 3
# Chunked lm_head on the system side (several chunks per minibatch); the reference has none.
LOGPROB_CHUNK_SIZE = 16

LR = 3e-3  # big enough that many of the second pass's ratios leave [1 - clip_low, 1 + clip_high]
WARMUP_STEPS = 2  # step 0 runs every pass at lr / 2; a per-pass schedule would show in pass 2
STEP0_LR = LR / WARMUP_STEPS
# Noise-level gradients stay in Adam's linear regime (tests/trainer/test_step_parity.py's docstring).
ADAM_EPS = 1e-4
WEIGHT_DECAY = 0.1  # decoupled, on matrices only (OptimConfig's documented rule)
NO_CLIP = 1e6  # max_grad_norm far above any gradient norm here: clipping off
# The demo's max_grad_norm. Pass 1's norm is ~1.7 (clipped: the global norm over both ranks'
# shards decides the scale), pass 2's of the two-epoch case ~0.8 (not clipped).
CLIPPING_MAX_NORM = 1.0
KL_COEF = 0.1
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
GSPO_CLIP = 0.3  # wider than GSPO's 3e-4: one step at lr 1.5e-3 moves these sequence ratios by tenths

# fp32 throughout, on any host: forked_ranks.run_ranks hides the GPUs from the ranks (on CUDA
# the trainer would compute in bf16; tests/model/test_gpu_model.py compares that step to this
# reference within bf16's tolerance). Packed vs padded attention, chunked lm_head, FSDP
# reduce-scatter and gloo sums only reorder float additions (~1e-7 relative on the gradients).
# Measured: at most ~2e-6 of a tensor's largest gradient.
GRAD_RTOL, GRAD_ATOL_FRACTION = 1e-4, 2e-5
GRAD_NORM_RTOL = 1e-5
PARAM_ATOL = 5e-6  # 0.3% of the step's lr / 2, about what one Adam step moves a weight by


@dataclass(frozen=True)
class Case:
    """One configuration of the step."""

    epochs_per_step: int
    loss: LossConfig
    optim: OptimConfig
    data_path: str = "per_rank"
    share_prompts: bool = False
    """model.share_prompts: the answers of one prompt share it in each packed minibatch."""
    per_layer_units: bool = False
    """One FSDP unit per decoder layer (model.fsdp_per_layer_min_params 0); otherwise the tiny
    model is one unit, as ModelConfig's default shards a model of its size."""


def optim_config(max_grad_norm: float) -> OptimConfig:
    return OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY, warmup_steps=WARMUP_STEPS,
                       max_grad_norm=max_grad_norm)


# ---------------------------------------------------------------------------------------------
# The reference: one process, one padded batch, the loss from its definition
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaddedBatch:
    """All samples right-padded to one length L; targets/masks are over positions 0 .. L-2."""

    input_ids: torch.Tensor
    """[B, L] prompt + output, then padding."""
    attention_mask: torch.Tensor
    """[B, L] 1 on real tokens."""
    targets: torch.Tensor
    """[B, L-1] input_ids shifted left: the token position t predicts."""
    output_mask: torch.Tensor
    """[B, L-1] 1 where position t predicts an output token of its sample."""
    advantages: torch.Tensor
    """[B]"""
    ref_logprobs: torch.Tensor
    """[B, L-1] reference logprob of each predicted output token, 0 elsewhere."""


def padded_batch(samples: list[Sample], pad_id: int) -> PaddedBatch:
    length = max(s.num_tokens for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), length), dtype=torch.long)
    output_mask = torch.zeros((len(samples), length - 1))
    ref = torch.zeros((len(samples), length - 1))
    for i, s in enumerate(samples):
        prompt, output = len(s.input_token_ids), len(s.output_token_ids)
        ids[i, : prompt + output] = torch.tensor(s.input_token_ids + s.output_token_ids)
        attention[i, : prompt + output] = 1
        # Output token j sits at position prompt + j and is predicted at position prompt + j - 1.
        output_mask[i, prompt - 1 : prompt - 1 + output] = 1
        if s.ref_logprobs is not None:
            ref[i, prompt - 1 : prompt - 1 + output] = torch.tensor(s.ref_logprobs)
    return PaddedBatch(input_ids=ids, attention_mask=attention, targets=ids[:, 1:], output_mask=output_mask,
                       advantages=torch.tensor([s.advantage for s in samples]), ref_logprobs=ref)


def token_logprobs(model: torch.nn.Module, batch: PaddedBatch) -> torch.Tensor:
    """[B, L-1] log pi(target | prefix) at every position, from the full logits."""
    positions = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions,
                   use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def _ratios(logp: torch.Tensor, old: torch.Tensor, batch: PaddedBatch,
            loss: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, clipped ratio) [B, L-1]: per token, or each sample's exp(mean log ratio) (GSPO)."""
    if loss.ratio_level == "sequence":
        mask = batch.output_mask
        ratio = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))[:, None].expand_as(logp)
        return ratio, ratio.clamp(1 - loss.seq_clip_low, 1 + loss.seq_clip_high)
    ratio = torch.exp(logp - old)
    return ratio, ratio.clamp(1 - loss.clip_low, 1 + loss.clip_high)


def step_loss(logp: torch.Tensor, old: torch.Tensor, batch: PaddedBatch, loss: LossConfig) -> torch.Tensor:
    """The step's loss from its definition: the clipped PPO term (+ kl_coef x k3) per token, then
    each sample's token mean averaged over samples (sample_mean), the mean over all the step's
    output tokens (token_mean), or the sum over them / (samples x max_tokens) (constant)."""
    advantage = batch.advantages[:, None]
    ratio, clipped = _ratios(logp, old, batch, loss)
    per_token = -torch.minimum(ratio * advantage, clipped * advantage)
    if loss.kl_coef > 0:
        ref_minus_pi = batch.ref_logprobs - logp
        per_token = per_token + loss.kl_coef * (torch.exp(ref_minus_pi) - ref_minus_pi - 1)
    masked = per_token * batch.output_mask
    if loss.aggregation == "token_mean":
        return masked.sum() / batch.output_mask.sum()
    if loss.aggregation == "constant":
        return masked.sum() / (masked.shape[0] * MAX_OUTPUT_TOKENS)
    return (masked.sum(-1) / batch.output_mask.sum(-1)).mean()


def clipped_fraction(logp: torch.Tensor, old: torch.Tensor, batch: PaddedBatch, loss: LossConfig) -> float:
    ratio, clipped_ratio = _ratios(logp, old, batch, loss)
    advantage = batch.advantages[:, None]
    clipped = clipped_ratio * advantage < ratio * advantage
    return float(clipped[batch.output_mask.bool()].float().mean())


@dataclass
class ReferenceStep:
    params: dict[str, torch.Tensor]
    grads: list[dict[str, torch.Tensor]]
    """Per optimizer step, the gradients AdamW received (after clipping)."""
    grad_norms: list[float]
    """Per optimizer step, the pre-clip global gradient norm."""
    clipped_fractions: list[float]
    """Per pass, the fraction of output tokens where the min picks the clipped term (their
    ratio gets no gradient)."""


def load_reference_model(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model.train()  # the tiny Qwen2 has no dropout; train() mirrors the trainer anyway


def reference_adamw(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": optim.weight_decay},
                              {"params": vectors, "weight_decay": 0.0}],
                             lr=STEP0_LR, betas=optim.betas, eps=optim.eps)


def reference_step(model_dir: Path, samples: list[Sample], case: Case,
                   make_batch: Callable[[list[Sample], int], PaddedBatch] = padded_batch) -> ReferenceStep:
    """The step from its definition: per pass one padded forward, one backward of the step's
    mean loss, clip, AdamW (at step 0's warmup lr); pi_old is the first pass's policy.
    make_batch(samples, pad_id) pads them (a multi-turn test masks its observations there)."""
    model = load_reference_model(model_dir)
    optimizer = reference_adamw(model, case.optim)
    batch = make_batch(samples, model.config.pad_token_id)
    old: torch.Tensor | None = None
    out = ReferenceStep(params={}, grads=[], grad_norms=[], clipped_fractions=[])
    for _ in range(case.epochs_per_step):
        logp = token_logprobs(model, batch)
        if old is None:
            old = logp.detach()  # pi_old of every pass: the first pass's policy
        step_loss(logp, old, batch, case.loss).backward()
        out.clipped_fractions.append(clipped_fraction(logp.detach(), old, batch, case.loss))
        out.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.optim.max_grad_norm)))
        out.grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out.params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return out


# ---------------------------------------------------------------------------------------------
# The samples, and the system's run
# ---------------------------------------------------------------------------------------------


def group_advantages(rewards: list[float]) -> list[float]:
    values = torch.tensor(rewards, dtype=torch.float64)
    centred = values - values.mean()
    return (centred / (values.std(correction=0) + ADVANTAGE_STD_EPS)).tolist()


def build_samples(model_dir: Path, seed: int) -> list[Sample]:
    """Groups of rollouts with mixed 0/1 rewards (so every advantage is nonzero), reference
    logprobs near the starting model's, sampling logprobs near those."""
    gen = torch.Generator().manual_seed(seed)
    model = load_reference_model(model_dir)
    vocab = model.config.vocab_size

    def randint(low_high: tuple[int, int]) -> int:
        return int(torch.randint(*low_high, (1,), generator=gen))

    samples = []
    for prompt_id in range(NUM_PROMPTS):
        prompt = torch.randint(FIRST_TOKEN_ID, vocab, (randint(PROMPT_LEN_RANGE),), generator=gen).tolist()
        rewards = [float(r) for r in torch.randint(0, 2, (GROUP_SIZE,), generator=gen)]
        rewards[0] = 1.0 - rewards[1]  # a mixed group: no zero advantages
        for reward, advantage in zip(rewards, group_advantages(rewards)):
            output = torch.randint(FIRST_TOKEN_ID, vocab, (randint(OUTPUT_LEN_RANGE),), generator=gen).tolist()
            samples.append(Sample(input_token_ids=prompt, output_token_ids=output, gt_answer="", prompt_id=prompt_id,
                                  reward=reward, advantage=advantage, weight_version=0))
    batch = padded_batch(samples, pad_id=model.config.pad_token_id)
    with torch.no_grad():
        current = token_logprobs(model, batch)
    for i, s in enumerate(samples):
        own = current[i][batch.output_mask[i].bool()]
        s.ref_logprobs = (own + REF_LOGPROB_NOISE * torch.randn(own.shape, generator=gen)).tolist()
        s.sampling_logprobs = (own + SAMPLING_LOGPROB_NOISE * torch.randn(own.shape, generator=gen)).tolist()
    return samples


def launch_worker(spec: dict, out_dir: Path) -> None:
    """The worker on WORLD_SIZE forked ranks (support.forked_ranks: 127.0.0.1, a free port); raise with
    its output on failure."""
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    run_ranks(WORKER, ["--spec", str(spec_path), "--out_dir", str(out_dir)], WORLD_SIZE, LAUNCH_TIMEOUT_S)


def run_cases(out_dir: Path, model_dir: Path, samples: list[Sample], cases: dict[str, Case]) -> Path:
    """One launch of the worker over `samples`, every case in turn; returns out_dir."""
    spec = {
        "model_path": str(model_dir),
        "model": {"logprob_chunk_size": LOGPROB_CHUNK_SIZE},
        "samples": [asdict(s) for s in samples],
        "max_tokens_per_gpu": MAX_TOKENS_PER_GPU,
        # The longest prompt and output build_samples makes: the budget must hold their sum.
        "max_prompt_tokens": PROMPT_LEN_RANGE[1] - 1,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "reorder_window": REORDER_WINDOW,
        "cases": {name: {"epochs_per_step": c.epochs_per_step, "loss": asdict(c.loss), "optim": asdict(c.optim),
                         "data_path": c.data_path, "share_prompts": c.share_prompts, "per_layer_units": c.per_layer_units}
                  for name, c in cases.items()},
    }
    launch_worker(spec, out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def max_diff(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert actual.keys() == expected.keys()
    return max((actual[name] - expected[name]).abs().max().item() for name in expected)


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> float:
    """Per tensor, to GRAD_RTOL and GRAD_ATOL_FRACTION of its largest gradient; returns the
    largest difference as a fraction of its tensor's largest gradient."""
    assert got.keys() == want.keys()
    worst = 0.0
    for param, grad in want.items():
        scale = grad.abs().max().item()
        assert scale > 0, f"{where}: reference gradient of {param} is zero, the check would be vacuous"
        torch.testing.assert_close(got[param], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL_FRACTION * scale,
                                   msg=lambda m: f"{where}, gradient of {param}: {m}")
        worst = max(worst, (got[param] - grad).abs().max().item() / scale)
    return worst
