"""Out of the trainer through Ray's object store: full weights (`ObjectStorePublisher`) and LoRA
adapters (`AdapterPublisher`), each a `transport.WeightPublisher`, and the shard stager that
collects every rank's shard ref in "sharded" mode.

Both put a `WeightUpdate` into the registries of the kinds that serve the policy (rank 0
announces it; each registry returns once its workers loaded it). "gather": rank 0 gathers the
full tensors and puts them as one shard; "sharded": every rank puts its own pieces and rank 0
collects their refs through the stager. A LoRA update is made loadable by the STABLE marker
(<weights_root>/STABLE), which rank 0 writes, atomically, once every part is in place (every
rank's shard staged, or in lora_files mode the folder <weights_root>/step_N complete) and
before it announces the update. Trainer side.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from async_grpo.config.actor_names import ON_HEAD_NODE, RAY_NAMESPACE, SHARD_STAGER_NAME
from async_grpo.weights.adapter_files import (
    STABLE_MARKER_FILE, StableMarker, adapter_step_dir, update_parts, write_adapter_folder, write_stable_marker,
)
from async_grpo.weights.trainer_adapter import adapter_config_json, gather_adapter, local_adapter_blobs
from async_grpo.weights.trainer_gather import gather_full_state_dict, local_shard_blobs
from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs

logger = logging.getLogger(__name__)


class ShardStager:
    """Collects every trainer rank's shard ref for a version so rank 0 can announce one update.

    Refs travel inside lists, so Ray passes them as references (each rank stays the owner of its
    own shard; workers fetch it straight from that rank's object store). Plain asyncio class,
    wrapped by a Ray actor in `get_or_create_shard_stager`.
    """

    def __init__(self) -> None:
        import asyncio

        self._refs: dict[int, dict[int, Any]] = {}
        self._changed = asyncio.Condition()

    async def stage(self, version: int, rank: int, refs: list[Any]) -> None:
        """Record rank's shard ref (refs is a one-element list) for a version."""
        async with self._changed:
            self._refs.setdefault(version, {})[rank] = refs[0]
            self._changed.notify_all()

    async def collect(self, version: int, world_size: int, timeout_s: float) -> list[Any]:
        """Wait until all world_size ranks staged `version`; return their refs in rank order."""
        import asyncio

        async def all_staged() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self._refs.get(version, {})) >= world_size)

        try:
            await asyncio.wait_for(all_staged(), timeout_s)
        except asyncio.TimeoutError:
            have = sorted(self._refs.get(version, {}))
            raise TimeoutError(
                f"{SHARD_STAGER_NAME}: version {version} has shards from ranks {have} of {world_size} "
                f"after {timeout_s:.0f} s"
            ) from None
        by_rank = self._refs.pop(version)
        return [by_rank[r] for r in range(world_size)]


def get_or_create_shard_stager() -> Any:
    """The named shard-staging actor of this run (created by the first rank that asks)."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_concurrency=64)(ShardStager)
    return actor_cls.options(name=SHARD_STAGER_NAME, namespace=RAY_NAMESPACE, get_if_exists=True,
                             resources=ON_HEAD_NODE).remote()


# The parts of an object-store push of full weights, in order (ObjectStorePublisher.phases).
PUSH_PHASES = ("collect", "put", "load", "barrier")
# lora_files folders kept on disk: the version being loaded and the one before it (a worker
# loads each version before the next push returns, so older folders are never read again).
_KEEP_ADAPTER_DIRS = 2


def _staged_refs(stager: Any, version: int, rank: int, world_size: int, own_ref: Any, timeout_s: float) -> list[Any]:
    """Stage this rank's shard ref; rank 0 gets every rank's refs in rank order ([] elsewhere)."""
    import ray

    ray.get(stager.stage.remote(version, rank, [own_ref]))
    if rank != 0:
        return []
    return ray.get(stager.collect.remote(version, world_size, timeout_s))


def _announce(update: WeightUpdate, registries: Sequence[Any], mode: str, dtype: torch.dtype) -> None:
    """Rank 0: publish the update through the registries; each returns once its workers loaded it."""
    import ray

    results = ray.get([reg.publish.remote(update) for reg in registries])
    logger.info("pushed %s v%d (%s, %s) to %d workers", "adapter" if update.is_adapter else "weights",
                update.version, mode, dtype, sum(len(r) for r in results))


class ObjectStorePublisher:
    """Full weights through Ray's object store, one version per `publish` (collective): gathered
    on rank 0 ("gather") or every rank's own shards ("sharded"), cast to `dtype` on the rank that
    holds them before they are put."""

    def __init__(self, mode: str, rank: int, world_size: int, registries: Sequence[Any], timeout_s: float, *,
                 dtype: torch.dtype, stager: Any = None) -> None:
        """registries: Ray handles of the registries to publish to (rank 0; [] elsewhere);
        stager: the shard stager ("sharded" mode)."""
        self._mode, self._rank, self._world_size = mode, rank, world_size
        self._registries = list(registries)
        self._timeout_s = timeout_s
        self._dtype = dtype
        self._stager = stager
        self.phases: dict[str, float] = {}
        """The last push, this rank's seconds per part (PUSH_PHASES): 'collect' (FSDP's
        all-gather, or this rank's shards, to host tensors), 'put' (into Ray's object store,
        staging included), 'load' (rank 0: the registries' publish, returning once every worker
        has the version in its engine), 'barrier' (waiting for the other ranks)."""

    def publish(self, model: nn.Module, version: int, initial: bool = False) -> None:
        import ray

        marks = [time.perf_counter()]
        if self._mode == "gather":
            state = gather_full_state_dict(model, dtype=self._dtype)
            marks.append(time.perf_counter())
            own_ref = ray.put(state_dict_to_blobs(state)) if self._rank == 0 else None
            refs = [own_ref]
        else:
            blobs = local_shard_blobs(model, dtype=self._dtype)
            marks.append(time.perf_counter())
            own_ref = ray.put(blobs)
            refs = _staged_refs(self._stager, version, self._rank, self._world_size, own_ref, self._timeout_s)
        marks.append(time.perf_counter())
        if self._rank == 0:
            update = WeightUpdate(version=version, shard_refs=refs, mode=self._mode, initial=initial)
            _announce(update, self._registries, self._mode, self._dtype)
        marks.append(time.perf_counter())
        # Workers fetch shards from every rank's object store: keep own_ref alive until all are done.
        # The registries hold the update (borrowing its refs) until the next publish, so these
        # objects stay in this rank's store until then: a worker joining meanwhile loads them.
        dist.barrier()
        marks.append(time.perf_counter())
        self.phases = {name: end - begin for name, begin, end in zip(PUSH_PHASES, marks, marks[1:])}
        del own_ref

    def close(self) -> None:
        """Nothing outlives a push: the registries hold the last update's refs."""


class AdapterPublisher:
    """A LoRA policy's adapter, under PEFT names, one version per `publish` (collective): every
    rank's pieces ("sharded"), gathered on rank 0 ("gather") or written by rank 0 as a PEFT folder
    on a shared filesystem ("lora_files"); loadable once the STABLE marker names it."""

    def __init__(self, mode: str, rank: int, world_size: int, registries: Sequence[Any], timeout_s: float, *,
                 dtype: torch.dtype, weights_root: Path | None, stager: Any = None) -> None:
        """weights_root: <run_dir>/weights, where the STABLE marker (and the lora_files folders)
        go; a LoRA push without it raises ValueError."""
        self._mode, self._rank, self._world_size = mode, rank, world_size
        self._registries = list(registries)
        self._timeout_s = timeout_s
        self._dtype = dtype
        self._weights_root = Path(weights_root) if weights_root is not None else None
        self._stager = stager

    def publish(self, model: nn.Module, version: int, initial: bool = False) -> None:
        import ray

        if self._weights_root is None:
            raise ValueError("WeightPusher: a LoRA policy needs weights_root (<run_dir>/weights) for its STABLE marker")
        own_ref, refs, folder = None, [], None
        if self._mode == "sharded":
            own_ref = ray.put(local_adapter_blobs(model, dtype=self._dtype))
            refs = _staged_refs(self._stager, version, self._rank, self._world_size, own_ref, self._timeout_s)
        else:
            tensors = gather_adapter(model, dtype=self._dtype)
            if self._rank == 0 and self._mode == "gather":
                own_ref = ray.put(state_dict_to_blobs(tensors))
                refs = [own_ref]
            elif self._rank == 0:
                folder = str(self._write_adapter_dir(tensors, adapter_config_json(model), version))
            del tensors
        if self._rank == 0:
            update = WeightUpdate(version=version, shard_refs=refs, mode=self._mode, initial=initial,
                                  adapter_config=adapter_config_json(model), adapter_path=folder,
                                  marker_path=str(self._weights_root / STABLE_MARKER_FILE))
            # Only now is every part of the version in place: the marker makes it loadable.
            write_stable_marker(Path(update.marker_path),
                                StableMarker(version=version, mode=self._mode, shards=update_parts(update)))
            _announce(update, self._registries, self._mode, self._dtype)
            if self._mode == "lora_files":
                self._prune_adapter_dirs()
        dist.barrier()
        del own_ref

    def close(self) -> None:
        """Nothing outlives a push: the last two lora_files folders stay for the workers."""

    def _write_adapter_dir(self, tensors: Mapping[str, torch.Tensor], config_json: str, version: int) -> Path:
        """Rank 0, lora_files: the version's PEFT folder, written under a temp name and renamed,
        so a folder under its final name is always complete."""
        final = adapter_step_dir(self._weights_root, version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_adapter_folder(tensors, config_json, tmp)
        if final.exists():  # a resumed run pushes its first version again
            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def _prune_adapter_dirs(self) -> None:
        """Rank 0, lora_files: keep the newest _KEEP_ADAPTER_DIRS version folders."""
        folders = sorted(p for p in self._weights_root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in folders[:-_KEEP_ADAPTER_DIRS]:
            shutil.rmtree(old, ignore_errors=True)
