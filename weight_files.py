"""The files a generation worker hands its engine: reload buckets and pushed LoRA adapters.

A push is cut into buckets of whole decoder layers (reload_buckets), each written to a
safetensors file in shared memory (weight_file_path) and loaded by the engine
(weight_reload.WeightReloadExtension). Files are named after their worker, so that whoever
outlives a killed worker (its dispatcher) can remove what it left (remove_weight_files).
No Ray, no vLLM: the dispatcher imports this to clean up.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    import torch

# tmpfs on Linux: the weights file never touches disk and is read back at memory speed.
SHARED_MEMORY_DIR = Path("/dev/shm")
_WEIGHT_FILE_PREFIX = "grpo-weights-"
_ADAPTER_DIR_PREFIX = "grpo-adapter-"
# The decoder layer an HF weight name belongs to. A push reloads whole layers at a time: vLLM
# fuses a layer's q/k/v and gate/up projections into single modules, and processes a module
# only when all of its weights arrived in the same reload call.
_DECODER_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _reload_group(name: str) -> str:
    """Tensors that must reach the engine in one reload call: a decoder layer's, or a single
    tensor outside the layers (embedding, final norm, lm_head)."""
    match = _DECODER_LAYER.match(name)
    return f"layer {match.group(1)}" if match else name


def reload_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
    """Cut a stream of (HF name, tensor) into (bucket, is_last) of at most bucket_bytes each.

    Cuts fall only between reload groups (_reload_group), so a bucket larger than bucket_bytes
    holds one group that is larger on its own. Each group's tensors must arrive together, as a
    state dict lists them; a group that reappears after its bucket was handed over raises
    ValueError, since loading it in two calls would leave its fused modules half loaded.
    """
    bucket: dict[str, torch.Tensor] = {}
    size, group = 0, None
    closed: set[str] = set()
    for name, tensor in named_tensors:
        current = _reload_group(name)
        if current in closed:
            raise ValueError(f"weight {name}: its reload group ({current}) was already sent; "
                             f"an update must list each decoder layer's tensors together")
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and current != group and size + nbytes > bucket_bytes:
            yield bucket, False
            closed.update(_reload_group(n) for n in bucket)
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
        group = current
    if bucket:
        yield bucket, True


def weights_file_dir() -> Path:
    """Where update files go: shared memory when the machine has it, else the temp dir."""
    return SHARED_MEMORY_DIR if SHARED_MEMORY_DIR.is_dir() else Path(tempfile.gettempdir())


def weight_file_path(worker_name: str, version: int) -> Path:
    """A fresh reload-bucket file of `worker_name`. Named after the worker so that whoever
    outlives it (its dispatcher) can remove what a killed worker left: remove_weight_files."""
    return weights_file_dir() / f"{_WEIGHT_FILE_PREFIX}{worker_name}-v{version}-{uuid.uuid4().hex}.safetensors"


def adapter_dir_path(worker_name: str, version: int) -> Path:
    """A fresh folder for one pushed adapter, in shared memory, named like weight_file_path."""
    return weights_file_dir() / f"{_ADAPTER_DIR_PREFIX}{worker_name}-v{version}-{uuid.uuid4().hex}"


def remove_weight_files(worker_name: str) -> list[Path]:
    """Delete the reload-bucket files `worker_name` left behind (a SIGKILL mid-update leaves one,
    gigabytes on a large model); returns what was removed. Other workers' files are untouched:
    the name is followed by '-v', so 'worker-1' never matches 'worker-10'."""
    removed = []
    for path in weights_file_dir().glob(f"{_WEIGHT_FILE_PREFIX}{worker_name}-v*.safetensors"):
        path.unlink(missing_ok=True)
        removed.append(path)
    for path in weights_file_dir().glob(f"{_ADAPTER_DIR_PREFIX}{worker_name}-v*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
