"""Two clusters on one machine keep their shared-memory files apart (issue 35: worker_bucket_files named
them by worker name only, and generation-worker-0 exists in every cluster, so one cluster's
dispatcher removed the other's adapter folders). Two local Ray heads run at once, each in its own
process; each files an adapter folder for its generation-worker-0, then the first cleans up as
its dispatcher would: the second's folder stays."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_grpo.weights.worker_bucket_files import adapter_dir_path, remove_weight_files
from support.paths import REPO_ROOT

pytestmark = pytest.mark.system


_CLUSTER = """
import json, sys, time
from pathlib import Path
from async_grpo.weights.worker_bucket_files import adapter_dir_path, remove_weight_files
from async_grpo.launch.ray_cluster import init_local_ray
from async_grpo.runtime.ray_access import shared_memory_owner

init_local_ray(num_cpus=1, namespace="shm-names", log_to_driver=False)
owner = shared_memory_owner("generation-worker-0")
folder = adapter_dir_path(owner, 3)
folder.mkdir()
print(json.dumps({"owner": owner, "folder": str(folder)}), flush=True)
go = Path(sys.argv[1])
while not go.exists():  # both clusters up, both folders written
    time.sleep(0.1)
if sys.argv[2] == "clean":
    print(json.dumps({"removed": [str(p) for p in remove_weight_files(owner)]}), flush=True)
"""
_BOUND_S = 120


def _read_line(process: subprocess.Popen) -> dict:
    """The child's next JSON line; its error output when it ended without one."""
    line = process.stdout.readline()
    if not line:
        process.wait(timeout=_BOUND_S)
        raise AssertionError(f"the cluster process exited {process.returncode} without its line:\n"
                             f"{process.stderr.read()[-3000:]}")
    return json.loads(line)


def test_two_clusters_at_once_keep_their_workers_files_apart(tmp_path: Path) -> None:
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    clusters = [subprocess.Popen([sys.executable, "-c", _CLUSTER, str(go), role], cwd=REPO_ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for role in ("clean", "keep")]
    try:
        first = [_read_line(process) for process in clusters]
        assert first[0]["owner"] != first[1]["owner"]
        assert first[0]["owner"].endswith("-generation-worker-0") and first[1]["owner"].endswith("-generation-worker-0")
        go.touch()
        removed = _read_line(clusters[0])["removed"]
        for process in clusters:
            assert process.wait(timeout=_BOUND_S) == 0, process.stderr.read()[-3000:]
    finally:
        for process in clusters:
            if process.poll() is None:
                process.kill()
    assert removed == [first[0]["folder"]]
    assert not Path(first[0]["folder"]).exists() and Path(first[1]["folder"]).is_dir()
    remove_weight_files(first[1]["owner"])


def test_a_worker_name_is_never_a_prefix_match() -> None:
    """'generation-worker-1' never takes 'generation-worker-10''s files (the '-v' after the owner)."""
    mine, theirs = adapter_dir_path("ab12cd34-generation-worker-1", 1), adapter_dir_path("ab12cd34-generation-worker-10", 1)
    mine.mkdir(), theirs.mkdir()
    try:
        assert remove_weight_files("ab12cd34-generation-worker-1") == [mine] and theirs.is_dir()
    finally:
        remove_weight_files("ab12cd34-generation-worker-10")
