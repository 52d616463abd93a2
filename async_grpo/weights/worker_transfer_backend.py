"""The engine side of our object-store weight transport, as a vLLM weight-transfer engine.

vLLM 0.32 loads pushed weights through its weight-transfer API (`AsyncLLM.init_weight_transfer_engine`
/ `start_weight_update` / `update_weights` / `finish_weight_update`) with pluggable backends. This
module registers ours, `OBJECT_STORE_BACKEND`, in `WeightTransferEngineFactory`. The generation
worker (a Ray actor) fetches an update from Ray's object store and writes one bucket of whole
decoder layers at a time into an anonymous memory file (worker_bucket_files.BucketBuffer, memfd: nothing
in /dev/shm); `update_weights` hands the engine that file's (pid, fd) and the tensors' byte
layout, and the engine maps it read-only and loads the tensors straight from the mapping.

Runs inside vLLM's engine-core process, which imports this module through `worker_extension_cls`
(`WeightTransferRegistration`; importing the module is what registers the backend, before vLLM
builds the engine in load_model). Keep its imports small: torch, vLLM, worker_reload_fixes.py and
worker_bucket_files.py (which reads a bucket back: read_bucket).

With one of vLLM's CUDA engines instead (EngineTransferConfig.weight_transfer nccl / nccl_m2n / ipc) the
trainer drives the transfer (trainer_cuda_transfer.py) and the generation worker passes its
calls through to its AsyncLLM (worker_cuda_transfer.py, in the worker's process).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from async_grpo.weights.worker_bucket_files import BUCKET_DTYPES, read_bucket
from async_grpo.weights.worker_reload_fixes import install_reload_warning_filter, with_tied_lm_head

logger = logging.getLogger(__name__)

# The name our transport registers under in vLLM's factory (worker_options' EngineConfig.
# weight_transfer 'object_store' maps to it). Project-prefixed: vLLM's own names are plain words.
OBJECT_STORE_BACKEND = "grpo_object_store"


@dataclass
class ObjectStoreInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: every update names its own memory file."""


@dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """One bucket of an update: where its bytes are and how to cut them into tensors."""

    pid: int
    """Process (the generation worker) holding the memory file open."""
    fd: int
    """Its file descriptor in that process; the engine opens /proc/<pid>/fd/<fd>."""
    nbytes: int
    """Size of the file's used part."""
    names: list[str] = field(default_factory=list)
    """HF names of the bucket's tensors."""
    dtypes: list[str] = field(default_factory=list)
    """Each tensor's dtype name (one of worker_bucket_files.BUCKET_DTYPES)."""
    shapes: list[list[int]] = field(default_factory=list)
    """Each tensor's shape."""
    offsets: list[int] = field(default_factory=list)
    """Each tensor's first byte in the file."""

    def __post_init__(self) -> None:
        counts = {len(self.names), len(self.dtypes), len(self.shapes), len(self.offsets)}
        if len(counts) != 1:
            raise ValueError(f"BucketUpdateInfo: names/dtypes/shapes/offsets differ in length {sorted(counts)}")
        unknown = sorted(set(self.dtypes) - set(BUCKET_DTYPES))
        if unknown:
            raise ValueError(f"BucketUpdateInfo: dtypes {unknown} are not among {BUCKET_DTYPES}")


class ObjectStoreWeightTransferEngine(WeightTransferEngine[ObjectStoreInitInfo, BucketUpdateInfo]):
    """Loads buckets of HF-named tensors from the generation worker's memory files.

    One update is vLLM's layerwise reload spread over the session: `start_weight_update`
    prepares it, each `update_weights` bucket goes through `model.load_weights` (a layer is
    processed, e.g. repacked for the CPU kernels, once all its tensors arrived), and
    `finish_weight_update` finalizes what is left, so any bucket cut is safe and no step runs
    on a half-processed layer (the worker keeps scheduling paused across the session).
    """

    init_info_cls = ObjectStoreInitInfo
    update_info_cls = BucketUpdateInfo
    # The draft model of speculative decoding is not ours to update.
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ObjectStoreInitInfo) -> None:
        install_reload_warning_filter()

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        # CPU copies are done when load_weights returns; an accelerator's may still be queued.
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        tensors = with_tied_lm_head(read_bucket(dataclasses.asdict(update_info)), self.model_config.hf_text_config)
        self.model.load_weights(iter(tensors.items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Nothing held between updates."""


def register_object_store_backend() -> None:
    """Make OBJECT_STORE_BACKEND known to vLLM's factory in this process (idempotent)."""
    try:
        WeightTransferEngineFactory.register_engine(OBJECT_STORE_BACKEND, ObjectStoreWeightTransferEngine)
    except ValueError:  # already registered: this module was imported before
        pass


class WeightTransferRegistration:
    """vLLM's `worker_extension_cls`: adds no method to the worker. Naming it makes the
    engine-core process import this module, whose import registers OBJECT_STORE_BACKEND
    before vLLM creates the weight-transfer engine (worker load_model)."""


register_object_store_backend()
