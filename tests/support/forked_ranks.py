"""Run a program's ranks forked from a process that has already imported torch, transformers and
the trainer's modules (tests/programs/rank_forkserver.py), instead of under torchrun.

A trainer rank spends much of its CPU importing: ~2.5-3.8 CPU-s a rank, and ~1.5 more for torchrun
itself, which imports torch only to start the ranks. The distributed tier launches its parity
programs (tests/programs/: FSDP gradients, the trainer's step, LoRA and weight pushes, the data
path) about ten times, and the whole-system tests run trainer_core.py about fifteen times
(support.cluster.run_forked_trainer). Here one server per pytest process pays the imports once;
each rank is a fork of it, a real process with torchrun's environment that joins a real gloo group
on 127.0.0.1. As under torchrun, the first rank to fail stops the others and the launch fails.

Tests of what ranks do when a peer stalls or dies keep torchrun (support.torchrun_launch.run_worker),
and so do the gpu tier, the cluster path, the crash-resume kills, the chaos test and every demo and
benchmark command: there torchrun's behaviour is part of what is checked.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from support.paths import PROGRAMS, REPO_ROOT
from support.torchrun_launch import free_port, rank_env

SERVER = PROGRAMS / "rank_forkserver.py"
START_TIMEOUT_S = 300.0  # its imports take a few seconds on 2 idle cores
LOG_TAIL_CHARS = 8000

_server: subprocess.Popen | None = None


def _started_server() -> subprocess.Popen:
    """This process's rank server, started on first use (and again if a timeout killed it)."""
    global _server
    if _server is None or _server.poll() is not None:
        # A session of its own: a launch that outlives its timeout is killed with the server's group.
        _server = subprocess.Popen([sys.executable, str(SERVER)], cwd=REPO_ROOT, env=rank_env(), text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        atexit.register(_stop_server, _server)
        _read_reply(_server, START_TIMEOUT_S, "start")
    return _server


def _stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _read_reply(server: subprocess.Popen, timeout_s: float, what: str) -> dict:
    """The server's next JSON line; on a timeout or a dead server, kill its group and fail."""
    with selectors.DefaultSelector() as selector:
        selector.register(server.stdout, selectors.EVENT_READ)
        ready = selector.select(timeout_s)
    line = server.stdout.readline() if ready else ""
    if not line:
        _stop_server(server)
        raise AssertionError(f"rank server: no reply to {what} within {timeout_s:.0f} s (exit {server.returncode})")
    return json.loads(line)


def run_ranks(program: Path, args: list[str], nproc: int, timeout_s: float, *, env: dict[str, str] | None = None,
              logs: list[Path] | None = None) -> None:
    """Run `program` on nproc forked ranks; raise with each rank's output if one fails or the
    launch outlives timeout_s (the ranks and the server are then killed).

    env: what the ranks start from (default rank_env(); MASTER_ADDR is set to 127.0.0.1, where the
    port is free, and the server adds each rank's identity and port). logs: one file per rank for its output (default: temporary
    files, gone after the launch)."""
    server = _started_server()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs_dir:
        logs = logs or [Path(logs_dir) / f"rank{rank}.log" for rank in range(nproc)]
        paths = [str(path) for path in logs]
        assert len(paths) == nproc, f"{len(paths)} log files for {nproc} ranks"
        env = {**(rank_env() if env is None else env), "MASTER_ADDR": "127.0.0.1"}
        request = {"program": str(program), "args": [str(a) for a in args], "nproc": nproc, "port": free_port(),
                   "logs": paths, "env": env}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        try:
            codes = _read_reply(server, timeout_s, f"{program.name} {' '.join(request['args'])}")["exit_codes"]
        except AssertionError as error:
            raise AssertionError(f"{error}\n{_outputs(paths)}") from None
        if any(code != 0 for code in codes):
            raise AssertionError(f"{program.name} {' '.join(request['args'])}: rank exit codes {codes} "
                                 f"(None: stopped after another failed)\n{_outputs(paths)}")


def _outputs(logs: list[str]) -> str:
    parts = []
    for rank, log in enumerate(logs):
        text = Path(log).read_text(errors="replace") if Path(log).exists() else "(no output)"
        parts.append(f"--- rank {rank}:\n{text[-LOG_TAIL_CHARS:]}")
    return "\n".join(parts)
