"""A second Ray node on this machine, joined to a running head on loopback: what `ray start
--address=<head>` would start on another machine (Ray's single-machine mode, which keeps every
process on 127.0.0.1, refuses that command, so the node is started as Ray's own test cluster
does: ray._private.node.Node, as in ray.cluster_utils.Cluster.add_node).

    python tests/programs/ray_node.py --address 127.0.0.1:6379 --temp_dir /tmp/rn2 --num_cpus 2 --num_gpus 2

Prints `NODE-UP <node id>` once the node is alive, then waits on standard input: the line
`remove` kills every process of the node at once (a node lost mid-run: raylet, object store,
its actors and their children), EOF or SIGTERM stops it the same way. Run with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 and the head's auth settings in the environment.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

NODE_UP = "NODE-UP"
NODE_REMOVED = "NODE-REMOVED"
# Ray's test-cluster defaults (cluster_utils.Cluster.add_node): a small object store, and ports
# chosen by the OS so the node cannot collide with the head's.
_OBJECT_STORE_BYTES = 150 * 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the head's GCS address, host:port")
    parser.add_argument("--temp_dir", required=True, help="this node's Ray temp folder (tells the nodes apart)")
    parser.add_argument("--num_cpus", type=int, default=2)
    parser.add_argument("--num_gpus", type=int, default=0, help="GPUs to advertise (Ray's fake GPUs on a CPU machine)")
    parser.add_argument("--resources", default="{}", help="extra custom resources, as JSON")
    args = parser.parse_args()

    from async_grpo.runtime.ray_access import use_loopback_only_ray

    use_loopback_only_ray()
    import ray._private.node
    import ray._private.parameter

    params = ray._private.parameter.RayParams(
        gcs_address=args.address, node_ip_address="127.0.0.1", temp_dir=args.temp_dir, num_cpus=args.num_cpus,
        num_gpus=args.num_gpus, resources=json.loads(args.resources), object_store_memory=_OBJECT_STORE_BYTES,
        min_worker_port=0, max_worker_port=0, node_manager_port=0, include_log_monitor=False,
        dashboard_agent_listen_port=None,
    )
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)

    def remove(*_: object) -> None:
        # Everything this node runs descends from this process (its raylet's workers, their vLLM
        # engine cores): all of it is killed, as a lost machine loses it. Ray's own teardown alone
        # stops Ray's processes, and an engine core whose actor died with its raylet lived on as
        # an orphan for the rest of the test session (2026-11-29).
        import psutil

        descendants = psutil.Process().children(recursive=True)
        for process in descendants:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(descendants, timeout=30)
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        print(NODE_REMOVED, flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, remove)
    print(f"{NODE_UP} {node.node_id}", flush=True)
    for line in sys.stdin:
        if line.strip() == "remove":
            break
    remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
