"""What a weight push carries between the trainer and the workers: the `WeightUpdate` record and
its tensors as `TensorBlob`s.

An update is one of three kinds, by `WeightUpdate.mode`, and every worker loads all three:

- "gather": rank 0 gathers the full (unsharded) state dict and `ray.put`s it as one shard.
- "sharded": every FSDP rank `ray.put`s its own shards (no gather on rank 0); a worker fetches
  all ranks' objects and puts each tensor's pieces back together by the dim and offset each
  records (a fan-in: no rank holds the whole model, for full weights).
- "lora_files": a LoRA adapter as a PEFT folder on a shared filesystem (adapter_files.py).

Tensors are stored as raw uint8 numpy buffers plus dtype and shape: numpy has no bfloat16, and
plain buffers let Ray hand them over zero-copy from shared memory. Nothing here unpickles data of
its own; Ray's serialisation carries the object refs. Shared by both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from setup_model import MODEL_DTYPES

# Dtypes a blob can carry: every model dtype, plus integer buffers (e.g. position ids).
BLOB_DTYPES: dict[str, torch.dtype] = {**MODEL_DTYPES, "int64": torch.int64, "int32": torch.int32}


@dataclass(slots=True)
class TensorBlob:
    """One tensor (or one rank's piece of it along its sharded dim) as a raw byte buffer."""

    data: np.ndarray
    """uint8 buffer of the piece's bytes (C-contiguous)."""
    dtype: str
    """Key of BLOB_DTYPES, e.g. 'bfloat16'."""
    shape: tuple[int, ...]
    """Shape of this piece."""
    global_shape: tuple[int, ...]
    """Shape of the full tensor the piece belongs to."""
    offset: int = 0
    """Index along shard_dim of the full tensor where this piece starts."""
    shard_dim: int = 0
    """The dim the full tensor is cut along (its DTensor placement Shard(shard_dim)); FSDP2
    shards on dim 0 unless told otherwise (LoRA A matrices: dim 1, fsdp_setup)."""


@dataclass(slots=True)
class WeightUpdate:
    """A new weight version for inference workers: object refs to dicts of name -> TensorBlob."""

    version: int
    """Weight version (optimizer steps taken) these weights correspond to."""
    shard_refs: list[Any] = field(default_factory=list)
    """Ray ObjectRefs, one per publishing rank; each resolves to dict[str, TensorBlob]."""
    mode: str = "gather"
    """'gather' (one full shard from rank 0), 'sharded' (one shard per FSDP rank) or
    'lora_files' (no shards: the adapter is a folder on a shared filesystem, adapter_path)."""
    initial: bool = False
    """A run's first push: workers take it whatever version they serve (they may hold a newer
    version from an earlier run); later pushes must not go backwards."""
    adapter_config: str | None = None
    """LoRA updates: the PEFT adapter_config.json text (rank, alpha, target modules), and the
    shards hold only adapter tensors under PEFT names; None: a full-weights update."""
    adapter_path: str | None = None
    """lora_files mode: the PEFT-format folder (<run_dir>/weights/step_N) holding this version."""
    marker_path: str | None = None
    """LoRA updates: the STABLE marker (<run_dir>/weights/STABLE); workers load the update only
    while the marker names its version and shards (check_stable)."""

    @property
    def is_adapter(self) -> bool:
        """True for a LoRA adapter update (workers load it as a new adapter, not as weights)."""
        return self.adapter_config is not None


def tensor_to_blob(tensor: torch.Tensor, global_shape: tuple[int, ...] | None = None, offset: int = 0,
                   shard_dim: int = 0) -> TensorBlob:
    """Copy a tensor to CPU and wrap its bytes; global_shape defaults to the tensor's own."""
    cpu = tensor.detach().to("cpu").contiguous()
    dtype_name = str(cpu.dtype).removeprefix("torch.")
    if dtype_name not in BLOB_DTYPES:
        raise ValueError(f"a weight update cannot carry dtype {cpu.dtype}")
    # reshape first: a 0-dim tensor cannot be viewed as bytes of another element size
    data = cpu.reshape(-1).view(torch.uint8).numpy() if cpu.numel() else np.empty(0, dtype=np.uint8)
    return TensorBlob(
        data=data.reshape(-1),
        dtype=dtype_name,
        shape=tuple(cpu.shape),
        global_shape=tuple(global_shape if global_shape is not None else cpu.shape),
        offset=offset,
        shard_dim=shard_dim,
    )


def state_dict_to_blobs(state_dict: Mapping[str, torch.Tensor]) -> dict[str, TensorBlob]:
    """Full tensors -> blobs (the 'gather' mode payload)."""
    return {name: tensor_to_blob(t) for name, t in state_dict.items()}


def blob_tensor(blob: TensorBlob) -> torch.Tensor:
    """A blob's piece as a tensor viewing its bytes (no copy): tensor_to_blob's inverse."""
    dtype = BLOB_DTYPES[blob.dtype]
    if not blob.data.size:
        return torch.empty(blob.shape, dtype=dtype)
    return torch.from_numpy(blob.data).view(dtype).reshape(blob.shape)

