"""Forks the ranks of a test program or of trainer_core.py from one process that has already
imported torch, transformers and the trainer's modules (support.forked_ranks starts it and says why).

    python tests/programs/rank_forkserver.py      # then one JSON request per line on stdin

A request names a program, its arguments, the world size, the rendezvous port, the environment
(support.torchrun_launch.rank_env by default: the launcher's, with MASTER_ADDR, one intra-op thread
and no GPU; a trainer run's is LocalCluster.trainer_env) and one log file per rank; the server forks
one child per rank, and each child adds the variables torchrun gives a rank (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_PORT), takes the environment's OMP_NUM_THREADS as its intra-op
threads, sends its output to its log and runs the program as __main__. As under torchrun, the first
rank to fail stops the others (SIGTERM, then SIGKILL after STOP_GRACE_S). The server answers each
request with one JSON line, the ranks' exit codes, and stays single-threaded, so that each fork is
a clean copy of it. JSON, not pickle, on its pipes: nothing here unpickles what it reads.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

# What the programs of tests/programs/ and trainer_core.py import, loaded once here (the point of
# this server). Not Ray: its C++ side draws object ids from a generator seeded when it loads, so
# ranks forked after that would draw the same ids and collide in the object store; each rank that
# uses Ray imports it itself (trainer_core.py's imports beyond these cost ~0.3 CPU-s, Ray's most).
import numpy
import peft  # noqa: F401
import torch
import torch.distributed.fsdp  # noqa: F401
import transformers  # noqa: F401

import async_grpo.batching.minibatch_packer  # noqa: F401
import async_grpo.trainer.checkpoint  # noqa: F401
import async_grpo.trainer.data_path  # noqa: F401
import async_grpo.trainer.fsdp_setup  # noqa: F401
import async_grpo.trainer.optimizer  # noqa: F401
import grpo_loss  # noqa: F401
import sample_processing_utils  # noqa: F401
import setup_model  # noqa: F401

assert "ray" not in sys.modules, "a preloaded module imports ray: see the note above the imports"

STOP_GRACE_S = 5.0  # how long a stopped rank may take to exit on SIGTERM (torchrun's default is 30)
POLL_S = 0.05


def _run_rank(request: dict, rank: int) -> int:
    """In a forked child: become rank `rank` and run the program; returns its exit code. It stays in
    the server's process group, so that a launcher killing that group on a timeout kills it too."""
    world = request["nproc"]
    os.environ.clear()  # the launching process's environment now, as torchrun would pass it on
    os.environ.update(request["env"])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_PORT=str(request["port"]))
    # OMP_NUM_THREADS is read when torch loads: here, before the fork; the rank's own value applies.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    # Fresh seeds, as a new process would have (Python's `random` reseeds itself after a fork).
    torch.seed()
    numpy.random.seed()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not the rank's input
    log = os.open(request["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    program = request["program"]
    sys.argv = [program, *request["args"]]
    sys.path[0] = os.path.dirname(program)  # as `python program` would have it
    code = 0
    try:
        runpy.run_path(program, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # the program's own (Ray's shutdown, torch's); os._exit skips them
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _stop(pids: dict[int, int]) -> None:
    """SIGTERM the ranks still running, then SIGKILL whatever outlives STOP_GRACE_S."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while pids and time.monotonic() < deadline:
        _reap(pids)
        time.sleep(POLL_S)
    for pid in list(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pids.pop(pid)


def _reap(pids: dict[int, int], codes: list[int | None] | None = None) -> None:
    """Collect the ranks that exited; their codes go to `codes` (by rank)."""
    for pid, rank in list(pids.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            pids.pop(pid)
            if codes is not None:
                codes[rank] = os.waitstatus_to_exitcode(status)


def _launch(request: dict) -> list[int | None]:
    """Fork the ranks, wait for them; the first failure stops the rest (their codes stay None)."""
    pids: dict[int, int] = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            os._exit(_run_rank(request, rank))
        pids[pid] = rank
    codes: list[int | None] = [None] * request["nproc"]
    while pids:
        _reap(pids, codes)
        if any(code not in (None, 0) for code in codes):
            _stop(pids)
            break
        time.sleep(POLL_S)
    return codes


def main() -> None:
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"exit_codes": _launch(json.loads(line))}), flush=True)


if __name__ == "__main__":
    main()
