"""Context parallelism for packed streams: one minibatch's tokens split over a group of ranks.

A group of `size` ranks receives the same packed minibatch; each rank runs the decoder on its own
share of the stream's tokens (two chunks of it, zigzag: rank r holds chunks r and 2*size-1-r of
2*size near-equal chunks), so one rank's activations hold about 1/size of a long sample. Attention
is DeepSpeed-Ulysses: in every layer one all-to-all turns [my tokens, all heads] into [all tokens,
my heads]; the unchanged packed attention (packed_attention.PACKED_SDPA or PACKED_VARLEN, with
the whole stream's sample boundaries) runs on that; a second all-to-all turns it back.

Why Ulysses rather than ring attention: each head's attention is exactly the single-rank
computation over the same keys, so the result is exact for every packing, causal mask and
sliding window without merging partial softmaxes; it needs only all_to_all, which gloo implements
with uneven splits (alltoall_base, so no padding) as NCCL does, and the attention entries stay
as they are (ring attention merges blockwise partial softmaxes, which needs kernels that return
their log-sum-exps). Its cost: `size` must divide the query heads (Qwen2.5-0.5B has 14: 2, 7
or 14), and key/value heads fewer than `size` (or not a multiple of it) are repeated before the
exchange (`kv_repeat`).

Balance: under Ulysses every rank attends over the whole stream for its heads, so the causal
attention work is equal whatever tokens a rank holds; the zigzag split evens out the rest (token
counts differ by at most 2; a long sample's scored tokens spread over the group) and is the
layout a ring-attention path would need.

The collectives are injected (`ContextGroup`: the trainer builds it, fsdp_setup.context_group),
so this module stays free of torch.distributed. The loss side: `local_batch` keeps the output
tokens a rank scores, `reduce_loss_metrics` and `gather_outputs` put a minibatch's figures back
together (grpo_loss takes `ContextGroup.sum_over_group` as its `sample_sums`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo_loss import SUMMED_METRICS
from sample_processing_utils import PackedBatch

CONTEXT_SHARD_KWARG = "context_shard"
"""The decoder (and so every attention call) keyword that carries a forward's ContextShard."""

AllToAll = Callable[[list[torch.Tensor], Sequence[int]], list[torch.Tensor]]
"""Differentiable all-to-all over a group: chunks[j] ([rows_j, *trailing]) goes to rank j; returns
what each rank i sent here, [received_rows[i], *trailing] (trailing dims equal on every rank)."""


@dataclass(frozen=True, eq=False)
class ContextGroup:
    """One rank's view of its context-parallel group and the collectives the split needs."""

    size: int
    """Ranks that split each minibatch's tokens."""
    rank: int
    """This rank's index in the group, 0 .. size - 1."""
    all_to_all: AllToAll
    """Differentiable all-to-all within the group (see AllToAll)."""
    sum_over_group: Callable[[torch.Tensor], torch.Tensor]
    """Differentiable sum of a same-shaped tensor over the group (every rank gets the sum)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ContextGroup: rank {self.rank} outside a group of {self.size}")


def zigzag_positions(total: int, size: int) -> list[torch.Tensor]:
    """Per rank, the ascending stream positions it holds: chunks r and 2*size-1-r of 2*size
    chunks whose lengths differ by at most one (the first total % (2*size) get the extra token)."""
    if total < size:
        raise ValueError(f"a packed stream of {total} tokens cannot be split over {size} ranks")
    base, extra = divmod(total, 2 * size)
    bounds = [0]
    for chunk in range(2 * size):
        bounds.append(bounds[-1] + base + (chunk < extra))
    return [torch.cat([torch.arange(bounds[r], bounds[r + 1]), torch.arange(bounds[2 * size - 1 - r], bounds[2 * size - r])])
            for r in range(size)]


def kv_repeat(heads: int, kv_heads: int, size: int) -> int:
    """How many times each key/value head is repeated so that `size` ranks get whole, aligned
    shares of both query and key/value heads (1 when kv_heads is a multiple of size)."""
    if heads % size:
        raise ValueError(f"context parallelism over {size} ranks splits attention heads: {heads} query heads "
                         f"are not divisible by {size}")
    repeat = size // math.gcd(kv_heads, size)
    if heads % (kv_heads * repeat):
        raise ValueError(f"{kv_heads} key/value heads cannot be repeated to a multiple of {size} that divides "
                         f"{heads} query heads")
    return repeat


@dataclass(frozen=True, eq=False)
class ContextShard:
    """A forward's split of one packed stream over the group (built by `shard_stream`)."""

    group: ContextGroup
    counts: tuple[int, ...]
    """Tokens each rank holds."""
    positions: torch.Tensor
    """[counts[rank]] int64: the stream positions this rank holds, ascending."""
    gathered_order: torch.Tensor
    """[T] int64: the stream position of each row of the ranks' tokens laid end to end, rank by rank."""
    to_stream: torch.Tensor
    """[T] int64: the inverse permutation, gathered rows back into stream order."""
    position_ids: torch.Tensor
    """[1, T] the whole stream's position ids (the attention's samples come from them)."""
    stream_kwargs: dict[str, Any]
    """The whole stream's sample boundaries (packed_attention.varlen_kwargs)."""

    def scored_here(self, output_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([O] bool: which output tokens this rank scores, those predicted by a position it
        holds; [O_local] int64: the local rows that predict them, in output order)."""
        owned = torch.isin(output_indices, self.positions)
        return owned, torch.searchsorted(self.positions, output_indices[owned])


def shard_stream(position_ids: torch.Tensor, group: ContextGroup, stream_kwargs: dict[str, Any]) -> ContextShard:
    """Split a packed stream ([T] position ids) over the group: which tokens this rank holds and
    how the gathered tokens map back to the stream."""
    device = position_ids.device
    per_rank = zigzag_positions(position_ids.numel(), group.size)
    order = torch.cat(per_rank).to(device)
    to_stream = torch.empty_like(order)
    to_stream[order] = torch.arange(order.numel(), device=device)
    return ContextShard(group=group, counts=tuple(p.numel() for p in per_rank), positions=per_rank[group.rank].to(device),
                        gathered_order=order, to_stream=to_stream, position_ids=position_ids.reshape(1, -1),
                        stream_kwargs=stream_kwargs)


class _HeadShareModule:
    """The attention module as the inner attention reads it, with the key/value grouping of a
    rank's share of heads (which repeated key/value heads change)."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(inner: Callable[..., tuple[torch.Tensor, Any]], module: nn.Module, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, shard: ContextShard, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A layer's attention over a split stream: query [1, H, n, D] and key, value [1, H_kv, n, D]
    of this rank's n tokens in, [1, n, H, D] out. `inner` (a packed attention entry) runs on the
    whole stream for H / size heads; kwargs go to it, with the stream's positions and boundaries."""
    size, (_, heads, length, head_dim) = shard.group.size, query.shape
    repeat = kv_repeat(heads, key.shape[1], size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q_share, kv_share = heads // size, key.shape[1] // size
    # [n, size, q_share + 2 kv_share, D]: slice j of every head group, sent to rank j in one exchange.
    send = torch.cat([t[0].transpose(0, 1).reshape(length, size, -1, head_dim) for t in (query, key, value)], dim=2)
    received = shard.group.all_to_all(list(send.unbind(1)), shard.counts)
    stream = torch.cat(received).index_select(0, shard.to_stream)  # [T, q_share + 2 kv_share, D]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in stream.split([q_share, kv_share, kv_share], dim=1))
    kwargs.update(shard.stream_kwargs, position_ids=shard.position_ids)
    view = _HeadShareModule(module, q_share // kv_share) if repeat > 1 else module
    out, _ = inner(view, q, k, v, None, **kwargs)  # [1, T, q_share, D]
    pieces = out[0].index_select(0, shard.gathered_order).split(list(shard.counts))
    returned = shard.group.all_to_all(list(pieces), [length] * size)  # rank j's heads of my tokens
    return torch.cat(returned, dim=1).unsqueeze(0), None


def local_batch(batch: PackedBatch, group: ContextGroup) -> PackedBatch:
    """This rank's part of a packed minibatch for the loss: every per-output-token field cut to
    the output tokens it scores (ContextShard.scored_here), in the same order as the model's
    logprobs. Per-sample fields (output_lengths, output_lengths_per_sample, sample_index's
    values) keep whole-sample figures, so sample_mean weights stay exact; inputs stay whole."""
    total = batch.inputs.input_ids.numel()
    mine = zigzag_positions(total, group.size)[group.rank]
    owned = torch.isin(batch.inputs.output_indices, mine)

    def cut(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[owned.to(values.device)]

    return dataclasses.replace(
        batch, advantages=cut(batch.advantages), output_lengths=cut(batch.output_lengths),
        sample_index=cut(batch.sample_index), sampling_logprobs=cut(batch.sampling_logprobs),
        ref_logprobs=cut(batch.ref_logprobs), old_logprobs=cut(batch.old_logprobs),
        token_versions=cut(batch.token_versions),
    )


def reduce_loss_metrics(loss: torch.Tensor, metrics: dict[str, float], num_tokens: int,
                        group: ContextGroup) -> tuple[float, dict[str, float]]:
    """The whole minibatch's loss and grpo_loss metrics from each rank's part, in one collective:
    sums for the loss and SUMMED_METRICS, token-weighted means for the rest (num_tokens: output
    tokens this rank scored; a rank with none adds nothing, not its empty mean's nan)."""
    keys = sorted(metrics)
    parts = [float(loss.detach()), float(num_tokens)]
    for name in keys:
        value = metrics[name]
        parts.append(value if name in SUMMED_METRICS else (value * num_tokens if num_tokens else 0.0))
    with torch.no_grad():
        totals = group.sum_over_group(torch.tensor(parts, dtype=torch.float64, device=loss.device)).tolist()
    loss_sum, tokens = totals[0], totals[1]
    reduced = {name: value if name in SUMMED_METRICS else (value / tokens if tokens else float("nan"))
               for name, value in zip(keys, totals[2:])}
    return loss_sum, reduced


def gather_outputs(values: torch.Tensor, batch: PackedBatch, group: ContextGroup) -> torch.Tensor:
    """A per-output-token tensor of the whole minibatch ([O], output order, no grad) from each
    rank's local one (its local_batch's order): e.g. the entropy, for today's metrics."""
    total = batch.inputs.input_ids.numel()
    owned = torch.isin(batch.inputs.output_indices, zigzag_positions(total, group.size)[group.rank])
    with torch.no_grad():
        whole = values.new_zeros(owned.numel())
        whole[owned.to(values.device)] = values.detach()
        return group.sum_over_group(whole)
