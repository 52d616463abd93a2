"""Packed logprobs and the GRPO loss against independent references, on the tiny model in fp32.

- packed == per-sample: each sample scored alone (no padding) gives the same logprobs as the
  packed stream; continuous position ids (no restart) do not, so the check has power;
- chunked lm_head == one full log_softmax, values and gradients, for several chunk sizes;
- loss and parameter gradients == a right-padded reference written here (plain HF forward with
  attention_mask, full log_softmax, gather, the GRPO formula by hand);
- post_process_batch's layout and broadcasts against hand-built tensors, and its errors;
- PACKED_SDPA (packed_attention's kernel, the default without flash-attn): per-sample causal sdpa equals the
  per-sample forward and transformers' block-mask sdpa (values and gradients, with and without
  gradient checkpointing, GQA and not, sliding window), never sees a mask or a [T, T] square on
  packed streams, and is plain sdpa wherever a mask is given (padded batches, `generate`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from async_grpo.model.packed_attention import PACKED_SDPA, PackedSegments, packed_segments
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


@pytest.fixture(scope="module", params=["sdpa", "eager", PACKED_SDPA])
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
        crossed_lp, _ = logprob_model(packed.input_ids, continuous, packed.targets, packed.output_indices)
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
    """The GRPO objective written out per sample: clipped ratio (per token, or the sequence's
    geometric mean for GSPO) x advantage x importance weight, plus kl_coef x KL; each sample's
    token mean (sample_mean) or token sum (token_mean, constant: the trainer divides later)."""
    total = torch.zeros(())
    for lp, s in zip(per_sample_lp, samples):
        old = torch.tensor(s.old_logprobs) if s.old_logprobs is not None else lp.detach()
        ref, sampling = torch.tensor(s.ref_logprobs), torch.tensor(s.sampling_logprobs)
        advantage = torch.tensor(s.token_advantages) if s.token_advantages is not None else s.advantage
        if config.ratio_level == "sequence":
            ratio = torch.exp((lp - old).mean()).expand(lp.shape)
            clipped = torch.clamp(ratio, 1 - config.seq_clip_low, 1 + config.seq_clip_high)
        else:
            ratio = torch.exp(lp - old)
            clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
        pg = -torch.minimum(ratio * advantage, clipped * advantage)
        rho = torch.exp(old - sampling)
        if config.is_mode == "tis":
            pg = pg * torch.clamp(rho, max=config.is_cap)
        elif config.is_mode == "mis":
            pg = pg * torch.where(rho > config.is_cap, torch.zeros_like(rho), rho)
        log_ref_over_pi = ref - lp
        kl = {
            "k1": -log_ref_over_pi,
            "k2": 0.5 * log_ref_over_pi**2,
            "k3": torch.exp(log_ref_over_pi) - log_ref_over_pi - 1,
        }[config.kl_estimator]
        terms = pg + (config.kl_coef * kl if not config.kl_in_reward else 0.0)
        total = total + (terms.mean() if config.aggregation == "sample_mean" else terms.sum())
    return total


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "config, with_old",
    [
        (LossConfig(kl_coef=0.1, kl_estimator="k1", clip_low=0.2, clip_high=0.28), True),
        (LossConfig(kl_coef=0.05, kl_estimator="k2", clip_low=0.1, clip_high=0.3, is_mode="tis", is_cap=1.1), True),
        (LossConfig(kl_coef=0.2, kl_estimator="k3", clip_low=0.2, clip_high=0.28, is_mode="tis", is_cap=1.1), True),
        (LossConfig(kl_coef=0.0), False),
        (LossConfig(kl_coef=0.1, is_mode="mis", is_cap=1.1), True),
        (LossConfig(kl_coef=0.1, aggregation="token_mean"), True),
        (LossConfig(kl_coef=0.0, aggregation="constant", is_mode="tis", is_cap=1.1), True),
        (LossConfig(ratio_level="sequence", seq_clip_low=0.002, seq_clip_high=0.003), True),
        (LossConfig(kl_coef=0.3, kl_in_reward=True), True),
    ],
    ids=["k1", "k2-tis", "k3-tis", "no-old-no-kl", "mis", "token-mean", "constant-tis", "gspo", "kl-in-reward"],
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
    if config.is_mode != "none":
        weights = torch.exp(batch.old_logprobs - batch.sampling_logprobs)
        assert (weights > config.is_cap).any() and (weights < config.is_cap).any()
    if config.is_mode == "mis":
        assert metrics["mismatch/masked_frac"] == pytest.approx(float((weights > config.is_cap).float().mean()))
    # Token sums are ~tokens-per-sample times larger than token means: compare on the mean's scale.
    scale = 1.0 if config.aggregation == "sample_mean" else 1.0 / batch.advantages.numel()
    torch.testing.assert_close(loss * scale, reference * scale, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    for name, grad in reference_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(
            packed_grads[name] * scale, grad * scale, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}"
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
    assert batch.inputs.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 40, 41, 42]
    assert batch.inputs.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    # Each output token is scored by the position before it: input_ids[t + 1] == targets at t.
    assert batch.inputs.output_indices.tolist() == [2, 3, 5, 6, 7]
    assert batch.inputs.targets.tolist() == [20, 21, 40, 41, 42]
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



# ------------------------------------------------------------------------------------------
# 5. PACKED_SDPA: per-sample attention without flash-attn.
# ------------------------------------------------------------------------------------------

# Lengths (prompt, output) with repeats, so equal-length samples share one batched sdpa call, and a
# one-token-prompt sample; 12 samples, 5..63 tokens each.
_SEGMENT_SHAPES = [
    (3, 2), (9, 30), (1, 4), (20, 11), (3, 2), (17, 5), (9, 30), (40, 23), (2, 3), (11, 11), (3, 2), (6, 1),
]


def _fixed_shape_samples(vocab: int, seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Sample(
            input_token_ids=torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
            output_token_ids=torch.randint(0, vocab, (output_len,), generator=gen).tolist(),
            gt_answer="",
            prompt_id=i,
        )
        for i, (prompt_len, output_len) in enumerate(_SEGMENT_SHAPES)
    ]


_MODEL_FIXTURES = {"gqa": "tiny_model_dir", "mha": "mha_model_dir", "sliding": "sliding_model_dir"}


def _model_dir(shape: str, request: pytest.FixtureRequest) -> Path:
    """The checkpoint folder of one model shape (see _MODEL_FIXTURES)."""
    return request.getfixturevalue(_MODEL_FIXTURES[shape])


def test_packed_segments_follow_position_restarts() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert packed_segments(positions, 1) == PackedSegments(starts=(0, 3, 5, 6), lengths=(3, 2, 1, 4))
    # A [1, T] row broadcast over a batch of 2: every row starts a sample.
    assert packed_segments(torch.tensor([[0, 1, 2]]), 2) == PackedSegments(starts=(0, 3), lengths=(3, 3))
    # Consecutive positions that do not start at 0 are one sample (a continuation), as in transformers.
    assert packed_segments(torch.tensor([[5, 6, 7, 0, 1]]), 1) == PackedSegments(starts=(0, 3), lengths=(3, 2))


def test_packed_sdpa_is_the_default_and_loads(tiny_model_dir: Path) -> None:
    causal_lm = load_causal_lm(tiny_model_dir)
    assert causal_lm.config._attn_implementation == PACKED_SDPA
    # The tiny model is GQA: 4 query heads share 2 key/value heads.
    assert causal_lm.config.num_key_value_heads < causal_lm.config.num_attention_heads


@pytest.mark.parametrize("shape", ["gqa", "mha", "sliding"])
def test_packed_sdpa_equals_per_sample(shape: str, request: pytest.FixtureRequest) -> None:
    model_dir = _model_dir(shape, request)
    model = TokenLogprobModel(load_causal_lm(model_dir, attn_implementation=PACKED_SDPA), logprob_chunk_size=16)
    samples = _fixed_shape_samples(model.causal_lm.config.vocab_size, seed=11)
    with torch.no_grad():
        packed_lp, packed_ent = model.score(get_input_for_logprobs(samples))
        alone = [model.score(get_input_for_logprobs([s])) for s in samples]
    assert (packed_lp - torch.cat([lp for lp, _ in alone])).abs().max() <= LOGPROB_ATOL
    assert (packed_ent - torch.cat([ent for _, ent in alone])).abs().max() <= LOGPROB_ATOL


def _value_and_grads(model: TokenLogprobModel, samples: list[Sample], upstream: torch.Tensor) -> list[torch.Tensor]:
    """Logprobs, entropy and every parameter's gradient of (logprobs * upstream).sum()."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = model.score(get_input_for_logprobs(samples))
    (logprobs * upstream).sum().backward()
    return [logprobs.detach(), entropy.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
@pytest.mark.parametrize("shape", ["gqa", "mha", "sliding"])
def test_packed_sdpa_values_and_grads_equal_block_mask_sdpa(
    shape: str, checkpointing: bool, request: pytest.FixtureRequest
) -> None:
    """Same packed stream, transformers' [T, T] block-mask sdpa as the reference."""
    model_dir = _model_dir(shape, request)
    models = {}
    for attn in ("sdpa", PACKED_SDPA):
        causal_lm = load_causal_lm(model_dir, attn_implementation=attn).train()  # dropout is 0
        if checkpointing and attn == PACKED_SDPA:
            causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        models[attn] = TokenLogprobModel(causal_lm, logprob_chunk_size=16)
    samples = _random_samples(models["sdpa"].causal_lm.config.vocab_size, NUM_SAMPLES, seed=5)
    upstream = torch.randn(sum(len(s.output_token_ids) for s in samples), generator=torch.Generator().manual_seed(0))

    reference = _value_and_grads(models["sdpa"], samples, upstream)
    got = _value_and_grads(models[PACKED_SDPA], samples, upstream)
    names = ["logprobs", "entropy"] + [name for name, _ in models["sdpa"].named_parameters()]
    torch.testing.assert_close(got[0], reference[0], rtol=0, atol=LOGPROB_ATOL)
    torch.testing.assert_close(got[1], reference[1], rtol=0, atol=LOGPROB_ATOL)
    for name, g, want in zip(names[2:], got[2:], reference[2:]):
        assert want.abs().max() > 0, name
        torch.testing.assert_close(g, want, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict]]:
    """Records (query shape, key length, mask shape, is_causal) of every torch sdpa call."""
    calls: list[dict] = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append({
            "batch": query.shape[0], "q_len": query.shape[-2], "kv_len": key.shape[-2],
            "mask": None if attn_mask is None else tuple(attn_mask.shape), "is_causal": is_causal,
        })
        return real_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    yield calls


def test_packed_sdpa_attends_per_sample_without_a_mask(tiny_model_dir: Path, sdpa_calls: list[dict]) -> None:
    """The work is sum(len_i^2) in unmasked causal calls; the block-mask path would fail this."""
    samples = _fixed_shape_samples(vocab=90, seed=2)
    lengths = [s.num_tokens for s in samples]
    packed = get_input_for_logprobs(samples)
    num_layers = 2
    for attn in ("sdpa", PACKED_SDPA):
        model = TokenLogprobModel(load_causal_lm(tiny_model_dir, attn_implementation=attn))
        assert model.causal_lm.config.num_hidden_layers == num_layers
        sdpa_calls.clear()
        with torch.no_grad():
            model.score(packed)
        if attn == "sdpa":
            # Power of the check: transformers' path is one [T, T] masked call per layer.
            total = sum(lengths)
            block_mask_call = {
                "batch": 1, "q_len": total, "kv_len": total, "mask": (1, 1, total, total), "is_causal": False,
            }
            assert sdpa_calls == [block_mask_call] * num_layers
            continue
        assert all(call["mask"] is None and call["is_causal"] for call in sdpa_calls)
        assert all(call["q_len"] == call["kv_len"] for call in sdpa_calls)
        pairs = sum(call["batch"] * call["q_len"] * call["kv_len"] for call in sdpa_calls)
        assert pairs == num_layers * sum(n * n for n in lengths)
        # Equal lengths share a call: one call per distinct length and layer.
        assert len(sdpa_calls) == num_layers * len(set(lengths))


def _padded_batch(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [s.input_token_ids + s.output_token_ids for s in samples]
    width = max(len(seq) for seq in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
    return input_ids, attention_mask


def test_packed_sdpa_with_a_mask_is_plain_sdpa(tiny_model_dir: Path, sdpa_calls: list[dict]) -> None:
    """Padded batches and `generate` (left padding, KV cache) get exactly transformers' sdpa."""
    models = {attn: load_causal_lm(tiny_model_dir, attn_implementation=attn).eval() for attn in ("sdpa", PACKED_SDPA)}
    input_ids, attention_mask = _padded_batch(_fixed_shape_samples(vocab=90, seed=4)[:4])
    calls, logits = {}, {}
    for attn, causal_lm in models.items():
        sdpa_calls.clear()
        with torch.no_grad():
            logits[attn] = causal_lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        calls[attn] = list(sdpa_calls)
    assert torch.equal(logits[PACKED_SDPA], logits["sdpa"])
    assert calls[PACKED_SDPA] == calls["sdpa"] and calls["sdpa"][0]["mask"] is not None

    prompts = torch.tensor([[1, 1, 40, 41, 42], [50, 51, 52, 53, 54]])  # token 1 is the pad token
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    generated = {
        attn: causal_lm.generate(
            input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=1
        )
        for attn, causal_lm in models.items()
    }
    assert torch.equal(generated[PACKED_SDPA], generated["sdpa"])


def test_packed_sdpa_single_sequence_is_plain_causal_sdpa(tiny_model_dir: Path, sdpa_calls: list[dict]) -> None:
    sample = _fixed_shape_samples(vocab=90, seed=6)[7]
    single = get_input_for_logprobs([sample])
    results = {}
    for attn in ("sdpa", PACKED_SDPA):
        sdpa_calls.clear()
        with torch.no_grad():
            results[attn] = TokenLogprobModel(load_causal_lm(tiny_model_dir, attn_implementation=attn)).score(single)
        assert all(call["mask"] is None and call["is_causal"] for call in sdpa_calls)
    assert torch.equal(results[PACKED_SDPA][0], results["sdpa"][0])


def test_flash_attention_is_the_cuda_default_only_for_bf16_or_fp16_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA node with flash-attn installed (simulated: only the import is checked, no GPU used)."""
    import types

    import setup_model
    from setup_model import check_attn_dtype, default_attn_implementation

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    # Registering packed_sdpa makes transformers probe the (fake) flash_attn package: not tested here.
    monkeypatch.setattr(setup_model, "register_packed_sdpa", lambda: None)
    cuda = torch.device("cuda", 0)
    assert default_attn_implementation(cuda) == "flash_attention_2"  # bf16 mixed precision, the default
    assert default_attn_implementation(cuda, torch.float16) == "flash_attention_2"
    assert default_attn_implementation(cuda, torch.float32) == PACKED_SDPA  # mixed_precision: false
    assert default_attn_implementation(torch.device("cpu"), torch.bfloat16) == PACKED_SDPA
    check_attn_dtype("flash_attention_2", torch.bfloat16, "ModelConfig.attn_implementation")
    check_attn_dtype("sdpa", torch.float32, "ModelConfig.attn_implementation")
    with pytest.raises(ValueError, match=r"ModelConfig.attn_implementation='flash_attention_2' needs bf16"):
        check_attn_dtype("flash_attention_2", torch.float32, "ModelConfig.attn_implementation")
    check_attn_dtype("packed_varlen", torch.bfloat16, "ModelConfig.attn_implementation")
    with pytest.raises(ValueError, match=r"'packed_varlen' needs bf16 or fp16 compute, but the model computes in "
                                         r"float32: torch's flash-attention varlen kernel"):
        check_attn_dtype("packed_varlen", torch.float32, "ModelConfig.attn_implementation")
