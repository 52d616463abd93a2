"""The two ends of a weight transport: a `WeightPublisher` in the trainer ranks, a `WeightReceiver`
beside each generation engine. Every transport implements both:

- full weights through Ray's object store (weight_push_mode 'gather' or 'sharded'):
  trainer_object_store.ObjectStorePublisher -> worker_object_store.ObjectStoreReloader;
- LoRA adapters, through the object store or a shared folder ('lora_files'):
  trainer_object_store.AdapterPublisher -> worker_adapter.AdapterLoader;
- vLLM's CUDA engines (EngineConfig.weight_transfer nccl, nccl_m2n, ipc), GPU to GPU:
  trainer_cuda_transfer.EngineWeightSender -> worker_cuda_transfer.TransferPassThrough.

trainer_pusher.WeightPusher picks a run's publishers; vllm_worker.GenerationWorker takes full
weights with the receiver of its engine's transport and adapters with the adapter receiver. The
logprob workers load object-store updates into their plain models with the same loader
(worker_loader.fetch_shards). Shared by both sides: no torch, Ray or vLLM at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from async_grpo.weights.update import WeightUpdate


@runtime_checkable
class WeightPublisher(Protocol):
    """The trainer's end of a transport: sends one weight version at a time."""

    def publish(self, model: nn.Module, version: int, initial: bool = False) -> None:
        """Collective: every trainer rank calls it with its part of `model`. Returns once every
        worker this transport serves holds `version`; `initial`: a run's first push, which workers
        take whatever version they serve."""
        ...

    def close(self) -> None:
        """Release what outlives a push (a transfer group), at the end of training."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """A generation worker's end of a transport: readies its engine, then takes each version in."""

    async def init_engine(self, engine: Any) -> None:
        """Ready a freshly started engine (vLLM's AsyncLLM) for this transport, before any version arrives."""
        ...

    async def receive(self, engine: Any, update: WeightUpdate) -> None:
        """Load a version a registry published; the engine serves it to new requests after. A
        transport whose versions arrive by calls the trainer drives (the CUDA transfers) refuses it."""
        ...
