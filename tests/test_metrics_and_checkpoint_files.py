"""Checkpoint discovery ignores half-written directories; metrics files read and plot."""

from __future__ import annotations

import json
from pathlib import Path

from checkpoint import latest_checkpoint
from metrics import plot_reward_curve, read_metrics


def _complete(root: Path, step: int) -> Path:
    path = root / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_latest_checkpoint_skips_tmp_and_incomplete(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    _complete(tmp_path, 2)
    newest = _complete(tmp_path, 4)
    half_written = tmp_path / "checkpoints" / "step_000006.tmp"
    half_written.mkdir()
    (half_written / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_000008").mkdir()  # no trainer_state.json: never completed
    assert latest_checkpoint(tmp_path) == newest


def test_read_metrics_last_record_per_step_wins_and_plots(tmp_path: Path) -> None:
    lines = [
        {"step": 0, "time_s": 1.0, "reward/mean": 0.1},
        {"step": 1, "time_s": 2.0, "reward/mean": 0.2},
        {"step": 1, "time_s": 9.0, "reward/mean": 0.3},  # a resumed run re-logged step 1
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["reward/mean"] for r in records] == [0.1, 0.3]
    out = plot_reward_curve(tmp_path, tmp_path / "reward.png")
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
