"""One trainer rank of tests/weights/test_weight_push_dtype.py: real WeightPusher pushes into a
recorder.

    torchrun --nproc_per_node=2 tests/programs/weight_push_worker.py --ray_address HOST:PORT \
        --namespace NS --out_dir OUT --model_path DIR [--model_path DIR ...]

Each rank joins the test's Ray cluster and the gloo group, builds the FSDP2 model of every
--model_path (build_training_model, as the trainer does), and pushes it with
trainer_pusher.WeightPusher in each mode ("gather", "sharded") and each dtype (float32, bfloat16).
Rank 0 hands the pushers a recorder actor in place of the registries: its `publish` receives
the WeightUpdate exactly as a registry would and reads it the two ways a worker can
(`fetch_state_dict`, and `iter_state_dict`, one tensor at a time).

Rank 0 writes OUT/received.pt: a list of {model_path, mode, dtype, fetched, streamed_names,
streamed} per push, with the tensors as the recorder received them.
"""

from __future__ import annotations

import argparse
import sys
import time
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
from setup_model import ModelConfig  # noqa: E402

DIST_TIMEOUT_S = 120.0  # a crashed peer turns into an error well inside the test's own timeout
PUSH_TIMEOUT_S = 120.0  # the shard stager's wait for every rank's shard
MODES = ("gather", "sharded")
DTYPES = (torch.float32, torch.bfloat16)
# How long the recorder holds each publish, as a worker loading into its engine would: the
# pusher's 'load' phase must contain it (tests/weights/test_weight_push_dtype.py).
PUBLISH_HOLD_S = 0.2


@ray.remote(num_cpus=0)
class Recorder:
    """Stands in for a registry: `publish(update)` reads the update as a worker would."""

    def __init__(self) -> None:
        self.received: dict[int, dict] = {}

    def publish(self, update: WeightUpdate) -> dict[str, int]:
        from async_grpo.weights.worker_loader import fetch_state_dict, iter_state_dict

        streamed = list(iter_state_dict(update))
        self.received[update.version] = {
            "mode": update.mode,
            "fetched": fetch_state_dict(update),
            "streamed_names": [name for name, _ in streamed],
            "streamed": dict(streamed),
        }
        time.sleep(PUBLISH_HOLD_S)
        return {"recorder": update.version}

    def take(self) -> dict[int, dict]:
        return self.received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray_address", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--model_path", action="append", required=True)
    args = parser.parse_args()
    info = init_distributed(DIST_TIMEOUT_S)
    join_cluster(args.ray_address, namespace=args.namespace, timeout_s=60.0, log_to_driver=False,
                 runtime_env=actor_runtime_env())
    recorder = Recorder.remote() if info.is_main else None
    # Built once and kept, as the trainer keeps its one pusher: the shard stager is owned by the
    # rank that created it and goes away with that rank's last handle.
    pushers = {
        (mode, dtype): WeightPusher(mode, info.rank, info.world_size, [recorder] if info.is_main else [],
                                    PUSH_TIMEOUT_S, dtype=dtype)
        for mode in MODES for dtype in DTYPES
    }
    pushes = []
    version = 0
    for model_path in args.model_path:
        model = build_training_model(ModelConfig(model_path=model_path), info)
        for (mode, dtype), pusher in pushers.items():
            seconds = pusher.push(model, version)
            pushes.append({"model_path": model_path, "mode": mode, "dtype": dtype, "version": version,
                           "seconds": seconds, "phases": dict(pusher.phases)})
            version += 1
    if info.is_main:
        received = ray.get(recorder.take.remote())
        records = [{**push, **received[push["version"]]} for push in pushes]
        torch.save(records, Path(args.out_dir) / "received.pt")
    dist.barrier()
    ray.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
