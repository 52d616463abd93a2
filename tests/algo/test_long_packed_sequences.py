"""Long packed sequences: the benchmarks' sample packing and FLOPs count, chunked logprobs against
full logits over many chunks, and a packed stream of long samples under gradient checkpointing
scoring like each sample alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from benchmarks.packed_samples import draw_packed_samples, full_logit_logprobs, training_flops
from grpo_loss import LossConfig, chunked_token_logprobs, grpo_loss
from sample_processing_utils import Sample, post_process_batch
from setup_model import TokenLogprobModel, load_causal_lm

LENGTHS = dict(min_prompt=64, max_prompt=512, output_median=1024.0, output_sigma=0.75, max_output=4096)
FP32_TOLERANCE = 1e-5


@pytest.mark.parametrize("num_tokens", [2, 3, 600, 16384, 40000])
def test_samples_fill_exactly_the_token_budget(num_tokens: int) -> None:
    samples = draw_packed_samples(num_tokens, vocab_size=151_936, seed=num_tokens, **LENGTHS)
    assert sum(s.num_tokens for s in samples) == num_tokens
    assert all(s.input_token_ids and s.output_token_ids for s in samples)
    assert all(len(s.output_token_ids) <= LENGTHS["max_output"] + 1 for s in samples)
    assert post_process_batch(samples).num_tokens == num_tokens


def test_training_flops_closed_form() -> None:
    flops = training_flops(non_embedding_params=1000, hidden_size=8, vocab_size=50, num_layers=2,
                           attention_width=8, sample_lengths=[3, 5], output_tokens=4)
    assert flops.dense == 6 * 1000 * 8
    assert flops.lm_head == 6 * 8 * 50 * 4
    assert flops.attention == 6 * 2 * 8 * (9 + 25)  # 12 L d len^2 per sample, halved by the causal mask
    assert flops.total == flops.dense + flops.lm_head + flops.attention


def test_chunked_logprobs_equal_full_logits_over_many_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    samples = draw_packed_samples(4096, vocab_size=1000, seed=1, **LENGTHS)
    batch = post_process_batch(samples)
    labels = batch.inputs.targets
    lm_head = torch.nn.Linear(32, 1000, bias=False)
    hidden = torch.randn(labels.numel(), 32, generator=gen, requires_grad=True)
    results = {}
    for name, score in {"chunked": lambda: chunked_token_logprobs(hidden, lm_head, labels, chunk_size=256)[0],
                        "full": lambda: full_logit_logprobs(hidden, lm_head, labels)}.items():
        hidden.grad, lm_head.weight.grad = None, None
        logprobs = score()
        loss, _ = grpo_loss(logprobs, batch, LossConfig())
        loss.backward()
        results[name] = (logprobs.detach(), hidden.grad.clone(), lm_head.weight.grad.clone())
    assert labels.numel() > 3 * 256
    for chunked, full in zip(results["chunked"], results["full"]):
        torch.testing.assert_close(chunked, full, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("long-context"),
                            TinyModelConfig(hidden_size=64, max_position_embeddings=4096, seed=2))


def test_packed_long_samples_with_gradient_checkpointing_score_like_each_alone(long_context_model_dir: Path) -> None:
    """Two 1.5k/1.7k-token samples and a short one in one stream: logprobs and gradients as if scored apart."""
    causal_lm = load_causal_lm(long_context_model_dir)
    causal_lm.config.use_cache = False
    causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = TokenLogprobModel(causal_lm, logprob_chunk_size=512).train()
    vocab = causal_lm.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    samples = [
        Sample(input_token_ids=torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
               output_token_ids=torch.randint(0, vocab, (output,), generator=gen).tolist(),
               gt_answer="", prompt_id=i, advantage=float(i) - 1.0, sampling_logprobs=[-0.5] * output)
        for i, (prompt, output) in enumerate([(200, 1300), (480, 1220), (30, 10)])
    ]

    def grads_of(sample_groups):
        model.zero_grad(set_to_none=True)
        logprobs = []
        for group in sample_groups:
            batch = post_process_batch(group)
            group_logprobs, _ = model.score(batch.inputs)
            loss, _ = grpo_loss(group_logprobs, batch, LossConfig())
            loss.backward()
            logprobs.append(group_logprobs.detach())
        return torch.cat(logprobs), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed_logprobs, packed_grads = grads_of([samples])
    alone_logprobs, alone_grads = grads_of([[s] for s in samples])
    torch.testing.assert_close(packed_logprobs, alone_logprobs, atol=1e-4, rtol=1e-4)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-4, rtol=1e-3, msg=name)
