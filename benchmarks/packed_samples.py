"""Packed training minibatches of realistic lengths and what training on them costs: shared by
trainer_throughput.py and memory.py (and the tests that check their sums)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sample_processing_utils import Sample


@dataclass(frozen=True, slots=True)
class FlopCount:
    """Model FLOPs of one forward + backward over a packed minibatch (see the module docstring)."""

    dense: float
    """6 * non-embedding params * packed tokens."""
    lm_head: float
    """6 * hidden * vocab * output tokens."""
    attention: float
    """6 * layers * attention width * sum of squared sample lengths (causal)."""

    @property
    def total(self) -> float:
        return self.dense + self.lm_head + self.attention


def training_flops(*, non_embedding_params: int, hidden_size: int, vocab_size: int, num_layers: int,
                   attention_width: int, sample_lengths: list[int], output_tokens: int) -> FlopCount:
    """Model FLOPs of training on one packed minibatch; attention_width = n_heads * head_dim."""
    tokens = sum(sample_lengths)
    return FlopCount(
        dense=6.0 * non_embedding_params * tokens,
        lm_head=6.0 * hidden_size * vocab_size * output_tokens,
        attention=6.0 * num_layers * attention_width * sum(n * n for n in sample_lengths),
    )


def draw_packed_samples(num_tokens: int, vocab_size: int, *, min_prompt: int, max_prompt: int,
                        output_median: float, output_sigma: float, max_output: int, seed: int) -> list[Sample]:
    """Rollouts of realistic lengths filling exactly num_tokens packed tokens (the last one cut to fit).

    Token ids are uniform over the vocabulary; logprobs are near 0 (sampling = reference, so the
    KL term is live); advantages are standard normal. Needs num_tokens >= 2.
    """
    if num_tokens < 2:
        raise ValueError(f"draw_packed_samples: num_tokens must be >= 2, got {num_tokens}")
    gen = torch.Generator().manual_seed(seed)
    lengths: list[tuple[int, int]] = []  # (prompt, output)
    remaining = num_tokens
    while remaining > 0:
        prompt = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=gen))
        output = int(min(max_output, max(1.0, round(output_median * math.exp(output_sigma * float(
            torch.randn(1, generator=gen)))))))
        if remaining == 1:  # no room for a prompt and an output: the previous rollout gets the token
            last_prompt, last_output = lengths.pop()
            lengths.append((last_prompt, last_output + 1))
            break
        prompt = min(prompt, remaining - 1)
        output = min(output, remaining - prompt)
        lengths.append((prompt, output))
        remaining -= prompt + output
    samples = []
    for i, (prompt, output) in enumerate(lengths):
        logprobs = (-0.1 * torch.rand(output, generator=gen)).tolist()
        samples.append(Sample(
            input_token_ids=torch.randint(0, vocab_size, (prompt,), generator=gen).tolist(),
            output_token_ids=torch.randint(0, vocab_size, (output,), generator=gen).tolist(),
            gt_answer="", prompt_id=i, advantage=float(torch.randn(1, generator=gen)),
            sampling_logprobs=logprobs, ref_logprobs=logprobs,
        ))
    return samples


def full_logit_logprobs(hidden_states: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """The reference: every position's [vocab] logits at once, log_softmax in fp32, gather the labels."""
    logits = F.linear(hidden_states, lm_head.weight, lm_head.bias).float()
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None])[:, 0]
