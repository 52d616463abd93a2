"""Which weights a generation worker's engine serves, and the requests running on them.

Every request (a rollout, an endpoint request) reads this state as it starts: it waits while a
weight update holds new requests back, then takes the version and the LoRA adapter it runs on
(`ServedWeights.request`). The weight receivers change it: a full-weight load (object store,
worker_object_store.py; CUDA transfer, worker_cuda_transfer.py) switches the version while
scheduling is paused, an adapter load (worker_adapter.py) swaps the adapter new requests get.

Worker side; plain asyncio, no vLLM (the adapters are only named for type checking).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from async_grpo.inference.served_adapters import AdapterBook
from async_grpo.rollouts.token_versions import TokenVersionTracker

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


class ServedWeights:
    """The version and adapter the engine serves, shared by the requests that read them and the
    weight receivers that change them."""

    def __init__(self, remove_adapter: Callable[[int], Awaitable[None]]) -> None:
        """remove_adapter: unloads a replaced adapter from the engine, given its id (AdapterBook)."""
        self.version = -1
        """Version of the weights the engine serves (-1: the initial checkpoint)."""
        self.token_versions = TokenVersionTracker()
        """Per in-flight full-weight request: its start version and the pushes that landed meanwhile."""
        self.adapters = AdapterBook(remove_adapter)
        """The LoRA adapter new requests run with, and each adapter's requests in flight."""
        self.accepting = asyncio.Event()
        """Set unless a weight update holds new requests back: requests arriving meanwhile wait,
        so the version they record is the one they run on."""
        self.accepting.set()
        self.holds_pushed_weights = False
        """True once a full-weight push replaced the checkpoint's weights: an adapter trained on
        the checkpoint must not be applied on top of them (AdapterLoader restores them first)."""
        self.inflight = 0
        """Requests running now (rollouts and endpoint requests)."""

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[tuple[int, LoRARequest | None]]:
        """One request's hold on the served weights: waits out a weight update, then yields the
        version and the adapter it runs on (taken together: the request keeps this adapter to the
        end, even if a newer one is loaded meanwhile), counted in flight until it ends."""
        # A request woken by accepting.set() may run only after the next update cleared it again:
        # it checks once more, so none starts while an update that counted no request in flight runs.
        while not self.accepting.is_set():
            await self.accepting.wait()
        version, adapter = self.version, self.adapters.acquire()
        self.inflight += 1
        try:
            yield version, adapter
        finally:
            self.inflight -= 1
            if adapter is not None:
                await self.adapters.release(adapter.lora_int_id)

    def switch_version(self, version: int) -> None:
        """The engine serves `version` from its next step on (scheduling is still paused): the
        one place a full-weight load switches versions."""
        self.version = version
        self.token_versions.pushed(version)

    async def full_weights_loaded(self) -> None:
        """Pushed full weights replaced the checkpoint's: new requests run on them without an
        adapter (full weights from a run without LoRA are served as they are)."""
        self.holds_pushed_weights = True
        await self.adapters.replace()
