"""Table demo runs by max_lag: how soon each reaches a reward level, and how stale it trained.

    python scripts/lag_report.py --runs runs/demo-lag0-s0 runs/demo-lag1-s0 --out_md runs/demo_lag.md

One row per run (max_lag and loss.decoupled from its config.yaml), then one row per max_lag with
the median and range of the step that first reaches 0.9 (10-step mean reward) and how many runs
never did. Staleness columns are the run's medians over steps of the trainer's metrics
(staleness/mean, behaviour/*), staleness/max its largest. Everything is read from the runs' files.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.telemetry.run_report import read_metrics, summarize_run  # noqa: E402

LEVEL = 0.9


@dataclass(kw_only=True, frozen=True)
class LagReportConfig:
    """Command line of `python scripts/lag_report.py`."""

    runs: list[str]
    """Run directories (each with metrics.jsonl and config.yaml)."""
    out_md: str | None = None
    """Write the table (markdown) here; None: print it only."""
    command: str = ""
    """The command that produced the runs, quoted above the table."""


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def _cell(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _run_row(run: Path) -> tuple[int, int | None, str]:
    """(max_lag, first step at LEVEL or None, the run's table row)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    lag, decoupled = config["max_lag"], config["loss"].get("decoupled")  # config.yaml keeps max_lag top-level
    records = read_metrics(run / "metrics.jsonl")
    summary = summarize_run(run)
    reached = summary.reached.get(LEVEL)
    step = reached[0] if reached else None
    cells = [run.name, str(lag), str(decoupled), str(summary.seed), str(summary.steps),
             "-" if step is None else str(step), f"{summary.final_mean:.3f}",
             _cell(summary.final_eval_accuracy), f"{summary.median_step_s:.2f}",
             _cell(_median(records, "staleness/mean"), "{:.2f}"),
             _cell(max((r.get("staleness/max", 0.0) for r in records), default=None), "{:.0f}"),
             _cell(_median(records, "behaviour/weight_mean")), _cell(_median(records, "behaviour/weight_std")),
             _cell(_median(records, "behaviour/capped_frac"))]
    return lag, step, "| " + " | ".join(cells) + " |"


def lag_table(runs: list[Path]) -> str:
    header = ["run", "max_lag", "decoupled", "seed", "steps", f"first >= {LEVEL} (step)", "last-10 reward",
              "greedy eval acc", "median step (s)", "staleness/mean", "staleness/max", "behaviour weight mean",
              "behaviour weight std", "capped frac"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_lag: dict[int, list[int | None]] = {}
    for run in runs:
        lag, step, row = _run_row(run)
        by_lag.setdefault(lag, []).append(step)
        lines.append(row)
    lines += ["", f"| max_lag | runs | first >= {LEVEL}: median (min-max) | not reached |", "|---|---|---|---|"]
    for lag, steps in sorted(by_lag.items()):
        got = [s for s in steps if s is not None]
        spread = f"{statistics.median(got):g} ({min(got)}-{max(got)})" if got else "-"
        lines.append(f"| {lag} | {len(steps)} | {spread} | {len(steps) - len(got)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = load_config(LagReportConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    table = lag_table([Path(run) for run in args.runs])
    text = ([f"Command: `{args.command}`", ""] if args.command else []) + [table, ""]
    print("\n".join(text))
    if args.out_md:
        Path(args.out_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_md).write_text("\n".join(text))
        print(f"[lag_report] wrote {args.out_md}")


if __name__ == "__main__":
    main()
