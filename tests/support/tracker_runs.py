"""A small run written through the trackers, as the tracker tests read it back: four steps of
made-up metrics (two with evaluation figures) and a run config, logged by the real metrics sink
(open_metrics_sink) to the trackers a test names. tests/telemetry/test_trackers.py calls it in
process and in child processes (trackio reads its folder once, at import; the network probe)."""

from __future__ import annotations

from pathlib import Path

import yaml

from async_grpo.telemetry.metrics import MetricsConfig, open_metrics_sink

STEPS = 4
EVALS = {1: {"eval/accuracy": 0.25, "eval/pass@4": 0.5}, 3: {"eval/accuracy": 0.75, "eval/pass@4": 0.875}}
RUN_CONFIG = {"seed": 3, "num_steps": STEPS, "optim": {"lr": 0.001, "schedule": "cosine"},
              "sampling": {"n": 16, "stop": ["\n"]}, "model": {"lora": {"r": 0}}}


def logged_record(step: int) -> dict[str, float]:
    """The metrics logged at `step` (with EVALS' figures at steps 1 and 3)."""
    return {"reward/mean": 0.1 * step + 0.05, "reward/accuracy": 0.1 * step, "loss/kl": 0.001 * step,
            "response/length_mean": 3.0 + step, "entropy/first_token": 1.5 - 0.1 * step, "timing/step_s": 0.5 + step,
            "counts/samples": 64.0, **EVALS.get(step, {})}


def write_run(run_dir: Path, report_to: tuple[str, ...], *, is_main: bool = True) -> None:
    """RUN_CONFIG, then STEPS steps of logged_record, through the metrics sink to `report_to`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(RUN_CONFIG, sort_keys=False))
    sink = open_metrics_sink(run_dir, is_main=is_main, tensorboard=True, progress_total=STEPS, progress_bar=False,
                             report=MetricsConfig(report_to=report_to))
    for step in range(STEPS):
        sink.log(step, logged_record(step))
    sink.close()
