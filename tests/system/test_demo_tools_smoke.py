"""scripts/demo_tools.sh as a user runs it, shortened: both runs (with and without the calculator)
on a real cluster, then the report with its curve and tool_gain= line.

    .venv/bin/python -m pytest tests/system/test_demo_tools_smoke.py -q    # ~3 min

The starting model gets a 2-step warm-up (the demo's is 800), and each run 10 small steps: this
checks that the command works end to end, not that the model learns (docs/environments.md has the
learning runs and their command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.paths import REPO_ROOT


@pytest.mark.system
def test_demo_tools_runs_both_arms_and_prints_tool_gain(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    subprocess.run([sys.executable, "scripts/prepare_tool_demo.py", "--out_dir", str(assets), "--warmup_steps", "2",
                    "--num_prompts", "200"], cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    env = {**os.environ, "DEMO_TOOLS_ASSETS": str(assets), "DEMO_TOOLS_RUNS": str(tmp_path / "runs"), "SEEDS": "0",
           "DEMO_TOOLS_CLUSTER_ARGS": "--enforce_eager true"}
    done = subprocess.run(["bash", "scripts/demo_tools.sh", "--num_steps", "10", "--prompts_per_rank", "2",
                           "--sampling.n", "4"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tool_gain=" in done.stdout and "step    9" in done.stdout
    for name, tools_allowed in (("demo-tools-s0", True), ("demo-tools-notool-s0", False)):
        records = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == 10 and all("multi_turn/observed_frac" in r for r in records)
        # The trainer's resolved config names the environment options the run used.
        config = yaml.safe_load((tmp_path / "runs" / name / "config.yaml").read_text())
        assert config["sampling"]["environment"]["options"]["tools"] == (["calculator"] if tools_allowed else [])
    assert (tmp_path / "runs" / "demo-tools-reward.png").is_file()
