"""The receiving end of tests/weights/test_gpu_weight_transfer.py's one-GPU check: opens CUDA IPC
handles of the trainer's tensors, as vLLM's IPC engine does in a colocated inference worker (torch's
rebuild_cuda_tensor), without vLLM, and answers each with the SHA-256 of the bytes it sees.

    python tests/programs/gpu_ipc_receiver.py

One JSON request per line on stdin ({"name": ..., "args": <ipc_codec.encode of reduce_tensor's
arguments>}), one JSON answer per line ({"name": ..., "sha256": ...} or {"error": ...}). JSON
only: nothing is unpickled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.ipc_codec import decode, tensor_sha256  # noqa: E402


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        try:
            tensor = rebuild_cuda_tensor(*decode(request["args"]))
            reply = {"name": request["name"], "sha256": tensor_sha256(tensor)}
            del tensor
            torch.cuda.synchronize()
        except Exception as error:  # reported to the test, which fails on it
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
