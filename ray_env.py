"""Where the project's actors live in Ray: one namespace, their names, and the runtime env they run in.

Every process that talks to the cluster (trainer ranks, dispatchers, the batcher, the tests)
finds actors by these names, so `ray list actors` reads the same everywhere:

    generation-registry, logprob-registry, ...   one per worker kind (vllm_registry.py)
    generation-worker-0, logprob-worker-0, ...   one per worker (worker_dispatcher.py)
    experience-batcher                           one per run (vllm_experience_batcher.py)
    math-verifier-pool                           one per cluster (math_verifier.py)
    weight-shard-stager                          "sharded" weight pushes (weight_sync.py)

Actors import project modules (vLLM's engine-core process too), so they run with this
repository first on their PYTHONPATH: `actor_runtime_env()`.

Every process that joins a running cluster (trainer ranks, dispatchers, `status`, scripts) joins
through `join_cluster`: it turns Ray's token authentication on where a token exists, and turns
the ways a join can hang (no cluster, an unreachable head, a missing or refused token) into one
line (ClusterJoinError) within a timeout. Imports nothing but the stdlib at module level (`ray`
only inside join_cluster), so `python trainer_core.py --help` and config checks stay fast.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
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
WORKER_KINDS = (GENERATION, LOGPROB, REFERENCE, TEACHER)
LOGPROB_SERVICE_KINDS = (LOGPROB, REFERENCE, TEACHER)
"""Kinds served by the logprob worker class (logprob_worker.py)."""
FROZEN_KINDS = (REFERENCE, TEACHER)
"""Logprob services whose weights never change: they refuse weight pushes."""
BATCHER_ACTOR_NAME = "experience-batcher"
VERIFIER_POOL_ACTOR_NAME = "math-verifier-pool"
SHARD_STAGER_NAME = "weight-shard-stager"
# The folder holding this module: the repository in a checkout, site-packages once installed.
REPO_ROOT = Path(__file__).resolve().parent


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
    """Ray runtime_env of every project actor and of ray.init: this repository importable."""
    return {"env_vars": {"PYTHONPATH": repo_pythonpath()}}


# Ray 2.60 turns a node IP of 127.0.0.1 into the host's routable address
# (services.resolve_ip_for_localhost), and its GCS, raylet, workers and agents then listen on all
# interfaces. With this variable false, Ray's node-IP lookup returns 127.0.0.1 (the path it takes
# for single-machine macOS and Windows), and every one of them listens on loopback only (checked
# in tests/test_end_to_end.py). Child processes inherit it, so the trainer and the dispatchers
# look for their local node at the same address.
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


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


class ClusterJoinError(RuntimeError):
    """This process cannot join the Ray cluster; the message is one line that says why and what to do."""


# How long the TCP probe of the head waits: a live head on a reachable host answers (or refuses)
# in milliseconds; a silent drop (firewall, wrong host) would otherwise cost Ray's own ~40 s of
# retries before `ray.init` even reports it.
_TCP_PROBE_TIMEOUT_S = 5.0
_TOKEN_HINT = ("the head's token is in ~/.ray/auth_token on the head node: copy that file here, or set "
               "RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH")


def _refresh_ray_auth_mode() -> None:
    """Make an already-imported Ray read RAY_AUTH_MODE again (what Ray itself does when it turns
    token mode on for a local cluster: its cached config is re-initialised from the environment)."""
    from ray._raylet import Config

    Config.initialize("")


def resolve_ray_address(address: str) -> str:
    """host:port of the cluster's GCS: RAY_ADDRESS wins (as in Ray), then `address`, where 'auto'
    means the last cluster `ray start` started on this machine. ClusterJoinError if none is found.

    A loopback head (127.0.0.1, as local and test clusters run) switches this process to Ray's
    single-machine mode first (use_loopback_only_ray): otherwise Ray rewrites the address to the
    machine's routable one, where no head listens, and retries forever."""
    from ray._private.services import canonicalize_bootstrap_address
    from ray._private.utils import read_ray_address

    given = os.environ.get("RAY_ADDRESS") or address
    raw = (read_ray_address() or "") if given == "auto" else given
    if not raw:
        raise ClusterJoinError("no Ray cluster found on this machine (start one with `ray start --head`, "
                               "or set RAY_ADDRESS=host:port of the head)")
    if "://" in raw:
        raise ClusterJoinError(f"Ray address {raw!r}: give the head's GCS address host:port (Ray Client "
                               f"addresses are not supported)")
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterJoinError(f"Ray address {raw!r} is not host:port (RAY_ADDRESS or --ray_address)")
    if _is_loopback(host):
        use_loopback_only_ray()
    try:
        return canonicalize_bootstrap_address(raw)
    except (ConnectionError, ValueError) as err:
        raise ClusterJoinError(f"Ray address {raw!r}: {' '.join(str(err).split())}") from None


def check_head_reachable(gcs_address: str, timeout_s: float = _TCP_PROBE_TIMEOUT_S) -> None:
    """ClusterJoinError unless a TCP connection to the head's GCS port opens within `timeout_s`."""
    host, _, port = gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as err:
        raise ClusterJoinError(f"cannot reach the Ray head at {gcs_address}: {err} (is `ray start --head` running "
                               f"there, and is this the address it printed?)") from None


def check_head_accepts_us(gcs_address: str, timeout_s: float) -> None:
    """ClusterJoinError unless the head's GCS answers this process within `timeout_s`: a head with
    token auth on refuses a client with no token or another token, and Ray's own client retries
    that forever (`Failed to get cluster ID from GCS server: Unauthenticated`)."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            GcsClient(address=gcs_address).get_all_node_info(timeout=timeout_s)
            outcome.append(None)
        except BaseException as err:  # reported to the caller below
            outcome.append(err)

    thread = threading.Thread(target=probe, name="ray-head-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise ClusterJoinError(f"the Ray head at {gcs_address} did not answer within {timeout_s:.0f} s")
    error = outcome[0]
    if isinstance(error, AuthenticationError):
        mode = os.environ.get(RAY_AUTH_MODE_VAR, "").lower()
        if mode == "token":
            why = "refused this process's Ray auth token (a different cluster's token?)"
        elif mode:
            why = f"requires a Ray auth token and this process runs with {RAY_AUTH_MODE_VAR}={mode}"
        else:
            why = "requires a Ray auth token and this process has none"
        raise ClusterJoinError(f"the Ray head at {gcs_address} {why}: {_TOKEN_HINT}") from None
    if error is not None:
        raise ClusterJoinError(f"the Ray head at {gcs_address} did not answer: {' '.join(str(error).split())}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def join_cluster(address: str, *, namespace: str, timeout_s: float, log_to_driver: bool,
                 runtime_env: dict[str, Any] | None = None, temp_dir: str = "") -> str:
    """Join a running Ray cluster (RAY_ADDRESS, else `address`; 'auto': the one `ray start` started
    on this machine) in `namespace`; returns the GCS address joined.

    Token auth is turned on when a token exists and RAY_AUTH_MODE is unset (a head started where a
    token exists demands it; Ray turns it on by itself only for address 'auto' without
    RAY_ADDRESS). The variable is set in os.environ, so this process's children join the same way.
    `temp_dir` (a node's `ray start --temp-dir`) picks this machine's node when several Ray nodes
    share its address; '' lets Ray pick (the head node, where there is one).
    Raises ClusterJoinError, with one line, when there is no cluster, the head is unreachable or
    refuses this process, within about `timeout_s` (plus a few seconds for the TCP probe).
    """
    import ray

    if use_ray_token_auth_if_available():
        _refresh_ray_auth_mode()
    gcs_address = resolve_ray_address(address)
    check_head_reachable(gcs_address)
    check_head_accepts_us(gcs_address, timeout_s)
    ray.init(address=gcs_address, namespace=namespace, log_to_driver=log_to_driver, runtime_env=runtime_env,
             _temp_dir=temp_dir or None)
    return gcs_address
