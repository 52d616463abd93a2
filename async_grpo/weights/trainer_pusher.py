"""Publishing the trainer's weights, one version per push: `WeightPusher` (collective over the
trainer ranks) picks the run's publishers (transport.py) and calls them, and `resolve_push_dtype`
says what dtype pushes carry.

A LoRA policy pushes its adapter (trainer_object_store.AdapterPublisher). Full weights go through
Ray's object store (trainer_object_store.ObjectStorePublisher) or, when the generation engines
run one of vLLM's CUDA weight-transfer engines, straight from the trainer's GPUs
(trainer_cuda_transfer.EngineWeightSender, given as `engine_transfer`), and then through the
object store too to the registries that sender does not serve (the logprob workers'). Trainer side.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from torch import nn

from async_grpo.weights.trainer_adapter import is_lora_model
from async_grpo.weights.trainer_cuda_transfer import TRANSFER_PUSH_MODE, EngineWeightSender
from async_grpo.weights.trainer_object_store import AdapterPublisher, ObjectStorePublisher, get_or_create_shard_stager
from setup_model import MODEL_DTYPES, training_compute_dtype

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


class WeightPusher:
    """Publishes the trainer's weights to every inference worker, one version at a time.

    Collective: every trainer rank builds one and calls `push` together. Rank 0 holds the
    registries of the kinds that serve the policy; tensors are cast to `dtype` on the rank that
    holds them. A LoRA policy (fsdp_setup under model.lora) pushes only its adapter, to every
    registry. With `engine_transfer` (one of vLLM's CUDA transfers), full weights reach the
    generation engines through it instead; the registries it does not own (the logprob
    workers') still get them through the object store when `object_store_weights` says so.
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
        trainer_cuda_transfer.check_transfer_pairing); object_store_weights: with
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
        self._mode = mode
        self.dtype = dtype
        registries = list(registries)
        stager = get_or_create_shard_stager() if mode == "sharded" else None
        self._adapters = AdapterPublisher(mode, rank, world_size, registries, timeout_s, dtype=dtype,
                                          weights_root=weights_root, stager=stager)
        self._object_store: ObjectStorePublisher | None = None
        """Full weights through the object store: to every registry, or with an engine transfer
        to those it does not own (None: not at all)."""
        if mode != "lora_files" and (engine_transfer is None or object_store_weights):
            if engine_transfer is not None:
                registries = [reg for reg in registries if not engine_transfer.owns(reg)]
            self._object_store = ObjectStorePublisher(mode, rank, world_size, registries, timeout_s, dtype=dtype,
                                                      stager=stager)

    @property
    def phases(self) -> dict[str, float]:
        """The last object-store push of full weights, this rank's seconds per part
        (trainer_object_store.PUSH_PHASES); {} before one."""
        return self._object_store.phases if self._object_store is not None else {}

    def push(self, model: nn.Module, version: int, initial: bool = False) -> float:
        """Collective: every rank calls it. Returns seconds spent."""
        start = time.perf_counter()
        if is_lora_model(model):
            self._adapters.publish(model, version, initial)
        elif self._mode == "lora_files":
            raise ValueError("weight_push_mode lora_files pushes LoRA adapters: the policy has none (model.lora.r is 0)")
        else:
            if self._engine_transfer is not None:
                self._engine_transfer.send(model, version)
            if self._object_store is not None:
                self._object_store.publish(model, version, initial)
        return time.perf_counter() - start

    def close(self) -> None:
        """Release what outlives a push (the engine transfer's group) at the end of training."""
        if self._engine_transfer is not None:
            self._engine_transfer.shutdown()
