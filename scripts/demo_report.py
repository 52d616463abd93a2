"""Summarise demo runs: a markdown table (one row per run) and one reward curve for all of them.

    python scripts/demo_report.py --runs runs/demo-seed0 runs/demo-seed1 runs/demo-seed2 \
        --out_md docs/demo_seeds.md --out_png docs/demo_reward.png
    python scripts/demo_report.py --runs runs/demo            # one run: prints its summary line

Each run directory holds the trainer's metrics.jsonl and, written by scripts/demo.sh, the
`command_started_at` file (unix time when the demo command started), so times are reported from
the command's start: Ray, worker and trainer start-up included. Every figure printed here is
computed from those files; nothing is typed in by hand.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from metrics import first_reached, moving_average, read_metrics  # noqa: E402
from run_config import load_config  # noqa: E402

WINDOW = 10  # the README's "10-step mean reward"
THRESHOLDS = (0.5, 0.6, 0.9)
STARTED_FILE = "command_started_at"
FINISHED_FILE = "command_finished_at"
EVAL_ACCURACY = "eval/accuracy"


@dataclass(kw_only=True, frozen=True)
class DemoReportConfig:
    """Command line of `python scripts/demo_report.py`."""

    runs: list[str]
    """Run directories (each with the trainer's metrics.jsonl), one or more."""
    out_md: str | None = None
    """Write the table (markdown) here; None: print the summary lines only."""
    out_png: str | None = None
    """Draw all runs' curves here; None: no plot."""
    command: str = ""
    """The command that produced the runs, quoted in the table."""


@dataclass(slots=True)
class RunSummary:
    """What the README reports of one demo run."""

    name: str
    seed: int | None
    steps: int
    reached: dict[float, tuple[int, float] | None]
    """threshold -> (first step whose 10-step mean reached it, minutes since the command), or None."""
    final_mean: float
    """10-step mean reward over the last 10 steps."""
    final_eval_accuracy: float | None
    """Greedy accuracy of the last evaluation, if the run evaluated."""
    median_step_s: float
    total_min: float | None
    """Minutes from the command's start to its end (None if the run has no finish mark)."""


def _read_time(path: Path) -> float | None:
    return float(path.read_text().strip()) if path.is_file() else None


def summarize_run(run_dir: Path) -> RunSummary:
    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no records")
    started = _read_time(run_dir / STARTED_FILE)
    finished = _read_time(run_dir / FINISHED_FILE)

    def minutes(record: dict) -> float:
        if started is not None and "unix_time" in record:
            return (record["unix_time"] - started) / 60
        return record["time_s"] / 60  # no command mark: time since the trainer started

    smoothed = moving_average([r["reward/mean"] for r in records], WINDOW)
    reached: dict[float, tuple[int, float] | None] = {}
    for threshold in THRESHOLDS:
        i = first_reached(records, threshold, WINDOW)
        reached[threshold] = None if i is None else (records[i]["step"], minutes(records[i]))
    evals = [r[EVAL_ACCURACY] for r in records if EVAL_ACCURACY in r]
    config_seed = _config_seed(run_dir)
    return RunSummary(
        name=run_dir.name, seed=config_seed, steps=len(records), reached=reached, final_mean=smoothed[-1],
        final_eval_accuracy=evals[-1] if evals else None,
        median_step_s=statistics.median(r["timing/step_s"] for r in records),
        total_min=None if started is None or finished is None else (finished - started) / 60,
    )


def _config_seed(run_dir: Path) -> int | None:
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()).get("seed") if path.is_file() else None


def _reached_text(value: tuple[int, float] | None) -> str:
    return "not reached" if value is None else f"step {value[0]} ({value[1]:.1f} min)"


def summary_line(s: RunSummary) -> str:
    reached = "; ".join(f"{t}: {_reached_text(s.reached[t])}" for t in THRESHOLDS)
    evaluated = "" if s.final_eval_accuracy is None else f", final greedy eval accuracy {s.final_eval_accuracy:.3f}"
    total = "" if s.total_min is None else f", whole command {s.total_min:.1f} min"
    return (f"{s.name}: {WINDOW}-step mean reward first reached {reached}; last {WINDOW} steps "
            f"{s.final_mean:.3f}{evaluated}; median step {s.median_step_s:.2f} s{total}")


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def markdown_table(summaries: list[RunSummary]) -> str:
    header = ["run", "seed", "steps"] + [f"first >= {t}" for t in THRESHOLDS] + [
        "last-10 reward", "greedy eval acc", "median step (s)", "command (min)"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        cells = [s.name, str(s.seed), str(s.steps)] + [_reached_text(s.reached[t]) for t in THRESHOLDS] + [
            f"{s.final_mean:.3f}", "-" if s.final_eval_accuracy is None else f"{s.final_eval_accuracy:.3f}",
            f"{s.median_step_s:.2f}", "-" if s.total_min is None else f"{s.total_min:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    minutes = {t: [s.reached[t][1] for s in summaries if s.reached[t]] for t in THRESHOLDS}
    missing = {t: sum(1 for s in summaries if s.reached[t] is None) for t in THRESHOLDS}
    spread = ["median (min-max)", "", ""] + [
        _spread(minutes[t]) + " min" + (f", {missing[t]} not reached" if missing[t] else "") for t in THRESHOLDS] + [
        _spread([s.final_mean for s in summaries]),
        _spread([s.final_eval_accuracy for s in summaries if s.final_eval_accuracy is not None]),
        _spread([s.median_step_s for s in summaries]),
        _spread([s.total_min for s in summaries if s.total_min is not None])]
    rows.append("| " + " | ".join(spread) + " |")
    return "\n".join(rows)


TIMING_KEYS = ("timing/step_s", "timing/wait_s", "timing/train_s", "timing/push_s",
               "timing/batcher_generate_s_mean", "timing/batcher_logprob_s_mean", "perf/samples_per_s")


def timing_line(run_dirs: list[Path]) -> str:
    """Medians over every step of every run: where a step's time goes, and what an evaluation costs.
    `rest` is step - wait - train - push (optimizer steps, metrics, the batcher's stats call)."""
    records = [r for run in run_dirs for r in read_metrics(run / "metrics.jsonl")]
    medians = {k.split("/", 1)[1]: statistics.median(r[k] for r in records if k in r) for k in TIMING_KEYS}
    medians["rest_s"] = statistics.median(
        r["timing/step_s"] - r["timing/wait_s"] - r["timing/train_s"] - r["timing/push_s"] for r in records)
    evals = [r["eval/time_s"] for r in records if "eval/time_s" in r]
    if evals:
        medians["eval_time_s"] = statistics.median(evals)
    return "medians over all steps: " + " ".join(f"{k}={v:.3f}" for k, v in medians.items())


def machine_line() -> str:
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """10-step mean reward of every run against minutes since its command started, and eval points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run_dir in run_dirs:
        records = read_metrics(run_dir / "metrics.jsonl")
        started = _read_time(run_dir / STARTED_FILE)
        steps = [r["step"] for r in records]
        minutes = [((r["unix_time"] - started) if started and "unix_time" in r else r["time_s"]) / 60 for r in records]
        smoothed = moving_average([r["reward/mean"] for r in records], WINDOW)
        for ax, xs in ((axes[0], steps), (axes[1], minutes)):
            line, = ax.plot(xs, smoothed, label=f"{run_dir.name}: reward, {WINDOW}-step mean")
            points = [(x, r[EVAL_ACCURACY]) for x, r in zip(xs, records) if EVAL_ACCURACY in r]
            if points:
                ax.plot(*zip(*points), marker="o", linestyle=":", color=line.get_color(), markersize=4,
                        label=f"{run_dir.name}: greedy eval accuracy")
    for ax, label in ((axes[0], "step"), (axes[1], "minutes since the command started")):
        ax.axhline(0.9, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("demo: tiny Qwen2, single-digit addition, 2 CPU cores (scripts/demo_seeds.sh)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    args = load_config(DemoReportConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    runs = [Path(run) for run in args.runs]
    summaries = [summarize_run(run) for run in runs]
    for s in summaries:
        print("[demo]", summary_line(s))
    timing = timing_line(runs)
    print("[demo]", timing)
    if args.out_md:
        out_md = Path(args.out_md)
        text = [f"Measured {machine_line()}.", ""]
        if args.command:
            text += [f"Command: `{args.command}`", ""]
        text += [markdown_table(summaries), "", f"Step time, {timing}", ""]
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text("\n".join(text))
        print(f"[demo] wrote {out_md}")
    if args.out_png:
        print(f"[demo] wrote {plot_runs(runs, Path(args.out_png))}")


if __name__ == "__main__":
    main()
