"""Starting this process's own Ray head: the local launcher's and the tests' clusters (joining a
running one is runtime/ray_access.join_cluster).
"""

from __future__ import annotations

import ray

from async_grpo.launch.ray_env import actor_runtime_env
from async_grpo.runtime.ray_access import use_loopback_only_ray


def init_local_ray(*, num_cpus: int, namespace: str, log_to_driver: bool, num_gpus: int = 0) -> str:
    """Start a private Ray head owned by this process; returns its GCS address. LocalCluster and
    the tests' Ray fixture both start their heads here.

    Loopback only (use_loopback_only_ray), dashboard off, this repository importable in every
    worker, and off what nothing here reads:
    - Ray's own metrics: their OpenTelemetry collector thread has segfaulted a fresh actor process
      during start-up (Ray 2.60).
    - task events (`task_events_report_interval_ms: 0`): only the dashboard and the state API read
      them, and kept they grow the GCS with every actor call (docs/notes/soak_memory_growth.md).
    - worker processes prestarted for this driver (`prestart_worker_first_driver`): its actors
      start their own, and the idle ones cost memory and CPU (docs/notes/test_suite_time.md,
      "Lighter exits and starts").
    """
    use_loopback_only_ray()
    ray.init(
        # 'local': always a new head. With no address Ray joins RAY_ADDRESS, or else any Ray
        # cluster running on the machine (it looks for GCS processes), and then refuses num_cpus.
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        namespace=namespace,
        runtime_env=actor_runtime_env(),
        _system_config={"enable_metrics_collection": False, "task_events_report_interval_ms": 0,
                        "prestart_worker_first_driver": False},
        log_to_driver=log_to_driver,
    )
    return ray.get_runtime_context().gcs_address
