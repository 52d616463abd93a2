"""Launch a test's worker script under torchrun (or plain python) on 127.0.0.1, for tests that
check real multi-rank behaviour (tests/test_fsdp.py, tests/test_step_parity.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ray_env import repo_pythonpath

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(worker: Path, args: list[str], nproc: int | None, timeout_s: float) -> None:
    """Run `worker` with torchrun on nproc ranks (plain python when nproc is None); raise with its
    output if it fails or outlives timeout_s."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONPATH=repo_pythonpath())
    if nproc is None:
        launcher = [sys.executable]
    else:
        port = free_port()
        env["MASTER_PORT"] = str(port)
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "--master_addr=127.0.0.1", f"--master_port={port}"]
    cmd = launcher + [str(worker), *args]
    # A session of its own, so a hung launch is killed with all its ranks, not just torchrun.
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stdout[-4000:]}\n{stderr[-8000:]}")
