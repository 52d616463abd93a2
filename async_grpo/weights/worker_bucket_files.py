"""The files a generation worker hands its engine: reload buckets and pushed LoRA adapters.

A push is cut into buckets of whole decoder layers (reload_buckets), each copied into an
anonymous memory file (BucketBuffer, memfd: no name in /dev/shm, freed when the last process
lets go of it, so a killed worker leaves nothing) and loaded by the engine through vLLM's
weight-transfer API (worker_transfer_backend.ObjectStoreWeightTransferEngine). A pushed LoRA
adapter still needs a folder, which goes to shared memory after a free-space check
(check_free_space); folders are named after their worker, so that whoever outlives a killed
worker (its dispatcher) can remove what it left (remove_weight_files).
No Ray, no vLLM: the dispatcher imports this to clean up.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

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
# Dtypes a bucket may carry (torch attribute names): the model dtypes and integer buffers.
BUCKET_DTYPES = ("float32", "bfloat16", "float16", "int64", "int32")
# Each tensor of a bucket starts on a cache-line boundary, so the engine's views of it are
# aligned for every dtype.
_TENSOR_ALIGN = 64
# madvise(2) advice value (Linux >= 5.14) that Python's mmap module does not name.
_MADV_POPULATE_READ = 22


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


class BucketBuffer:
    """One bucket of tensors in an anonymous memory file (memfd), as the engine reads it.

    `update_info` is what vLLM's update_weights carries to the engine: this process's pid and
    the file's descriptor (the engine opens /proc/<pid>/fd/<fd>) plus each tensor's name, dtype,
    shape and byte offset. A fresh file per bucket: the engine may keep viewing a bucket's
    tensors after update_weights returns (vLLM's layerwise reload holds a layer's tensors until
    the layer is complete), so a file is never rewritten; `close` drops this side's handle, and
    the memory goes when the engine's last view of it does.
    """

    def __init__(self, worker_name: str, bucket: dict[str, torch.Tensor]) -> None:
        layout, nbytes = _bucket_layout(bucket)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in bucket.values()]
        unknown = sorted(set(dtypes) - set(BUCKET_DTYPES))
        if unknown:
            raise ValueError(f"BucketBuffer: dtypes {unknown} are not among {BUCKET_DTYPES}")
        self._fd = os.memfd_create(f"{_WEIGHT_FILE_PREFIX}{worker_name}", os.MFD_CLOEXEC)
        try:
            if nbytes:
                os.ftruncate(self._fd, nbytes)  # the alignment gaps stay holes: they read as zeros
                for (_, offset, _), tensor in zip(layout, bucket.values()):
                    _write_at(self._fd, _tensor_bytes(tensor), offset)
        except BaseException:
            os.close(self._fd)
            raise
        self.update_info: dict[str, Any] = {
            "pid": os.getpid(), "fd": self._fd, "nbytes": nbytes,
            "names": [name for name, _, _ in layout],
            "dtypes": dtypes,
            "shapes": [list(t.shape) for t in bucket.values()],
            "offsets": [offset for _, offset, _ in layout],
        }

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_bucket(update_info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A BucketBuffer's tensors (from its update_info), viewing a private mapping of its file;
    what the engine side (worker_transfer_backend) loads.

    The mapping stays alive as long as any tensor views it: vLLM's layerwise reload keeps a
    layer's tensors until the whole layer arrived, then copies them into its parameters.
    """
    import torch

    dtypes = [getattr(torch, name) for name in update_info["dtypes"]]
    layout = list(zip(update_info["names"], dtypes, update_info["shapes"], update_info["offsets"]))
    if not update_info["nbytes"]:
        return {name: torch.empty(shape, dtype=dtype) for name, dtype, shape, _ in layout}
    handle = os.open(f"/proc/{update_info['pid']}/fd/{update_info['fd']}", os.O_RDONLY)
    try:
        # ACCESS_COPY: writable, as torch.frombuffer wants, yet private: nothing reaches the sender.
        mapping = mmap.mmap(handle, update_info["nbytes"], access=mmap.ACCESS_COPY)
    finally:
        os.close(handle)
    _populate_read(mapping)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    tensors = {}
    for name, dtype, shape, offset in layout:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        tensors[name] = flat[offset:offset + nbytes].view(dtype).reshape(shape)
    return tensors


def _populate_read(mapping: mmap.mmap) -> None:
    """Map every page of the bucket in one call (MADV_POPULATE_READ) instead of one page fault
    per few pages as vLLM's loaders first read them (~20% of reading a 0.5 GB bucket here).
    Read-only population keeps the mapping private: a later write still copies the page.
    Kernels before 5.14 refuse the advice; their page faults do the same work, so it is skipped."""
    try:
        mapping.madvise(_MADV_POPULATE_READ)
    except OSError:
        pass


def _bucket_layout(bucket: dict[str, torch.Tensor]) -> tuple[list[tuple[str, int, int]], int]:
    """(name, byte offset, byte size) of each tensor packed in order, and the total size."""
    layout, end = [], 0
    for name, tensor in bucket.items():
        offset = -(-end // _TENSOR_ALIGN) * _TENSOR_ALIGN
        size = tensor.numel() * tensor.element_size()
        layout.append((name, offset, size))
        end = offset + size
    return layout, end


def _write_at(fd: int, data: Any, offset: int) -> None:
    """Write a buffer's bytes to the file at offset, however many calls the kernel needs.

    pwrite, not a copy into an mmap of the file: each page first touched through a mapping
    costs a page fault that also zeroes it before the copy overwrites it, while pwrite fills
    freshly allocated memfd pages in one pass. On a 0.54 GB bucket that halved the write
    (0.55 s -> 0.25 s, on par with safetensors' file write), and the mapped write was what made
    the transfer slower than the old file path (benchmarks/weight_push.py --target engine).
    """
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    """A tensor's bytes as a flat uint8 numpy array (no copy when it is contiguous on CPU)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else flat.new_empty(0, dtype=torch.uint8).numpy()


def shm_free_bytes(folder: Path) -> int:
    """Bytes an unprivileged process may still write under `folder` (statvfs)."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


class SharedMemoryFullError(OSError):
    """Shared memory lacks the room for what a worker was about to write there."""


def check_free_space(folder: Path, needed_bytes: int, what: str,
                     free_bytes: Callable[[Path], int] = shm_free_bytes) -> None:
    """SharedMemoryFullError naming the free space and the size needed unless `folder` has
    room for `needed_bytes` (a container's /dev/shm is 64 MB unless given --shm-size)."""
    free = free_bytes(folder)
    if needed_bytes > free:
        raise SharedMemoryFullError(
            f"{folder} has {free / 2**20:.1f} MiB free, {what} needs {needed_bytes / 2**20:.1f} MiB: "
            f"give the container more shared memory (docker --shm-size) or free some")


def weights_file_dir() -> Path:
    """Where update files go: shared memory when the machine has it, else the temp dir."""
    return SHARED_MEMORY_DIR if SHARED_MEMORY_DIR.is_dir() else Path(tempfile.gettempdir())


def adapter_dir_path(worker_name: str, version: int) -> Path:
    """A fresh folder for one pushed adapter, in shared memory, named after its worker (remove_weight_files)."""
    return weights_file_dir() / f"{_ADAPTER_DIR_PREFIX}{worker_name}-v{version}-{uuid.uuid4().hex}"


def remove_weight_files(worker_name: str) -> list[Path]:
    """Delete the shared-memory files `worker_name` left behind: adapter folders, and the
    reload-bucket files of earlier versions, which wrote buckets there (a SIGKILL mid-update
    left one, gigabytes on a large model); returns what was removed. Other workers' files are
    untouched: the name is followed by '-v', so 'worker-1' never matches 'worker-10'."""
    removed = []
    for path in weights_file_dir().glob(f"{_WEIGHT_FILE_PREFIX}{worker_name}-v*.safetensors"):
        path.unlink(missing_ok=True)
        removed.append(path)
    for path in weights_file_dir().glob(f"{_ADAPTER_DIR_PREFIX}{worker_name}-v*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
