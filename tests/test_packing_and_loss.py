"""Packed logprobs and the GRPO loss against independent references, on the tiny model in fp32.

- packed == per-sample: each sample scored alone (no padding) gives the same logprobs as the
  packed stream; continuous position ids (no restart) do not, so the check has power;
- chunked lm_head == one full log_softmax, values and gradients, for several chunk sizes;
- loss and parameter gradients == a right-padded reference written here (plain HF forward with
  attention_mask, full log_softmax, gather, the GRPO formula by hand);
- post_process_batch's layout and broadcasts against hand-built tensors, and its errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_loss import LossConfig, chunked_token_logprobs, grpo_loss
from sample_processing_utils import IGNORE_INDEX, Sample, get_input_for_logprobs, post_process_batch
from setup_model import TokenLogprobModel, load_causal_lm

# fp32 on CPU: packing changes attention's matrix shapes (and so summation order), not the maths.
LOGPROB_ATOL = 1e-5
# Without position restarts, later samples attend to earlier ones: errors of order 0.1 and more.
CROSS_TALK_MIN_DIFF = 100 * LOGPROB_ATOL
# Loss and gradients summed over a few hundred tokens in fp32.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
NUM_SAMPLES = 10
MAX_PROMPT, MAX_OUTPUT = 24, 40  # exclusive bounds of the random lengths: short, so tests stay fast


def _random_samples(vocab: int, num_samples: int, seed: int) -> list[Sample]:
    """Prompts of 1..23 and outputs of 1..39 random tokens, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        prompt_len = int(torch.randint(1, MAX_PROMPT, (1,), generator=gen))
        output_len = int(torch.randint(1, MAX_OUTPUT, (1,), generator=gen))
        samples.append(Sample(
            input_token_ids=torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
            output_token_ids=torch.randint(0, vocab, (output_len,), generator=gen).tolist(),
            gt_answer="",
            prompt_id=i,
            advantage=float(torch.randn(1, generator=gen)),
        ))
    return samples


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def logprob_model(request, tiny_model_dir: Path) -> TokenLogprobModel:
    return TokenLogprobModel(load_causal_lm(tiny_model_dir, attn_implementation=request.param), logprob_chunk_size=16)


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[Sample]:
    vocab = load_causal_lm(tiny_model_dir).config.vocab_size
    return _random_samples(vocab, NUM_SAMPLES, seed=3)


# ------------------------------------------------------------------------------------------
# 1. Packed == per-sample.
# ------------------------------------------------------------------------------------------


def test_packed_logprobs_equal_per_sample(logprob_model: TokenLogprobModel, samples: list[Sample]) -> None:
    lengths = {s.num_tokens for s in samples}
    assert len(lengths) > 3, "samples should have varied lengths"
    packed = get_input_for_logprobs(samples)
    with torch.no_grad():
        packed_lp, packed_ent = logprob_model.score(packed)
        alone = [logprob_model.score(get_input_for_logprobs([s])) for s in samples]
    alone_lp = torch.cat([lp for lp, _ in alone])
    alone_ent = torch.cat([ent for _, ent in alone])
    assert packed_lp.shape == (sum(len(s.output_token_ids) for s in samples),)
    assert (packed_lp - alone_lp).abs().max() <= LOGPROB_ATOL
    assert (packed_ent - alone_ent).abs().max() <= LOGPROB_ATOL

    # Power: the same stream with positions 0..T-1 lets samples attend across boundaries.
    continuous = torch.arange(packed.input_ids.numel())
    with torch.no_grad():
        crossed_lp, _ = logprob_model(packed.input_ids, continuous, packed.labels, packed.output_indices)
    assert (crossed_lp - alone_lp).abs().max() > CROSS_TALK_MIN_DIFF


# ------------------------------------------------------------------------------------------
# 2. Chunked == unchunked.
# ------------------------------------------------------------------------------------------


def _unchunked(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full logits, full log_softmax, gather; 0 where the label is ignored."""
    log_p = torch.log_softmax(head(hidden), dim=-1)
    scored = labels != IGNORE_INDEX
    picked = log_p.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(scored, picked, torch.zeros_like(picked)), entropy.detach()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 37, 64])
def test_chunked_logprobs_equal_unchunked(chunk_size: int, bias: bool) -> None:
    num_tokens, hidden_size, vocab = 37, 16, 50
    gen = torch.Generator().manual_seed(chunk_size)
    head = torch.nn.Linear(hidden_size, vocab, bias=bias)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen)
    labels[::5] = IGNORE_INDEX
    upstream = torch.randn(num_tokens, generator=gen)

    def value_and_grads(fn) -> list[torch.Tensor]:
        head.zero_grad()
        hidden.grad = None
        lp, ent = fn()
        ((lp * upstream).sum()).backward()
        return [lp.detach(), ent, hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]

    chunked = value_and_grads(lambda: chunked_token_logprobs(hidden, head, labels, chunk_size))
    reference = value_and_grads(lambda: _unchunked(hidden, head, labels))
    assert chunked[0][labels == IGNORE_INDEX].abs().max() == 0
    for got, want in zip(chunked, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# 3. Loss and gradients == right-padded reference.
# ------------------------------------------------------------------------------------------


def _with_policy_logprobs(samples: list[Sample], model: TokenLogprobModel, with_old: bool, seed: int) -> list[Sample]:
    """Copies whose old/ref/sampling logprobs sit near the model's, so some ratios clip."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        current, _ = model.score(get_input_for_logprobs(samples))
    old = current + 0.3 * torch.randn(current.shape, generator=gen)
    ref = current + 0.3 * torch.randn(current.shape, generator=gen)
    sampling = old + 0.2 * torch.randn(current.shape, generator=gen)
    lengths = [len(s.output_token_ids) for s in samples]
    out = []
    for s, o, r, q in zip(samples, old.split(lengths), ref.split(lengths), sampling.split(lengths)):
        out.append(Sample(
            input_token_ids=s.input_token_ids, output_token_ids=s.output_token_ids, gt_answer="",
            prompt_id=s.prompt_id, advantage=s.advantage, old_logprobs=o.tolist() if with_old else None,
            ref_logprobs=r.tolist(), sampling_logprobs=q.tolist(),
        ))
    return out


def _padded_output_logprobs(causal_lm: torch.nn.Module, samples: list[Sample]) -> list[torch.Tensor]:
    """Right-pad into [B, L], HF forward with attention_mask, log_softmax, gather each output token."""
    seqs = [s.input_token_ids + s.output_token_ids for s in samples]
    max_len = max(len(seq) for seq in seqs)
    input_ids = torch.zeros(len(seqs), max_len, dtype=torch.long)
    attention_mask = torch.zeros(len(seqs), max_len, dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
    log_p = torch.log_softmax(causal_lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits, -1)
    per_sample = []
    for row, s in enumerate(samples):
        prompt_len = len(s.input_token_ids)
        # Output token j sits at prompt_len + j and is predicted by the position before it.
        positions = torch.arange(prompt_len - 1, prompt_len - 1 + len(s.output_token_ids))
        per_sample.append(log_p[row, positions, torch.tensor(s.output_token_ids)])
    return per_sample


def _reference_loss(per_sample_lp: list[torch.Tensor], samples: list[Sample], config: LossConfig) -> torch.Tensor:
    """The GRPO objective written out: clipped ratio x advantage x TIS weight, plus kl_coef x KL."""
    total = torch.zeros(())
    for lp, s in zip(per_sample_lp, samples):
        old = torch.tensor(s.old_logprobs) if s.old_logprobs is not None else lp.detach()
        ref, sampling = torch.tensor(s.ref_logprobs), torch.tensor(s.sampling_logprobs)
        ratio = torch.exp(lp - old)
        clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
        pg = -torch.minimum(ratio * s.advantage, clipped * s.advantage)
        if config.tis_cap is not None:
            pg = pg * torch.clamp(torch.exp(old - sampling), max=config.tis_cap)
        log_ref_over_pi = ref - lp
        kl = {
            "k1": -log_ref_over_pi,
            "k2": 0.5 * log_ref_over_pi**2,
            "k3": torch.exp(log_ref_over_pi) - log_ref_over_pi - 1,
        }[config.kl_estimator]
        total = total + (pg + config.kl_coef * kl).mean()
    return total


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "config, with_old",
    [
        (LossConfig(kl_coef=0.1, kl_estimator="k1", clip_low=0.2, clip_high=0.28, tis_cap=None), True),
        (LossConfig(kl_coef=0.05, kl_estimator="k2", clip_low=0.1, clip_high=0.3, tis_cap=1.1), True),
        (LossConfig(kl_coef=0.2, kl_estimator="k3", clip_low=0.2, clip_high=0.28, tis_cap=1.1), True),
        (LossConfig(kl_coef=0.0, tis_cap=None), False),
    ],
    ids=["k1", "k2-tis", "k3-tis", "no-old-no-kl"],
)
def test_loss_and_grads_equal_padded_reference(
    config: LossConfig, with_old: bool, tiny_model_dir: Path, samples: list[Sample]
) -> None:
    model = TokenLogprobModel(load_causal_lm(tiny_model_dir), logprob_chunk_size=16)
    batch_samples = _with_policy_logprobs(samples, model, with_old, seed=7)
    batch = post_process_batch(batch_samples)

    logprobs, _ = model.score(batch.inputs)
    loss, metrics = grpo_loss(logprobs, batch, config)
    loss.backward()
    packed_grads = _grads(model.causal_lm)
    model.zero_grad()

    reference = _reference_loss(_padded_output_logprobs(model.causal_lm, batch_samples), batch_samples, config)
    reference.backward()
    reference_grads = _grads(model.causal_lm)

    if with_old:
        assert 0 < metrics["loss/clip_frac"] < 1, "both clipped and unclipped tokens should occur"
    if config.tis_cap is not None:
        weights = torch.exp(batch.old_logprobs - batch.sampling_logprobs)
        assert (weights > config.tis_cap).any() and (weights < config.tis_cap).any()
    torch.testing.assert_close(loss, reference, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    for name, grad in reference_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(
            packed_grads[name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}"
        )


# ------------------------------------------------------------------------------------------
# 4. post_process_batch layout.
# ------------------------------------------------------------------------------------------


def _sample(prompt: list[int], output: list[int], advantage: float, **logprobs) -> Sample:
    fields = {"sampling_logprobs": [-0.5] * len(output)} | logprobs
    return Sample(input_token_ids=prompt, output_token_ids=output, gt_answer="", advantage=advantage, **fields)


def test_post_process_batch_layout() -> None:
    a = _sample([10, 11, 12], [20, 21], 1.5, sampling_logprobs=[-1.0, -2.0], ref_logprobs=[-1.1, -2.1])
    b = _sample([30], [40, 41, 42], -0.5, sampling_logprobs=[-3.0, -4.0, -5.0], ref_logprobs=[-3.1, -4.1, -5.1])
    batch = post_process_batch([a, b])
    ignore = IGNORE_INDEX
    assert batch.inputs.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 40, 41, 42]
    assert batch.inputs.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # Position t holds the label input_ids[t + 1] when that is an output token of the same sample.
    assert batch.inputs.labels.tolist() == [ignore, ignore, 20, 21, ignore, 40, 41, 42, ignore]
    assert batch.inputs.output_indices.tolist() == [2, 3, 5, 6, 7]
    assert batch.inputs.output_lengths == [2, 3]
    assert batch.advantages.tolist() == [1.5, 1.5, -0.5, -0.5, -0.5]
    assert batch.output_lengths.tolist() == [2.0, 2.0, 3.0, 3.0, 3.0]
    assert batch.sample_index.tolist() == [0, 0, 1, 1, 1]
    assert batch.sampling_logprobs.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert torch.allclose(batch.ref_logprobs, torch.tensor([-1.1, -2.1, -3.1, -4.1, -5.1]))
    assert batch.old_logprobs is None
    assert (batch.num_samples, batch.num_tokens) == (2, 9)
    assert batch.advantages.dtype == batch.output_lengths.dtype == torch.float32


@pytest.mark.parametrize(
    "make_samples, message",
    [
        (lambda: [_sample([1], [2, 3], 0.0, sampling_logprobs=[-1.0])], "sampling_logprobs has 1 entries for 2"),
        (lambda: [_sample([1], [2, 3], 0.0, ref_logprobs=[-1.0, -2.0, -3.0])], "ref_logprobs has 3 entries"),
        (lambda: [_sample([1], [], 0.0)], "no output tokens"),
        (lambda: [_sample([], [2], 0.0)], "empty prompt"),
        (lambda: [_sample([1], [2], 0.0, old_logprobs=[-1.0]), _sample([1], [2], 0.0)], "old_logprobs missing"),
        (lambda: [_sample([1], [2], 0.0, sampling_logprobs=[])], "no sampling_logprobs"),
    ],
    ids=["sampling-length", "ref-length", "no-output", "no-prompt", "mixed-old", "no-sampling"],
)
def test_post_process_batch_errors(make_samples, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        post_process_batch(make_samples())

