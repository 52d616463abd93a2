"""Publishing the trainer's weights, one version per push: `WeightPusher` (collective over the
trainer ranks), the shard stager that collects every rank's shard ref in "sharded" mode, and the
dtype pushes carry (`resolve_push_dtype`).

Full weights travel through Ray's object store as a `weight_sync.WeightUpdate` that the
registries announce to their workers, or, when the generation engines run one of vLLM's CUDA
weight-transfer engines, straight from the trainer's GPUs (weight_transfer_trainer.
EngineWeightSender, given as `engine_transfer`); LoRA adapters always take the object store (or
a shared folder). What is published is built in weight_sync.py.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from async_grpo.config.actor_names import ON_HEAD_NODE, RAY_NAMESPACE, SHARD_STAGER_NAME
from async_grpo.trainer.weight_transfer_trainer import TRANSFER_PUSH_MODE, EngineWeightSender
from async_grpo.weights.weight_sync import (
    STABLE_MARKER_FILE, StableMarker, WeightUpdate, adapter_config_json, adapter_step_dir, gather_adapter,
    gather_full_state_dict, is_lora_model, local_adapter_blobs, local_shard_blobs, state_dict_to_blobs, update_parts,
    write_adapter_folder, write_stable_marker,
)
from setup_model import MODEL_DTYPES, training_compute_dtype

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


AUTO_PUSH_DTYPE = "auto"


def resolve_push_dtype(name: str, device: torch.device, mixed_precision: bool) -> torch.dtype:
    """The dtype weight pushes carry: 'auto' -> bfloat16 when the trainer computes in bf16 (on
    CUDA with ModelConfig.mixed_precision, see fsdp_setup.build_training_model), else float32;
    any other name of setup_model.MODEL_DTYPES as given."""
    if name == AUTO_PUSH_DTYPE:
        return training_compute_dtype(device, mixed_precision)
    if name not in MODEL_DTYPES:
        raise ValueError(f"weight push dtype must be one of {(AUTO_PUSH_DTYPE, *MODEL_DTYPES)}, got {name!r}")
    return MODEL_DTYPES[name]


PUSH_MODES = ("gather", "sharded", "lora_files")
# The parts of an object-store push of full weights, in order (WeightPusher.phases).
PUSH_PHASES = ("collect", "put", "load", "barrier")
# lora_files folders kept on disk: the version being loaded and the one before it (a worker
# loads each version before the next push returns, so older folders are never read again).
_KEEP_ADAPTER_DIRS = 2


class WeightPusher:
    """Publishes the trainer's weights to every inference worker, one version at a time.

    Collective: every trainer rank builds one and calls `push` together. Rank 0 holds the
    registries of the kinds that serve the policy and announces each `WeightUpdate` to them; in
    "sharded" mode every rank stages its own shard ref with the shard stager first. Tensors are
    cast to `dtype` on the rank that holds them, before they are put into Ray's object store.

    A LoRA policy (fsdp_setup under model.lora) pushes only its adapter, under PEFT names, and
    every push is made visible by the STABLE marker (<weights_root>/STABLE) before it is
    announced: rank 0 writes it, atomically, once every rank's shard is staged (or, in
    lora_files mode, once the adapter folder <weights_root>/step_N is complete).

    With `engine_transfer` (one of vLLM's CUDA transfers), full weights reach the generation
    engines through it instead; the registries it does not own (the logprob workers') still get
    them through the object store when `object_store_weights` says so. Adapters go to every
    registry through the object store either way.
    """

    def __init__(self, mode: Literal["gather", "sharded", "lora_files"], rank: int, world_size: int,
                 registries: Sequence[Any], timeout_s: float, *, dtype: torch.dtype = torch.float32,
                 weights_root: Path | None = None, engine_transfer: EngineWeightSender | None = None,
                 object_store_weights: bool = True) -> None:
        """registries: Ray handles of the registries to publish to (rank 0; [] elsewhere);
        dtype: what the pushed tensors carry (resolve_push_dtype; the model's own fp32 by default);
        weights_root: <run_dir>/weights, where LoRA pushes keep their STABLE marker (and their
        folders in lora_files mode); required for LoRA policies; engine_transfer: sends full
        weights to the generation engines (its mode must pair with `mode`:
        weight_transfer_trainer.check_transfer_pairing); object_store_weights: with
        engine_transfer, whether full weights also go through the object store to the
        registries it does not own (the same value on every rank: the gather is collective)."""
        if mode not in PUSH_MODES:
            raise ValueError(f"WeightPusher mode must be one of {PUSH_MODES}, got {mode!r}")
        if dtype not in MODEL_DTYPES.values():
            raise ValueError(f"WeightPusher dtype must be one of {tuple(MODEL_DTYPES.values())}, got {dtype}")
        if engine_transfer is not None and mode != "lora_files":
            needed = TRANSFER_PUSH_MODE[engine_transfer.config.weight_transfer]
            if mode != needed:
                raise ValueError(f"WeightPusher: weight_transfer {engine_transfer.config.weight_transfer!r} needs "
                                 f"weight_push_mode {needed!r}, got {mode!r}")
        self._engine_transfer = engine_transfer
        self._object_store_weights = engine_transfer is None or object_store_weights
        self._mode = mode
        self.dtype = dtype
        self._rank = rank
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._registries = list(registries)
        self._weights_root = Path(weights_root) if weights_root is not None else None
        self._stager = get_or_create_shard_stager() if mode == "sharded" else None
        self.phases: dict[str, float] = {}
        """The last object-store push of full weights, this rank's seconds per part: 'collect'
        (FSDP's all-gather, or this rank's shards, to host tensors), 'put' (into Ray's object
        store, staging included), 'load' (rank 0: the registries' publish, returning once every
        worker has the version in its engine), 'barrier' (waiting for the other ranks)."""

    def push(self, model: nn.Module, version: int, initial: bool = False) -> float:
        """Collective: every rank calls it. Returns seconds spent."""
        start = time.perf_counter()
        if is_lora_model(model):
            self._push_adapter(model, version, initial)
        elif self._mode == "lora_files":
            raise ValueError("weight_push_mode lora_files pushes LoRA adapters: the policy has none (model.lora.r is 0)")
        else:
            self._push_weights(model, version, initial)
        return time.perf_counter() - start

    def close(self) -> None:
        """Release what outlives a push (the engine transfer's group) at the end of training."""
        if self._engine_transfer is not None:
            self._engine_transfer.shutdown()

    def _push_weights(self, model: nn.Module, version: int, initial: bool) -> None:
        """Full weights: through the engine transfer, and/or through the object store."""
        if self._engine_transfer is not None:
            self._engine_transfer.send(model, version)
        if self._object_store_weights:
            self._publish_weights(model, version, initial)

    def _publish_weights(self, model: nn.Module, version: int, initial: bool) -> None:
        """Full weights through the object store: gathered on rank 0, or every rank's own shards."""
        import ray

        marks = [time.perf_counter()]
        if self._mode == "gather":
            state = gather_full_state_dict(model, dtype=self.dtype)
            marks.append(time.perf_counter())
            own_ref = ray.put(state_dict_to_blobs(state)) if self._rank == 0 else None
            refs = [own_ref]
        else:
            blobs = local_shard_blobs(model, dtype=self.dtype)
            marks.append(time.perf_counter())
            own_ref = ray.put(blobs)
            refs = self._staged_refs(version, own_ref)
        marks.append(time.perf_counter())
        if self._rank == 0:
            update = WeightUpdate(version=version, shard_refs=refs, mode=self._mode, initial=initial)
            self._announce(update, self._object_store_registries())
        marks.append(time.perf_counter())
        # Workers fetch shards from every rank's object store: keep own_ref alive until all are done.
        # The registries hold the update (borrowing its refs) until the next publish, so these
        # objects stay in this rank's store until then: a worker joining meanwhile loads them.
        dist.barrier()
        marks.append(time.perf_counter())
        self.phases = {name: end - begin for name, begin, end in zip(PUSH_PHASES, marks, marks[1:])}
        del own_ref

    def _push_adapter(self, model: nn.Module, version: int, initial: bool) -> None:
        """LoRA: the adapter (gathered, per-rank shards, or a folder), STABLE, then the announcement."""
        import ray

        if self._weights_root is None:
            raise ValueError("WeightPusher: a LoRA policy needs weights_root (<run_dir>/weights) for its STABLE marker")
        own_ref, refs, folder = None, [], None
        if self._mode == "sharded":
            own_ref = ray.put(local_adapter_blobs(model, dtype=self.dtype))
            refs = self._staged_refs(version, own_ref)
        else:
            tensors = gather_adapter(model, dtype=self.dtype)
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
            self._announce(update)
            if self._mode == "lora_files":
                self._prune_adapter_dirs()
        dist.barrier()
        del own_ref

    def _staged_refs(self, version: int, own_ref: Any) -> list[Any]:
        """Stage this rank's shard ref; rank 0 gets every rank's refs in rank order ([] elsewhere)."""
        import ray

        ray.get(self._stager.stage.remote(version, self._rank, [own_ref]))
        if self._rank != 0:
            return []
        return ray.get(self._stager.collect.remote(version, self._world_size, self._timeout_s))

    def _object_store_registries(self) -> list[Any]:
        """The registries that take full weights through the object store: all, or with an engine
        transfer those it does not own."""
        if self._engine_transfer is None:
            return self._registries
        return [reg for reg in self._registries if not self._engine_transfer.owns(reg)]

    def _announce(self, update: WeightUpdate, registries: Sequence[Any] | None = None) -> None:
        """Rank 0: publish the update through the registries (default: every one); each returns
        once its workers loaded it."""
        import ray

        registries = self._registries if registries is None else registries
        results = ray.get([reg.publish.remote(update) for reg in registries])
        logger.info("pushed %s v%d (%s, %s) to %d workers", "adapter" if update.is_adapter else "weights",
                    update.version, self._mode, self.dtype, sum(len(r) for r in results))

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
