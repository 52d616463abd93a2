"""Packed attention without flash-attn: causal sdpa per packed sample, plugged into transformers.

A packed stream lays several samples end to end in one row, each sample's positions restarting
at 0 and no attention mask. `register_packed_sdpa` adds PACKED_SDPA to transformers' attention
and mask interfaces; a model loaded with attn_implementation=PACKED_SDPA then attends within
each sample only, at the cost of sum(len_i^2) instead of the [T, T] block mask plain "sdpa" builds.

`varlen_kwargs` computes a packed forward's sample boundaries once (cu_seq_lens_q/k,
max_length_q/k: the names transformers' flash-attention path takes); TokenLogprobModel passes
them down to every layer, so flash-attention does not rebuild them from position ids (a host
sync) in each layer, and PACKED_SDPA reads its samples from them too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from async_grpo.model.context_parallel import CONTEXT_SHARD_KWARG, ulysses_attention
from async_grpo.model.prompt_sharing import (
    SHARED_PROMPT_LAYOUT_KWARG, AttentionPlan, PromptBlock, SharedPromptLayout, attention_plan, run_attention_plan,
    shared_prompt_attention,
)

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


VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The keyword arguments of a packed forward's sample boundaries, as transformers' flash-attention
path (modeling_flash_attention_utils._flash_attention_forward) takes them from the decoder."""


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """Sample boundaries of a packed [1, T] (or [T]) position-id tensor, for the decoder's kwargs.

    cu_seq_lens_q/k: int32 [num_samples + 1] on position_ids' device, the cumulative lengths
    (0, len_0, len_0 + len_1, ..., T); max_length_q/k: the longest sample, a Python int (flash-attn
    takes it so; computing it here is the forward's one host sync). Samples start where a
    position is not its predecessor + 1 (packed_segments).
    """
    flat = position_ids.reshape(1, -1)
    segments = packed_segments(flat, 1)
    cu = torch.tensor([*segments.starts, flat.shape[1]], dtype=torch.int32).to(position_ids.device)
    longest = max(segments.lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _segments_from_cu(cu_seq_lens: torch.Tensor) -> PackedSegments:
    bounds = cu_seq_lens.tolist()
    return PackedSegments(starts=tuple(bounds[:-1]), lengths=tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])))


# Layout of the last position-id tensor seen, keyed on the tensor object and its in-place
# version: every decoder layer (and gradient checkpointing's recompute) receives the same tensor,
# so a forward pays packed_segments' host sync, and builds its attention plan, once rather than
# once per layer. A single tuple, so threads that forward concurrently (the logprob worker) at
# worst recompute it. The dict holds plans per (device, sliding window), filled on first use.
_last_layout: tuple[torch.Tensor, int, int, PackedSegments, dict[tuple[torch.device, int | None], AttentionPlan]] | None = None


def _layout_of(
    key: torch.Tensor, batch_size: int, from_cu: bool = False
) -> tuple[torch.Tensor, int, int, PackedSegments, dict[tuple[torch.device, int | None], AttentionPlan]]:
    """The cache entry for `key` (position ids, or cu_seq_lens when from_cu), recomputed unless
    given the same, unmodified tensor."""
    global _last_layout
    cached = _last_layout
    version = _version_of(key)
    if cached is not None and cached[0] is key and cached[1] == version and cached[2] == batch_size:
        return cached
    segments = _segments_from_cu(key) if from_cu else packed_segments(key, batch_size)
    _last_layout = (key, version, batch_size, segments, {})
    return _last_layout


def _version_of(tensor: torch.Tensor) -> int:
    """The tensor's in-place version; tensors made under inference_mode (the logprob worker's
    varlen_kwargs) keep no counter, and are taken as unmodified (nothing edits them in place)."""
    return 0 if tensor.is_inference() else tensor._version


def _segments_of(key: torch.Tensor, batch_size: int, from_cu: bool = False) -> PackedSegments:
    """packed_segments (or the cu_seq_lens' segments), reusing the last result when given the
    same, unmodified tensor."""
    return _layout_of(key, batch_size, from_cu)[3]


def _plan_of(key: torch.Tensor, batch_size: int, device: torch.device, sliding_window: int | None,
             from_cu: bool = False) -> AttentionPlan:
    """The attention plan of _segments_of(key, batch_size, from_cu), each sample a block of its own
    (prompt_sharing.attention_plan: samples grouped by length), built once per forward, device and window."""
    _, _, _, segments, plans = _layout_of(key, batch_size, from_cu)
    if (device, sliding_window) not in plans:
        whole = SharedPromptLayout(blocks=tuple(PromptBlock(start=start, prompt_length=length, branch_lengths=())
                                                for start, length in zip(segments.starts, segments.lengths)))
        plans[device, sliding_window] = attention_plan(whole, sliding_window, device)
    return plans[device, sliding_window]


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
    layer forwards, position_ids [B or 1, T] among them, and cu_seq_lens_q when the caller
    computed the samples once (varlen_kwargs): then the samples are read from it, or a
    SharedPromptLayout (prompt_sharing: answers that share their prompt), which it runs, or a
    ContextShard (context_parallel: this rank's tokens of a stream split over ranks). Returns ([B, T, H, D], None) like
    transformers' sdpa_attention_forward, which it defers to when there is a mask to honour,
    no position ids, a KV cache (queries and keys differ in length) or non-causal attention.
    Samples of equal length share one batched sdpa call.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shard = kwargs.pop(CONTEXT_SHARD_KWARG, None)
    if shard is not None:  # this rank's share of a split stream: Ulysses around this same attention
        return ulysses_attention(packed_sdpa_attention, module, query, key, value, shard, dropout=dropout,
                                 scaling=scaling, sliding_window=sliding_window, **kwargs)
    layout = kwargs.pop(SHARED_PROMPT_LAYOUT_KWARG, None)
    if layout is not None and attention_mask is None and query.shape[2] == key.shape[2]:
        return shared_prompt_attention(module, query, key, value, layout, dropout=dropout, scaling=scaling,
                                       sliding_window=sliding_window, **kwargs)
    position_ids = kwargs.get("position_ids")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2] or not causal:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, length, head_dim = query.shape
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    from_cu = cu_seq_lens is not None
    key_tensor = cu_seq_lens if from_cu else position_ids
    segments = _segments_of(key_tensor, batch, from_cu)
    if len(segments.starts) == batch and (sliding_window is None or length <= sliding_window):
        # One sample per row: exactly plain causal sdpa.
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)

    # [B, H, T, D] -> [B * T, H, D]: undoes the decoder's transpose, a view in the usual layout.
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], head_dim) for t in (query, key, value))
    plan = _plan_of(key_tensor, batch, query.device, sliding_window, from_cu)
    out = run_attention_plan(module, q, k, v, plan, dropout=dropout, scaling=scaling, **kwargs)
    return out.view(batch, length, heads, head_dim), None


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


PACKED_VARLEN = "packed_varlen"
"""attn_implementation name of torch's own flash-attention varlen kernel
(torch.nn.attention.varlen.varlen_attn, CUDA only) on a packed stream, registered by
register_packed_varlen: flash-attention's cost without the flash-attn package (the GPU machine
has torch but not flash-attn). It needs the samples' boundaries in the layer's kwargs
(VARLEN_KWARGS, which TokenLogprobModel passes) and defers to PACKED_SDPA otherwise (and on the
CPU, where the kernel does not exist)."""


@functools.cache
def _varlen_causal_kwargs() -> dict[str, Any]:
    """How this torch's varlen_attn is told to be causal: torch 2.13 takes a window (-1, 0),
    earlier releases is_causal. Read once: the attention runs in every layer of every forward."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {"window_size": (-1, 0)}


def packed_varlen_attention(
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
    """AttentionInterface entry for PACKED_VARLEN: one causal varlen_attn call over the packed
    stream. Shapes as packed_sdpa_attention; key/value heads are repeated to the query's (GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    shard = kwargs.pop(CONTEXT_SHARD_KWARG, None)
    if shard is not None:  # as in packed_sdpa_attention
        return ulysses_attention(packed_varlen_attention, module, query, key, value, shard, dropout=dropout,
                                 scaling=scaling, sliding_window=sliding_window, **kwargs)
    cu_seq_lens, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    plain = attention_mask is None and query.shape[2] == key.shape[2] and sliding_window is None and dropout == 0.0
    # varlen_attn has CUDA kernels only: elsewhere PACKED_SDPA computes the same attention. A
    # shared-prompt stream comes without cu_seq_lens (its answers are not causal runs): PACKED_SDPA too.
    if cu_seq_lens is None or longest is None or not plain or query.shape[0] != 1 or not query.is_cuda:
        return packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     sliding_window=sliding_window, **kwargs)
    _, heads, length, head_dim = query.shape
    repeat = heads // key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens, cu_seq_lens, longest, longest,
                      scale=scaling, **_varlen_causal_kwargs())
    return out.view(1, length, heads, head_dim), None


def register_packed_varlen() -> None:
    """Register PACKED_VARLEN with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PACKED_VARLEN, packed_varlen_attention)
    AttentionMaskInterface.register(PACKED_VARLEN, packed_sdpa_mask)


def register_packed_sdpa() -> None:
    """Register PACKED_SDPA with transformers' attention and mask interfaces (idempotent).

    from_pretrained(attn_implementation=PACKED_SDPA) validates the name against
    AttentionInterface, so this must run first in every process (load_causal_lm does it).
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
