"""The child of tests/rewards/test_verifier_slots.py: a two-node Ray cluster on this machine
(ray.cluster_utils.Cluster, loopback only) whose nodes offer `verification_slot`, the verifier pool
on it, and one line of what it saw (REPORT_PREFIX, then JSON); the test asserts on that line.

    python tests/programs/verifier_slots_cluster.py \
        '{"head_slots": 2, "second_node_slots": 1, "processes": 4, "timeout_s": 5.0, "cases": [["8", "7"]]}'

A process of its own, because a process holds one Ray connection and the tests' session-wide Ray
fixture (tests/conftest.py) must stay up for the modules after the test. The spec's cases are
(completion, gold answer) pairs, each scored through the pool actor and through the workers' client.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

REPORT_PREFIX = "SLOT-REPORT "
SLOTS_BACK_BOUND_S = 60.0  # killed actors give their resources back asynchronously


def run_cluster_scenario(spec: dict) -> dict:
    """Start the two-node cluster, exercise the pool, return what was seen."""
    from async_grpo.runtime.ray_access import use_loopback_only_ray

    use_loopback_only_ray()
    import ray
    from ray.cluster_utils import Cluster

    from async_grpo.launch.ray_env import actor_runtime_env
    from async_grpo.rewards.math_verify_cluster import (
        VERIFICATION_SLOT, connect_verifier_pool, get_or_create_verifier_pool, shutdown_verifier_pool,
    )

    processes, timeout_s = spec["processes"], spec["timeout_s"]
    cases = [(completion, gold) for completion, gold in spec["cases"]]
    node_args = {"num_cpus": 1, "include_dashboard": False, "_system_config": {"enable_metrics_collection": False}}
    cluster = Cluster(initialize_head=True,
                      head_node_args={**node_args, "resources": {VERIFICATION_SLOT: spec["head_slots"]}})
    try:
        second = cluster.add_node(num_cpus=1, resources={VERIFICATION_SLOT: spec["second_node_slots"]})
        ray.init(address=cluster.address, namespace="verifier-slots-test", runtime_env=actor_runtime_env())
        cluster.wait_for_nodes()
        report: dict = {
            "head_node": cluster.head_node.node_id,
            "second_node": second.node_id,
            "slots_before": ray.available_resources().get(VERIFICATION_SLOT, 0.0),
        }
        pool = get_or_create_verifier_pool(processes, timeout_s)
        report["placement"] = ray.get(pool.placement.remote())
        report["slots_taken"] = ray.available_resources().get(VERIFICATION_SLOT, 0.0)
        shards = ray.get(pool.shards.remote())
        report["shard_nodes"] = ray.get([shard.node_id.remote() for shard in shards])
        report["via_pool"] = [ray.get(pool.score.remote([c], g))[0].reward for c, g in cases]

        async def through_client() -> list[float]:
            client = connect_verifier_pool(processes, timeout_s)
            groups = await asyncio.gather(*(client.score([c + " "], g) for c, g in cases))
            return [group[0].reward for group in groups]

        report["via_client"] = asyncio.run(through_client())
        report["stats"] = ray.get(pool.stats.remote())
        report["per_shard_scored"] = [ray.get(shard.stats.remote())["scored"] for shard in shards]
        shutdown_verifier_pool()
        deadline = time.monotonic() + SLOTS_BACK_BOUND_S
        while ray.available_resources().get(VERIFICATION_SLOT, 0.0) < report["slots_before"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        report["slots_after_shutdown"] = ray.available_resources().get(VERIFICATION_SLOT, 0.0)
        return report
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(REPORT_PREFIX + json.dumps(run_cluster_scenario(json.loads(sys.argv[1]))), flush=True)
