"""A recording stand-in of vLLM's AsyncLLM for the weight-transfer tests: its weight-transfer, pause
and cache calls, recorded in order with their arguments, and the init and update payloads the tests
send (tests/weights/test_transfer_pass_through.py and tests/weights/test_object_store_reload.py,
the worker's end; tests/weights/test_weight_sync_transfer.py, the trainer's end against engines
that record)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tests' collection imports no vLLM
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest


class RecordingEngine:
    """AsyncLLM's weight-transfer, pause and cache calls, recorded as (name, argument) pairs."""

    def __init__(self, world_size: int = 2) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.prefix_cache_resets = True
        """What reset_prefix_cache answers (vLLM: False when a KV connector could not be reset)."""
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size))

    async def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        self.calls.append(("init_weight_transfer_engine", request.init_info))

    async def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append(("shutdown_weight_transfer_engine", None))

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause_generation", (mode, clear_cache)))

    async def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", None))

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        self.calls.append(("update_weights", request.update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish_weight_update", weight_version))

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", None))

    async def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        return self.prefix_cache_resets


INIT = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 3, "world_size": 5, "packed": True}
UPDATE = {"names": ["model.embed_tokens.weight"], "dtype_names": ["bfloat16"], "shapes": [[8, 4]]}
