"""The LoRA adapters a generation worker serves: which adapter new requests run with, and how
many requests each has in flight (a replaced adapter leaves the engine once its last request
ends). Loading a new one is worker_adapter.py's.

Worker side: held by served_weights.ServedWeights; vLLM is only named for type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

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
