"""The runtime env the project's actors run in: this repository first on their PYTHONPATH
(actors import project modules, vLLM's engine-core process too), `actor_runtime_env()`; child
processes get the same path from `repo_pythonpath()`.

Their names live in config/actor_names.py; joining a running cluster is runtime/ray_access.py's.
Imports nothing but the stdlib.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The folder that holds the async_grpo package and the spine's modules: the repository in a
# checkout, site-packages once installed (this file is async_grpo/launch/ray_env.py).
REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_pythonpath(inherited: str | None = None) -> str:
    """PYTHONPATH that imports this repository first, then `inherited` (default: this process's)."""
    root = str(REPO_ROOT)
    inherited = os.environ.get("PYTHONPATH", "") if inherited is None else inherited
    rest = [p for p in inherited.split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])


def actor_runtime_env() -> dict[str, Any]:
    """Ray runtime_env of every project actor and of ray.init: this repository importable; in a
    process the local launcher gave a worker's cores (cpu_plan.CPU_CORES_ENV: a dispatcher), the
    actors it starts run on those cores from their first instruction (cpu_plan.pinned_python)."""
    from async_grpo.launch.cpu_plan import CPU_CORES_ENV, pinned_python

    runtime_env: dict[str, Any] = {"env_vars": {"PYTHONPATH": repo_pythonpath()}}
    if os.environ.get(CPU_CORES_ENV):
        runtime_env["py_executable"] = pinned_python(os.environ[CPU_CORES_ENV])
    return runtime_env
