"""Packed streams in which the answers of one prompt share it: the prompt once, then each answer.

GRPO samples n answers per prompt, and packed whole a minibatch repeats every prompt n times. A
*block* lays a prompt out once, followed by its answers (branches). Each branch's tokens take the
positions that continue the prompt's and attend to the prompt and to their own earlier tokens,
never to a sibling: every answer token sees exactly the context it had packed whole, so the
logprobs are the same up to float rounding, with fewer tokens through every layer.

    stream:     p0 p1 p2 p3 | a0 a1 | b0 | q0 q1 ...   (prompt p, its answers a and b, prompt q, ...)
    positions:   0  1  2  3 |  4  5 |  4 |  0  1       (each answer continues its prompt)

`SharedPromptLayout` describes the blocks of a stream (sample_processing_utils builds it);
`shared_prompt_attention` runs a layer's attention over it (packed_attention.PACKED_SDPA calls it
when the decoder's kwargs carry a layout): the prompts by causal sdpa, grouped by length, and the
answers by sdpa over [prompt keys, own keys] under a causal mask aligned to the bottom right,
grouped by (prompt length, answer length). The cost is sum(m_i * (p + m_i)) over answers: what
the answers' own attention costs, without the prompt's repeated queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SHARED_PROMPT_LAYOUT_KWARG = "shared_prompt_layout"
"""The decoder (and so every attention call) keyword that carries a stream's SharedPromptLayout."""


@dataclass(frozen=True, slots=True)
class PromptBlock:
    """One prompt and the answers laid out after it, at `start` in the stream."""

    start: int
    """Stream offset of the prompt's first token."""
    prompt_length: int
    """Tokens of the prompt (>= 1)."""
    branch_lengths: tuple[int, ...]
    """Tokens of each answer as laid out after the prompt, in order (0 for an answer whose only
    token is predicted by the prompt's last position: its last token is never an input)."""

    @property
    def num_tokens(self) -> int:
        """Tokens the block occupies in the stream."""
        return self.prompt_length + sum(self.branch_lengths)


@dataclass(frozen=True, slots=True)
class SharedPromptLayout:
    """The blocks of a packed stream, end to end from offset 0 (see the module docstring)."""

    blocks: tuple[PromptBlock, ...]

    def __post_init__(self) -> None:
        offset = 0
        for block in self.blocks:
            if block.start != offset or block.prompt_length < 1 or min(block.branch_lengths, default=0) < 0:
                raise ValueError(f"SharedPromptLayout: block {block} does not continue the stream at {offset}")
            offset += block.num_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole stream."""
        return sum(block.num_tokens for block in self.blocks)


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Queries of equal shape that share one sdpa call."""

    count: int
    query_length: int
    key_length: int
    mask: torch.Tensor | None
    """[1, 1, query_length, key_length] bool (True: attend), or None for plain causal attention."""


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Index tensors that gather a stream's queries and keys group by group, and put outputs back.

    Per-sample slices would cost a full-size zero fill each in backward (SliceBackward), which is
    quadratic in the number of samples; one index_select in and one out costs O(tokens)."""

    query_order: torch.Tensor
    """[T] long: stream positions of every group's queries, group after group (a permutation)."""
    key_order: torch.Tensor
    """[K] long: stream positions of every group's keys (a prompt's once per answer that reads it)."""
    inverse: torch.Tensor
    """[T] long: where each stream position landed in query_order."""
    groups: tuple[AttentionGroup, ...]


def _answer_mask(prompt_length: int, answer_length: int, sliding_window: int | None,
                 device: torch.device) -> torch.Tensor:
    """[1, 1, m, p + m] bool: answer token j (position p + j) sees key k (position k) iff k <= p + j,
    and, under a sliding window w, k > p + j - w."""
    query_positions = torch.arange(answer_length, device=device)[:, None] + prompt_length
    key_positions = torch.arange(prompt_length + answer_length, device=device)[None, :]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    return visible[None, None]


def _sliding_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, L, L] bool: causal, and each query sees only its `window` latest keys (itself included)."""
    offsets = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return ((offsets >= 0) & (offsets < window))[None, None]


def _prompt_mask(length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """None (plain causal attention) unless a sliding window is shorter than the prompt."""
    if sliding_window is None or length <= sliding_window:
        return None
    return _sliding_window_mask(length, sliding_window, device)


def attention_plan(layout: SharedPromptLayout, sliding_window: int | None, device: torch.device) -> AttentionPlan:
    """Group a layout's prompts by length and its answers by (prompt length, answer length). A
    layout of blocks without answers is a stream of whole samples (packed_attention's)."""
    prompts: dict[int, list[int]] = {}  # prompt length -> the prompts' starts
    answers: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (p, m) -> (prompt starts, answer starts)
    for block in layout.blocks:
        prompts.setdefault(block.prompt_length, []).append(block.start)
        offset = block.start + block.prompt_length
        for length in block.branch_lengths:
            if length:
                prompt_starts, answer_starts = answers.setdefault((block.prompt_length, length), ([], []))
                prompt_starts.append(block.start)
                answer_starts.append(offset)
            offset += length
    query_pieces: list[torch.Tensor] = []
    key_pieces: list[torch.Tensor] = []
    groups: list[AttentionGroup] = []
    for length, starts in prompts.items():
        positions = _spans(starts, length)
        query_pieces.append(positions.flatten())
        key_pieces.append(positions.flatten())
        groups.append(AttentionGroup(len(starts), length, length, _prompt_mask(length, sliding_window, device)))
    for (prompt_length, length), (prompt_starts, answer_starts) in answers.items():
        queries = _spans(answer_starts, length)
        query_pieces.append(queries.flatten())
        key_pieces.append(torch.cat([_spans(prompt_starts, prompt_length), queries], dim=1).flatten())
        groups.append(AttentionGroup(len(answer_starts), length, prompt_length + length,
                                     _answer_mask(prompt_length, length, sliding_window, device)))
    order = torch.cat(query_pieces)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return AttentionPlan(query_order=order.to(device), key_order=torch.cat(key_pieces).to(device),
                         inverse=inverse.to(device), groups=tuple(groups))


def _spans(starts: list[int], length: int) -> torch.Tensor:
    """[len(starts), length] long: the stream positions of spans of `length` tokens at `starts`."""
    return torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(length, dtype=torch.long)[None, :]


def run_attention_plan(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       plan: AttentionPlan, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> torch.Tensor:
    """The plan's groups through transformers' sdpa, one call each. query: [T, H, D]; key, value:
    [T, H_kv, D] (a stream's tokens; GQA left to transformers' sdpa). Returns [T, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)  # each group says itself: causal without a mask, else the mask
    heads, head_dim = query.shape[1:]
    q_groups = torch.split(query.index_select(0, plan.query_order), [g.count * g.query_length for g in plan.groups])
    k_groups, v_groups = (torch.split(t.index_select(0, plan.key_order), [g.count * g.key_length for g in plan.groups])
                          for t in (key, value))
    outputs = []
    for group, q_group, k_group, v_group in zip(plan.groups, q_groups, k_groups, v_groups):
        # [n * L, H, D] -> [n, H, L, D]
        q_group = q_group.view(group.count, group.query_length, heads, head_dim).transpose(1, 2)
        k_group, v_group = (g.view(group.count, group.key_length, g.shape[1], head_dim).transpose(1, 2)
                            for g in (k_group, v_group))
        out, _ = sdpa_attention_forward(module, q_group, k_group, v_group, group.mask, dropout=dropout,
                                        scaling=scaling, is_causal=group.mask is None, **kwargs)  # [n, L, H, D]
        outputs.append(out.reshape(group.count * group.query_length, heads, head_dim))
    return torch.cat(outputs).index_select(0, plan.inverse)


# The plan of the last layout seen: every decoder layer (and a checkpointed layer's recompute)
# receives the same layout object, so a forward builds its index tensors once, not per layer.
_last_plan: tuple[SharedPromptLayout, int | None, torch.device, AttentionPlan] | None = None


def _plan_of(layout: SharedPromptLayout, sliding_window: int | None, device: torch.device) -> AttentionPlan:
    global _last_plan
    cached = _last_plan
    if cached is not None and cached[0] is layout and cached[1] == sliding_window and cached[2] == device:
        return cached[3]
    plan = attention_plan(layout, sliding_window, device)
    _last_plan = (layout, sliding_window, device, plan)
    return plan


def shared_prompt_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: SharedPromptLayout,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a shared-prompt stream. query: [1, H, T, D]; key, value: [1, H_kv, T, D]
    (GQA left to transformers' sdpa, as packed_sdpa_attention does). Returns ([1, T, H, D], None)."""
    batch, heads, length, head_dim = query.shape
    if batch != 1 or length != layout.num_tokens or key.shape[2] != length:
        raise ValueError(f"shared_prompt_attention: a [1, H, {layout.num_tokens}, D] stream and its own keys expected, "
                         f"got query {tuple(query.shape)} and key {tuple(key.shape)}")
    plan = _plan_of(layout, sliding_window, query.device)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = run_attention_plan(module, q, k, v, plan, dropout=dropout, scaling=scaling, **kwargs)
    return out.view(1, length, heads, head_dim), None
