"""Where the project's actors live in Ray: one namespace, their names, and the runtime env they run in.

Every process that talks to the cluster (trainer ranks, dispatchers, the batcher, the tests)
finds actors by these names, so `ray list actors` reads the same everywhere:

    generation-registry, logprob-registry, ...   one per worker kind (vllm_registry.py; judge-registry too)
    generation-worker-0, logprob-worker-0, ...   one per worker (worker_dispatcher.py)
    experience-batcher                           one per run (vllm_experience_batcher.py)
    math-verifier-pool                           one per cluster (math_verify_cluster.py)
    weight-shard-stager                          "sharded" weight pushes (weights/trainer_object_store.py)

Actors import project modules (vLLM's engine-core process too), so they run with this
repository first on their PYTHONPATH: `actor_runtime_env()`.

Processes that join a running cluster do so through ray_cluster.join_cluster. Imports nothing
but the stdlib.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

RAY_NAMESPACE = "async-grpo"
GENERATION = "generation"
LOGPROB = "logprob"
REFERENCE = "reference"
"""A logprob service on the frozen reference model that never receives weight pushes, for runs
whose logprob workers compute old-policy logprobs and that also need reference logprobs."""
TEACHER = "teacher"
"""A logprob service on a teacher model (another model sharing the student's tokenizer) that
never receives weight pushes: on-policy distillation (algorithm.DistillConfig)."""
JUDGE = "judge"
"""A model judge (a vLLM engine or a reward-model head) that answers judge requests for the reward
named `judge` (inference/judge_worker.py); frozen: it never receives the policy's weight pushes."""
WORKER_KINDS = (GENERATION, LOGPROB, REFERENCE, TEACHER, JUDGE)
LOGPROB_SERVICE_KINDS = (LOGPROB, REFERENCE, TEACHER)
"""Kinds served by the logprob worker class (logprob_worker.py)."""
FROZEN_KINDS = (REFERENCE, TEACHER, JUDGE)
"""Services whose weights never change: they refuse weight pushes."""
# The resource only Ray's head node offers (Ray Train pins its state actor with it too). The
# cluster's bookkeeping actors (registries, the batcher, the verifier pool, the shard stager) ask
# for a sliver of it: they must live where the cluster itself lives, not on a worker node that
# can be lost mid-run (its dispatchers' workers are replaceable; a registry or batcher is not).
HEAD_NODE_RESOURCE = "node:__internal_head__"
ON_HEAD_NODE = {HEAD_NODE_RESOURCE: 0.001}
BATCHER_ACTOR_NAME = "experience-batcher"
VERIFIER_POOL_ACTOR_NAME = "math-verifier-pool"
SHARD_STAGER_NAME = "weight-shard-stager"
# The folder that holds the async_grpo package and the spine's modules: the repository in a
# checkout, site-packages once installed (this file is async_grpo/launch/ray_env.py).
REPO_ROOT = Path(__file__).resolve().parents[2]


def check_kind(kind: str) -> str:
    """`kind` itself if it is a worker kind, else a ValueError that lists the kinds."""
    if kind not in WORKER_KINDS:
        raise ValueError(f"unknown worker kind {kind!r}; expected one of {WORKER_KINDS}")
    return kind


def registry_name(kind: str) -> str:
    """Ray actor name of the registry of one worker kind, e.g. 'generation-registry'."""
    return f"{check_kind(kind)}-registry"


def worker_actor_name(kind: str, index: int) -> str:
    """Ray actor name of one worker, e.g. 'generation-worker-0' (what `ray list actors` shows)."""
    if index < 0:
        raise ValueError(f"worker index must be >= 0, got {index}")
    return f"{check_kind(kind)}-worker-{index}"


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


# Ray 2.60 turns a node IP of 127.0.0.1 into the host's routable address
# (services.resolve_ip_for_localhost), and its GCS, raylet, workers and agents then listen on all
# interfaces. With this variable false, Ray's node-IP lookup returns 127.0.0.1 (the path it takes
# for single-machine macOS and Windows), and every one of them listens on loopback only (checked
# in tests/system/test_end_to_end.py). Child processes inherit it, so the trainer and the dispatchers
# look for their local node at the same address.
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# For a `ray start --block` head that is stopped with SIGTERM (the tests' own heads): Ray 2.60
# first marks the node as draining and waits up to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (default
# 30 s) for its raylet to exit by itself, a wait meant for Ray Serve replicas on Kubernetes; the
# tests' heads never finished draining, so each stop took 31 s (3 s without). 0 turns it off ("a value <= 0
# disables draining and preserves immediate teardown", ray._private.node): the head then kills its
# processes at once, as `ray stop` would for that one head only.
PROMPT_STOP_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def use_loopback_only_ray() -> None:
    """Make the next `ray.init` in this process (and every child's) run on 127.0.0.1 only."""
    os.environ.update(LOOPBACK_ONLY_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray is imported already and read the variable then
        constants.ENABLE_RAY_CLUSTER = False


# Ray's token authentication, configured through its documented environment variables
# (docs.ray.io, "Ray token authentication"): RAY_AUTH_MODE, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
# and the default token file ~/.ray/auth_token that `ray start` / `ray get-auth-token --generate`
# write. Ray reads the mode once, when `ray` is first imported.
RAY_AUTH_MODE_VAR = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_VAR = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"


def ray_auth_token_exists(environ: dict[str, str] | None = None) -> bool:
    """Whether a Ray auth token is available: RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH
    names, else ~/.ray/auth_token."""
    env = os.environ if environ is None else environ
    if env.get(RAY_AUTH_TOKEN_VAR):
        return True
    path = env.get(RAY_AUTH_TOKEN_PATH_VAR) or str(Path(env.get("HOME", str(Path.home()))) / ".ray" / "auth_token")
    return Path(path).is_file()


def use_ray_token_auth_if_available(environ: dict[str, str] | None = None) -> bool:
    """Set RAY_AUTH_MODE=token when it is unset and a token exists; whether token auth is on.

    A head started with `ray start` where a token exists demands it from every client, but Ray
    turns token mode on by itself only for `address="auto"` without RAY_ADDRESS. An explicit
    RAY_AUTH_MODE always wins; a token-carrying client also joins a cluster without auth. Call it
    before `import ray` (Ray reads the variable at import), as worker_dispatcher.py does.
    """
    env = os.environ if environ is None else environ
    mode = env.get(RAY_AUTH_MODE_VAR)
    if mode is not None:
        return mode.lower() == "token"
    if not ray_auth_token_exists(env):
        return False
    env[RAY_AUTH_MODE_VAR] = "token"
    return True

