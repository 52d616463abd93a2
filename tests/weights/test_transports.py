"""Every weight transport implements both ends of transport.py: its publisher the
`WeightPublisher` methods, its receiver the `WeightReceiver` methods, each with the protocol's
parameters (and a receiver's as coroutines). The transports' behaviour is tested beside each
(test_weight_sync.py, test_weight_transfer.py, tests/inference/, tests/trainer/).

    .venv/bin/python -m pytest tests/weights/test_transports.py -q
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from async_grpo.weights.trainer_cuda_transfer import EngineWeightSender
from async_grpo.weights.trainer_object_store import AdapterPublisher, ObjectStorePublisher
from async_grpo.weights.transport import WeightPublisher, WeightReceiver
from async_grpo.weights.worker_adapter import AdapterLoader
from async_grpo.weights.worker_cuda_transfer import TransferPassThrough
from async_grpo.weights.worker_object_store import ObjectStoreReloader

# transport -> (its publisher, its receiver)
TRANSPORTS = {
    "object store, full weights": (ObjectStorePublisher, ObjectStoreReloader),
    "LoRA adapters": (AdapterPublisher, AdapterLoader),
    "vLLM's CUDA engines": (EngineWeightSender, TransferPassThrough),
}


def _protocol_methods(protocol: type) -> list[str]:
    return sorted(name for name, value in vars(protocol).items()
                  if inspect.isfunction(value) and not name.startswith("_"))


def _parameters(function: object) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("side, protocol", [(0, WeightPublisher), (1, WeightReceiver)])
def test_each_transport_implements_both_ends(transport: str, side: int, protocol: type) -> None:
    implementation = TRANSPORTS[transport][side]
    assert _protocol_methods(protocol), f"{protocol.__name__} declares no method"
    for name in _protocol_methods(protocol):
        ours, declared = getattr(implementation, name, None), getattr(protocol, name)
        assert ours is not None, f"{implementation.__name__} ({transport}) lacks {protocol.__name__}.{name}"
        assert _parameters(ours) == _parameters(declared), (
            f"{implementation.__name__}.{name}{inspect.signature(ours)} differs from "
            f"{protocol.__name__}.{name}{inspect.signature(declared)}")
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(declared), (
            f"{implementation.__name__}.{name}: async must match {protocol.__name__}.{name}")


def test_the_cuda_receiver_refuses_an_object_store_update() -> None:
    """Its versions arrive by the trainer's calls: a registry's WeightUpdate is refused, named."""
    from types import SimpleNamespace

    receiver = TransferPassThrough("generation-worker-0", backend="nccl", pause_mode="keep", engine=lambda: None,
                                   served=None, stats=None, life=None)
    with pytest.raises(ValueError, match="generation-worker-0: a WeightUpdate travels through the object store, "
                                         "but this engine takes weights by EngineConfig.weight_transfer 'nccl'"):
        asyncio.run(receiver.receive(None, SimpleNamespace(version=3)))
