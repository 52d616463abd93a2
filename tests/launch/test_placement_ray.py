"""The placement plan on Ray's fake GPUs (issue 36, item 2): for 1, 2, 4 and 8 GPUs, stand-in
worker actors that ask Ray for the plan's share land where the plan says: on the plan's worker
GPUs, never on a trainer GPU unless the plan colocates them (one GPU), a shared GPU holding at
most 1/share workers. One Ray head in a child process advertises eight fake GPUs (its
CUDA_VISIBLE_DEVICES 0-7) and hosts the cases in turn, each case's actors killed before the next:
a head advertising only the plan's worker GPUs (as LocalCluster starts it) leaves Ray no other
choice, so eight is the stricter test of Ray packing fractional shares as the plan assumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from async_grpo.launch.placement import GiB, ModelShape, RunShape, plan_placement
from support.paths import REPO_ROOT

pytestmark = pytest.mark.system

QWEN_0_5B = ModelShape(num_params=494_032_768, hidden_size=896, num_layers=24, vocab_size=151936)
CASES = {  # host GPUs -> the run on them
    1: RunShape(trainer_ranks=1, max_tokens_per_gpu=8192, generation_workers=1, logprob_workers=1),
    2: RunShape(trainer_ranks=1, max_tokens_per_gpu=8192, generation_workers=2, logprob_workers=1),
    4: RunShape(trainer_ranks=2, max_tokens_per_gpu=8192, generation_workers=1, logprob_workers=1),
    8: RunShape(trainer_ranks=4, max_tokens_per_gpu=8192, generation_workers=3, logprob_workers=1),
}
_FAKE_GPUS = 8
_CHILD = """
import json, os, sys, time
import ray
from async_grpo.launch.ray_cluster import init_local_ray

cases = json.loads(sys.argv[1])
os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(int(sys.argv[2]))))
init_local_ray(num_cpus=16, namespace="placement-test", log_to_driver=False, num_gpus=int(sys.argv[2]))


@ray.remote(num_cpus=0.1)
class StandIn:
    def visible(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")


seen = {}
for gpus, (share, workers) in cases.items():
    actors = [StandIn.options(num_gpus=share).remote() for _ in range(workers)]
    seen[gpus] = ray.get([actor.visible.remote() for actor in actors], timeout=120)
    for actor in actors:
        ray.kill(actor)
    while ray.available_resources().get("GPU", 0) < int(sys.argv[2]):  # the next case starts on free GPUs
        time.sleep(0.1)
print("SEEN " + json.dumps(seen))
"""


def test_workers_land_on_the_plans_gpus_for_1_2_4_and_8_gpus() -> None:
    plans = {gpus: plan_placement(gpus, 80 * GiB, QWEN_0_5B, run) for gpus, run in CASES.items()}
    cases = {gpus: (plan.worker_gpu_share, CASES[gpus].workers) for gpus, plan in plans.items()}
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases), str(_FAKE_GPUS)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SEEN "))[5:])
    for gpus, plan in plans.items():
        visible = seen[str(gpus)]
        held = [int(v) for v in visible]  # one GPU id each: a share never spans two GPUs
        assert set(held) <= set(plan.worker_gpus), (gpus, visible, plan)
        if not plan.colocated:
            assert not set(held) & set(plan.trainer_gpus), (gpus, visible, plan)
        per_gpu = max(held.count(g) for g in set(held))
        assert per_gpu * plan.worker_gpu_share <= 1, (gpus, visible, plan)
    assert seen["1"] == ["0", "0"]  # one GPU: both workers share GPU 0 with the trainer
    assert sorted(seen["2"]) == ["0", "0", "0"]  # two GPUs: all three workers on GPU 0, the trainer on 1
    assert sorted(seen["4"]) == ["0", "1"]  # whole GPUs, as before
    assert sorted(seen["8"]) == ["0", "1", "2", "3"]
