"""The tests' session-wide Ray connection (conftest's ray_local fixture) and how a test that runs
its own Ray head in this process (a LocalCluster: support.cluster) sets it aside: a process holds
one Ray connection, and the folders run in any order."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

TEST_NAMESPACE = "grpo-tests"
_in_use = False  # between ray_local's setup and its teardown


def start_session_ray() -> None:
    """A private local Ray cluster bound to 127.0.0.1, dashboard off, project code importable."""
    from async_grpo.launch.ray_cluster import init_local_ray

    global _in_use
    init_local_ray(num_cpus=max(4, os.cpu_count() or 1), namespace=TEST_NAMESPACE, log_to_driver=True)
    _in_use = True


def stop_session_ray() -> None:
    """ray_local's teardown: the session's cluster stops and is not started again."""
    import ray

    global _in_use
    _in_use = False
    ray.shutdown()


def ensure_session_ray() -> None:
    """Before a test that uses ray_local (tests/conftest.py): start the session's cluster again if
    a LocalCluster set it aside since it last ran (session_ray_set_aside)."""
    import ray

    if _in_use and not ray.is_initialized():
        start_session_ray()


@contextlib.contextmanager
def session_ray_set_aside() -> Iterator[None]:
    """Inside the block this process holds no Ray connection, so a LocalCluster can start its own
    head in it (a process holds one connection). The session's cluster (ray_local), if there was
    one, is not started again at the block's end but before the next test that uses it
    (ensure_session_ray): a run of LocalCluster tests, or a module of them followed by tests that
    need no Ray, costs no session head between them (~8 CPU-s a head on 2 cores)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    yield
