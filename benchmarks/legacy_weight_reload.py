"""The generation worker's weight push as it was before vLLM's weight-transfer API (issue 23), kept
as benchmarks/weight_push.py's baseline (`--target engine`), nowhere else.

Old path, per bucket of whole decoder layers: write a safetensors file to /dev/shm, then
`collective_rpc(LEGACY_RELOAD_RPC, path)` in the engine, which reads the file back and calls
`model_runner.reload_weights` (a whole layerwise reload per bucket). `LegacyFileReload` is the
engine's `worker_extension_cls` in that benchmark; subclassing the project's registration class
keeps the object-store backend registered in the same engine, so both paths run on one engine.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from async_grpo.inference.weight_files import weights_file_dir
from async_grpo.inference.weight_reload import install_reload_warning_filter, with_tied_lm_head
from async_grpo.inference.weight_transfer_engine import WeightTransferRegistration
from async_grpo.weights.weight_sync import write_safetensors

if TYPE_CHECKING:
    import torch
    from vllm.v1.engine.async_llm import AsyncLLM

# The old RPC's name (vLLM refuses extension names its worker already has, hence the prefix).
LEGACY_RELOAD_RPC = "grpo_reload_weights_from_file"
LEGACY_EXTENSION = f"{__name__}.LegacyFileReload"


class LegacyFileReload(WeightTransferRegistration):
    """The old engine side: one safetensors file per bucket, reloaded with reload_weights."""

    def grpo_reload_weights_from_file(self, path: str) -> int:
        from safetensors.torch import load_file

        install_reload_warning_filter()
        weights = with_tied_lm_head(load_file(path, device="cpu"), self.model_runner.model_config.hf_text_config)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        return len(weights)


async def legacy_push(engine: AsyncLLM, buckets: Iterator[tuple[dict[str, torch.Tensor], bool]], version: int,
                      pause_mode: str = "keep") -> int:
    """The old GenerationWorker._reload_paused (now object_store_reload.ObjectStoreReloader's):
    pause, one file + RPC per bucket, label, resume."""
    await engine.pause_generation(mode=pause_mode, clear_cache=True)
    try:
        count = 0
        while (item := await asyncio.to_thread(next, buckets, None)) is not None:
            path = weights_file_dir() / f"grpo-weights-legacy-bench-v{version}-{uuid.uuid4().hex}.safetensors"
            try:
                await asyncio.to_thread(write_safetensors, item[0], path)
                await engine.collective_rpc(LEGACY_RELOAD_RPC, args=(str(path),))
            finally:
                Path(path).unlink(missing_ok=True)
            count += 1
        await engine.update_weight_version(str(version))
        return count
    finally:
        await engine.resume_generation()
