"""What each tracker costs rank 0: start-up, one step's log() and close (with the reward plot),
against metrics.jsonl alone, measured in the same process.

    cd /work/main && .venv/bin/python -m benchmarks.trackers            # ~2 min on 2 cores
    .venv/bin/python -m benchmarks.trackers --steps 200 --rounds 3 --gap_s 0

Each round runs MetricsLogger once per setting (jsonl alone, then jsonl plus one tracker) on a
fresh run dir with a config.yaml, logging `--steps` records of the trainer's size (~60 keys,
evaluation keys every 10th step), `--gap_s` apart: the time a training step takes between two
log() calls, in which a tracker's background threads catch up (0: back to back, the worst
case). W&B runs offline, MLflow on its SQLite file in the run dir,
trackio in a temporary TRACKIO_DIR (set before trackio is imported). Per setting: the median over
rounds of start-up seconds, of the median log() seconds per step, and of close() seconds.

The LAST line is key=value pairs: `<tracker>_log_ms=<median> <tracker>_log_ratio=<vs jsonl> ...`
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

SETTINGS = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
# Keys of one trainer step (metrics.StepAccumulator.finalize and the batcher's, ~60).
STEP_KEYS = 60
EVAL_EVERY = 10


def _record(step: int) -> dict[str, float]:
    record = {f"group{i % 8}/metric_{i}": float(step * i % 97) / 97 for i in range(STEP_KEYS - 6)}
    record.update({"reward/mean": 0.5, "reward/accuracy": 0.5, "loss/kl": 0.01, "response/length_mean": 3.0,
                   "entropy/first_token": 1.0, "timing/step_s": 1.0})
    if step % EVAL_EVERY == 0:
        record.update({"eval/accuracy": 0.5, "eval/pass@4": 0.75})
    return record


def _one(setting: str, steps: int, gap_s: float, root: Path) -> tuple[float, float, float]:
    from async_grpo.telemetry.metrics import MetricsConfig, MetricsLogger

    run_dir = root / f"{setting}-{time.monotonic_ns()}"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 0\noptim:\n  lr: 0.001\n")
    start = time.perf_counter()
    sink = MetricsLogger(run_dir, tensorboard=True, progress_total=steps, progress_bar=False,
                         report=MetricsConfig(report_to=("jsonl",) if setting == "jsonl" else ("jsonl", setting)))
    started = time.perf_counter() - start
    per_step = []
    for step in range(steps):
        t = time.perf_counter()
        sink.log(step, _record(step))
        per_step.append(time.perf_counter() - t)
        time.sleep(gap_s)
    t = time.perf_counter()
    sink.close()
    return started, statistics.median(per_step), time.perf_counter() - t


SMOKE = {"steps": 5, "rounds": 1, "gap_s": 0.0}
"""Sizes of the smoke mode."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap_s", type=float, default=0.1, help="seconds between two steps' log() calls")
    parser.add_argument("--smoke", type=lambda v: v.lower() == "true", default=False,
                        help="true: 5 steps, 1 round, no gap (SMOKE): checks that the command still runs")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rounds, args.gap_s = SMOKE["steps"], SMOKE["rounds"], SMOKE["gap_s"]
    results: dict[str, list[tuple[float, float, float]]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="trackers-bench-") as temporary:  # the runs' files, removed at the end
        root = Path(temporary)
        os.environ["TRACKIO_DIR"] = str(root / "trackio")  # before trackio is imported
        os.environ["WANDB_DATA_DIR"] = str(root / "wandb-data")
        for round_ in range(args.rounds):
            for setting in SETTINGS:
                results[setting].append(_one(setting, args.steps, args.gap_s, root))
                start_s, log_s, close_s = results[setting][-1]
                print(f"round {round_} {setting}: start {start_s:.2f} s, log {log_s * 1e3:.2f} ms/step, "
                      f"close {close_s:.2f} s", flush=True)
    base_log = statistics.median(r[1] for r in results["jsonl"])
    pairs = []
    for setting, runs in results.items():
        log_ms = statistics.median(r[1] for r in runs) * 1e3
        pairs += [f"{setting}_start_s={statistics.median(r[0] for r in runs):.2f}", f"{setting}_log_ms={log_ms:.2f}",
                  f"{setting}_log_ratio={log_ms / (base_log * 1e3):.1f}",
                  f"{setting}_close_s={statistics.median(r[2] for r in runs):.2f}"]
    print(" ".join(pairs))


if __name__ == "__main__":
    main()
