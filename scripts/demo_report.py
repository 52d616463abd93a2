"""Summarise demo runs: a markdown table (one row per run) and one reward curve for all of them.

    python scripts/demo_report.py --runs runs/demo-seed0 runs/demo-seed1 runs/demo-seed2 \
        --out_md docs/demo_seeds.md --out_png docs/demo_reward.png
    python scripts/demo_report.py --runs runs/demo            # one run: prints its summary line

Each run directory holds the trainer's metrics.jsonl and, written by scripts/demo.sh, the
`command_started_at` file (unix time when the demo command started), so times are reported from
the command's start: Ray, worker and trainer start-up included. Every figure printed here is
computed from those files; nothing is typed in by hand. The table and the figure are
run_report.py's, which `python -m async_grpo.telemetry.metrics compare` prints and draws for any runs.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.telemetry.run_report import (  # noqa: E402
    command_times, markdown_table, plot_runs, summarize_run, summary_line, timing_line,
)

DEMO_TITLE = "demo: tiny Qwen2, single-digit addition, 2 CPU cores (scripts/demo_seeds.sh)"


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


def machine_line() -> str:
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> None:
    args = load_config(DemoReportConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    runs = [Path(run) for run in args.runs]
    summaries = [summarize_run(run, from_command=command_times(runs)) for run in runs]
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
        print(f"[demo] wrote {plot_runs(runs, Path(args.out_png), title=DEMO_TITLE)}")


if __name__ == "__main__":
    main()
