"""The LoRA adapters a generation worker serves: which adapter new requests run with, how many
requests each has in flight (a replaced adapter leaves the engine once its last request ends),
the rank check of an incoming adapter, and its PEFT folder (the trainer's, or one reassembled
from the object store into shared memory, checked for room first).

Worker side: imported by vllm_worker.py; vLLM is only named for type checking.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from async_grpo.inference.weight_files import adapter_dir_path, check_free_space
from async_grpo.weights.weight_loading import iter_state_dict
from async_grpo.weights.weight_sync import WeightUpdate, write_adapter_folder

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


class AdapterBook:
    """Which LoRA adapter new requests run with, and how many requests each adapter has in
    flight: a replaced adapter leaves the engine (`remove`, given its id) once its last request
    has finished."""

    def __init__(self, remove: Callable[[int], Awaitable[None]]) -> None:
        self._remove = remove
        self.current: LoRARequest | None = None
        """The adapter new requests run with (None: the engine's own weights)."""
        self._next_id = 1  # vLLM reserves id 0 for "no adapter"
        self._requests: dict[int, int] = {}
        """In-flight requests per adapter id."""
        self._retired: set[int] = set()
        """Replaced adapters still finishing requests: removed from the engine when the last ends."""

    def new_id(self) -> int:
        """A fresh adapter id (vLLM identifies a loaded adapter by it)."""
        self._next_id += 1
        return self._next_id - 1

    def acquire(self) -> LoRARequest | None:
        """The current adapter, counted as one more request in flight on it."""
        adapter = self.current
        if adapter is not None:
            self._requests[adapter.lora_int_id] = self._requests.get(adapter.lora_int_id, 0) + 1
        return adapter

    async def replace(self, replacement: LoRARequest | None = None) -> None:
        """Serve `replacement` (None: the engine's own weights) from the next request on; the
        adapter served so far is removed once its requests in flight have finished."""
        previous, self.current = self.current, replacement
        if previous is not None:
            self._retired.add(previous.lora_int_id)
            await self.release(previous.lora_int_id, finished=0)

    async def release(self, adapter_id: int, finished: int = 1) -> None:
        """Count `finished` requests of an adapter as done; a replaced adapter with none left in
        flight is removed from the engine (its memory is freed; nothing can ask for it again)."""
        left = self._requests.get(adapter_id, 0) - finished
        self._requests[adapter_id] = left
        if left > 0 or adapter_id not in self._retired:
            return
        self._retired.discard(adapter_id)
        self._requests.pop(adapter_id, None)
        await self._remove(adapter_id)


def check_adapter_rank(worker_name: str, update: WeightUpdate, max_lora_rank: int) -> None:
    """ValueError unless the engine serves adapters (max_lora_rank > 0) of the update's rank."""
    if not max_lora_rank:
        raise ValueError(f"{worker_name}: got a LoRA update but serves no adapters (max_lora_rank 0): "
                         f"start generation workers with --max_lora_rank >= the trainer's model.lora.r")
    rank = int(json.loads(update.adapter_config or "{}").get("r", 0))
    if rank > max_lora_rank:
        raise ValueError(f"{worker_name}: adapter rank {rank} exceeds max_lora_rank {max_lora_rank}")


async def adapter_folder(worker_name: str, update: WeightUpdate) -> tuple[Path, bool]:
    """(PEFT folder holding the update's adapter, whether it is a temporary copy of ours).

    lora_files: the trainer's folder as is. gather/sharded: every rank's shards fetched from
    the object store and reassembled by their placement, written to shared memory.
    """
    if update.mode == "lora_files":
        if update.adapter_path is None:
            raise ValueError(f"{worker_name}: lora_files update v{update.version} has no adapter_path")
        return Path(update.adapter_path), False
    folder = adapter_dir_path(worker_name, update.version)

    def fetch_and_write() -> None:
        tensors = dict(iter_state_dict(update))
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        check_free_space(folder.parent, needed, f"{worker_name}'s adapter v{update.version}")
        write_adapter_folder(tensors, update.adapter_config or "", folder)

    try:
        await asyncio.to_thread(fetch_and_write)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, True
