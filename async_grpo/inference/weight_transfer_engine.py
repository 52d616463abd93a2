"""The engine side of our object-store weight transport, as a vLLM weight-transfer engine.

vLLM 0.32 loads pushed weights through its weight-transfer API (`AsyncLLM.init_weight_transfer_engine`
/ `start_weight_update` / `update_weights` / `finish_weight_update`) with pluggable backends. This
module registers ours, `OBJECT_STORE_BACKEND`, in `WeightTransferEngineFactory`. The generation
worker (a Ray actor) fetches an update from Ray's object store and writes one bucket of whole
decoder layers at a time into an anonymous memory file (weight_files.BucketBuffer, memfd: nothing
in /dev/shm); `update_weights` hands the engine that file's (pid, fd) and the tensors' byte
layout, and the engine maps it read-only and loads the tensors straight from the mapping.

Runs inside vLLM's engine-core process, which imports this module through `worker_extension_cls`
(`WeightTransferRegistration`; importing the module is what registers the backend, before vLLM
builds the engine in load_model). Keep its imports small: torch, vLLM, weight_reload.py and
weight_files.py (which reads a bucket back: read_bucket).

With one of vLLM's CUDA engines instead (EngineConfig.weight_transfer nccl / nccl_m2n / ipc) the
trainer drives the transfer (weight_transfer_trainer.py) and the generation worker passes its
calls through to its AsyncLLM (transfer_pass_through.TransferPassThrough): `EngineTransferReceiver`
(in the worker's process) holds the engine's end, in order: init (join the trainer's group),
then per push start (pause, vLLM's start_weight_update), update (receive; concurrent with the
trainer's broadcast), finish (label the version, resume).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from async_grpo.inference.weight_files import BUCKET_DTYPES, read_bucket
from async_grpo.inference.weight_reload import install_reload_warning_filter, with_tied_lm_head

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
    """Each tensor's dtype name (one of weight_files.BUCKET_DTYPES)."""
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


class TransferOrderError(RuntimeError):
    """A weight-transfer call arrived out of order (e.g. update outside a start/finish session)."""


class EngineTransferReceiver:
    """The generation worker's end of one of vLLM's CUDA weight transfers: the trainer's calls
    (weight_transfer_trainer.EngineWorkersClient) passed through to the worker's AsyncLLM.

    Order: `init` once per transfer group (again when the trainer rebuilds its group: the old
    one is shut down first), then per push `start`, one or more `update`, `finish`. A call out
    of that order raises TransferOrderError before reaching vLLM. Scheduling is paused from
    `start` to `finish` (caches cleared: KV computed with the old weights must not be reused),
    so no step runs on a mix of two versions' layers. A session that fails part-way leaves the
    engine with a mix of versions: the worker must then fail (and be replaced), never resume.
    """

    def __init__(self, engine: Any, backend: str, pause_mode: str) -> None:
        """engine: the worker's AsyncLLM; backend: its EngineConfig.weight_transfer (one of vLLM's
        CUDA engines, which vLLM knows by the same names); pause_mode: vLLM's pause_generation
        mode (GenerationWorkerConfig.weight_update_pause_mode)."""
        self._engine = engine
        self.backend = backend
        self._pause_mode = pause_mode
        self._joined = False
        self.in_session = False
        """True from `start` until `finish` returns (the engine is paused meanwhile)."""

    def describe(self) -> dict[str, Any]:
        """What the trainer plans a group with: this engine's backend and how many ranks it puts
        into the group (tensor x pipeline parallel)."""
        return {"backend": self.backend, "ranks": int(self._engine.vllm_config.parallel_config.world_size)}

    async def init(self, backend: str, init_info: dict[str, Any]) -> None:
        """Join the trainer's transfer group (init_info is vLLM's worker-side init info, with this
        engine's own rank_offset); ValueError when the trainer sends by another backend."""
        if backend != self.backend:
            raise ValueError(f"the trainer sends weights by {backend!r}, but this engine was started with "
                             f"EngineConfig.weight_transfer backend {self.backend!r}: set both to the same value")
        if self.in_session:
            raise TransferOrderError("init during a weight update: the previous update never finished")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self._joined:  # the trainer rebuilt its group (a worker joined or left): leave the old one
            await self._engine.shutdown_weight_transfer_engine()
            self._joined = False
        await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        self._joined = True

    async def start(self) -> None:
        """Pause scheduling and open a weight update (vLLM's start_weight_update)."""
        if not self._joined:
            raise TransferOrderError("start before init: this engine has joined no transfer group")
        if self.in_session:
            raise TransferOrderError("start during a weight update: the previous update never finished")
        await self._engine.pause_generation(mode=self._pause_mode, clear_cache=True)
        self.in_session = True
        await self._engine.start_weight_update()

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one chunk of the update (vLLM's update_weights; NCCL blocks until the
        trainer's broadcast of it is done)."""
        if not self.in_session:
            raise TransferOrderError("update outside a weight update: start was not called")
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish(self, version: int, on_finished: Callable[[], None] | None = None) -> None:
        """Finish the update, label the engine's weights `version`, call `on_finished` (scheduling
        still paused: the worker switches its version labels there) and resume scheduling."""
        if not self.in_session:
            raise TransferOrderError("finish outside a weight update: start was not called")
        await self._engine.finish_weight_update(str(version))
        self.in_session = False
        if on_finished is not None:
            on_finished()
        await self._engine.resume_generation()


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
