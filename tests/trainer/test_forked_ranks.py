"""support.forked_ranks, the launcher of the parity programs' and the system tests' trainer ranks:
each rank gets torchrun's variables, the environment it is given and a seed of its own; one failing
rank fails the launch at once, stopping the others, with each rank's output in the error; a launch
past its timeout leaves no rank running (tests/programs/rank_probe.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from support.forked_ranks import run_ranks
from support.paths import PROGRAMS
from support.torchrun_launch import rank_env

PROBE = PROGRAMS / "rank_probe.py"
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 300.0
FAIL_WAIT_S = 120.0  # rank_probe.FAIL_WAIT_S: what the healthy rank would wait if nothing stopped it
KILL_BOUND_S = 30.0  # how long killed ranks may take to be gone (a hang guard, far under FAIL_WAIT_S)

pytestmark = [pytest.mark.distributed]


def _running(pid: int) -> bool:
    """Whether the process runs (a killed one not yet reaped is a zombie: it does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _records(out_dir: Path) -> list[dict]:
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


def test_each_rank_gets_torchruns_variables_and_its_own_seed(tmp_path: Path) -> None:
    run_ranks(PROBE, ["--out_dir", str(tmp_path)], WORLD_SIZE, LAUNCH_TIMEOUT_S)
    records = _records(tmp_path)
    for rank, record in enumerate(records):
        env = record["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(rank), str(WORLD_SIZE), str(WORLD_SIZE)), env
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert (env["OMP_NUM_THREADS"], env["CUDA_VISIBLE_DEVICES"], record["threads"]) == ("1", "", 1)
        assert record["argv"] == ["--out_dir", str(tmp_path)]
    assert records[0]["env"]["MASTER_PORT"] == records[1]["env"]["MASTER_PORT"]
    assert records[0]["pid"] != records[1]["pid"]
    assert records[0]["seed"] != records[1]["seed"]  # forked from one process, seeded apart


def test_a_failing_rank_stops_the_others_and_fails_the_launch_with_their_output(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(PROBE, ["--out_dir", str(tmp_path), "--fail_rank", "1"], WORLD_SIZE, LAUNCH_TIMEOUT_S)
    elapsed = time.monotonic() - began
    message = str(failed.value)
    assert "rank exit codes [None, 3]" in message, message
    assert "--- rank 0:\nrank 0 recorded" in message and "--- rank 1:\nrank 1 recorded" in message, message
    assert elapsed < FAIL_WAIT_S / 2, f"the launch waited for the healthy rank: {elapsed:.0f} s"
    healthy = _records(tmp_path)[0]["pid"]
    assert not _running(healthy), f"rank 0 (pid {healthy}) still runs after the launch failed"
    # The server forks the next launch as before, with the environment and log files it is given (a
    # trainer run's: LocalCluster.trainer_env, its thread count included).
    logs = [tmp_path / f"rank{rank}.out" for rank in range(WORLD_SIZE)]
    run_ranks(PROBE, ["--out_dir", str(tmp_path)], WORLD_SIZE, LAUNCH_TIMEOUT_S,
              env={**rank_env(), "OMP_NUM_THREADS": "2"}, logs=logs)
    assert [(r["env"]["OMP_NUM_THREADS"], r["threads"]) for r in _records(tmp_path)] == [("2", 2)] * WORLD_SIZE
    assert [log.read_text() for log in logs] == [f"rank {rank} recorded\n" for rank in range(WORLD_SIZE)]


def test_a_launch_past_its_timeout_kills_its_ranks_and_the_next_launch_starts_afresh(tmp_path: Path) -> None:
    # --fail_rank 9 names no rank: both record, then wait FAIL_WAIT_S, far past this launch's bound.
    with pytest.raises(AssertionError, match="no reply to rank_probe.py .* within 5 s") as failed:
        run_ranks(PROBE, ["--out_dir", str(tmp_path), "--fail_rank", "9"], WORLD_SIZE, timeout_s=5.0)
    assert "rank 0 recorded" in str(failed.value)
    pids = [record["pid"] for record in _records(tmp_path)]
    # SIGKILL takes effect when each rank is next scheduled: on a busy machine, not at once.
    deadline = time.monotonic() + KILL_BOUND_S
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids), f"ranks {pids} outlived their launch's timeout"
    run_ranks(PROBE, ["--out_dir", str(tmp_path)], WORLD_SIZE, LAUNCH_TIMEOUT_S)
    assert [record["pid"] for record in _records(tmp_path)] != pids
