"""The receiving end of tests/weights/test_gpu_weight_transfer.py: vLLM's worker-side NCCL weight
transfer (the calls NCCLWeightTransferEngine makes inside an inference worker), without an engine.

    python tests/programs/gpu_weight_receiver.py OUT.safetensors CUDA_DEVICE_INDEX

Reads one JSON request per line on stdin ({"op": "init" | "start" | "update" | "finish",
"payload": ...}: the VLLMWeightSyncClient calls the trainer-side engine makes, with their
payloads) and answers each with one JSON line ({"ok": true} or {"error": "..."}). "init" joins
the trainer's NCCL group as rank rank_offset; "update" receives every tensor the update info
names (packed or one by one, as the init info says); "finish" writes what arrived to
OUT.safetensors for the test to compare. JSON only: nothing is unpickled.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from safetensors.torch import save_file


class Receiver:
    """The worker side of one NCCL weight-transfer group."""

    def __init__(self, out_path: str, device_index: int) -> None:
        self.out_path, self.device = out_path, torch.device("cuda", device_index)
        self.group: Any = None
        self.init_info: Any = None
        self.received: dict[str, torch.Tensor] = {}

    def init(self, payload: dict) -> None:
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo, stateless_init_process_group,
        )

        self.init_info = NCCLWeightTransferInitInfo(**payload)
        self.group = stateless_init_process_group(
            self.init_info.master_address, self.init_info.master_port, self.init_info.rank_offset,
            self.init_info.world_size, device=self.device.index)

    def update(self, payload: dict) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        metas = [(name, (shape, getattr(torch, dtype)))
                 for name, dtype, shape in zip(payload["names"], payload["dtype_names"], payload["shapes"])]
        if self.init_info.packed:
            packed_nccl_broadcast_consumer(
                iterator=iter(metas), group=self.group, src=0, post_unpack_func=self._keep,
                buffer_size_bytes=self.init_info.packed_buffer_size_bytes,
                num_buffers=self.init_info.packed_num_buffers, device=self.device)
            return
        for name, (shape, dtype) in metas:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            self._keep([(name, tensor)])

    def _keep(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        # Unpacked tensors are views of a receive buffer the next round reuses: copy them out.
        for name, tensor in pairs:
            self.received[name] = tensor.to("cpu", copy=True)

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)
        save_file(self.received, self.out_path)


def main() -> None:
    torch.cuda.set_device(int(sys.argv[2]))
    receiver = Receiver(sys.argv[1], int(sys.argv[2]))
    handlers = {"init": lambda p: receiver.init(p), "start": lambda p: None,
                "update": lambda p: receiver.update(p), "finish": lambda p: receiver.finish()}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            handlers[request["op"]](request.get("payload"))
            reply: dict = {"ok": True}
        except Exception as error:  # reported to the trainer side, which raises it
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
