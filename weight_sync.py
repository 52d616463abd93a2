"""How trainer weights travel to inference workers: tensor blobs in Ray's object store.

Two publishing modes produce the same `WeightUpdate` record, so workers have one loading path:

- "gather": rank 0 gathers the full (unsharded) state dict and `ray.put`s it as one shard.
- "sharded": every FSDP rank `ray.put`s its own dim-0 shards (no gather on rank 0); a worker
  fetches all ranks' objects and concatenates each tensor's pieces in dim-0 offset order
  (seed 002's fan-in, for full weights).

Tensors are stored as raw uint8 numpy buffers plus dtype and shape: numpy has no bfloat16, and
plain buffers let Ray hand them over zero-copy from shared memory. Nothing here unpickles data of
its own; Ray's serialisation carries the object refs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
}


@dataclass(slots=True)
class TensorBlob:
    """One tensor (or one rank's dim-0 piece of it) as a raw byte buffer."""

    data: np.ndarray
    """uint8 buffer of the piece's bytes (C-contiguous)."""
    dtype: str
    """Key of _DTYPES, e.g. 'bfloat16'."""
    shape: tuple[int, ...]
    """Shape of this piece."""
    global_shape: tuple[int, ...]
    """Shape of the full tensor the piece belongs to."""
    dim0_offset: int = 0
    """Row of the full tensor where this piece starts."""


@dataclass(slots=True)
class WeightUpdate:
    """A new weight version for inference workers: object refs to dicts of name -> TensorBlob."""

    version: int
    """Weight version (optimizer steps taken) these weights correspond to."""
    shard_refs: list[Any] = field(default_factory=list)
    """Ray ObjectRefs, one per publishing rank; each resolves to dict[str, TensorBlob]."""
    mode: str = "gather"
    """'gather' (one full shard from rank 0) or 'sharded' (one shard per FSDP rank)."""
    initial: bool = False
    """A run's first push: workers take it whatever version they serve (they may hold a newer
    version from an earlier run); later pushes must not go backwards."""


def tensor_to_blob(tensor: torch.Tensor, global_shape: tuple[int, ...] | None = None, dim0_offset: int = 0) -> TensorBlob:
    """Copy a tensor to CPU and wrap its bytes; global_shape defaults to the tensor's own."""
    cpu = tensor.detach().to("cpu").contiguous()
    dtype_name = str(cpu.dtype).removeprefix("torch.")
    if dtype_name not in _DTYPES:
        raise ValueError(f"weight_sync cannot carry dtype {cpu.dtype}")
    # reshape first: a 0-dim tensor cannot be viewed as bytes of another element size
    data = cpu.reshape(-1).view(torch.uint8).numpy() if cpu.numel() else np.empty(0, dtype=np.uint8)
    return TensorBlob(
        data=data.reshape(-1),
        dtype=dtype_name,
        shape=tuple(cpu.shape),
        global_shape=tuple(global_shape if global_shape is not None else cpu.shape),
        dim0_offset=dim0_offset,
    )


def state_dict_to_blobs(state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorBlob]:
    """Full tensors -> blobs (the 'gather' mode payload)."""
    return {name: tensor_to_blob(t) for name, t in state_dict.items()}


def assemble_state_dict(shards: Iterable[Mapping[str, TensorBlob]]) -> dict[str, torch.Tensor]:
    """Every tensor's pieces from all shards, copied once each into its rows of a full tensor.

    The copies are numpy byte copies (a plain memcpy, faster than torch's copy_ on one thread,
    which is what a Ray actor gets). Raises ValueError naming the weight if its pieces do not tile
    dim 0 of its global shape exactly (a gap, an overlap, a wrong trailing shape, mixed dtypes).
    """
    pieces: dict[str, list[TensorBlob]] = {}
    for shard in shards:
        for name, blob in shard.items():
            pieces.setdefault(name, []).append(blob)
    full: dict[str, torch.Tensor] = {}
    for name, blobs in pieces.items():
        blobs.sort(key=lambda b: b.dim0_offset)
        global_shape = tuple(blobs[0].global_shape)
        dtypes = {b.dtype for b in blobs}
        if len(dtypes) != 1:
            raise ValueError(f"weight {name}: pieces have mixed dtypes {sorted(dtypes)}")
        dtype = _DTYPES[blobs[0].dtype]
        out = np.empty(int(np.prod(global_shape)) * dtype.itemsize, dtype=np.uint8)
        if not global_shape:  # a scalar travels whole
            out[:] = blobs[0].data
        else:
            row_bytes = int(np.prod(global_shape[1:])) * dtype.itemsize
            row = 0
            for blob in blobs:
                if blob.dim0_offset != row or tuple(blob.shape[1:]) != global_shape[1:]:
                    raise ValueError(
                        f"weight {name}: piece at row {blob.dim0_offset} with shape {tuple(blob.shape)} does not "
                        f"continue rows 0-{row} of {global_shape}"
                    )
                rows = blob.shape[0]
                out[row * row_bytes : (row + rows) * row_bytes] = blob.data
                row += rows
            if row != global_shape[0]:
                raise ValueError(f"weight {name}: pieces cover {row} of {global_shape[0]} rows")
        if out.size:
            full[name] = torch.from_numpy(out).view(dtype).reshape(global_shape)
        else:  # numpy's empty buffer cannot be viewed as another dtype
            full[name] = torch.empty(global_shape, dtype=dtype)
    return full


def fetch_state_dict(update: WeightUpdate) -> dict[str, torch.Tensor]:
    """Fetch every shard of an update from Ray's object store and assemble full tensors."""
    import ray  # imported here so the pure helpers above work without Ray installed

    return assemble_state_dict(ray.get(list(update.shard_refs)))


def write_safetensors(state_dict: Mapping[str, torch.Tensor], path: Path) -> Path:
    """Write tensors to a safetensors file atomically (temp name, then rename), with the 'pt'
    format tag that transformers' loader checks."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


SHARD_STAGER_NAME = "weight-shard-stager"  # `ray list actors` shows it next to the registries


class ShardStager:
    """Collects every trainer rank's shard ref for a version so rank 0 can announce one update.

    Refs travel inside lists, so Ray passes them as references (each rank stays the owner of its
    own shard; workers fetch it straight from that rank's object store). Plain asyncio class,
    wrapped by a Ray actor in `get_or_create_shard_stager`.
    """

    def __init__(self) -> None:
        import asyncio

        self._refs: dict[int, dict[int, Any]] = {}
        self._changed = asyncio.Condition()

    async def stage(self, version: int, rank: int, refs: list[Any]) -> None:
        """Record rank's shard ref (refs is a one-element list) for a version."""
        async with self._changed:
            self._refs.setdefault(version, {})[rank] = refs[0]
            self._changed.notify_all()

    async def collect(self, version: int, world_size: int, timeout_s: float) -> list[Any]:
        """Wait until all world_size ranks staged `version`; return their refs in rank order."""
        import asyncio

        async def all_staged() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self._refs.get(version, {})) >= world_size)

        try:
            await asyncio.wait_for(all_staged(), timeout_s)
        except asyncio.TimeoutError:
            have = sorted(self._refs.get(version, {}))
            raise TimeoutError(
                f"{SHARD_STAGER_NAME}: version {version} has shards from ranks {have} of {world_size} "
                f"after {timeout_s:.0f} s"
            ) from None
        by_rank = self._refs.pop(version)
        return [by_rank[r] for r in range(world_size)]


def get_or_create_shard_stager(namespace: str):
    """The named shard-staging actor of this run (created by the first rank that asks)."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_concurrency=64)(ShardStager)
    return actor_cls.options(name=SHARD_STAGER_NAME, namespace=namespace, get_if_exists=True).remote()
