"""The local launcher's processes: the temp folder and environment every child gets, a free
port, stopping a process tree (torchrun and its ranks) for good (runtime/processes.py holds what
the processes themselves use).

local_cluster.LocalCluster uses these; tests and benchmarks that start their own children reuse
them.
"""

from __future__ import annotations

import getpass
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil

from async_grpo.launch.process_tuning import launcher_child_env

logger = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # how long a stopped trainer gets to exit before SIGKILL

# A LocalCluster's processes (its Ray head's GCS, raylet and workers, the dispatchers, torchrun and
# the ranks) keep their temporary files in a folder the cluster removes when it stops. What they
# left in the system temp folder otherwise, on every clean stop (benchmarks/soak.py, RESULTS.md):
# each vLLM engine's three IPC sockets (vLLM binds them itself and never unlinks them), the
# verifier pool's multiprocessing folder (pymp-*: Ray ends the actor without its exit handlers)
# and torchrun's torchelastic_* log folder; and a worker killed mid-run leaves whatever it held.
# The folder is named after the launcher's pid, so that the next LocalCluster removes the folders
# of launchers that died without stopping (SIGKILL).
RUN_TEMP_PREFIX = "grpo-local-"


def make_run_temp_dir() -> str:
    """A new temp folder `grpo-local-<this pid>-*`, after removing those whose launcher is gone."""
    for folder in Path(tempfile.gettempdir()).glob(f"{RUN_TEMP_PREFIX}*-*"):
        owner = folder.name[len(RUN_TEMP_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            logger.info("removing %s, left by a local cluster that did not stop (pid %s)", folder, owner)
            shutil.rmtree(folder, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{RUN_TEMP_PREFIX}{os.getpid()}-")


def run_environment(temp_dir: str, tune_processes: bool = True) -> dict[str, str]:
    """Variables set for every process a LocalCluster starts: process_tuning.launcher_child_env,
    and TMPDIR=temp_dir with the two caches that live under the temp folder kept where they are:
    Ray's session folder (its logs; RAY_TMPDIR wins over TMPDIR in Ray) and torch inductor's
    compile cache (TORCHINDUCTOR_CACHE_DIR; torch's default path, which vLLM's CPU engine uses)."""
    system_temp = tempfile.gettempdir()
    return {
        **launcher_child_env(tune_processes),
        "TMPDIR": temp_dir,
        "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", system_temp),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(system_temp, f"torchinductor_{getpass.getuser()}")),
    }


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for torchrun's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _signal_pids(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def stop_process_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group `process` leads and every descendant, SIGKILL whatever is left
    after grace_s.

    Descendants are signalled by pid as well: torch 2.13's torchrun starts each rank in a session
    of its own, outside the leader's group, and once torchrun exits they are no longer its
    children; so they are collected before the first signal and again before the last.
    """
    tree = _descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    _signal_pids(tree, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("trainer did not stop within %.0f s of SIGTERM; killing it", grace_s)
    tree |= _descendants(process.pid)
    try:  # the leader may be gone while ranks linger: the group still exists then
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _signal_pids({pid for pid in tree if psutil.pid_exists(pid)}, signal.SIGKILL)
    process.wait()


class StopFlag:
    """Set by SIGINT / SIGTERM; long waits poll it so the dispatcher can clean up and exit 0."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        logger.info("received %s; stopping", signal.Signals(signum).name)
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)
