"""Answers that share their prompt (model.share_prompts, async_grpo/model/prompt_sharing.py).

- the layout against a hand-built stream (prompt once, each answer without its last token,
  positions continuing the prompt's, targets in sample order, observation tokens never targets);
- logprobs and parameter gradients equal an independent reference: each sample alone through the
  plain Hugging Face forward (full logits, log_softmax, gather), for GQA, MHA and a sliding-window
  model, with and without gradient checkpointing; entropies equal the whole-sample packing's;
- the check has power: the same stream run without its layout (answers then read their
  siblings) gives other logprobs;
- attention implementations that cannot run the layout are refused, in the config and at the forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_grpo.model.packed_attention import PACKED_SDPA
from async_grpo.model.prompt_sharing import PromptBlock, SharedPromptLayout
from sample_processing_utils import Sample, get_input_for_logprobs
from setup_model import ModelConfig, TokenLogprobModel, load_causal_lm
from support.reference_logprobs import reference_logprobs

LOGPROB_ATOL = 1e-5  # fp32: sharing changes matrix shapes (summation order), not the maths
# A prompt token's embedding gradient is one sum over its answers' attention here and a sum of
# per-answer copies in the reference: fp32 rounding of ~3e-6 seen on a few of 12,544 entries.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
CROSS_TALK_MIN_DIFF = 100 * LOGPROB_ATOL


def _sample(prompt: list[int], output: list[int], mask: list[bool] | None = None) -> Sample:
    return Sample(input_token_ids=prompt, gt_answer="", output_token_ids=output, output_mask=mask)


def test_the_layout_lays_each_prompt_once_before_its_answers() -> None:
    p, q = [1, 2, 3], [7, 8]
    samples = [_sample(p, [10, 11, 12]), _sample(q, [20]), _sample(p, [30, 31]),
               _sample(p, [40, 41, 42, 43], mask=[True, False, False, True])]
    inputs = get_input_for_logprobs(samples, share_prompts=True)
    # p, then its answers without their last token (12, 31, 43 predict nothing), then q (20: no token).
    assert inputs.input_ids.tolist() == [1, 2, 3, 10, 11, 30, 40, 41, 42, 7, 8]
    assert inputs.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1]
    assert inputs.shared_prompts == SharedPromptLayout(blocks=(
        PromptBlock(start=0, prompt_length=3, branch_lengths=(2, 1, 3)), PromptBlock(start=9, prompt_length=2,
                                                                                   branch_lengths=(0,))))
    # Sample order; p's last position (2) scores every first token; 41 and 42 are observations.
    assert inputs.targets.tolist() == [10, 11, 12, 20, 30, 31, 40, 43]
    assert inputs.output_indices.tolist() == [2, 3, 4, 10, 2, 5, 2, 8]
    assert inputs.output_lengths == [3, 1, 2, 2]
    whole = get_input_for_logprobs(samples)
    assert whole.shared_prompts is None and whole.targets.tolist() == inputs.targets.tolist()
    assert whole.input_ids.numel() == 3 + 3 + 2 + 1 + 3 + 2 + 3 + 4


def test_a_layout_that_does_not_tile_the_stream_is_refused() -> None:
    with pytest.raises(ValueError, match="does not continue the stream at 5"):
        SharedPromptLayout(blocks=(PromptBlock(start=0, prompt_length=2, branch_lengths=(3,)),
                                   PromptBlock(start=6, prompt_length=1, branch_lengths=())))


def _groups(vocab: int, seed: int) -> list[Sample]:
    """Prompts of 1-9 tokens with 1-5 answers of 1-12 tokens (some multi-turn), shuffled so a
    prompt's answers are not adjacent; one prompt appears in two separate groups."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    samples = []
    prompts = [torch.randint(0, vocab, (randint(1, 10),), generator=gen).tolist() for _ in range(6)]
    for prompt in prompts + prompts[:1]:
        for _ in range(randint(1, 6)):
            length = randint(1, 13)
            mask = None if randint(0, 2) else [j == 0 or randint(0, 3) > 0 for j in range(length)]
            samples.append(_sample(prompt, torch.randint(0, vocab, (length,), generator=gen).tolist(), mask))
    order = torch.randperm(len(samples), generator=gen).tolist()
    return [samples[i] for i in order]


def _reference(causal_lm: torch.nn.Module, samples: list[Sample]) -> torch.Tensor:
    """Each sample alone through the plain forward (support.reference_logprobs): its sampled tokens' logprobs."""
    picked = []
    for sample in samples:
        logprobs = reference_logprobs(causal_lm, sample.input_token_ids, sample.output_token_ids, grad=True)
        mask = sample.output_mask or [True] * len(sample.output_token_ids)
        picked.append(logprobs[torch.tensor(mask)])
    return torch.cat(picked)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("shape", ["tiny_model_dir", "mha_model_dir", "sliding_model_dir"])
def test_shared_prompts_equal_each_sample_alone(shape: str, checkpointing: bool, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(shape)
    causal_lm = load_causal_lm(model_dir, attn_implementation=PACKED_SDPA)
    if checkpointing:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = TokenLogprobModel(causal_lm, logprob_chunk_size=16).train()
    samples = _groups(causal_lm.config.vocab_size, seed=3)
    inputs = get_input_for_logprobs(samples, share_prompts=True)
    distinct_prompts = {tuple(s.input_token_ids) for s in samples}
    assert len(distinct_prompts) < len(samples)
    assert inputs.input_ids.numel() == (sum(map(len, distinct_prompts))
                                        + sum(len(s.output_token_ids) - 1 for s in samples))
    weights = torch.randn(inputs.targets.numel(), generator=torch.Generator().manual_seed(0))

    logprobs, entropy = model.score(inputs)
    (logprobs * weights).sum().backward()
    shared_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    reference = _reference(causal_lm, samples)
    (reference * weights).sum().backward()

    torch.testing.assert_close(logprobs, reference, rtol=0, atol=LOGPROB_ATOL)
    with torch.no_grad():
        _, whole_entropy = model.score(get_input_for_logprobs(samples))
    torch.testing.assert_close(entropy, whole_entropy, rtol=0, atol=LOGPROB_ATOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(shared_grads[name], p.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")

    # Power: without its layout the stream is split at position restarts only, so an answer
    # attends to the answers laid out before it.
    with torch.no_grad():
        crossed, _ = model(inputs.input_ids, inputs.position_ids, inputs.targets, inputs.output_indices)
    assert (crossed - reference.detach()).abs().max() > CROSS_TALK_MIN_DIFF


def test_attention_that_cannot_run_the_layout_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="share_prompts needs ModelConfig.attn_implementation"):
        ModelConfig(model_path="m", share_prompts=True, attn_implementation="sdpa")
    ModelConfig(model_path="m", share_prompts=True)  # None: the trainer then picks packed_sdpa
    model = TokenLogprobModel(load_causal_lm(tiny_model_dir, attn_implementation="eager"))
    inputs = get_input_for_logprobs([_sample([1, 2], [3, 4]), _sample([1, 2], [5])], share_prompts=True)
    with pytest.raises(ValueError, match="would let answers attend to each other"):
        model.score(inputs)
