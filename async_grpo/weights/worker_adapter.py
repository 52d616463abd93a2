"""LoRA updates into a generation worker's engine, each as a new vLLM adapter.

A LoRA policy's updates (`WeightUpdate.is_adapter`) are loaded as a new `LoRARequest` (a fresh
id per version) once the run's STABLE marker names them, and served from the next request on;
requests started before the switch finish on their adapter, which is then removed
(served_adapters.AdapterBook). The adapter's PEFT folder is the trainer's (lora_files) or one
reassembled from the object store into shared memory, checked for room first. An engine that
held pushed full weights gets the checkpoint's own back first (worker_object_store.py): every
adapter is trained on the checkpoint.

Worker side: vLLM is imported when an adapter is loaded, not at import.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from async_grpo.inference.generation_stats import GenerationStats
from async_grpo.inference.served_weights import ServedWeights
from async_grpo.weights.adapter_files import UnstableVersionError, check_stable, write_adapter_folder
from async_grpo.weights.update import WeightUpdate
from async_grpo.weights.worker_bucket_files import adapter_dir_path, check_free_space
from async_grpo.weights.worker_loader import assemble_state_dict, fetch_shards
from async_grpo.weights.worker_object_store import ObjectStoreReloader

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class AdapterLoader:
    """Loads a LoRA update as a new vLLM adapter and serves it from the next request on (the
    worker's end of the adapter transport, a transport.WeightReceiver).

    Only a version the STABLE marker names is loaded (UnstableVersionError otherwise; the worker
    keeps serving its adapter and stays healthy). No pause: requests in flight finish on the
    adapter they started with, which is removed from the engine once they have.
    """

    def __init__(self, worker_name: str, *, max_lora_rank: int, served: ServedWeights, stats: GenerationStats,
                 reloader: ObjectStoreReloader, on_engine_error: Callable[[BaseException], None],
                 files_owner: str | None = None) -> None:
        """max_lora_rank: the engine's EngineConfig.max_lora_rank (0: it serves no adapters);
        reloader: restores the checkpoint's weights over pushed ones; on_engine_error: the
        worker's check that fails it when an engine call raised because the engine died;
        files_owner: the name its adapter folders go under (default worker_name)."""
        self.worker_name = worker_name
        self.files_owner = files_owner or worker_name
        self._max_lora_rank = max_lora_rank
        self._served = served
        self._stats = stats
        self._reloader = reloader
        self._on_engine_error = on_engine_error

    async def init_engine(self, engine: AsyncLLM) -> None:
        """Nothing to ready: vLLM takes adapters once started with max_lora_rank > 0."""

    async def receive(self, engine: AsyncLLM, update: WeightUpdate) -> None:
        """Load `update`'s adapter; the engine serves it (and its version) to new requests after."""
        from vllm.lora.request import LoRARequest

        check_adapter_rank(self.worker_name, update, self._max_lora_rank)
        began = time.perf_counter()
        try:
            await asyncio.to_thread(check_stable, update)
        except UnstableVersionError:
            self._stats.unstable_updates_refused += 1
            raise
        if self._served.holds_pushed_weights:
            await self._reloader.restore_checkpoint(engine, update.version)
        folder, temporary = await adapter_folder(self.worker_name, update, self.files_owner)
        try:
            adapter_id = self._served.adapters.new_id()
            request = LoRARequest(lora_name=f"policy-v{update.version}-{adapter_id}", lora_int_id=adapter_id,
                                  lora_path=str(folder))
            try:
                await engine.add_lora(request)  # reads the folder now, into the engine's adapter cache
            except Exception as exc:
                self._on_engine_error(exc)
                raise
        finally:
            if temporary:
                await asyncio.to_thread(shutil.rmtree, folder, True)
        await self._served.adapters.replace(replacement=request)
        self._served.version = update.version
        self._stats.weight_updates += 1
        logger.info("%s: adapter v%d (%s) loaded in %.2f s", self.worker_name, update.version, update.mode,
                    time.perf_counter() - began)


def check_adapter_rank(worker_name: str, update: WeightUpdate, max_lora_rank: int) -> None:
    """ValueError unless the engine serves adapters (max_lora_rank > 0) of the update's rank."""
    if not max_lora_rank:
        raise ValueError(f"{worker_name}: got a LoRA update but serves no adapters (max_lora_rank 0): "
                         f"start generation workers with --max_lora_rank >= the trainer's model.lora.r")
    rank = int(json.loads(update.adapter_config or "{}").get("r", 0))
    if rank > max_lora_rank:
        raise ValueError(f"{worker_name}: adapter rank {rank} exceeds max_lora_rank {max_lora_rank}")


async def adapter_folder(worker_name: str, update: WeightUpdate, files_owner: str | None = None) -> tuple[Path, bool]:
    """(PEFT folder holding the update's adapter, whether it is a temporary copy of ours).

    lora_files: the trainer's folder as is. gather/sharded: every rank's shards fetched from
    the object store and reassembled by their placement, written to shared memory under
    `files_owner` (default: the worker's name; ray_access.shared_memory_owner in a cluster).
    """
    if update.mode == "lora_files":
        if update.adapter_path is None:
            raise ValueError(f"{worker_name}: lora_files update v{update.version} has no adapter_path")
        return Path(update.adapter_path), False
    folder = adapter_dir_path(files_owner or worker_name, update.version)
    shards = await fetch_shards(update)

    def assemble_and_write() -> None:
        tensors = assemble_state_dict(shards)
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        check_free_space(folder.parent, needed, f"{worker_name}'s adapter v{update.version}")
        write_adapter_folder(tensors, update.adapter_config or "", folder)

    try:
        await asyncio.to_thread(assemble_and_write)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, True
