"""Launching tests/programs/data_path_worker.py's rank-0-gone scenarios as two plain processes, and
what rank 1 must then report: shared by tests/trainer/test_data_path.py (gloo) and
tests/trainer/test_gpu_data_path.py (NCCL). Needs neither Ray nor the batcher, so it runs on the GPU
machine too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from async_grpo.launch.ray_env import repo_pythonpath
from support.paths import PROGRAMS, REPO_ROOT
from support.torchrun_launch import free_port

WORKER = PROGRAMS / "data_path_worker.py"
FAILED_EXIT = 3  # data_path_worker's exit status for "stopped with Rank0DataPathError"
LAUNCH_TIMEOUT_S = 300  # generous: only stops a hung launch


def launch_pair(scenario: str, out_dir: Path, dist_timeout_s: float,
                cuda: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """Two ranks as plain processes (torchrun would kill rank 1 as soon as rank 0 exits, before
    it could show how it stops); returns rank 1's result and its wall time. cuda=False hides the
    GPUs (gloo on any host); cuda=True lets init_distributed pick NCCL, one GPU per rank."""
    port = free_port()
    procs = []
    started = time.monotonic()
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": repo_pythonpath()}
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), "--scenario", scenario, "--dist_timeout_s", str(dist_timeout_s),
             "--out_dir", str(out_dir)], env=env, cwd=REPO_ROOT, text=True, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        out, _ = procs[1].communicate(timeout=LAUNCH_TIMEOUT_S)
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(procs[1].args, procs[1].returncode, out, ""), elapsed


DIST_TIMEOUT_S = 10.0
"""The process group's timeout in the rank-0-gone scenarios; the data path waits 0.9 of it."""


def check_rank0_gone(result: subprocess.CompletedProcess, backend: str) -> None:
    """Rank 1 ran on `backend` and stopped with Rank0DataPathError from the data path's own timed
    wait (the message names its deadline), while waiting for the sizes of step 0's first round."""
    assert result.returncode == FAILED_EXIT, result.stdout[-4000:]
    assert f"rank 1 on {backend}" in result.stdout, result.stdout[-4000:]
    assert "data_path rank0 failed to exchange the message sizes for step 0" in result.stdout
    assert f"deadline {DIST_TIMEOUT_S * 0.9:.1f} s" in result.stdout
    assert "rank 0 died or stopped" in result.stdout
