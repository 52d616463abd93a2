"""The chunked logprob's entropy costs nothing in backward (grpo_loss.chunked_token_logprobs).

The entropy is a no-grad metric built inside the checkpointed chunk function. Non-reentrant
activation checkpointing recomputes a chunk in backward only until the tensors backward needs
are back (torch's early stop, on by default), and the entropy comes after all of them: so the
backward pass runs log_softmax again but never the entropy's exp/mul/sum over [chunk, vocab].
Checked by counting the aten ops backward dispatches; the gradients equal a full-logits
reference computed without chunks or checkpointing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_loss import IGNORE_INDEX, chunked_token_logprobs

TOKENS, HIDDEN, VOCAB, CHUNK = 10, 8, 50, 4


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _inputs() -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB)
    labels = torch.randint(0, VOCAB, (TOKENS,))
    labels[3] = IGNORE_INDEX
    return hidden, lm_head, labels


def test_backward_recomputes_no_entropy_and_gradients_match_full_logits() -> None:
    hidden, lm_head, labels = _inputs()
    with _OpCounter() as forward:
        logprobs, entropy = chunked_token_logprobs(hidden, lm_head, labels, CHUNK)
    chunks = -(-TOKENS // CHUNK)
    assert forward.counts.get("exp", 0) == chunks, "the entropy is computed once per chunk in forward"
    weights = torch.linspace(-1.0, 1.0, TOKENS)
    with _OpCounter() as backward:
        (logprobs * weights).sum().backward()
    assert backward.counts.get("_log_softmax", 0) == chunks, "checkpointing recomputes each chunk's log_softmax"
    assert backward.counts.get("exp", 0) == 0 and backward.counts.get("mul_", 0) == 0, backward.counts
    got = hidden.grad.clone(), lm_head.weight.grad.clone()

    hidden.grad, lm_head.weight.grad, lm_head.bias.grad = None, None, None
    log_p = torch.log_softmax(F.linear(hidden, lm_head.weight, lm_head.bias).float(), dim=-1)
    kept = labels != IGNORE_INDEX
    reference = log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * kept
    (reference * weights).sum().backward()
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], lm_head.weight.grad)
    expected_entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(entropy, expected_entropy.detach())
