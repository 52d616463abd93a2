"""`python -m async_grpo.telemetry.metrics compare`: the table and the figure of run_report.py, checked against values
worked out by hand on synthetic metrics.jsonl files (binary-exact rewards, so means compare
exactly); the same code is the demo's report (scripts/demo_report.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from async_grpo.config.run_config import load_config
from async_grpo.telemetry.metrics import CompareConfig
from async_grpo.telemetry.metrics import main as metrics_main
from async_grpo.telemetry.run_report import (
    COMMAND_TIME, THRESHOLDS, TRAINER_TIME, WINDOW, compare_runs, runs_figure, summarize_run,
)
from support.paths import REPO_ROOT

# Run "fast": rewards 0, .25, .75, .75, 1 at 10 s a step; 2-step means 0, .125, .5, .75, .875.
FAST = {"rewards": [0.0, 0.25, 0.75, 0.75, 1.0], "step_s": [1.0, 3.0, 2.0, 5.0, 4.0], "evals": {2: 0.5, 4: 0.75}}
# Run "slow": rewards 0, 0, .25, .5, .5 at 30 s a step; 2-step means 0, 0, .125, .375, .5.
SLOW = {"rewards": [0.0, 0.0, 0.25, 0.5, 0.5], "step_s": [6.0, 6.0, 6.0, 7.0, 8.0], "evals": {}}


def _write_run(run_dir: Path, spec: dict, seconds_per_step: float, started_at: float | None = None) -> Path:
    run_dir.mkdir(parents=True)
    t0 = 1_000_000.0
    lines = []
    for step, (reward, step_s) in enumerate(zip(spec["rewards"], spec["step_s"])):
        time_s = seconds_per_step * (step + 1)
        record = {"step": step, "time_s": time_s, "unix_time": t0 + time_s, "reward/mean": reward,
                  "timing/step_s": step_s}
        if step in spec["evals"]:
            record["eval/accuracy"] = spec["evals"][step]
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "config.yaml").write_text("seed: 7\n")
    if started_at is not None:  # scripts/demo.sh's marks: the command began 60 s before the trainer
        (run_dir / "command_started_at").write_text(str(t0 - started_at))
        (run_dir / "command_finished_at").write_text(str(t0 + 300.0))
    return run_dir


def test_summary_by_hand(tmp_path: Path) -> None:
    fast = summarize_run(_write_run(tmp_path / "fast", FAST, 10.0), window=2, thresholds=(0.5, 0.8, 0.9))
    # 2-step means 0, .125, .5, .75, .875: 0.5 first at step 2 (30 s), 0.8 at step 4 (50 s), never 0.9.
    assert fast.reached == {0.5: (2, 0.5), 0.8: (4, 50 / 60), 0.9: None}
    assert (fast.final_mean, fast.final_eval_accuracy, fast.median_step_s) == (0.875, 0.75, 3.0)
    assert (fast.seed, fast.steps, fast.total_min) == (7, 5, None)


def test_compare_table_and_figure(tmp_path: Path) -> None:
    fast = _write_run(tmp_path / "fast", FAST, 10.0, started_at=60.0)
    slow = _write_run(tmp_path / "slow", SLOW, 30.0, started_at=60.0)
    text = compare_runs([fast, slow], tmp_path / "cmp.png", window=2, thresholds=(0.5, 0.8))
    rows = [line for line in text.splitlines() if line.startswith("|")]
    # Times from the command's start (60 s before the trainer's): fast reaches 0.5 at step 2,
    # 60 + 30 s = 1.5 min; slow at step 4, 60 + 150 s = 3.5 min; whole command 360 s = 6 min.
    assert rows[0] == ("| run | seed | steps | first >= 0.5 | first >= 0.8 | last-2 reward | best 2-step mean (step) "
                       "| greedy eval acc | median step (s) | command (min) |")
    # Both runs rise to the end: their best 2-step mean is their last.
    assert rows[2] == "| fast | 7 | 5 | step 2 (1.5 min) | step 4 (1.8 min) | 0.875 | 0.875 (4) | 0.750 | 3.00 | 6.0 |"
    assert rows[3] == "| slow | 7 | 5 | step 4 (3.5 min) | not reached | 0.500 | 0.500 (4) | - | 6.00 | 6.0 |"
    assert rows[4] == ("| median (min-max) |  |  | 2.50 (1.50-3.50) min | 1.83 (1.83-1.83) min, 1 not reached "
                       "| 0.69 (0.50-0.88) | 0.69 (0.50-0.88) | 0.75 (0.75-0.75) | 4.50 (3.00-6.00) | 6.00 (6.00-6.00) |")
    assert COMMAND_TIME in text
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"

    fig = runs_figure([fast, slow], title="t", window=2)
    by_step, by_time = ({line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
                         if not line.get_label().startswith("_")} for ax in fig.axes)
    plt.close(fig)
    assert by_step == {"fast: reward, 2-step mean": ([0, 1, 2, 3, 4], [0.0, 0.125, 0.5, 0.75, 0.875]),
                       "fast: greedy eval accuracy": ([2, 4], [0.5, 0.75]),
                       "slow: reward, 2-step mean": ([0, 1, 2, 3, 4], [0.0, 0.0, 0.125, 0.375, 0.5])}
    assert by_time["fast: greedy eval accuracy"] == ([1.5, 110 / 60], [0.5, 0.75])
    assert by_time["slow: reward, 2-step mean"][0] == [1.5, 2.0, 2.5, 3.0, 3.5]
    assert fig.axes[1].get_xlabel() == COMMAND_TIME


def test_runs_without_command_marks_use_the_trainer_clock(tmp_path: Path) -> None:
    fast = _write_run(tmp_path / "fast", FAST, 10.0, started_at=60.0)
    slow = _write_run(tmp_path / "slow", SLOW, 30.0)  # no marks: both runs fall back to time_s
    text = compare_runs([fast, slow], None, window=2, thresholds=(0.5,))
    assert "| fast | 7 | 5 | step 2 (0.5 min) |" in text and "| slow | 7 | 5 | step 4 (2.5 min) |" in text
    assert TRAINER_TIME in text


def test_command_lines_load_their_configs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fast = _write_run(tmp_path / "fast", FAST, 10.0)
    out = tmp_path / "reward.png"
    metrics_main(["plot", "--run_dir", str(fast), "--out", str(out), "--title", "t"])
    assert capsys.readouterr().out == f"wrote {out}\n" and out.read_bytes()[:4] == b"\x89PNG"
    # The run directories are positional; window and levels default to the reports' own.
    assert load_config(CompareConfig, [str(fast), "b"]) == CompareConfig(
        run_dirs=[str(fast), "b"], out="compare.png", window=WINDOW, thresholds=list(THRESHOLDS))
    with pytest.raises(SystemExit) as info:
        metrics_main(["compare", str(fast), "--window", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "metrics.py compare: CompareConfig: CompareConfig.window must be >= 1, got 0\n"


@pytest.mark.system
def test_compare_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fast = _write_run(tmp_path / "fast", FAST, 10.0)
    slow = _write_run(tmp_path / "slow", SLOW, 30.0)
    out = tmp_path / "fig.png"
    metrics_main(["compare", str(fast), str(slow), "--out", str(out), "--window", "2", "--thresholds", "0.5"])
    printed = capsys.readouterr().out
    # best 2-step mean: 0.875, the window ending at step 4 (FAST's 2-step means .125, .5, .75, .875)
    assert "| fast | 7 | 5 | step 2 (0.5 min) | 0.875 | 0.875 (4) | 0.750 | 3.00 | - |" in printed
    assert f"wrote {out}" in printed and out.is_file()
    missing = subprocess.run([sys.executable, "-m", "async_grpo.telemetry.metrics", "compare", str(fast), str(tmp_path / "nope")],
                             cwd=REPO_ROOT, capture_output=True, text=True)
    assert missing.returncode == 2
    expected = f"metrics.py compare: {tmp_path / 'nope'}: no metrics.jsonl (is it a run directory?)"
    assert missing.stderr.strip() == expected
