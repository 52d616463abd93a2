"""One trainer rank of tests/weights/test_lora_push.py: the real WeightPusher pushing a LoRA policy.

    torchrun --nproc_per_node=2 tests/programs/lora_push_worker.py --ray_address HOST:PORT --namespace NS \
        --out_dir OUT --model_path BASE --adapter_dir START_ADAPTER

Every rank joins the test's Ray cluster and the gloo group, builds the FSDP2 LoRA policy from
the base and the starting adapter (build_training_model, as a resumed trainer does) and pushes
it with trainer_pusher.WeightPusher in each mode, twice per mode. Rank 0 hands the pushers a
recorder actor in place of the registries; its `publish` reads the update as a worker would:
the STABLE marker must name it (check_stable), then the adapter is fetched (every rank's
shards reassembled, or the lora_files folder read). OUT/weights is the pushers' weights_root.

Rank 0 writes OUT/received.pt: {version: {mode, stable_ok, tensors, adapter_config, marker,
adapter_path}}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ray
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from async_grpo.runtime.ray_access import join_cluster
from async_grpo.launch.ray_env import actor_runtime_env  # noqa: E402
from async_grpo.trainer.fsdp_setup import build_training_model, init_distributed  # noqa: E402
from async_grpo.weights.trainer_pusher import WeightPusher  # noqa: E402
from async_grpo.weights.update import WeightUpdate
from setup_model import LoraConfig, ModelConfig  # noqa: E402

DIST_TIMEOUT_S = 120.0  # a crashed peer turns into an error well inside the test's own timeout
PUSH_TIMEOUT_S = 120.0  # the shard stager's wait for every rank's shard
MODES = ("gather", "sharded", "lora_files")
PUSHES_PER_MODE = 2


@ray.remote(num_cpus=0)
class Recorder:
    """Stands in for a registry: `publish(update)` loads the update as a worker would."""

    def __init__(self) -> None:
        self.received: dict[int, dict] = {}

    def publish(self, update: WeightUpdate) -> dict[str, int]:
        from safetensors.torch import load_file

        from async_grpo.weights.adapter_files import ADAPTER_WEIGHTS_FILE, check_stable, read_stable_marker
        from async_grpo.weights.worker_loader import fetch_state_dict

        check_stable(update)
        if update.mode == "lora_files":
            tensors = load_file(str(Path(update.adapter_path) / ADAPTER_WEIGHTS_FILE))
        else:
            tensors = fetch_state_dict(update)
        marker = read_stable_marker(Path(update.marker_path))
        self.received[update.version] = {
            "mode": update.mode, "tensors": tensors, "adapter_config": update.adapter_config,
            "marker": (marker.version, marker.mode, list(marker.shards)), "adapter_path": update.adapter_path,
            "num_refs": len(update.shard_refs),
        }
        return {"recorder": update.version}

    def take(self) -> dict[int, dict]:
        return self.received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray_address", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--model_path", required=True)
    parser.add_argument("--adapter_dir", required=True)
    args = parser.parse_args()
    info = init_distributed(DIST_TIMEOUT_S)
    join_cluster(args.ray_address, namespace=args.namespace, timeout_s=60.0, log_to_driver=False,
                 runtime_env=actor_runtime_env())
    recorder = Recorder.remote() if info.is_main else None
    out = Path(args.out_dir)
    model = build_training_model(ModelConfig(model_path=args.model_path, lora=LoraConfig(r=8, alpha=16.0)), info,
                                 adapter_dir=args.adapter_dir)
    version = 0
    for mode in MODES:
        pusher = WeightPusher(mode, info.rank, info.world_size, [recorder] if info.is_main else [], PUSH_TIMEOUT_S,
                              dtype=torch.float32, weights_root=out / "weights")
        for _ in range(PUSHES_PER_MODE):
            pusher.push(model, version, initial=version == 0)
            version += 1
    if info.is_main:
        torch.save(ray.get(recorder.take.remote()), out / "received.pt")
    dist.barrier()
    ray.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
