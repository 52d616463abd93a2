"""The trainer side of vLLM's CUDA weight transfers (trainer_cuda_transfer.py) against receiver
processes (gpu tier), in two tests sized to the machines they can run on:

- one GPU, no vLLM (the lent GPU machine has torch and transformers, neither vLLM nor Ray):
  `test_the_source_shares_its_tensors_over_cuda_ipc_without_vllm`. Our weight source
  (HFWeightSource) on a CUDA model: names, push dtype and shapes as announced, cast on the GPU;
  each tensor's CUDA IPC handle (torch's reduce_tensor: what vLLM's IPC engine ships to a
  colocated worker) opened by tests/programs/gpu_ipc_receiver.py in a second process on the same GPU,
  which must see the same bytes. Importing and planning the transfer must not import vLLM.
- two GPUs and vLLM: `test_nccl_sender_delivers_every_weight_to_the_receiver`. Our
  EngineWeightSender drives vLLM's NCCLTrainerWeightTransferEngine (GPU 0) into
  tests/programs/gpu_weight_receiver.py (GPU 1: vLLM's worker-side NCCL group and packed consumer, no
  engine); the workers' pass-through calls travel as JSON lines over the receiver's stdin/stdout.
  Every tensor must arrive bit for bit, packed and one by one. Skipped, with the reason printed
  (-rs), where vLLM is absent or there is one GPU (NCCL refuses two ranks on one device).

The CPU half (pairing, plan, call order through vLLM's engine with the wire stubbed) is
tests/weights/test_weight_sync_transfer.py. `scripts/test.sh --gpu` runs this tier.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest
import torch

from async_grpo.weights.trainer_cuda_sources import HFWeightSource, send_plan
from async_grpo.weights.trainer_cuda_transfer import (
    DESCRIBE_METHOD, FINISH_METHOD, INIT_METHOD, START_METHOD, UPDATE_METHOD, EngineWeightSender, TrainerTransferConfig,
    WorkerCallError, engines_from_answers,
)
from support.ipc_codec import decode, encode, tensor_sha256
from support.paths import PROGRAMS, REPO_ROOT, TESTS

NCCL_RECEIVER = PROGRAMS / "gpu_weight_receiver.py"
IPC_RECEIVER = PROGRAMS / "gpu_ipc_receiver.py"
RECEIVER_NAME = "gpu-receiver"
DEADLINE_S = 300.0  # generous: only stops a hung receiver


def _receiver_env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS)])}


def _cuda_model(model_dir: Path, index: int, dtype: torch.dtype) -> torch.nn.Module:
    from setup_model import load_causal_lm

    return load_causal_lm(model_dir, device=torch.device("cuda", index), dtype=dtype, attn_implementation="sdpa")


def test_ipc_codec_round_trips_reduce_tensors_arguments() -> None:
    """CPU: the JSON form of a CUDA IPC handle's arguments decodes to the same values."""
    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 0, torch.UntypedStorage, torch.bfloat16, 0,
            b"\x00\xff handle", 12, 0, False, b"refcount", 4, None, True)
    assert decode(json.loads(json.dumps(encode(args)))) == args
    with pytest.raises(ValueError, match="torch classes only"):
        decode({"type": "os:system"})


@pytest.mark.gpu
def test_the_source_shares_its_tensors_over_cuda_ipc_without_vllm(tiny_model_dir: Path) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    vllm_loaded_before = "vllm" in sys.modules
    torch.cuda.set_device(0)
    model = _cuda_model(tiny_model_dir, 0, torch.float32)  # fp32 master weights, bf16 on the wire
    source = HFWeightSource(model, torch.bfloat16)
    metas = source.metadata()
    sent = list(source)
    params = model.state_dict()
    assert [name for name, _ in sent] == [m.name for m in metas]
    for meta, (name, tensor) in zip(metas, sent):
        assert tensor.is_cuda and tensor.is_contiguous(), name
        assert (tensor.dtype, tuple(tensor.shape)) == (meta.dtype, meta.shape) == (torch.bfloat16,
                                                                                   tuple(params[name].shape))
        assert torch.equal(tensor, params[name].to(torch.bfloat16)), name
    plan = send_plan("ipc", 0, metas, lambda name: None)
    assert sum(n for _, n in plan) == sum(t.numel() * t.element_size() for _, t in sent)

    proc = subprocess.Popen([sys.executable, str(IPC_RECEIVER)], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=_receiver_env())
    try:
        for name, tensor in sent:
            _, args = reduce_tensor(tensor)
            proc.stdin.write(json.dumps({"name": name, "args": encode(args)}) + "\n")
            proc.stdin.flush()
            reply = json.loads(proc.stdout.readline() or '{"error": "receiver exited"}')
            assert reply == {"name": name, "sha256": tensor_sha256(tensor)}, reply
    finally:
        proc.stdin.close()
        proc.wait(timeout=DEADLINE_S)
    assert ("vllm" in sys.modules) == vllm_loaded_before  # the trainer side plans without vLLM
    nbytes = sum(n for _, n in plan)
    print(f"cuda ipc: {len(sent)} tensors, {nbytes / 2**20:.2f} MiB opened by a second process on the same GPU")


class PipeCalls:
    """WorkerCalls over the NCCL receiver process: the generation worker's pass-through methods
    (transfer_describe / init / start / update / finish) as JSON lines."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        self.killed: list[str] = []

    def _send(self, op: str, payload: Any) -> None:
        self._proc.stdin.write(json.dumps({"op": op, "payload": payload}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        reply = json.loads(line) if line else {"error": f"receiver exited (status {self._proc.poll()})"}
        if "error" in reply:
            raise WorkerCallError(op, {RECEIVER_NAME: reply["error"]}, {RECEIVER_NAME: True})

    def call(self, method: str, args: Mapping[str, tuple], timeout_s: float) -> dict[str, Any]:
        (call_args,) = args.values()
        if method == DESCRIBE_METHOD:
            return {RECEIVER_NAME: {"backend": "nccl", "ranks": 1}}
        op, payload = {INIT_METHOD: ("init", call_args[-1]), START_METHOD: ("start", None),
                       UPDATE_METHOD: ("update", call_args[0] if call_args else None),
                       FINISH_METHOD: ("finish", None)}[method]
        self._send(op, payload)
        return {RECEIVER_NAME: call_args[0] if method == FINISH_METHOD else None}

    def kill(self, names: Sequence[str]) -> None:
        self.killed.extend(names)
        self._proc.kill()


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="needs vLLM (its NCCL trainer engine and worker-side group); the lent GPU machine has none")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one device")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-by-one"])
def test_nccl_sender_delivers_every_weight_to_the_receiver(tmp_path: Path, tiny_model_dir: Path,
                                                           packed: bool) -> None:
    from safetensors.torch import load_file

    torch.cuda.set_device(0)
    model = _cuda_model(tiny_model_dir, 0, torch.bfloat16)
    out = tmp_path / "received.safetensors"
    proc = subprocess.Popen([sys.executable, str(NCCL_RECEIVER), str(out), "1"], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=_receiver_env())
    calls = PipeCalls(proc)

    def discover() -> tuple[list, PipeCalls]:
        return engines_from_answers(calls.call(DESCRIBE_METHOD, {RECEIVER_NAME: ()}, DEADLINE_S), "nccl"), calls

    sender = EngineWeightSender(TrainerTransferConfig(weight_transfer="nccl", packed=packed), 0, 1, [], DEADLINE_S,
                                dtype=torch.bfloat16, device=torch.device("cuda", 0), discover=discover)
    try:
        started = time.monotonic()
        outcome = sender.send(model, 3)
        elapsed = time.monotonic() - started
        sender.shutdown()
    finally:
        proc.stdin.close()
        proc.wait(timeout=DEADLINE_S)
    assert outcome.served == {RECEIVER_NAME: 3} and outcome.replaced == [] and calls.killed == []
    received = load_file(str(out))
    expected = {name: p.detach().cpu() for name, p in model.state_dict().items()}
    assert received.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    print(f"nccl weight transfer ({'packed' if packed else 'one by one'}): {nbytes / 2**20:.1f} MiB "
          f"in {elapsed * 1e3:.1f} ms including the group's set-up (tiny model: not a bandwidth figure)")
