"""How trainer weights reach inference workers and disk: the records and tensors of weight publishing.

Out of the trainer: `gather_full_state_dict` (rank 0 gets full tensors), `local_shard_blobs`
(each FSDP rank its own rows) and `export_hf_checkpoint` (a Hugging Face folder on disk).
`trainer_pusher.WeightPusher` runs one push per weight version; both publishing modes produce the
same `WeightUpdate` record, so workers have one loading path:

- "gather": rank 0 gathers the full (unsharded) state dict and `ray.put`s it as one shard.
- "sharded": every FSDP rank `ray.put`s its own dim-0 shards (no gather on rank 0); a worker
  fetches all ranks' objects and concatenates each tensor's pieces in dim-0 offset order
  (a fan-in: no rank holds the whole model, for full weights).

Pushes carry the serving dtype (`trainer_pusher.resolve_push_dtype`: bf16 when the trainer computes in bf16,
else fp32), cast on each rank before anything leaves it; checkpoints keep the fp32 weights.

A LoRA policy (model.lora) pushes only its adapter, under PEFT names, in the same two modes or
as a PEFT folder on a shared filesystem ("lora_files"). Pieces record the dim they were cut
along (FSDP2 shards LoRA A matrices on dim 1), and workers reassemble by it. Every LoRA push is
made loadable by the STABLE marker (<run_dir>/weights/STABLE, written atomically by rank 0 once
every part is in place): workers load only a version it names (`check_stable`).

Into a worker: worker_loader.py assembles an update's pieces into full tensors (one at a
time) and loads them into a plain model; the pieces decode with `blob_tensor`.

Tensors are stored as raw uint8 numpy buffers plus dtype and shape: numpy has no bfloat16, and
plain buffers let Ray hand them over zero-copy from shared memory. Nothing here unpickles data of
its own; Ray's serialisation carries the object refs."""

from __future__ import annotations

import copy
import logging
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from setup_model import LORA_ADAPTER_NAME, MODEL_DTYPES, TokenLogprobModel

logger = logging.getLogger(__name__)

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
        raise ValueError(f"weight_sync cannot carry dtype {cpu.dtype}")
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


def write_safetensors(state_dict: Mapping[str, torch.Tensor], path: Path) -> Path:
    """Write tensors to a safetensors file atomically (temp name, then rename), with the 'pt'
    format tag that transformers' loader checks."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------------------------
# Out of the trainer: gather, per-rank shards, Hugging Face export (in: worker_loader.py).
# --------------------------------------------------------------------------------------------

# Attribute prefix of the causal LM inside TokenLogprobModel; HF checkpoint names lack it.
_WRAPPER_PREFIX = "causal_lm."
_ADAPTER_NAME = LORA_ADAPTER_NAME
# Files copied verbatim from the source checkpoint on export: everything a tokenizer (and
# generation defaults) may be made of, but never weights or config, which export writes itself.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
WEIGHTS_FILE = "model.safetensors"  # a single-file checkpoint, as from_pretrained and vLLM expect


def _hf_name(name: str) -> str:
    """Checkpoint name of a parameter of TokenLogprobModel (or of a bare causal LM)."""
    return name.removeprefix(_WRAPPER_PREFIX)


def hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under HF names, each tied tensor once.

    state_dict lists a tied tensor under every name; only the first is kept, which for a causal
    LM is 'model.embed_tokens.weight' (the input embedding is registered before lm_head), the
    name tied HF checkpoints store. safetensors refuses to save one tensor twice anyway.
    """
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[_hf_name(name)] = tensor
    return tensors


def _is_main_process() -> bool:
    """Rank 0, or the only process when no process group exists (e.g. the logprob worker)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathers a DTensor (collective), returns a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _cast_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
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
    return _gather_to_main(hf_tensors(model), dtype, bucket_bytes)


def _gather_to_main(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
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
        item_dtype = _cast_dtype(tensor, dtype)
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
    """This rank's own piece of every weight (no communication), as weight_sync blobs.

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
            piece = local.to(_cast_dtype(local, dtype))
            blobs[name] = tensor_to_blob(piece, global_shape=tuple(tensor.shape), offset=offset, shard_dim=dim)
    return blobs


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside a TokenLogprobModel (or the model itself)."""
    return model.causal_lm if isinstance(model, TokenLogprobModel) else model


def inference_config(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> Any:
    """A copy of the model's HF config as a saved folder stores it: KV cache on (training turned
    it off; inference engines want it back) and the dtype of the saved tensors."""
    config = copy.deepcopy(unwrap_causal_lm(model).config)
    config.use_cache = True
    config.dtype = next(iter(weights.values())).dtype
    return config


def write_hf_folder(weights: Mapping[str, torch.Tensor], config: Any, out: Path, source_model_path: str) -> None:
    """config.json, model.safetensors and the source's tokenizer files: a loadable HF folder."""
    config.save_pretrained(out)
    write_safetensors(dict(weights), out / WEIGHTS_FILE)
    source = Path(source_model_path)
    for file_name in TOKENIZER_FILES:
        if (source / file_name).is_file():
            shutil.copy2(source / file_name, out / file_name)


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


# --------------------------------------------------------------------------------------------
# LoRA adapters: PEFT-format tensors and folders, and the STABLE readiness marker.
# --------------------------------------------------------------------------------------------

# PEFT's file names (peft.utils.constants): what PeftModel.from_pretrained and vLLM's LoRA loader read.
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# The readiness marker under <run_dir>/weights/, and the folders of lora_files mode beside it.
STABLE_MARKER_FILE = "STABLE"
WEIGHTS_SUBDIR = "weights"
_ADAPTER_STEP_DIR = "step_{version:06d}"


def _peft_model(model: nn.Module) -> Any:
    """The PeftModel inside a TokenLogprobModel (or the model itself); TypeError if not one."""
    from peft import PeftModel

    inner = unwrap_causal_lm(model)
    if not isinstance(inner, PeftModel):
        raise TypeError(f"expected a LoRA (PEFT) policy, got {type(inner).__name__}: is model.lora.r set?")
    return inner


def is_lora_model(model: nn.Module) -> bool:
    """True when the policy carries PEFT adapters (fsdp_setup wrapped it under model.lora)."""
    # A PeftModel exists only once peft is imported: a full-weights run never imports it (~0.14
    # CPU-s of every trainer rank's start).
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(unwrap_causal_lm(model), peft.PeftModel)


def adapter_named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters (DTensors under FSDP) by their PEFT-format names, as
    adapter_model.safetensors stores them (the adapter name dropped: 'base_model.model.model.
    layers.0.self_attn.q_proj.lora_A.weight'). PEFT's own get_peft_model_state_dict does the
    naming, so the files match what PeftModel.save_pretrained would write."""
    from peft import get_peft_model_state_dict

    peft_model = _peft_model(model)
    trainable = {_hf_name(name): p for name, p in model.named_parameters() if p.requires_grad}
    return get_peft_model_state_dict(peft_model, state_dict=trainable)


def adapter_config_json(model: nn.Module) -> str:
    """adapter_config.json of the policy's adapter, as PeftModel.save_pretrained writes it
    (inference_mode true; sets as sorted lists)."""
    import json

    config = copy.deepcopy(_peft_model(model).peft_config[_ADAPTER_NAME])
    config.inference_mode = True
    values = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return json.dumps(values, indent=2, sort_keys=True)


def gather_adapter(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """Full CPU copies of the adapter tensors under PEFT names on rank 0 (None elsewhere).
    Collective, like gather_full_state_dict; adapters are small (a few MB for r=16 on 7B)."""
    return _gather_to_main(adapter_named_tensors(model), dtype)


def local_adapter_blobs(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, TensorBlob]:
    """This rank's own piece of every adapter tensor (no communication), cut along its DTensor
    placement's dim, under PEFT names. Adapter parameters are all FSDP-sharded, so every rank
    contributes a piece of each (possibly empty); iter_assembled over all ranks' dicts rebuilds
    gather_adapter."""
    blobs: dict[str, TensorBlob] = {}
    with torch.no_grad():
        for name, tensor in adapter_named_tensors(model).items():
            local, dim, offset = local_piece(name, tensor.detach())
            piece = local.to(_cast_dtype(local, dtype))
            blobs[name] = tensor_to_blob(piece, global_shape=tuple(tensor.shape), offset=offset, shard_dim=dim)
    return blobs


def write_adapter_folder(tensors: Mapping[str, torch.Tensor], config_json: str, out: Path) -> Path:
    """A PEFT-format adapter folder: adapter_config.json + adapter_model.safetensors (each file
    written atomically), loadable with PeftModel.from_pretrained and by vLLM's LoRARequest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(dict(tensors), out / ADAPTER_WEIGHTS_FILE)
    tmp = out / (ADAPTER_CONFIG_FILE + ".tmp")
    tmp.write_text(config_json)
    tmp.replace(out / ADAPTER_CONFIG_FILE)
    return out


def weights_dir(run_dir: str | Path) -> Path:
    """<run_dir>/weights: the STABLE marker and (lora_files mode) the adapter folders."""
    return Path(run_dir) / WEIGHTS_SUBDIR


def adapter_step_dir(weights_root: Path, version: int) -> Path:
    """The lora_files folder of one version: <run_dir>/weights/step_000012."""
    return Path(weights_root) / _ADAPTER_STEP_DIR.format(version=version)


@dataclass(frozen=True, slots=True)
class StableMarker:
    """What <run_dir>/weights/STABLE says: the one version workers may load, and its parts."""

    version: int
    """The fully published weight version."""
    mode: str
    """The push mode that published it ('gather', 'sharded' or 'lora_files')."""
    shards: tuple[str, ...]
    """Its parts: the Ray object ids (hex) of every rank's shard, or the adapter folder's path."""


class UnstableVersionError(RuntimeError):
    """An update the STABLE marker does not name (missing, another version, other shards)."""


def update_parts(update: WeightUpdate) -> tuple[str, ...]:
    """The parts of an update as its STABLE marker lists them."""
    if update.mode == "lora_files":
        return (str(update.adapter_path),)
    return tuple(ref.hex() for ref in update.shard_refs)


def write_stable_marker(path: Path, marker: StableMarker) -> None:
    """Replace the marker atomically (write a temp file, fsync, rename): a reader sees the old
    marker or the new one, never a partial file."""
    import json
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": marker.version, "mode": marker.mode, "shards": list(marker.shards)}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_stable_marker(path: Path) -> StableMarker | None:
    """The marker at path, or None when there is none yet."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return StableMarker(version=int(data["version"]), mode=str(data["mode"]), shards=tuple(data["shards"]))


def check_stable(update: WeightUpdate) -> None:
    """Raise UnstableVersionError unless the update's STABLE marker names exactly this update
    (version and parts): a version still being published, or one replaced since, is never loaded."""
    if update.marker_path is None:
        raise UnstableVersionError(f"adapter update v{update.version} carries no STABLE marker path")
    marker = read_stable_marker(Path(update.marker_path))
    if marker is None:
        raise UnstableVersionError(f"adapter update v{update.version}: no STABLE marker at {update.marker_path}")
    if marker.version != update.version or marker.shards != update_parts(update):
        raise UnstableVersionError(
            f"adapter update v{update.version}: STABLE marker {update.marker_path} names v{marker.version} "
            f"({marker.mode}, {len(marker.shards)} parts), not this update"
        )
