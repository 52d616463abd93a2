"""benchmarks/checkpoint_async.py's pure helpers (in benchmarks/harness.py): which steps checkpoint, and a run's summary."""

from __future__ import annotations

import pytest

from benchmarks import harness


def test_checkpoint_steps_follow_the_trainer_rule() -> None:
    # checkpoint_every 3 over 7 steps: after steps 2 and 5, and after the last (checkpoint_at_end).
    assert harness.checkpoint_steps(7, 3) == [2, 5, 6]
    assert harness.checkpoint_steps(4, 2) == [1, 3]


def test_summarize_run_splits_checkpoint_times_and_step_times() -> None:
    records = [{"step": s, "time_s": 10.0 * (s + 1), "timing/step_s": 1.0 + s, "timing/checkpoint_s": 0.0}
               for s in range(6)]
    for step, seconds in ((1, 0.5), (3, 0.7), (5, 0.9)):
        records[step]["timing/checkpoint_s"] = seconds
    summary = harness.summarize_checkpoint_run(records, every=2, skip_steps=1)
    assert summary["checkpoint_s"] == [0.5, 0.7, 0.9]
    assert summary["step_after_checkpoint_s"] == [3.0, 5.0]  # steps 2 and 4
    assert summary["other_step_s"] == [2.0, 4.0, 6.0]  # steps 1, 3, 5 (step 0 skipped)
    assert summary["time_s"] == 60.0
    with pytest.raises(ValueError, match="once each"):
        harness.summarize_checkpoint_run(records[:2] + records[:1], every=2, skip_steps=0)
