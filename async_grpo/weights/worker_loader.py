"""The workers' one object-store loader: an update's shards fetched, assembled into full tensors
and loaded into a plain model.

Every worker fetches an update with `fetch_shards`: the generation worker's receivers
(worker_object_store.py, worker_adapter.py) and the logprob worker alike. `iter_assembled` then
gives (HF name, full tensor) one at a time, each assembled only when reached (a 'gather'
update's one shard holds whole tensors; a 'sharded' update's pieces, cut along the dim each
records, are put back together), so a consumer that drops each tensor before taking the next
holds one full tensor beyond the shards. They are streamed into a plain model by
`load_streamed_into` (logprob worker) or cut into buckets for vLLM's weight-transfer API
(worker_object_store.py); `assemble_state_dict` builds them all at once. `iter_state_dict` /
`fetch_state_dict` do the same outside an event loop (tests, tools); `iter_checkpoint_tensors`
reads a checkpoint folder's own tensors.

The records and the blobs' byte format are update.py's; the trainer's side is trainer_gather.py.
Worker side.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from async_grpo.weights.hf_checkpoint import hf_tensors
from async_grpo.weights.update import BLOB_DTYPES, TensorBlob, WeightUpdate, blob_tensor


def _pieces_by_name(shards: Iterable[Mapping[str, TensorBlob]]) -> dict[str, list[TensorBlob]]:
    """Every tensor's pieces from all shards, by name, in the order names first appear."""
    pieces: dict[str, list[TensorBlob]] = {}
    for shard in shards:
        for name, blob in shard.items():
            pieces.setdefault(name, []).append(blob)
    return pieces


def _assemble_along(name: str, blobs: list[TensorBlob], dim: int) -> torch.Tensor:
    """One full tensor from pieces cut along `dim` > 0 (concatenated in offset order); ValueError
    naming the weight if they do not tile that dim of the global shape exactly."""
    global_shape = tuple(blobs[0].global_shape)
    if not 0 < dim < len(global_shape):
        raise ValueError(f"weight {name}: shard dim {dim} is outside its shape {global_shape}")
    position = 0
    for blob in blobs:
        other_dims = tuple(s for d, s in enumerate(blob.shape) if d != dim)
        expected = tuple(s for d, s in enumerate(global_shape) if d != dim)
        if blob.offset != position or len(blob.shape) != len(global_shape) or other_dims != expected:
            raise ValueError(
                f"weight {name}: piece at index {blob.offset} of dim {dim} with shape {tuple(blob.shape)} does not "
                f"continue indices 0-{position} of {global_shape}"
            )
        position += blob.shape[dim]
    if position != global_shape[dim]:
        raise ValueError(f"weight {name}: pieces cover {position} of {global_shape[dim]} indices of dim {dim}")
    return torch.cat([blob_tensor(b) for b in blobs], dim=dim)


def _assemble_tensor(name: str, blobs: list[TensorBlob]) -> torch.Tensor:
    """One full tensor from its pieces, by the dim each was cut along (TensorBlob.shard_dim).

    Dim-0 pieces are copied once each into their rows of a fresh buffer, as numpy byte copies (a
    plain memcpy, faster than torch's copy_ on one thread, which is what a Ray actor gets);
    pieces along another dim are concatenated along it. Raises ValueError naming the weight if
    its pieces do not tile that dim of its global shape exactly (a gap, an overlap, a wrong
    shape in the other dims, mixed dtypes or mixed shard dims).
    """
    blobs = sorted(blobs, key=lambda b: b.offset)
    global_shape = tuple(blobs[0].global_shape)
    dtypes = {b.dtype for b in blobs}
    if len(dtypes) != 1:
        raise ValueError(f"weight {name}: pieces have mixed dtypes {sorted(dtypes)}")
    shard_dims = {b.shard_dim for b in blobs}
    if len(shard_dims) != 1:
        raise ValueError(f"weight {name}: pieces are cut along different dims {sorted(shard_dims)}")
    if blobs[0].shard_dim != 0:
        return _assemble_along(name, blobs, blobs[0].shard_dim)
    dtype = BLOB_DTYPES[blobs[0].dtype]
    out = np.empty(int(np.prod(global_shape)) * dtype.itemsize, dtype=np.uint8)
    if not global_shape:  # a scalar travels whole
        out[:] = blobs[0].data
    else:
        row_bytes = int(np.prod(global_shape[1:])) * dtype.itemsize
        row = 0
        for blob in blobs:
            if blob.offset != row or tuple(blob.shape[1:]) != global_shape[1:]:
                raise ValueError(
                    f"weight {name}: piece at row {blob.offset} with shape {tuple(blob.shape)} does not "
                    f"continue rows 0-{row} of {global_shape}"
                )
            rows = blob.shape[0]
            out[row * row_bytes : (row + rows) * row_bytes] = blob.data
            row += rows
        if row != global_shape[0]:
            raise ValueError(f"weight {name}: pieces cover {row} of {global_shape[0]} rows")
    if not out.size:  # numpy's empty buffer cannot be viewed as another dtype
        return torch.empty(global_shape, dtype=dtype)
    return torch.from_numpy(out).view(dtype).reshape(global_shape)


def iter_assembled(shards: Iterable[Mapping[str, TensorBlob]], views: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every weight in the shards, assembled one at a time.

    Each tensor is a fresh, writable buffer built only when the iteration reaches it, so beyond
    the shards themselves a consumer that drops each tensor before taking the next holds one
    full tensor at a time. Errors as _assemble_tensor, raised when the bad weight is reached.
    views: a tensor that travelled whole (a 'gather' update's) comes as a read-only view of its
    blob instead, with no copy, for consumers that only copy it on (into a model, a bucket).
    """
    for name, blobs in _pieces_by_name(shards).items():
        whole = views and len(blobs) == 1 and tuple(blobs[0].shape) == tuple(blobs[0].global_shape)
        yield name, _read_only_view(blobs[0]) if whole else _assemble_tensor(name, blobs)


def _read_only_view(blob: TensorBlob) -> torch.Tensor:
    """blob_tensor of a blob Ray mapped read-only from its store; torch warns that it cannot
    protect such memory from writes, which views=True callers promise not to make."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return blob_tensor(blob)


def assemble_state_dict(shards: Iterable[Mapping[str, TensorBlob]]) -> dict[str, torch.Tensor]:
    """Every tensor's pieces from all shards, each assembled into a full tensor (iter_assembled)."""
    return dict(iter_assembled(shards))


def fetch_state_dict(update: WeightUpdate) -> dict[str, torch.Tensor]:
    """Fetch every shard of an update from Ray's object store and assemble full tensors."""
    return dict(iter_state_dict(update))


async def fetch_shards(update: WeightUpdate) -> list[dict[str, TensorBlob]]:
    """Every rank's shard of an update, from Ray's object store: what both workers load from
    (iter_assembled, update_shapes, assemble_state_dict). Awaited, not ray.get: a blocking get
    would stall the actor's event loop while the shards arrive. Ray maps them from its
    shared-memory store without copying. Objects that are gone (their owner, a trainer rank,
    exited) raise ray.exceptions.ObjectLostError here, before anything is loaded."""
    import asyncio

    return list(await asyncio.gather(*update.shard_refs))


def iter_state_dict(update: WeightUpdate, views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every weight of an update, one tensor assembled at a time.

    Both modes: a 'gather' update's one shard holds whole tensors, a 'sharded' update's pieces
    are concatenated per tensor. The shards are fetched first (Ray maps them from its
    shared-memory object store without copying); only the tensor being yielded is built in this
    process, so a consumer that streams each one into a model (e.g. vLLM's reload_weights) and
    drops it never holds a second full copy of the weights. views: as iter_assembled's.
    """
    import ray  # imported here so the pure helpers above work without Ray installed

    yield from iter_assembled(ray.get(list(update.shard_refs)), views=views)


def iter_checkpoint_tensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight in a checkpoint folder's *.safetensors files, in name
    order (which keeps each decoder layer's tensors together, as reload_buckets needs), one
    tensor read at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors weights to restore")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        where = {name: handle for handle in handles for name in handle.keys()}
        for name in sorted(where):
            yield name, where[name].get_tensor(name)


def _check_names_and_shapes(where: str, targets: Mapping[str, torch.Tensor],
                            shapes: Mapping[str, tuple[int, ...]]) -> None:
    """KeyError naming missing and unexpected names, ValueError on a shape that differs from the
    model's: checked before anything is copied."""
    missing = sorted(targets.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - targets.keys())
    if missing or unexpected:
        raise KeyError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")
    for name, target in targets.items():
        if tuple(shapes[name]) != tuple(target.shape):
            raise ValueError(f"{where}: {name} has shape {tuple(shapes[name])}, model expects {tuple(target.shape)}")


def load_state_dict_into(causal_lm: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full HF-named tensors into a plain HF model, in place (strict).

    Tied embeddings take one tensor ('model.embed_tokens.weight'), which updates lm_head too;
    an extra 'lm_head.weight' for a tied model is reported as unexpected. Raises KeyError naming
    missing and unexpected keys, ValueError on a shape mismatch; nothing is copied on error.
    """
    targets = hf_tensors(causal_lm)
    _check_names_and_shapes("load_state_dict_into", targets,
                            {name: tuple(tensor.shape) for name, tensor in state_dict.items()})
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(state_dict[name])


def update_shapes(shards: Iterable[Mapping[str, TensorBlob]]) -> dict[str, tuple[int, ...]]:
    """The full shape of every tensor in an update's shards, read from their metadata (nothing
    assembled): what a streamed load checks before it copies anything."""
    return {name: tuple(blobs[0].global_shape) for name, blobs in _pieces_by_name(shards).items()}


def load_streamed_into(causal_lm: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                       named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy a stream of full HF-named tensors into a plain HF model, in place, one at a time (the
    stream may assemble each only when reached: iter_assembled); returns how many were copied.

    `shapes` (update_shapes) is checked first, as load_state_dict_into checks its dict: missing
    or unexpected names raise KeyError, a shape mismatch ValueError, and nothing is copied. A
    stream that then disagrees with `shapes` raises ValueError part-way (the model holds a mix).
    """
    targets = hf_tensors(causal_lm)
    _check_names_and_shapes("load_streamed_into", targets, shapes)
    copied = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in targets or tuple(tensor.shape) != tuple(targets[name].shape):
                raise ValueError(f"load_streamed_into: the stream's {name} {tuple(tensor.shape)} is not in its shapes")
            targets[name].copy_(tensor)
            copied.add(name)
    if copied != targets.keys():
        raise ValueError(f"load_streamed_into: the stream lacked {sorted(targets.keys() - copied)[:3]}")
    return len(copied)
