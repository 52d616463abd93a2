"""scripts/lag_report.py: the table behind scripts/demo_lag.sh, on runs written by hand.

    .venv/bin/python -m pytest tests/telemetry/test_lag_report.py -q
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from support.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("lag_report", REPO_ROOT / "scripts" / "lag_report.py")
lag_report = importlib.util.module_from_spec(_spec)
sys.modules["lag_report"] = lag_report  # dataclasses look their module up while building the class
_spec.loader.exec_module(lag_report)


def _run(root: Path, name: str, lag: int, rewards: list[float], staleness: list[float]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    records = [{"step": step, "time_s": 10.0 * (step + 1), "reward/mean": reward, "timing/step_s": 0.5,
                "staleness/mean": lagged, "staleness/max": lagged, "behaviour/weight_mean": 1.0 - 0.01 * step,
                "behaviour/weight_std": 0.1, "behaviour/capped_frac": 0.0}
               for step, (reward, lagged) in enumerate(zip(rewards, staleness))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # As the trainer saves it: the experience section's fields are top-level (flattened).
    (run / "config.yaml").write_text(f"seed: 3\nmax_lag: {lag}\nloss:\n  decoupled: {str(lag > 0).lower()}\n")
    return run


def test_the_table_gives_each_lag_its_median_step_and_misses(tmp_path: Path) -> None:
    climbing = [0.0] * 5 + [1.0] * 15  # the 10-step mean first reaches 0.9 at step 13 (9 of 10 at 1.0)
    late = [0.0] * 8 + [1.0] * 12  # ... at step 16
    never = [0.5] * 20
    runs = [_run(tmp_path, "a", 0, climbing, [0.0] * 20), _run(tmp_path, "b", 1, climbing, [1.0] * 20),
            _run(tmp_path, "c", 1, late, [0.0] + [1.0] * 19), _run(tmp_path, "d", 1, never, [1.0, 2.0] * 10)]
    table = lag_report.lag_table(runs)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert "| a | 0 | False | 3 | 20 | 13 |" in rows["a"]
    assert "| c | 1 | True | 3 | 20 | 16 |" in rows["c"]
    assert rows["d"].split(" | ")[5] == "-" and rows["d"].split(" | ")[10] == "2"
    assert "| 0 | 1 | 13 (13-13) | 0 |" in table
    assert "| 1 | 3 | 14.5 (13-16) | 1 |" in table
