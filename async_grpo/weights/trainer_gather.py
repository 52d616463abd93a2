"""Out of the trainer: the policy's tensors collected from its FSDP shards, for a push or a checkpoint.

`gather_full_state_dict` gives rank 0 full tensors (a "gather" push, an HF export),
`local_shard_blobs` each rank its own pieces (a "sharded" push, no communication), and
`export_hf_checkpoint` writes a Hugging Face folder. Pushes carry the serving dtype
(trainer_pusher.resolve_push_dtype: bf16 when the trainer computes in bf16, else fp32), cast on
each rank before anything leaves it; checkpoints keep the fp32 weights. Pieces record the dim
they were cut along (FSDP2 shards LoRA A matrices on dim 1), and workers reassemble by it
(worker_loader.py). Trainer side.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from async_grpo.weights.hf_checkpoint import hf_tensors, inference_config, write_hf_folder
from async_grpo.weights.update import TensorBlob, tensor_to_blob

logger = logging.getLogger(__name__)


def _is_main_process() -> bool:
    """Rank 0, or the only process when no process group exists (e.g. the logprob worker)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathers a DTensor (collective), returns a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def cast_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a published copy of `tensor` takes: `dtype` for floating-point tensors, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


GATHER_BUCKET_BYTES = 16 * 2**20
"""Most bytes of full tensors (gathered dtype) one all-gather carries when weights are gathered to
rank 0: per-tensor collectives were most of the demo model's push (27 tensors: 23.7 ms, bucketed
3.3 ms). A tensor this big or bigger is bandwidth-bound and goes alone through torch's own gather,
which copies less (benchmarks/RESULTS.md, "The push in milliseconds")."""


def gather_full_state_dict(model: nn.Module, *, dtype: torch.dtype | None = None,
                           bucket_bytes: int = GATHER_BUCKET_BYTES) -> dict[str, torch.Tensor] | None:
    """Full, unsharded CPU copies of every weight under HF names, on rank 0; None elsewhere.

    Collective: every rank must call it. FSDP's shards are all-gathered in buckets of up to
    bucket_bytes of full tensors (any other tensor alone), so peak extra memory is one bucket or
    one full tensor, whichever is bigger. dtype casts the floating-point copies (e.g. bf16 for
    inference; integer buffers keep theirs); None keeps them.
    """
    return gather_to_main(hf_tensors(model), dtype, bucket_bytes)


def gather_to_main(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                    bucket_bytes: int = GATHER_BUCKET_BYTES) -> dict[str, torch.Tensor] | None:
    """Collective: all-gather every (possibly sharded) tensor, bucket by bucket; rank 0 keeps full
    CPU copies (floating point ones cast to dtype when given) and returns them, the others None."""
    main = _is_main_process()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for bucket in _gather_buckets(named, dtype, bucket_bytes):
            if len(bucket) == 1 and bucket[0].shard_dim is None:
                (item,) = bucket
                full = full_tensor(item.tensor)
                fulls = {item.name: full.to(device="cpu", dtype=item.dtype, copy=True)} if main else {}
            else:
                fulls = _all_gather_shards(bucket, unpack=main)
            if main:
                out.update(fulls)  # CPU copies already
    return out if main else None


@dataclass(frozen=True, slots=True)
class _GatherItem:
    """One tensor of a gather: its name, the tensor (detached), the dtype its full copy takes,
    and the dim FSDP shards it along (None: not an FSDP shard, all-gathered alone)."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype
    shard_dim: int | None


def _fsdp_shard_dim(tensor: torch.Tensor) -> int | None:
    """The dim a DTensor on a 1-D mesh with one Shard placement is cut along (FSDP2's layout);
    None for a plain tensor or any other placement."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1 or len(tensor.placements) != 1:
        return None
    placement = tensor.placements[0]
    return placement.dim if isinstance(placement, Shard) else None


def _gather_buckets(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                    bucket_bytes: int) -> Iterator[list[_GatherItem]]:
    """The tensors in order, in buckets every rank cuts alike: consecutive FSDP shards smaller than
    bucket_bytes on one mesh and device, of one gathered dtype, up to bucket_bytes of full tensors;
    any other tensor in a bucket of its own, marked unsharded (gathered by torch alone)."""
    bucket: list[_GatherItem] = []
    size = 0
    for name, tensor in named.items():
        tensor = tensor.detach()
        item_dtype = cast_dtype(tensor, dtype)
        nbytes = tensor.numel() * item_dtype.itemsize
        shard_dim = _fsdp_shard_dim(tensor) if nbytes < bucket_bytes else None
        item = _GatherItem(name, tensor, item_dtype, shard_dim)
        first = bucket[0] if bucket else None
        if first is not None and (shard_dim is None or size + nbytes > bucket_bytes or item.dtype != first.dtype
                                  or tensor.device != first.tensor.device
                                  or tensor.device_mesh != first.tensor.device_mesh):
            yield bucket
            bucket, size = [], 0
        if shard_dim is None:
            yield [item]
            continue
        bucket.append(item)
        size += nbytes
    if bucket:
        yield bucket


def _all_gather_shards(bucket: list[_GatherItem], unpack: bool) -> dict[str, torch.Tensor]:
    """Collective: every rank's pieces of a bucket's FSDP shards in one all-gather; with `unpack`
    (rank 0) the full CPU tensors in their gathered dtype, else {}.

    Each piece takes torch.chunk's rows per shard along its shard dim (moved first) in one flat
    buffer, its padding rows zero, so every rank sends the same number of elements and rank r's
    rows of a tensor start at r * rows per shard.
    """
    mesh = bucket[0].tensor.device_mesh
    world = mesh.size()
    shapes = [_padded_shape(item, world) for item in bucket]
    sizes = [math.prod(shape) for shape in shapes]
    sent = torch.empty(sum(sizes), dtype=bucket[0].dtype, device=bucket[0].tensor.device)
    for item, shape, segment in zip(bucket, shapes, sent.split(sizes)):
        local, _, _ = local_piece(item.name, item.tensor)  # checks the torch.chunk layout
        piece = local.movedim(item.shard_dim, 0)
        rows = segment.view(shape)
        rows[: piece.shape[0]].copy_(piece)  # casts to the gathered dtype
        rows[piece.shape[0]:].zero_()
    received = sent.new_empty(world * sent.numel())
    _all_gather_single(received, sent, group=mesh.get_group())
    if not unpack:
        return {}
    per_rank = received.cpu().view(world, -1)
    fulls: dict[str, torch.Tensor] = {}
    for item, shape, columns in zip(bucket, shapes, per_rank.split(sizes, dim=1)):
        # Rank r's rows follow rank r-1's: one copy into the tensor's own storage, padding rows last.
        stacked = columns.new_empty((world * shape[0], *shape[1:]))
        stacked.view(world, -1).copy_(columns)
        full = stacked[: item.tensor.shape[item.shard_dim]]
        fulls[item.name] = full if item.shard_dim == 0 else full.movedim(0, item.shard_dim).contiguous()
    return fulls


def _padded_shape(item: _GatherItem, world: int) -> tuple[int, ...]:
    """A piece's shape in the flat buffer: rows per shard along the shard dim (moved first), then the rest."""
    rest = tuple(size for dim, size in enumerate(item.tensor.shape) if dim != item.shard_dim)
    return (_rows_per_shard(item.tensor.shape[item.shard_dim], world), *rest)


# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every rank); older torch lacks the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rows_per_shard(dim_size: int, num_shards: int) -> int:
    """torch.chunk's piece length: ceil(dim_size / num_shards)."""
    return -(-dim_size // num_shards)


def fsdp_shard_extent(dim0_size: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """(offset, length) along the sharded dim of one FSDP2 shard: torch.chunk's split, trailing
    shards empty.

    torch.chunk cuts ceil(n / k)-row pieces, so with n=5, k=4 the rows are 2, 2, 1, 0.
    """
    rows_per_shard = _rows_per_shard(dim0_size, num_shards)
    offset = min(shard_index * rows_per_shard, dim0_size)
    return offset, min(rows_per_shard, dim0_size - offset)


def local_piece(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """This rank's piece of a parameter: (local tensor, the dim it is cut along, its offset
    along that dim in the full tensor), read from the DTensor's placement. A plain tensor is
    its own whole piece (dim 0, offset 0)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, 0, 0
    dim = _fsdp_shard_dim(tensor)
    if dim is None:
        raise ValueError(f"weight {name}: only 1-D FSDP meshes with one Shard(dim) placement are supported, "
                         f"got {tuple(tensor.placements)}")
    mesh = tensor.device_mesh
    local = tensor.to_local()
    offset, size = fsdp_shard_extent(tensor.shape[dim], mesh.size(), mesh.get_local_rank())
    if local.shape[dim] != size:
        raise RuntimeError(f"weight {name}: local shard has {local.shape[dim]} entries along dim {dim}, "
                           f"torch.chunk layout says {size}")
    return local, dim, offset


def local_shard_blobs(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, TensorBlob]:
    """This rank's own piece of every weight (no communication), as update.TensorBlobs.

    assemble_state_dict over all ranks' dicts rebuilds gather_full_state_dict (with the same
    dtype, which casts floating-point pieces only). Tensors FSDP does not shard (persistent
    buffers, or every tensor of a plain model) are replicated, so only rank 0 (or the only
    process) includes them, whole at offset 0: a copy from every rank would overlap.
    """
    from torch.distributed.tensor import DTensor

    main = _is_main_process()
    blobs: dict[str, TensorBlob] = {}
    with torch.no_grad():
        for name, tensor in hf_tensors(model).items():
            if not main and not isinstance(tensor, DTensor):
                continue
            local, dim, offset = local_piece(name, tensor.detach())
            piece = local.to(cast_dtype(local, dtype))
            blobs[name] = tensor_to_blob(piece, global_shape=tuple(tensor.shape), offset=offset, shard_dim=dim)
    return blobs


def export_hf_checkpoint(model: nn.Module, out_dir: str | Path, source_model_path: str | Path) -> Path | None:
    """Save the (FSDP) model as a Hugging Face checkpoint folder; collective, rank 0 writes.

    Writes config.json (the model's config, KV cache re-enabled for generation, dtype of the
    saved tensors), a single model.safetensors, and the tokenizer files of source_model_path.
    Returns the folder on rank 0, None elsewhere; all ranks return after the files exist.
    """
    state = gather_full_state_dict(model)
    out: Path | None = None
    if state is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_hf_folder(state, inference_config(model, state), out, source_model_path)
        logger.info("exported %d tensors to %s", len(state), out)
    if dist.is_initialized():
        dist.barrier()
    return out

