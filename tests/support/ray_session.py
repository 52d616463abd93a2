"""The tests' session-wide Ray connection (conftest's ray_local fixture) and how a test that runs
its own Ray head in this process (a LocalCluster: support.cluster) sets it aside: a process holds
one Ray connection, and the folders run in any order."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

TEST_NAMESPACE = "grpo-tests"


def start_session_ray() -> None:
    """A private local Ray cluster bound to 127.0.0.1, dashboard off, project code importable."""
    from async_grpo.launch.ray_cluster import init_local_ray

    init_local_ray(num_cpus=max(4, os.cpu_count() or 1), namespace=TEST_NAMESPACE, log_to_driver=True)


@contextlib.contextmanager
def session_ray_set_aside() -> Iterator[None]:
    """Inside the block this process holds no Ray connection, so a LocalCluster can start its own
    head in it (a process holds one connection); the session's cluster (ray_local) is started
    again after it, if there was one, for the modules that come later in the same run."""
    import ray

    had_session_ray = ray.is_initialized()
    if had_session_ray:
        ray.shutdown()
    try:
        yield
    finally:
        if had_session_ray and not ray.is_initialized():
            start_session_ray()
