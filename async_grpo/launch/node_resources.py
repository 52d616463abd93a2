"""What a dispatcher knows of its Ray node: whether it computes on CUDA, the GPUs it advertises
and who holds them, how much a worker takes, whether the node is still in the cluster, and the
KV-cache default of a CPU node.
"""

from __future__ import annotations

import socket

import ray

from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE, WORKER_KINDS, registry_name

NODE_ID_CHARS = 12  # enough of the hex node id to tell nodes apart in messages and the status table

# KV cache of a generation worker on a CPU node when the operator sets no size: vLLM's CPU backend
# otherwise reserves gpu_memory_utilization (0.9) of the node's RAM and refuses to start when
# anything else holds memory. An eighth of what is free leaves room for the trainer, the other
# workers and the model itself; the bounds keep tiny and huge nodes sane.
CPU_KV_CACHE_FRACTION_OF_FREE = 1 / 8
CPU_KV_CACHE_MIN_BYTES = 256 * 2**20
CPU_KV_CACHE_MAX_BYTES = 8 * 2**30


def cpu_kv_cache_bytes(available_bytes: int) -> int:
    """Default KV-cache size of a generation worker on a CPU node with `available_bytes` free."""
    share = int(available_bytes * CPU_KV_CACHE_FRACTION_OF_FREE)
    return max(CPU_KV_CACHE_MIN_BYTES, min(share, CPU_KV_CACHE_MAX_BYTES))


def node_runs_cuda() -> bool:
    """Whether workers on this node compute on CUDA GPUs. Ray's GPU resource alone does not say
    so: `ray start --num-gpus=N` advertises GPUs on a machine without any (Ray's fake GPUs)."""
    import torch

    return torch.cuda.is_available()


def node_gpu_count(node_id: str) -> int:
    """GPUs the Ray node advertises (`ray start --num-gpus`, or the GPUs Ray detected)."""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return int(node["Resources"].get("GPU", 0))
    raise RuntimeError(f"node {node_id} is not in the Ray cluster's node list")


def gpus_per_worker(mode: str, tensor_parallel_size: int, node_gpus: int, requested: float | None = None) -> float:
    """GPUs one worker reserves on a node advertising `node_gpus`: none on a CPU node, else
    `requested` (a fraction shares a GPU) or whole GPUs: the engine's tensor-parallel size
    (generation) or one. ValueError when the node has too few."""
    if node_gpus == 0:
        return 0
    wanted = requested if requested is not None else (tensor_parallel_size if mode == GENERATION else 1)
    if wanted > node_gpus:
        raise ValueError(f"a {mode} worker needs {wanted:g} GPU(s) and this Ray node advertises {node_gpus}")
    return wanted


def gpu_holders(node_id: str) -> list[str]:
    """Workers of every pool that run on the node (who holds its GPUs), for error messages."""
    holders = []
    for kind in WORKER_KINDS:
        if actor_exists(registry_name(kind)):
            rows = ray.get(ray.get_actor(registry_name(kind), namespace=RAY_NAMESPACE).status.remote())
            holders += [f"{row.name} (GPU {row.gpu_ids or '-'})" for row in rows if row.node_id == node_id]
    return holders


def actor_exists(name: str) -> bool:
    """Whether a live actor already holds `name` in the project namespace."""
    try:
        ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    return True


class NodeLostError(RuntimeError):
    """This dispatcher's Ray node left the cluster (its raylet died, the machine was removed): its
    workers died with it, and a replacement can only run on this node, so the dispatcher exits."""

    @classmethod
    def of(cls, node_id: str, worker: str, detail: str = "") -> "NodeLostError":
        seen = f" ({detail})" if detail else ""
        return cls(f"node {node_id[:NODE_ID_CHARS]} left the Ray cluster (its raylet is gone) and worker {worker} "
                   f"with it{seen}; exiting: this dispatcher starts workers on its own node only")


_RAYLET_PROBE_TIMEOUT_S = 2.0


def node_alive(node_id: str) -> bool:
    """Whether the node is still in the cluster: the GCS lists it as alive and its raylet accepts
    a connection. The second check decides at once: the GCS marks a lost node dead only after
    its own health checks (seconds), while the worker's death is seen first."""
    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            try:
                address = (node["NodeManagerAddress"], node["NodeManagerPort"])
                with socket.create_connection(address, timeout=_RAYLET_PROBE_TIMEOUT_S):
                    return True
            except OSError:
                return False
    return False
