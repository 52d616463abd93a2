"""A generation worker's end of the trainer's CUDA weight transfers (EngineTransferConfig.weight_transfer
nccl / nccl_m2n / ipc).

The trainer drives these transfers (trainer_cuda_transfer.EngineWeightSender) by calling the
worker actor's transfer_describe / transfer_init / transfer_start / transfer_update /
transfer_finish; `TransferPassThrough` passes each call on to the engine through
`EngineTransferReceiver`, the engine's end, in order: init (join the trainer's group), then per
push start (pause, vLLM's start_weight_update), update (receive; concurrent with the trainer's
broadcast), finish (label the version, resume); around them the worker's own bookkeeping: new
requests wait from start to finish, finish switches the served version, and a failure inside a
session (the engine then holds a mix of versions) fails the worker.

vLLM is imported on first use, not at import (the tests of the order import this module without it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from async_grpo.config.worker_options import OBJECT_STORE_TRANSFER
from async_grpo.inference.generation_stats import GenerationStats
from async_grpo.inference.served_weights import ServedWeights
from async_grpo.routing.worker_lifecycle import WorkerLifecycle

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from async_grpo.weights.update import WeightUpdate

logger = logging.getLogger(__name__)


class TransferOrderError(RuntimeError):
    """A weight-transfer call arrived out of order (e.g. update outside a start/finish session)."""


class EngineTransferReceiver:
    """The generation worker's end of one of vLLM's CUDA weight transfers: the trainer's calls
    (trainer_cuda_transfer.EngineWorkersClient) passed through to the worker's AsyncLLM.

    Order: `init` once per transfer group (again when the trainer rebuilds its group: the old
    one is shut down first), then per push `start`, one or more `update`, `finish`. A call out
    of that order raises TransferOrderError before reaching vLLM. Scheduling is paused from
    `start` to `finish` (caches cleared: KV computed with the old weights must not be reused),
    so no step runs on a mix of two versions' layers. A session that fails part-way leaves the
    engine with a mix of versions: the worker must then fail (and be replaced), never resume.
    """

    def __init__(self, engine: Any, backend: str, pause_mode: str) -> None:
        """engine: the worker's AsyncLLM; backend: its EngineTransferConfig.weight_transfer (one of vLLM's
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
                             f"EngineTransferConfig.weight_transfer backend {self.backend!r}: set both to the same value")
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


class TransferPassThrough:
    """The trainer's CUDA weight-transfer calls, passed through to this worker's engine: the
    worker's end of the CUDA transports (a transport.WeightReceiver whose versions arrive by the
    trainer's calls, describe / init / start / update / finish, never as a WeightUpdate)."""

    def __init__(self, worker_name: str, *, backend: str, pause_mode: str, engine: Callable[[], AsyncLLM],
                 served: ServedWeights, stats: GenerationStats, life: WorkerLifecycle) -> None:
        """backend: the engine's EngineTransferConfig.weight_transfer; pause_mode: vLLM's pause_generation
        mode (GenerationWorkerConfig.weight_update_pause_mode); engine: the started engine (raises
        before start)."""
        self.worker_name = worker_name
        self._backend = backend
        self._pause_mode = pause_mode
        self._engine = engine
        self._served = served
        self._stats = stats
        self._life = life
        self._receiver: EngineTransferReceiver | None = None
        """The engine's end of the transfer, built on first use."""

    def _engine_receiver(self) -> EngineTransferReceiver:
        """The engine's end of the trainer's CUDA weight transfer (built on first use)."""
        if self._backend == OBJECT_STORE_TRANSFER:
            raise ValueError(f"{self.worker_name}: this engine takes full weights from the object store "
                             "(EngineTransferConfig.weight_transfer 'object_store'), not from the trainer's GPUs")
        if self._receiver is None:
            self._receiver = EngineTransferReceiver(self._engine(), self._backend, self._pause_mode)
        return self._receiver

    def _failed(self, phase: str, exc: Exception) -> Exception:
        """A failure inside a transfer session leaves a mix of versions: the worker fails (and is
        replaced). One refused before the session opened changed nothing: raised as it is."""
        receiver = self._receiver
        if receiver is None or not receiver.in_session:
            self._served.accepting.set()
            return exc
        return self._life.fail(f"weight transfer {phase} failed: {type(exc).__name__}: {exc}")

    async def init_engine(self, engine: AsyncLLM) -> None:
        """Nothing to ready here: the trainer's `init` joins the engine to its transfer group."""

    async def receive(self, engine: AsyncLLM, update: WeightUpdate) -> None:
        """Refuse a WeightUpdate: this engine takes full weights from the trainer's GPUs."""
        raise ValueError(f"{self.worker_name}: a WeightUpdate travels through the object store, but this engine "
                         f"takes weights by EngineConfig.weight_transfer {self._backend!r}")

    def describe(self) -> dict[str, Any]:
        self._life.require_alive()
        return self._engine_receiver().describe()

    async def init(self, backend: str, init_info: dict[str, Any]) -> None:
        self._life.require_alive()
        await self._engine_receiver().init(backend, init_info)

    async def start(self) -> None:
        self._life.require_alive()
        receiver = self._engine_receiver()
        self._served.accepting.clear()  # requests arriving meanwhile wait: they record the version they run on
        try:
            await receiver.start()
        except Exception as exc:
            raise self._failed("start", exc) from exc

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._life.require_alive()
        try:
            await self._engine_receiver().update(update_info)
        except Exception as exc:
            raise self._failed("update", exc) from exc

    async def finish(self, version: int) -> int:
        """Finish the session: the engine serves `version` from now on; returns it."""
        self._life.require_alive()
        try:
            await self._engine_receiver().finish(version, on_finished=lambda: self._served.switch_version(version))
        except Exception as exc:
            raise self._failed("finish", exc) from exc
        self._served.accepting.set()
        self._stats.weight_updates += 1
        await self._served.full_weights_loaded()
        logger.info("%s: weights v%d loaded by %s", self.worker_name, version, self._backend)
        return self._served.version
