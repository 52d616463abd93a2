"""How any process reaches Ray: joining a running cluster (the trainer's ranks, the dispatchers,
`worker_dispatcher.py status`, scripts), Ray's loopback-only mode and its token auth.

    join_cluster("auto", namespace=RAY_NAMESPACE, timeout_s=30, log_to_driver=False)

A `ray start --head` where a Ray auth token exists (Ray 2.60 makes one for every local
`ray.init`) demands that token from every client, but Ray turns token mode on in a client only
for address 'auto' without RAY_ADDRESS; a client without it loops forever on "Failed to get
cluster ID from GCS server: Unauthenticated". join_cluster turns token mode on wherever a token
exists (use_ray_token_auth_if_available), switches to Ray's single-machine mode for a
loopback head (use_loopback_only_ray), and turns each way a join can hang (no cluster, an
unreachable head, a missing or refused token) into one line, ClusterJoinError, within a timeout.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import ray
from ray._raylet import Config, GcsClient
from ray.exceptions import AuthenticationError

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


class ClusterJoinError(RuntimeError):
    """This process cannot join the Ray cluster; the message is one line that says why and what to do."""


# How long the TCP probe of the head waits: a live head on a reachable host answers (or refuses)
# in milliseconds; a silent drop (firewall, wrong host) would otherwise cost Ray's own ~40 s of
# retries before `ray.init` even reports it.
_TCP_PROBE_TIMEOUT_S = 5.0
_TOKEN_HINT = ("the head's token is in ~/.ray/auth_token on the head node: copy that file here, or set "
               "RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH")


# Hex digits of the cluster tag in shared-memory names: collisions between the few clusters one
# machine runs at once are negligible at 32 bits.
_CLUSTER_TAG_CHARS = 8


def _refresh_ray_auth_mode() -> None:
    """Make an already-imported Ray read RAY_AUTH_MODE again (what Ray itself does when it turns
    token mode on for a local cluster: its cached config is re-initialised from the environment)."""
    Config.initialize("")


def last_started_cluster() -> str:
    """The address `ray start` recorded for this machine's latest cluster ('' if none): the file
    ray_current_cluster in Ray's temp folder, which is what Ray's address 'auto' reads."""
    temp_root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    path = Path(temp_root) / "ray" / "ray_current_cluster"
    return path.read_text().strip() if path.is_file() else ""


def resolve_ray_address(address: str) -> str:
    """host:port of the cluster's GCS: RAY_ADDRESS wins (as in Ray), then `address`, where 'auto'
    means the last cluster `ray start` started on this machine. ClusterJoinError if none is found.

    A loopback head (127.0.0.1, as local and test clusters run) switches this process to Ray's
    single-machine mode first (use_loopback_only_ray): otherwise Ray rewrites the address to the
    machine's routable one, where no head listens, and retries forever."""
    given = os.environ.get("RAY_ADDRESS") or address
    raw = last_started_cluster() if given == "auto" else given
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
    return raw


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
    if use_ray_token_auth_if_available():
        _refresh_ray_auth_mode()
    gcs_address = resolve_ray_address(address)
    check_head_reachable(gcs_address)
    check_head_accepts_us(gcs_address, timeout_s)
    ray.init(address=gcs_address, namespace=namespace, log_to_driver=log_to_driver, runtime_env=runtime_env,
             _temp_dir=temp_dir or None)
    return gcs_address


def cluster_tag(gcs_address: str) -> str:
    """A short tag of a Ray cluster, from its GCS address (unique among the clusters of a machine)."""
    return hashlib.sha1(gcs_address.encode()).hexdigest()[:_CLUSTER_TAG_CHARS]


def shared_memory_owner(worker_name: str) -> str:
    """The name a worker's files in shared memory are filed under: the worker's name prefixed
    with the tag of the Ray cluster this process is connected to, so that generation-worker-0 of
    two clusters on one machine never remove each other's adapter folders (weights/worker_bucket_files.py)."""
    return f"{cluster_tag(ray.get_runtime_context().gcs_address)}-{worker_name}"
