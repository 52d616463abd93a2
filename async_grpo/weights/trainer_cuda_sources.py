"""What the trainer puts on the wire in one of vLLM's CUDA weight transfers (trainer_cuda_transfer.py).

nccl and ipc send `HFWeightSource`: the policy's tensors under HF names (each tied tensor once, as
the object store's pushes name them), each all-gathered in turn and cast to the push dtype on
its GPU. nccl_m2n sends `shard_source`: every rank's own FSDP shards, through vLLM's
DTensorModuleSource, cast the same way. `send_plan` says what one rank sends per push (logged
when a transfer group is built).

Import cost: torch only; vLLM is imported when an nccl_m2n source is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class WireMeta:
    """Name, wire dtype and full shape of one tensor (the fields of vLLM's ParamMeta, which the
    trainer engines read; duck-typed so that planning needs no vLLM)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def wire_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """What a tensor travels as: the push dtype for floating point tensors, else its own."""
    return dtype if tensor.is_floating_point() else tensor.dtype


class HFWeightSource:
    """vLLM's WeightSource contract over a (possibly FSDP-sharded) policy, under HF names and in
    the push dtype: what nccl and ipc send. The names are hf_checkpoint's (each tied tensor once,
    as HF checkpoints store it), so the engine loads the same names as from the object store.

    `metadata()` reads global shapes without gathering; iteration all-gathers each sharded
    tensor (a collective: every trainer rank iterates, in the same order) and casts it on the
    GPU that holds it.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        from async_grpo.weights.hf_checkpoint import hf_tensors

        self._tensors = hf_tensors(model)
        self._dtype = dtype

    def metadata(self) -> list[WireMeta]:
        return [WireMeta(name, wire_dtype(t, self._dtype), tuple(t.shape)) for name, t in self._tensors.items()]

    def held_names(self) -> None:
        """Every rank takes part in every tensor (vLLM's WeightSource: None is all)."""
        return None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from async_grpo.weights.trainer_gather import full_tensor

        with torch.no_grad():
            for name, tensor in self._tensors.items():
                full = full_tensor(tensor.detach())
                yield name, full.to(wire_dtype(full, self._dtype)).contiguous()


def send_plan(backend: str, rank: int, metas: Sequence[WireMeta], shard_of: Callable[[str], int | None]
              ) -> list[tuple[str, int]]:
    """What `rank` puts on the wire in one push: (name, bytes) per tensor it sends. nccl and ipc:
    rank 0 sends every tensor whole, the other ranks nothing (they only take part in the
    gathers). nccl_m2n: every rank sends its own shard of each sharded tensor (shard_of gives its
    bytes, None for a tensor FSDP does not shard), replicated tensors from every rank (m2n
    reads each destination piece from one of them)."""
    whole = [(m.name, _nbytes(m)) for m in metas]
    if backend != "nccl_m2n":
        return whole if rank == 0 else []
    return [(m.name, nbytes if (nbytes := shard_of(m.name)) is not None else _nbytes(m)) for m in metas]


def local_shard_bytes(model: nn.Module, dtype: torch.dtype) -> Callable[[str], int | None]:
    """send_plan's shard_of for this rank: the wire bytes of its own shard of each sharded
    (DTensor) weight, None for a weight it holds whole."""
    from torch.distributed.tensor import DTensor

    from async_grpo.weights.hf_checkpoint import hf_tensors

    sizes = {name: t.to_local().numel() * torch.empty((), dtype=wire_dtype(t, dtype)).element_size()
             for name, t in hf_tensors(model).items() if isinstance(t, DTensor)}
    return sizes.get


def _nbytes(meta: WireMeta) -> int:
    return int(torch.Size(meta.shape).numel()) * torch.empty((), dtype=meta.dtype).element_size()


def shard_source(model: nn.Module, dtype: torch.dtype, trainer_ranks: int) -> Any:
    """nccl_m2n's source: vLLM's DTensorModuleSource over the HF causal LM (its parameter names
    are the HF names), each local shard cast to the push dtype on its GPU."""
    from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource

    from async_grpo.weights.hf_checkpoint import unwrap_causal_lm

    class _CastShards(DTensorModuleSource):
        def metadata(self) -> list[Any]:
            return [type(m)(m.name, dtype if m.dtype.is_floating_point else m.dtype, m.shape, m.placements)
                    for m in super().metadata()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, shard in super().__iter__():
                yield name, shard.detach().to(wire_dtype(shard, dtype))

    return _CastShards(unwrap_causal_lm(model), trainer_ranks)
