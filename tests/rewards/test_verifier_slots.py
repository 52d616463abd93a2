"""The verifier pool on a cluster whose nodes offer `verification_slot`: processes reserve slots
and spread over the nodes, scoring works through the pool actor and the workers' client, and
shutting the pool down gives the slots back.

    .venv/bin/python -m pytest tests/rewards/test_verifier_slots.py -q

The cluster is two Ray nodes on this machine (ray.cluster_utils.Cluster, loopback only): a head
offering 2 slots and a second node offering 1. It runs in a child process
(tests/programs/verifier_slots_cluster.py), because a process holds one Ray connection and the
tests' session-wide Ray fixture (tests/conftest.py) must stay up for the modules after this one.
The child reports what it saw as one JSON line; the assertions are here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from support.paths import PROGRAMS, REPO_ROOT

pytestmark = pytest.mark.system  # a two-node Ray cluster in a child process (module fixture)

# Slots each node offers, and the processes asked for: more than the 3 slots, so the pool is capped.
HEAD_SLOTS = 2
SECOND_NODE_SLOTS = 1
ASKED_PROCESSES = 4
VERIFIER_TIMEOUT_S = 5.0
# Two raylets, two verifier shards and their forkservers on a busy 2-core machine: ~30 s measured.
CHILD_TIMEOUT_S = 400.0
REPORT_PREFIX = "SLOT-REPORT "  # the child's line (its REPORT_PREFIX)
# (completion, gold answer, expected reward) scored through the pool actor and the client.
CASES = [("so \\boxed{7}", "7", 1.0), ("\\boxed{3} then \\boxed{5}", "5", 1.0), ("8", "7", 0.0), ("no idea", "7", 0.0)]


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    spec = {"head_slots": HEAD_SLOTS, "second_node_slots": SECOND_NODE_SLOTS, "processes": ASKED_PROCESSES,
            "timeout_s": VERIFIER_TIMEOUT_S, "cases": [(completion, gold) for completion, gold, _ in CASES]}
    # A session of its own, so that a timeout kills the child's raylets and verifiers too.
    child = subprocess.Popen([sys.executable, str(PROGRAMS / "verifier_slots_cluster.py"), json.dumps(spec)],
                             cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        pytest.fail(f"cluster scenario did not finish within {CHILD_TIMEOUT_S:.0f} s:\n{output[-5000:]}")
    lines = [line for line in output.splitlines() if line.startswith(REPORT_PREFIX)]
    assert child.returncode == 0 and lines, f"cluster scenario failed (exit {child.returncode}):\n{output[-5000:]}"
    return json.loads(lines[-1][len(REPORT_PREFIX):])


def test_processes_reserve_slots_spread_over_nodes(report: dict) -> None:
    total = HEAD_SLOTS + SECOND_NODE_SLOTS
    assert report["slots_before"] == total
    # 4 asked, 3 offered: one process per slot, dealt over both nodes, every slot reserved.
    assert report["placement"] == {report["head_node"]: HEAD_SLOTS, report["second_node"]: SECOND_NODE_SLOTS}
    assert report["slots_taken"] == 0
    assert sorted(report["shard_nodes"]) == sorted([report["head_node"], report["second_node"]])
    assert (report["stats"]["num_processes"], report["stats"]["shards"]) == (total, 2)


def test_scoring_works_through_the_pool_and_the_client(report: dict) -> None:
    expected = [reward for _, _, reward in CASES]
    assert report["via_pool"] == expected
    assert report["via_client"] == expected
    # Every completion was verified once (the client's texts differ by a space: no cache hits).
    assert report["stats"]["scored"] == 2 * len(CASES)
    assert sum(report["per_shard_scored"]) == 2 * len(CASES)


def test_shutdown_gives_the_slots_back(report: dict) -> None:
    assert report["slots_after_shutdown"] == HEAD_SLOTS + SECOND_NODE_SLOTS

