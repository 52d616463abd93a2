"""The trainer-side NCCL weight-transfer sender against a receiver process (gpu tier).

vLLM's own trainer-side engine (vllm.distributed.weight_transfer.nccl_engine.
NCCLTrainerWeightTransferEngine: trainer_init, send_weights) sends a bf16 model's weights from
this process (GPU 0) to tests/gpu_weight_receiver.py on GPU 1, which runs the worker side of
the same transfer (vLLM's stateless NCCL group and packed consumer) without an engine; the
client between them is the VLLMWeightSyncClient protocol over the receiver's stdin/stdout
(JSON lines). Every tensor must arrive bit for bit, packed and one by one. Needs vLLM (the
GPU machine lent so far has none) and two GPUs (one per NCCL rank).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (its NCCL weight transfer)"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one device"),
]

RECEIVER = Path(__file__).resolve().parent / "gpu_weight_receiver.py"
REPLY_TIMEOUT_S = 300  # generous: only stops a hung receiver


class PipeClient:
    """VLLMWeightSyncClient over the receiver's stdin/stdout, one JSON line each way per call."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc

    def _call(self, op: str, payload: Any = None) -> None:
        self._proc.stdin.write(json.dumps({"op": op, "payload": payload}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"receiver exited during {op} (status {self._proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"receiver failed {op}: {reply['error']}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", init_info)

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info: dict) -> None:
        self._call("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-by-one"])
def test_nccl_sender_delivers_every_weight_to_the_receiver(tmp_path: Path, tiny_model_dir: Path,
                                                           packed: bool) -> None:
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    from ray_env import repo_pythonpath
    from setup_model import load_causal_lm
    from torchrun_launch import free_port

    torch.cuda.set_device(0)
    model = load_causal_lm(tiny_model_dir, device=torch.device("cuda", 0), dtype=torch.bfloat16,
                           attn_implementation="sdpa")
    out = tmp_path / "received.safetensors"
    proc = subprocess.Popen([sys.executable, str(RECEIVER), str(out), "1"], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={"PYTHONPATH": repo_pythonpath(), **_cuda_env()})
    try:
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0,
                                   packed=packed)
        engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=PipeClient(proc),
                                                              source=ModuleSource(model))
        started = time.monotonic()
        engine.send_weights()
        elapsed = time.monotonic() - started
        engine.shutdown()
    finally:
        proc.stdin.close()
        proc.wait(timeout=REPLY_TIMEOUT_S)
    received = load_file(str(out))
    expected = {name: p.detach().cpu() for name, p in model.named_parameters()}
    assert received.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    print(f"nccl weight transfer ({'packed' if packed else 'one by one'}): {nbytes / 2**20:.1f} MiB "
          f"in {elapsed * 1e3:.1f} ms (tiny model: latency-bound, not a bandwidth figure)")


def _cuda_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
