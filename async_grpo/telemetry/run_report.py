"""Compare runs from their metrics.jsonl: when each reached given reward levels (step and time),
its final reward, its last greedy evaluation and its median step time, as a markdown table; and
one figure of every run's reward curve against step and time, with evaluation points.

    python -m async_grpo.telemetry.metrics compare runs/a runs/b --out compare.png
    python scripts/demo_report.py --runs runs/demo-seed0 runs/demo-seed1   # the demo's report

Times count from the command's start when every run has the `command_started_at` file that
scripts/demo.sh writes (Ray, worker and trainer start-up included), else from the trainer's
start (`time_s`). Every figure is computed from the run directories; nothing is typed in by hand.

`run_summary` is what the trainer prints at the end of every run (docs/console.md): the same
summary line, where a step's time goes, and what was dropped.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

EVAL_ACCURACY = "eval/accuracy"

# The one home of the levels every report reads a run's reward at (this module's table and
# figures, the trainer's summary and progress bar, `metrics.py plot / compare`, the demos' reports,
# benchmarks/learning_parity.py). One step's mean reward is one batch's, noisy from step to step,
# so reports read a trailing mean over WINDOW steps (the README's "10-step mean reward").
WINDOW = 10
# Levels a report times that mean at ("first >= t"): 0.5 and 0.6 show when a run has left its
# start (the demo's starting model is 4% correct), TARGET_LEVEL is the level the README's demo
# claims every run passes (drawn dashed on the figures).
THRESHOLDS = (0.5, 0.6, 0.9)
TARGET_LEVEL = THRESHOLDS[-1]
# A run whose last window-step mean ends more than this below its best window has lost what it
# learned (the tool demo's seed 3 ended 0.25 below its best; converged demo runs end within a few
# hundredths of theirs): reports say so beside the final figure.
ENDED_BELOW_BEST = 0.1


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl, the last record per step winning (a resumed run appends)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from None
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the up to window - 1 before it (a trailing window)."""
    if window < 1:
        raise ValueError(f"moving_average window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def best_window(records: Sequence[dict[str, Any]], window: int = WINDOW) -> tuple[float, int]:
    """(the highest window-step mean reward over full windows, the step its window ends at); the
    last record's trailing mean and step when the run is shorter than one window."""
    smoothed = moving_average([r["reward/mean"] for r in records], window)
    full = range(window - 1, len(smoothed)) if len(smoothed) >= window else range(len(smoothed) - 1, len(smoothed))
    best = max(full, key=lambda i: (smoothed[i], -i))
    return smoothed[best], records[best]["step"]


def ended_below_best(final: float, best: float) -> str:
    """'' for a run that ended near its best, else a warning to print beside its final figure."""
    return f" (ENDED {best - final:.2f} BELOW ITS BEST)" if best - final > ENDED_BELOW_BEST else ""


def first_reached(records: Sequence[dict[str, Any]], target: float, window: int = WINDOW) -> int | None:
    """Index of the first record whose trailing window-step mean reward (a full window) is >= target."""
    smoothed = moving_average([r["reward/mean"] for r in records], window)
    return next((i for i in range(window - 1, len(smoothed)) if smoothed[i] >= target), None)


EVAL_PASS_AT_PREFIX = "eval/pass@"
STARTED_FILE = "command_started_at"
FINISHED_FILE = "command_finished_at"
COMMAND_TIME = "minutes since the command started"
TRAINER_TIME = "minutes since the trainer started"


@dataclass(slots=True)
class RunSummary:
    """One run's row of the table."""

    name: str
    seed: int | None
    steps: int
    reached: dict[float, tuple[int, float] | None]
    """threshold -> (first step whose window-step mean reached it, minutes), or None."""
    final_mean: float
    """Mean reward over the last `window` steps (all steps if fewer)."""
    best_mean: float
    """The highest window-step mean reward of the run (over full windows; the final one if none)."""
    best_step: int
    """The step that window ends at."""
    final_eval_accuracy: float | None
    """Greedy accuracy of the last evaluation, if the run evaluated."""
    median_step_s: float
    total_min: float | None
    """Minutes from the command's start to its end (None if the run has no such marks)."""


def _read_time(path: Path) -> float | None:
    return float(path.read_text().strip()) if path.is_file() else None


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a run directory?)")
    records = read_metrics(path)
    if not records:
        raise ValueError(f"{path} has no records")
    return records


def command_times(run_dirs: Sequence[Path]) -> bool:
    """Whether times count from the command's start: only if every run has the mark, so that all
    runs of one table or figure share one clock."""
    return all((Path(run) / STARTED_FILE).is_file() for run in run_dirs)


def record_minutes(run_dir: Path, records: Sequence[dict[str, Any]], from_command: bool) -> list[float]:
    """Each record's minutes since the command started (from_command) or the trainer started."""
    started = _read_time(Path(run_dir) / STARTED_FILE) if from_command else None
    if started is None:
        return [r["time_s"] / 60 for r in records]
    # Records written before unix_time existed fall back to the trainer's clock.
    return [(r["unix_time"] - started) / 60 if "unix_time" in r else r["time_s"] / 60 for r in records]


def summarize_run(run_dir: Path, *, from_command: bool | None = None, window: int = WINDOW,
                  thresholds: Sequence[float] = THRESHOLDS) -> RunSummary:
    run_dir = Path(run_dir)
    records = _records(run_dir)
    from_command = command_times([run_dir]) if from_command is None else from_command
    minutes = record_minutes(run_dir, records, from_command)
    reached: dict[float, tuple[int, float] | None] = {}
    for threshold in thresholds:
        i = first_reached(records, threshold, window)
        reached[threshold] = None if i is None else (records[i]["step"], minutes[i])
    evals = [r[EVAL_ACCURACY] for r in records if EVAL_ACCURACY in r]
    started, finished = _read_time(run_dir / STARTED_FILE), _read_time(run_dir / FINISHED_FILE)
    return RunSummary(
        name=run_dir.name, seed=_config_seed(run_dir), steps=len(records), reached=reached,
        final_mean=moving_average([r["reward/mean"] for r in records], window)[-1],
        **dict(zip(("best_mean", "best_step"), best_window(records, window))),
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


def summary_line(s: RunSummary, window: int = WINDOW) -> str:
    reached = "; ".join(f"{t}: {_reached_text(v)}" for t, v in s.reached.items())
    evaluated = "" if s.final_eval_accuracy is None else f", final greedy eval accuracy {s.final_eval_accuracy:.3f}"
    total = "" if s.total_min is None else f", whole command {s.total_min:.1f} min"
    return (f"{s.name}: {window}-step mean reward first reached {reached}; last {window} steps "
            f"{s.final_mean:.3f}, best {s.best_mean:.3f} at step {s.best_step}"
            f"{ended_below_best(s.final_mean, s.best_mean)}{evaluated}; median step {s.median_step_s:.2f} s{total}")


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def markdown_table(summaries: Sequence[RunSummary], window: int = WINDOW) -> str:
    """One row per run, then the median (min-max) over the runs of each column."""
    thresholds = list(summaries[0].reached)
    header = ["run", "seed", "steps"] + [f"first >= {t}" for t in thresholds] + [
        f"last-{window} reward", f"best {window}-step mean (step)", "greedy eval acc", "median step (s)", "command (min)"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        cells = [s.name, str(s.seed), str(s.steps)] + [_reached_text(s.reached[t]) for t in thresholds] + [
            f"{s.final_mean:.3f}{ended_below_best(s.final_mean, s.best_mean)}", f"{s.best_mean:.3f} ({s.best_step})",
            "-" if s.final_eval_accuracy is None else f"{s.final_eval_accuracy:.3f}",
            f"{s.median_step_s:.2f}", "-" if s.total_min is None else f"{s.total_min:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    minutes = {t: [s.reached[t][1] for s in summaries if s.reached[t]] for t in thresholds}
    missing = {t: sum(1 for s in summaries if s.reached[t] is None) for t in thresholds}
    spread = ["median (min-max)", "", ""] + [
        _spread(minutes[t]) + " min" + (f", {missing[t]} not reached" if missing[t] else "") for t in thresholds] + [
        _spread([s.final_mean for s in summaries]),
        _spread([s.best_mean for s in summaries]),
        _spread([s.final_eval_accuracy for s in summaries if s.final_eval_accuracy is not None]),
        _spread([s.median_step_s for s in summaries]),
        _spread([s.total_min for s in summaries if s.total_min is not None])]
    rows.append("| " + " | ".join(spread) + " |")
    return "\n".join(rows)


def runs_figure(run_dirs: Sequence[Path], *, title: str, window: int = WINDOW,
                level: float | None = TARGET_LEVEL) -> Any:
    """A matplotlib Figure: each run's window-step mean reward against step (left) and minutes
    (right), its greedy evaluation points in the same colour, and a dashed line at `level`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from_command = command_times(run_dirs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run_dir in run_dirs:
        records = _records(Path(run_dir))
        name = Path(run_dir).name
        steps = [r["step"] for r in records]
        minutes = record_minutes(Path(run_dir), records, from_command)
        smoothed = moving_average([r["reward/mean"] for r in records], window)
        for ax, xs in ((axes[0], steps), (axes[1], minutes)):
            line, = ax.plot(xs, smoothed, label=f"{name}: reward, {window}-step mean")
            points = [(x, r[EVAL_ACCURACY]) for x, r in zip(xs, records) if EVAL_ACCURACY in r]
            if points:
                ax.plot(*zip(*points), marker="o", linestyle=":", color=line.get_color(), markersize=4,
                        label=f"{name}: greedy eval accuracy")
    for ax, label in ((axes[0], "step"), (axes[1], COMMAND_TIME if from_command else TRAINER_TIME)):
        if level is not None:
            ax.axhline(level, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: Sequence[Path], out: Path, *, title: str, window: int = WINDOW) -> Path:
    """runs_figure saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = runs_figure(run_dirs, title=title, window=window)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def compare_runs(run_dirs: Sequence[Path], out: Path | None, *, window: int = WINDOW,
                 thresholds: Sequence[float] = THRESHOLDS) -> str:
    """The `metrics.py compare` command: the table (returned, to print) and the figure (to out)."""
    run_dirs = [Path(run) for run in run_dirs]
    from_command = command_times(run_dirs)
    summaries = [summarize_run(run, from_command=from_command, window=window, thresholds=thresholds)
                 for run in run_dirs]
    clock = COMMAND_TIME if from_command else TRAINER_TIME
    text = f"{markdown_table(summaries, window)}\n\nTimes in {clock}; reward levels on the {window}-step mean reward."
    if out is not None:
        plot_runs(run_dirs, out, title=f"{len(run_dirs)} runs: " + ", ".join(r.name for r in run_dirs), window=window)
    return text


TIMING_KEYS = ("timing/step_s", "timing/wait_s", "timing/train_s", "timing/push_s",
               "timing/batcher_generate_s_mean", "timing/batcher_logprob_s_mean", "perf/samples_per_s")

# Per-step counts of rollouts, prompts or requests a run lost or had to repeat (metric key, what
# it counts): the console warns when one is non-zero and the summary gives their totals. Not
# here: counts/reward_failed, which counts answers without a parsable result too (routine while
# a model learns the format: 15 of 512 at the demo's first step), and policy choices such as
# counts/dropped_zero_variance_groups.
DROP_COUNTS = (
    ("counts/dropped_stale", "stale rollouts dropped"),
    ("counts/timed_out_prompts", "prompts timed out"),
    ("batcher/missing_rollouts", "rollouts missing from generation"),
    ("batcher/dropped_logprob_version", "rollouts dropped for logprobs of other weights"),
    ("counts/redispatched_requests", "requests re-sent after their worker failed"),
    # Masking (RewardConfig.on_function_failure, the judge's on_failure) is a choice, but a group
    # it empties lost its rewards to failures: worth a warning, unlike a zero-variance group.
    ("counts/dropped_groups_masked", "groups dropped for too few scored samples"),
)


def timing_line(run_dirs: Sequence[Path]) -> str:
    """Medians over every step of every run: where a step's time goes, and what an evaluation costs.
    `rest` is step - wait - train - push (optimizer steps, metrics, the batcher's stats call)."""
    records = [r for run in run_dirs for r in _records(Path(run))]
    medians = {k.split("/", 1)[1]: statistics.median(r[k] for r in records if k in r)
               for k in TIMING_KEYS if any(k in r for r in records)}
    parts = ("timing/step_s", "timing/wait_s", "timing/train_s", "timing/push_s")
    rests = [r[parts[0]] - sum(r[k] for k in parts[1:]) for r in records if all(k in r for k in parts)]
    if rests:
        medians["rest_s"] = statistics.median(rests)
    evals = [r["eval/time_s"] for r in records if "eval/time_s" in r]
    if evals:
        medians["eval_time_s"] = statistics.median(evals)
    return "medians over all steps: " + " ".join(f"{k}={v:.3f}" for k, v in medians.items())


def drop_counts(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Totals over `records` of each DROP_COUNTS key that is non-zero, in DROP_COUNTS order."""
    totals = {key: sum(r.get(key, 0.0) for r in records) for key, _ in DROP_COUNTS}
    return {key: total for key, total in totals.items() if total}


def drops_text(totals: dict[str, float]) -> str:
    """'3 stale rollouts dropped, 1 prompts timed out' for drop_counts' totals ('' when none)."""
    labels = dict(DROP_COUNTS)
    return ", ".join(f"{total:g} {labels[key]}" for key, total in totals.items())


def run_summary(run_dir: Path, window: int = WINDOW) -> str:
    """The end-of-run summary (the trainer prints it; scripts/demo_report.py prints its first two
    lines): when the window-step mean reward reached THRESHOLDS, the final reward and evaluation,
    where a step's time goes, and what the run dropped."""
    run_dir = Path(run_dir)
    dropped = drops_text(drop_counts(_records(run_dir)))
    return "\n".join([summary_line(summarize_run(run_dir, window=window), window), timing_line([run_dir]),
                      f"dropped or re-sent: {dropped or 'nothing'}"])


def eval_series(records: Sequence[dict[str, Any]]) -> list[str]:
    """Evaluation keys to draw, found in any record: eval/accuracy, then each eval/pass@k by k."""
    keys = {k for r in records for k in r}
    pass_keys = [k for k in keys if k.startswith(EVAL_PASS_AT_PREFIX) and k.removeprefix(EVAL_PASS_AT_PREFIX).isdigit()]
    pass_keys.sort(key=lambda k: int(k.removeprefix(EVAL_PASS_AT_PREFIX)))
    return ([EVAL_ACCURACY] if EVAL_ACCURACY in keys else []) + pass_keys
