"""The generation worker's end of vLLM's CUDA weight transfers (worker_cuda_transfer.
EngineTransferReceiver) against a recording stand-in of AsyncLLM: which of the engine's calls each
pass-through makes, in which order, with which arguments, and what it refuses before the engine sees
it. The real engines need CUDA; the object-store backend's engine path runs in
tests/inference/test_vllm_worker.py.

    .venv/bin/python -m pytest tests/weights/test_transfer_pass_through.py -q
"""

from __future__ import annotations

import asyncio

import pytest

from async_grpo.weights.worker_cuda_transfer import EngineTransferReceiver, TransferOrderError
from support.recording_engine import INIT, UPDATE, RecordingEngine


def _receiver(engine: RecordingEngine) -> EngineTransferReceiver:
    return EngineTransferReceiver(engine, backend="nccl", pause_mode="keep")


def test_two_pushes_make_vllms_calls_in_order() -> None:
    engine = RecordingEngine()
    receiver = _receiver(engine)

    async def two_pushes() -> None:
        await receiver.init("nccl", INIT)
        for version in (4, 5):
            await receiver.start()
            await receiver.update(UPDATE)
            await receiver.update([UPDATE])  # vLLM's payload may be a list of chunks: passed on as is
            await receiver.finish(version, on_finished=lambda: engine.calls.append(("on_finished", version)))

    asyncio.run(two_pushes())
    # The worker relabels its versions between finish and resume (scheduling still paused).
    push = lambda version: [("pause_generation", ("keep", True)), ("start_weight_update", None),  # noqa: E731
                            ("update_weights", UPDATE), ("update_weights", [UPDATE]),
                            ("finish_weight_update", str(version)), ("on_finished", version),
                            ("resume_generation", None)]
    assert engine.calls == [("init_weight_transfer_engine", INIT), *push(4), *push(5)]
    assert not receiver.in_session
    assert receiver.describe() == {"backend": "nccl", "ranks": 2}


def test_a_rebuilt_group_leaves_the_old_one_first() -> None:
    engine = RecordingEngine()
    receiver = _receiver(engine)
    rebuilt = {**INIT, "master_port": 29556}

    async def join_twice() -> None:
        await receiver.init("nccl", INIT)
        await receiver.init("nccl", rebuilt)

    asyncio.run(join_twice())
    assert engine.calls == [("init_weight_transfer_engine", INIT), ("shutdown_weight_transfer_engine", None),
                            ("init_weight_transfer_engine", rebuilt)]


@pytest.mark.parametrize("calls, message", [
    (["start"], "start before init"),
    (["init", "update"], "update outside a weight update"),
    (["init", "finish"], "finish outside a weight update"),
    (["init", "start", "start"], "start during a weight update"),
    (["init", "start", "init"], "init during a weight update"),
])
def test_calls_out_of_order_are_refused_before_vllm_sees_them(calls: list[str], message: str) -> None:
    engine = RecordingEngine()
    receiver = _receiver(engine)
    steps = {"init": lambda: receiver.init("nccl", INIT), "start": receiver.start,
             "update": lambda: receiver.update(UPDATE), "finish": lambda: receiver.finish(1)}

    async def run() -> None:
        for name in calls[:-1]:
            await steps[name]()
        seen = list(engine.calls)
        with pytest.raises(TransferOrderError, match=message):
            await steps[calls[-1]]()
        assert engine.calls == seen  # nothing reached the engine

    asyncio.run(run())


def test_a_trainer_sending_by_another_backend_is_refused_naming_both() -> None:
    engine = RecordingEngine()
    with pytest.raises(ValueError, match=r"sends weights by 'ipc'.*weight_transfer backend 'nccl'"):
        asyncio.run(_receiver(engine).init("ipc", {"packed": False}))
    assert engine.calls == []
