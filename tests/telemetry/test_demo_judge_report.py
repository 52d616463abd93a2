"""scripts/demo_judge_report.py: the judge demo's figures, on a run written by hand.

    .venv/bin/python -m pytest tests/telemetry/test_demo_judge_report.py -q
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from support.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("demo_judge_report", REPO_ROOT / "scripts" / "demo_judge_report.py")
demo_judge_report = importlib.util.module_from_spec(_spec)
sys.modules["demo_judge_report"] = demo_judge_report  # dataclasses look their module up while building the class
_spec.loader.exec_module(demo_judge_report)


def test_a_run_gives_its_evaluations_first_target_and_agreement(tmp_path: Path) -> None:
    # 120 steps: math-verify right on 0.1 of answers for the first 10, the judge agreeing fully
    # for the first 50 steps and on 0.8 after (a judge being fooled late), evaluations at 49 / 99 / 119.
    records = []
    for step in range(120):
        record = {"step": step, "reward/judge": 0.9, "reward/math_verify_reward": 0.1 if step < 10 else 0.7,
                  "reward/judge_agreement": 1.0 if step < 50 else 0.8, "timing/step_s": 1.0 + step % 3,
                  "judge/requests": 32 if step % 2 else 36, "judge/tokens_in": 3000.0 + step, "judge/tokens_out": 100.0,
                  "judge/latency_s_mean": 0.5}
        if step in (49, 99, 119):
            record["eval/accuracy"] = {49: 0.5, 99: 0.85, 119: 0.75}[step]
        records.append(record)
    run = tmp_path / "demo-judge-s0"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = demo_judge_report.summarize(run, target=0.8)
    assert summary.evals == [(49, 0.5), (99, 0.85), (119, 0.75)] and summary.first_at_target == 99
    assert summary.math_verify_start == pytest.approx(0.1)
    assert summary.agreement_first == pytest.approx(1.0) and summary.agreement_last == pytest.approx(0.8)
    assert summary.agreement_all == pytest.approx((50 * 1.0 + 70 * 0.8) / 120)
    assert (summary.judge_last, summary.math_verify_last) == (pytest.approx(0.9), pytest.approx(0.7))
    # medians over the 120 steps: requests 32 or 36 (60 each), tokens 3,100 + step, step 1 / 2 / 3 s
    assert (summary.requests_median, summary.tokens_median, summary.step_s_median) == (34, 3159.5, 2.0)
    assert "| demo-judge-s0 | 120 | 0.100 |" in demo_judge_report.table([summary], 0.8)
    assert "| 34 / 3,160 / 0.500 | 2.000 |" in demo_judge_report.table([summary], 0.8)
    never = demo_judge_report.summarize(run, target=0.9)
    assert never.first_at_target is None and "not reached" in demo_judge_report.line(never, 0.9)
