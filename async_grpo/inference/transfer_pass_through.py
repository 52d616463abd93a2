"""A generation worker's end of the trainer's CUDA weight transfers (EngineConfig.weight_transfer
nccl / nccl_m2n / ipc).

The trainer drives these transfers (weight_transfer_trainer.EngineWeightSender) by calling the
worker actor's transfer_describe / transfer_init / transfer_start / transfer_update /
transfer_finish; `TransferPassThrough` passes each call on to the engine through
weight_transfer_engine.EngineTransferReceiver, around the worker's own bookkeeping: new requests
wait from start to finish, finish switches the served version, and a failure inside a session
(the engine then holds a mix of versions) fails the worker.

Worker side: the receiver (and with it vLLM) is imported on first use, not at import.
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

    from async_grpo.inference.weight_transfer_engine import EngineTransferReceiver

logger = logging.getLogger(__name__)


class TransferPassThrough:
    """The trainer's CUDA weight-transfer calls, passed through to this worker's engine."""

    def __init__(self, worker_name: str, *, backend: str, pause_mode: str, engine: Callable[[], AsyncLLM],
                 served: ServedWeights, stats: GenerationStats, life: WorkerLifecycle) -> None:
        """backend: the engine's EngineConfig.weight_transfer; pause_mode: vLLM's pause_generation
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
                             "(EngineConfig.weight_transfer 'object_store'), not from the trainer's GPUs")
        if self._receiver is None:
            from async_grpo.inference.weight_transfer_engine import EngineTransferReceiver

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
