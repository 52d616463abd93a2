"""Packed attention without flash-attn: causal sdpa per packed sample, plugged into transformers.

A packed stream lays several samples end to end in one row, each sample's positions restarting
at 0 and no attention mask. `register_packed_sdpa` adds PACKED_SDPA to transformers' attention
and mask interfaces; a model loaded with attn_implementation=PACKED_SDPA then attends within
each sample only, at the cost of sum(len_i^2) instead of the [T, T] block mask plain "sdpa" builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PACKED_SDPA = "packed_sdpa"
"""attn_implementation name of the packed-aware sdpa below, as registered by register_packed_sdpa.

Plain "sdpa" runs a packed stream (positions restarting, no attention_mask) as one [T, T]
attention under a block-diagonal mask that transformers materialises: T^2 work and memory.
PACKED_SDPA runs causal sdpa on each sample instead (sum of len_i^2, no mask), and defers to
plain sdpa whenever a mask is needed (padding, KV-cache decoding), so `generate` and padded
batches behave exactly as with "sdpa".
"""


@dataclass(frozen=True, slots=True)
class PackedSegments:
    """Where the samples of a (flattened) batch lie, read from its position ids."""

    starts: tuple[int, ...]
    """Offset of each sample in the flattened [B * T] token stream, ascending; starts[0] == 0."""
    lengths: tuple[int, ...]
    """Tokens in each sample; they sum to B * T."""


def packed_segments(position_ids: torch.Tensor, batch_size: int) -> PackedSegments:
    """Samples of a [B, T] (or broadcastable [1, T]) position-id tensor, rows laid end to end.

    A sample starts at every row start and wherever a position is not its predecessor + 1 (a
    restart at 0 in our packed streams): the rule transformers' find_packed_sequence_indices
    uses to build its block mask, so both paths isolate exactly the same samples.
    """
    positions = position_ids.expand(batch_size, -1)
    is_start = torch.ones_like(positions, dtype=torch.bool)
    is_start[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    starts = is_start.flatten().nonzero().flatten().tolist()  # the one host sync of a forward
    ends = starts[1:] + [positions.numel()]
    return PackedSegments(starts=tuple(starts), lengths=tuple(end - start for start, end in zip(starts, ends)))


# Layout of the last position-id tensor seen, keyed on the tensor object and its in-place
# version: every decoder layer (and gradient checkpointing's recompute) receives the same tensor,
# so a forward pays packed_segments' host sync, and builds its length groups, once rather than
# once per layer. A single tuple, so threads that forward concurrently (the logprob worker) at
# worst recompute it. The dict holds length_groups per device, filled on first use.
_last_layout: tuple[torch.Tensor, int, int, PackedSegments, dict[torch.device, LengthGroups]] | None = None


def _layout_of(
    position_ids: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, int, int, PackedSegments, dict[torch.device, LengthGroups]]:
    """The cache entry for position_ids, recomputed unless given the same, unmodified tensor."""
    global _last_layout
    cached = _last_layout
    if (
        cached is not None
        and cached[0] is position_ids
        and cached[1] == position_ids._version
        and cached[2] == batch_size
    ):
        return cached
    _last_layout = (position_ids, position_ids._version, batch_size, packed_segments(position_ids, batch_size), {})
    return _last_layout


def _segments_of(position_ids: torch.Tensor, batch_size: int) -> PackedSegments:
    """packed_segments, reusing the last result when given the same, unmodified tensor."""
    return _layout_of(position_ids, batch_size)[3]


def _length_groups_of(position_ids: torch.Tensor, batch_size: int, device: torch.device) -> LengthGroups:
    """length_groups of _segments_of(position_ids, batch_size), built once per forward and device."""
    _, _, _, segments, by_device = _layout_of(position_ids, batch_size)
    if device not in by_device:
        by_device[device] = length_groups(segments, device)
    return by_device[device]


def _sliding_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, L, L] bool: causal, and each query sees only its `window` latest keys (itself included)."""
    offsets = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return ((offsets >= 0) & (offsets < window))[None, None]


@dataclass(frozen=True, slots=True)
class LengthGroups:
    """The tokens of a packed stream reordered so that samples of equal length sit together.

    Per-sample slices would cost a full-size zero fill each in backward (SliceBackward), which
    is quadratic in the number of samples; one index_select in and one out costs O(tokens).
    """

    order: torch.Tensor
    """[B * T] long: stream positions, grouped by sample length (a permutation)."""
    inverse: torch.Tensor
    """[B * T] long: where each stream position landed in `order`."""
    groups: tuple[tuple[int, int], ...]
    """(sample length, number of samples) of each group, in `order`'s order."""


def length_groups(segments: PackedSegments, device: torch.device) -> LengthGroups:
    """Group the samples of `segments` by length, as index tensors on `device`."""
    by_length: dict[int, list[int]] = {}
    for start, length in zip(segments.starts, segments.lengths):
        by_length.setdefault(length, []).append(start)
    pieces, groups = [], []
    for length, starts in by_length.items():
        offsets = torch.arange(length, dtype=torch.long)
        pieces.append((torch.tensor(starts, dtype=torch.long)[:, None] + offsets[None, :]).flatten())
        groups.append((length, len(starts)))
    order = torch.cat(pieces)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return LengthGroups(order=order.to(device), inverse=inverse.to(device), groups=tuple(groups))


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry for PACKED_SDPA: causal sdpa on each packed sample.

    query: [B, H, T, D]; key, value: [B, H_kv, T, D] (H_kv divides H: GQA is left to sdpa's
    enable_gqa or transformers' repeat_kv, as plain sdpa does). kwargs carry what the decoder
    layer forwards, position_ids [B or 1, T] among them. Returns ([B, T, H, D], None) like
    transformers' sdpa_attention_forward, which it defers to when there is a mask to honour,
    no position ids, a KV cache (queries and keys differ in length) or non-causal attention.
    Samples of equal length share one batched sdpa call.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2] or not causal:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, length, head_dim = query.shape
    segments = _segments_of(position_ids, batch)
    if len(segments.starts) == batch and (sliding_window is None or length <= sliding_window):
        # One sample per row: exactly plain causal sdpa.
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)

    # [B, H, T, D] -> [B * T, H, D]: undoes the decoder's transpose, a view in the usual layout.
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], head_dim) for t in (query, key, value))
    plan = _length_groups_of(position_ids, batch, query.device)
    group_sizes = [segment_length * count for segment_length, count in plan.groups]
    q_groups, k_groups, v_groups = (torch.split(t.index_select(0, plan.order), group_sizes) for t in (q, k, v))
    outputs = []
    for (segment_length, count), q_group, k_group, v_group in zip(plan.groups, q_groups, k_groups, v_groups):
        # [n * L, H, D] -> [n, H, L, D]
        q_group, k_group, v_group = (g.view(count, segment_length, g.shape[1], head_dim).transpose(1, 2)
                                     for g in (q_group, k_group, v_group))
        mask = None
        if sliding_window is not None and segment_length > sliding_window:
            mask = _sliding_window_mask(segment_length, sliding_window, query.device)
        group_out, _ = sdpa_attention_forward(
            module, q_group, k_group, v_group, mask, dropout=dropout, scaling=scaling, **kwargs
        )  # [n, L, H, D]
        outputs.append(group_out.reshape(count * segment_length, heads, head_dim))
    return torch.cat(outputs).index_select(0, plan.inverse).view(batch, length, heads, head_dim), None


def packed_sdpa_mask(
    *,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    config: PretrainedConfig | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """AttentionMaskInterface entry for PACKED_SDPA: no mask for a whole, unpadded causal forward.

    That case (every query and key of the sequence present, no padding mask: training and
    logprob forwards) is where transformers would build the [T, T] block mask of a packed
    stream; packed_sdpa_attention gets the samples from position_ids instead. Anything else
    (padding, a KV cache, bidirectional models) gets transformers' own sdpa mask.
    """
    from transformers.masking_utils import sdpa_mask

    whole_causal_forward = (
        attention_mask is None
        and q_length == kv_length
        and isinstance(q_offset, int) and q_offset == 0
        and isinstance(kv_offset, int) and kv_offset == 0
        and getattr(config, "is_causal", True)
    )
    if whole_causal_forward:
        return None
    return sdpa_mask(
        q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        attention_mask=attention_mask, config=config, **kwargs,
    )


def register_packed_sdpa() -> None:
    """Register PACKED_SDPA with transformers' attention and mask interfaces (idempotent).

    from_pretrained(attn_implementation=PACKED_SDPA) validates the name against
    AttentionInterface, so this must run first in every process (load_causal_lm does it).
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
