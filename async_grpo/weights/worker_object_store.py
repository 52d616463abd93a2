"""Full weights into a generation worker's engine through our object-store weight transport.

An object-store push (an `update.WeightUpdate`, EngineTransferConfig.weight_transfer 'object_store')
is streamed into the engine through vLLM's weight-transfer API: start_weight_update, one
update_weights per bucket of whole decoder layers, finish_weight_update. The update's shards are
fetched by worker_loader.fetch_shards (the loader the logprob workers use too), and each bucket
is copied from them into an anonymous memory file (worker_bucket_files.BucketBuffer) that the
engine-core process maps and loads from (worker_transfer_backend.ObjectStoreWeightTransferEngine).
The checkpoint's own weights are restored the same way, from model_path, before a LoRA adapter
goes onto an engine that held pushed full weights (worker_adapter.py).

Worker side: vLLM is imported when a bucket is sent, not at import.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Iterator, Literal

from async_grpo.config.worker_options import OBJECT_STORE_TRANSFER
from async_grpo.inference.generation_stats import GenerationStats
from async_grpo.inference.served_weights import ServedWeights
from async_grpo.routing.worker_lifecycle import WorkerLifecycle
from async_grpo.weights.update import WeightUpdate
from async_grpo.weights.worker_bucket_files import BucketBuffer, reload_buckets
from async_grpo.weights.worker_loader import fetch_shards, iter_assembled, iter_checkpoint_tensors

if TYPE_CHECKING:
    import torch
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

Bucket = tuple[dict[str, "torch.Tensor"], bool]
"""(HF name -> tensor, is_last): one reload call's tensors (worker_bucket_files.reload_buckets)."""


async def _next_bucket(buckets: Iterator[Bucket]) -> Bucket | None:
    """The next bucket, assembled off the event loop (it copies bytes out of the object store)."""
    return await asyncio.to_thread(next, buckets, None)


async def _send_bucket(engine: AsyncLLM, worker_name: str, bucket: dict[str, torch.Tensor]) -> None:
    """Hand one bucket to the engine (vLLM's update_weights) through an anonymous memory file."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    buffer = await asyncio.to_thread(BucketBuffer, worker_name, bucket)
    try:
        await engine.update_weights(WeightTransferUpdateRequest(update_info=buffer.update_info))
    finally:
        buffer.close()


class ObjectStoreReloader:
    """Loads full weights into the engine in buckets, within one paused weight-transfer session:
    a pushed WeightUpdate (`receive`: the worker's end of the object-store transport, a
    transport.WeightReceiver), or the checkpoint's own weights (`restore_checkpoint`).

    A load that fails part-way leaves the engine with a mix of versions: the worker then enters
    FAILED (WorkerFailedError), and its dispatcher replaces it.
    """

    def __init__(self, worker_name: str, *, model_path: str, weight_transfer: str, bucket_bytes: int,
                 pause_mode: Literal["keep", "wait"], served: ServedWeights, stats: GenerationStats,
                 life: WorkerLifecycle) -> None:
        """model_path: the checkpoint the engine loaded; weight_transfer: its EngineConfig.
        weight_transfer; bucket_bytes: GenerationWorkerConfig.weight_reload_bucket_bytes."""
        self.worker_name = worker_name
        self._model_path = model_path
        self._weight_transfer = weight_transfer
        self._bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        """vLLM's pause_generation mode during a load (GenerationWorkerConfig.weight_update_pause_mode)."""
        self._served = served
        self._stats = stats
        self._life = life

    async def init_engine(self, engine: AsyncLLM) -> None:
        """Ready a new engine's object-store backend (no rendezvous: each update names its own
        memory files). vLLM's CUDA engines are initialised by the trainer's side instead."""
        if self._weight_transfer == OBJECT_STORE_TRANSFER:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))

    async def receive(self, engine: AsyncLLM, update: WeightUpdate) -> None:
        """Load a full-weight update from the object store; the engine serves its version after.
        Objects gone before anything was loaded raise ObjectLostError and leave the worker healthy."""
        if self._weight_transfer != OBJECT_STORE_TRANSFER:
            raise ValueError(f"{self.worker_name}: a WeightUpdate travels through the object store, but this engine "
                             f"takes weights by EngineTransferConfig.weight_transfer {self._weight_transfer!r}")
        began = time.perf_counter()
        # Objects gone (ObjectLostError) fail the fetch before anything is loaded: the engine still
        # serves its version intact, and the error is not this worker's fault.
        shards = await fetch_shards(update)
        # views: a tensor that travelled whole is copied straight from the object store into its bucket.
        buckets = reload_buckets(iter_assembled(shards, views=True), self._bucket_bytes)
        try:
            num_buckets = await self._reload_paused(engine, buckets, update.version)
        except Exception as exc:
            raise self._life.fail(f"weight update to v{update.version} failed: {type(exc).__name__}: {exc}") from exc
        self._stats.weight_updates += 1
        await self._served.full_weights_loaded()
        logger.info(
            "%s: weights v%d loaded in %.2f s (%d reload buckets)",
            self.worker_name, update.version, time.perf_counter() - began, num_buckets,
        )

    async def restore_checkpoint(self, engine: AsyncLLM, version: int) -> None:
        """Reload model_path's own weights (the base every LoRA run trains on) over full weights a
        previous push left in the engine, in the same paused, bucketed way as a push."""
        began = time.perf_counter()
        buckets = reload_buckets(iter_checkpoint_tensors(self._model_path), self._bucket_bytes)
        try:
            await self._reload_paused(engine, buckets, version)
        except Exception as exc:
            raise self._life.fail(f"restoring {self._model_path}'s weights before a LoRA adapter failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
        self._served.holds_pushed_weights = False
        self._stats.base_restores += 1
        logger.warning("%s: the engine held pushed full weights; reloaded %s's own weights before the LoRA adapter "
                       "v%d (%.2f s)", self.worker_name, self._model_path, version, time.perf_counter() - began)

    async def _reload_paused(self, engine: AsyncLLM, buckets: Iterator[Bucket], version: int) -> int:
        """Hold new requests back, stream every bucket through one weight-transfer session (vLLM's
        start_weight_update / update_weights / finish_weight_update), clear the prefix cache,
        label the version, let requests in again; returns the bucket count.

        No step ever runs on a mix of two versions' layers. With requests running, scheduling
        stays paused across all buckets (vLLM's pause_generation, which clears the caches).
        With none (`ServedWeights.inflight` 0 once new ones are held back: between the steps of a
        synchronous run), nothing can reach the engine until the load ends, so the pause is
        skipped: it costs a fixed 20 ms sleep for in-flight outputs (AsyncLLM.pause_generation in
        vLLM 0.32), a third of the load part of the demo's 1.2 MB push (58 ms); the prefix cache is
        reset after the load instead. Either way, cached KV computed with the old weights is never reused, and
        requests arriving meanwhile wait, so the version they record is the one they run on.
        The first bucket is assembled before the session starts (starting it takes the engine's
        layers apart for reloading), so an update that cannot be cut leaves the engine serving
        its version intact.
        """
        self._served.accepting.clear()
        pause = self._served.inflight > 0
        try:
            if pause:
                await engine.pause_generation(mode=self.pause_mode, clear_cache=True)
            try:
                # Assembling a bucket reads the object store and copies bytes: off the event loop.
                item = await _next_bucket(buckets)
                await engine.start_weight_update()
                count = 0
                while item is not None:
                    await _send_bucket(engine, self.worker_name, item[0])
                    count += 1
                    del item
                    item = await _next_bucket(buckets)
                await engine.finish_weight_update(str(version))
                if not pause and not await engine.reset_prefix_cache():
                    raise RuntimeError("vLLM could not reset its prefix cache after the weight load")
                self._served.switch_version(version)
                return count
            finally:
                if pause:
                    await engine.resume_generation()
        finally:
            self._served.accepting.set()
