"""The tool demo's figures: each run's reward curve, its rise, and tool_gain (with the tool over without).

    python scripts/demo_tools_report.py --with_tool runs/demo-tools-s0 --without_tool runs/demo-tools-notool-s0
    python scripts/demo_tools_report.py --with_tool runs/demo-tools-s0 runs/demo-tools-s1 runs/demo-tools-s2 \\
        --without_tool runs/demo-tools-notool-s0 runs/demo-tools-notool-s1 runs/demo-tools-notool-s2 \\
        --out_md docs/demo_tools.md --out_png docs/demo_tools_reward.png

For each run (the trainer's metrics.jsonl; times from scripts/demo_tools.sh's command_started_at
mark when present, else from the trainer's start), with means trailing over run_report.WINDOW
steps (10, the reports' window):
- curve: the 10-step mean sampled reward every `every` steps, and the share of rollouts that
  called the tool (multi_turn/observed_frac: rollouts that got an observation back), also as a
  10-step mean;
- start: step 0's reward, the starting model's rollouts (the trailing 10-step mean at step 0;
  the rise is measured from there because the model learns within the first 10 steps, so the
  first full window, steps 0-9, already holds most of it);
- rise: the highest full 10-step mean reached within `budget_min` minutes of the start minus the
  start, and the minute the 10-step mean first stood `target_rise` above the start;
- final: the last 10-step mean.
Then tool_gain = (median final with the tool) / (median final without); when the runs without the
tool never scored it prints inf, the difference and a 95% lower bound (rule of three over the
rollouts behind the final mean). Every figure comes from those files.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.telemetry.run_report import (  # noqa: E402
    STARTED_FILE, WINDOW, best_window, ended_below_best, moving_average, plot_runs, read_metrics, record_minutes,
)

TOOL_RATE = "multi_turn/observed_frac"
ENTROPY = "entropy/first_token"


@dataclass(kw_only=True, frozen=True)
class DemoToolsReportConfig:
    """Command line of `python scripts/demo_tools_report.py`."""

    with_tool: list[str]
    """Run directories of the runs with the calculator."""
    without_tool: list[str] = ()
    """Run directories of the same task without it (tools: [])."""
    target_rise: float = 0.3
    """The rise of the trailing mean reward (run_report.WINDOW steps) the demo claims (issue 25: >= 0.3)."""
    budget_min: float = 10.0
    """Within how many minutes of the command's start the rise must come."""
    every: int = 5
    """Print the curve every N steps."""
    out_md: str | None = None
    """Write the table (markdown) here; None: print only."""
    out_png: str | None = None
    """Draw every run's curve here; None: no plot."""

    def __post_init__(self) -> None:
        if not self.with_tool:
            raise ValueError("DemoToolsReportConfig.with_tool needs at least one run directory")
        if self.every < 1 or not self.budget_min > 0:
            raise ValueError("DemoToolsReportConfig.every must be >= 1 and budget_min > 0")


@dataclass(frozen=True)
class ToolRun:
    name: str
    steps: int
    smoothed: list[float]
    tool_rate: list[float]
    minutes: list[float]
    start_reward: float
    best_in_budget: float
    rise_at_min: float | None
    """Minutes from the start until the rise first reached the target; None: never."""
    final_mean: float
    final_samples: int
    """Rollouts behind final_mean (counts/samples over the last WINDOW steps)."""
    total_min: float
    best_mean: float
    """The run's highest WINDOW-step mean reward (run_report.best_window), whatever the budget."""
    best_step: int
    """The step that best window ends at."""
    end_entropy: float | None
    """First-token entropy over the last WINDOW steps (None: not logged)."""

    @property
    def rise(self) -> float:
        return self.best_in_budget - self.start_reward


def summarize(run_dir: Path, target_rise: float, budget_min: float) -> ToolRun:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a run directory?)")
    records = read_metrics(path)
    if len(records) < WINDOW:
        raise ValueError(f"{path}: {len(records)} steps, fewer than the {WINDOW}-step window")
    smoothed = moving_average([r["reward/mean"] for r in records], WINDOW)
    tool_rate = moving_average([r.get(TOOL_RATE, 0.0) for r in records], WINDOW)
    minutes = record_minutes(run_dir, records, (Path(run_dir) / STARTED_FILE).is_file())
    first = smoothed[0]
    full = range(WINDOW - 1, len(records))
    in_budget = [i for i in full if minutes[i] <= budget_min]
    best = max((smoothed[i] for i in in_budget), default=first)
    rise_at = next((minutes[i] for i in in_budget if smoothed[i] - first >= target_rise), None)
    best_mean, best_step = best_window(records, WINDOW)
    entropies = [r[ENTROPY] for r in records[-WINDOW:] if ENTROPY in r]
    return ToolRun(name=Path(run_dir).name, steps=len(records), smoothed=smoothed, tool_rate=tool_rate,
                   minutes=minutes, start_reward=first, best_in_budget=best, rise_at_min=rise_at,
                   final_mean=smoothed[-1], final_samples=int(sum(r.get("counts/samples", 0) for r in records[-WINDOW:])),
                   total_min=minutes[-1], best_mean=best_mean, best_step=best_step,
                   end_entropy=statistics.fmean(entropies) if entropies else None)


def curve_lines(run: ToolRun, every: int) -> list[str]:
    steps = list(range(0, run.steps, every))
    if steps[-1] != run.steps - 1:
        steps.append(run.steps - 1)
    return [f"  step {i:4d} ({run.minutes[i]:4.1f} min): reward {run.smoothed[i]:.3f}  tool calls "
            f"{run.tool_rate[i]:.2f}  {'#' * round(40 * run.smoothed[i])}" for i in steps]


def run_line(run: ToolRun, target_rise: float, budget_min: float) -> str:
    reached = "never" if run.rise_at_min is None else f"{run.rise_at_min:.1f} min"
    entropy = "" if run.end_entropy is None else f", first-token entropy at the end {run.end_entropy:.3g}"
    return (f"{run.name}: reward {run.start_reward:.3f} at step 0 -> best {WINDOW}-step mean {run.best_in_budget:.3f} within "
            f"{budget_min:g} min (rise {run.rise:+.3f}; rise >= {target_rise} at {reached}), final {run.final_mean:.3f} "
            f"(best {run.best_mean:.3f} at step {run.best_step}){ended_below_best(run.final_mean, run.best_mean)}, "
            f"tool calls {run.tool_rate[0]:.2f} -> {run.tool_rate[-1]:.2f}{entropy}, {run.steps} steps in "
            f"{run.total_min:.1f} min")


def tool_gain(with_runs: Sequence[ToolRun], without_runs: Sequence[ToolRun]) -> str:
    final_with = statistics.median(r.final_mean for r in with_runs)
    final_without = statistics.median(r.final_mean for r in without_runs)
    line = (f"median final {WINDOW}-step mean reward {final_with:.3f} with the tool, {final_without:.3f} without; "
            f"difference {final_with - final_without:+.3f}")
    if final_without > 0:
        return f"tool_gain={final_with / final_without:.1f} ({line})"
    # No rollout without the tool scored: the ratio is unbounded; the rule of three bounds the
    # true rate by 3 / n at 95% confidence, which bounds the gain from below.
    samples = min(r.final_samples for r in without_runs)
    bound = "" if samples == 0 else f"; >= {final_with * samples / 3:.0f} at 95% confidence: no correct answer in {samples} rollouts"
    return f"tool_gain=inf ({line}{bound})"


def markdown(with_runs: Sequence[ToolRun], without_runs: Sequence[ToolRun], target_rise: float,
             budget_min: float, gain: str) -> str:
    header = ["run", "tool", "steps", "step 0 reward", f"best {WINDOW}-step mean within {budget_min:g} min", "rise",
              f"rise >= {target_rise} at", "final", "best (step)", "first-token entropy at the end",
              "tool calls first -> last", "minutes"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for tool, runs in (("yes", with_runs), ("no", without_runs)):
        for r in runs:
            reached = "never" if r.rise_at_min is None else f"{r.rise_at_min:.1f} min"
            entropy = "-" if r.end_entropy is None else f"{r.end_entropy:.3g}"
            rows.append(f"| {r.name} | {tool} | {r.steps} | {r.start_reward:.3f} | {r.best_in_budget:.3f} | "
                        f"{r.rise:+.3f} | {reached} | {r.final_mean:.3f}{ended_below_best(r.final_mean, r.best_mean)} | "
                        f"{r.best_mean:.3f} ({r.best_step}) | {entropy} | {r.tool_rate[0]:.2f} -> "
                        f"{r.tool_rate[-1]:.2f} | {r.total_min:.1f} |")
    return "\n".join(rows) + f"\n\n{gain}\n"


def main(argv: list[str] | None = None) -> None:
    args = load_config(DemoToolsReportConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    with_runs = [summarize(Path(d), args.target_rise, args.budget_min) for d in args.with_tool]
    without_runs = [summarize(Path(d), args.target_rise, args.budget_min) for d in args.without_tool]
    for run in [*with_runs, *without_runs]:
        print(run_line(run, args.target_rise, args.budget_min))
        print("\n".join(curve_lines(run, args.every)))
    gain = tool_gain(with_runs, without_runs) if without_runs else "tool_gain=n/a (no run without the tool)"
    print(gain)
    if args.out_md:
        Path(args.out_md).write_text(markdown(with_runs, without_runs, args.target_rise, args.budget_min, gain))
    if args.out_png:
        plot_runs([Path(d) for d in [*args.with_tool, *args.without_tool]], Path(args.out_png),
                  title="tool demo: 3-digit sums with / without a calculator (tiny Qwen2, 2 CPU cores)")


if __name__ == "__main__":
    main()
