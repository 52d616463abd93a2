"""Launch a test's worker script under torchrun (or plain python) on 127.0.0.1, for tests that check
real multi-rank behaviour (tests/trainer/test_fsdp.py, tests/trainer/test_step_parity.py); and
free_port, for every test that needs a port for a process it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from async_grpo.launch.ray_env import repo_pythonpath
from support.paths import REPO_ROOT

# Ports a Ray node takes by default whatever it is told for its GCS: the dashboard agent's HTTP
# port, the dashboard, the client server and the default GCS port. The OS readily hands out a
# port a finished Ray node just freed (52365 twice in a row in one full run), and a `ray start
# --port` given it then refuses to start: "dashboard_agent_http is trying to use a port number
# 52365 that is used by other components".
_RAY_DEFAULT_PORTS = frozenset({52365, 8265, 10001, 6379})


def free_port() -> int:
    """A free TCP port on 127.0.0.1 that no Ray node would also claim by default."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _RAY_DEFAULT_PORTS:
            return port


def rank_env(cuda: bool = False) -> dict[str, str]:
    """What a test's rank starts from: this process's environment without a rank identity of its
    own, with this repository importable, one intra-op thread, MASTER_ADDR 127.0.0.1 and (unless
    cuda) no GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONPATH=repo_pythonpath())
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_worker(worker: Path, args: list[str], nproc: int | None, timeout_s: float, *, cuda: bool = False) -> None:
    """Run `worker` with torchrun on nproc ranks (plain python when nproc is None); raise with its
    output if it fails or outlives timeout_s.

    cuda=False hides the GPUs from the ranks: the CPU tiers check gloo and fp32 against CPU
    references on any host (on a one-GPU host, two NCCL ranks would also share one device,
    which NCCL refuses); the gpu tier passes cuda=True.
    """
    env = rank_env(cuda)
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
