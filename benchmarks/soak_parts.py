"""soak.py's pure parts: its command line, the trainer flags it runs, and the comparison of two
memory snapshots (tests check them without importing the benchmark script)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import DEMO_CONFIG, REPO_ROOT
from benchmarks.process_monitor import parse_status

TARGET_GROWTH = 1.10  # issue 11: RSS at the last step within 10% of RSS at the early step


SMOKE = {"num_steps": 8, "early_step": 4, "num_prompts": 500, "poll_s": 2.0, "timeline_every": 4}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class SoakConfig:
    """Command line of `python -m benchmarks.soak`; trainer flags go after `--`."""

    work_dir: str = str(REPO_ROOT / "runs" / "soak")
    """Where the run (`run/`), its logs, the probe's readings and report.json go."""
    assets_dir: str = ""
    """The demo's starting model and prompts (scripts/prepare_demo.py; reused when complete);
    '' means <work_dir>/assets."""
    num_prompts: int = 2000
    """prepare_demo.py --num_prompts, when the assets are written (its default, as the demo)."""
    num_steps: int = 300
    """Optimizer steps of the run; the late snapshot is taken when all of them are done."""
    early_step: int = 50
    """The early snapshot is taken when metrics.jsonl holds this many records."""
    trainer_config: str = str(DEMO_CONFIG)
    """The trainer's --config (the demo's)."""
    nproc_per_node: int = 2
    """Trainer ranks."""
    poll_s: float = 5.0
    """How often the whole process tree is read for the memory timeline (snapshots are read when due)."""
    timeline_every: int = 0
    """Also read every process's memory each time metrics.jsonl gains this many records (0: only
    the two snapshots): a per-process timeline, which shows whether a growth levels off."""
    timeout_s: float = 2 * 3600.0
    """Stop the run (and fail) after this long."""

    smoke: bool = False
    """Smoke mode: 12 steps, snapshots at 4 and 12, a timeline every 4 (SMOKE), the engine uncompiled
    (harness.SMOKE_ENGINE); checks that the command still runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        if not 1 <= self.early_step < self.num_steps:
            raise ValueError(f"SoakConfig.early_step must be in [1, num_steps), got {self.early_step} "
                             f"(num_steps {self.num_steps})")
        if self.timeline_every < 0:
            raise ValueError(f"SoakConfig.timeline_every must be >= 0, got {self.timeline_every}")
        for name in ("num_prompts", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"SoakConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("poll_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SoakConfig.{name} must be > 0, got {getattr(self, name)}")


# ---- memory of one process --------------------------------------------------------------------

MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssShmem", "RssFile")


def read_memory(pid: int) -> dict[str, int] | None:
    """The kB memory fields of /proc/<pid>/status, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(errors="replace")
    except OSError:
        return None
    fields = parse_status(text)
    return {key: fields.get(key, 0) for key in MEMORY_FIELDS}


def rss_kb(memory: dict[str, int]) -> int:
    """The soak's RSS: private + touched shared memory (RssAnon + RssShmem), file pages left out."""
    return memory["RssAnon"] + memory["RssShmem"]


# ---- comparing two snapshots ----------------------------------------------------------------------

def numbered_labels(entries: dict[int, dict[str, Any]]) -> dict[int, str]:
    """pid -> label, with `#1`, `#2` (by start order) where processes share a label."""
    by_label: dict[str, list[tuple[float, int]]] = {}
    for pid, entry in entries.items():
        by_label.setdefault(entry["label"], []).append((entry["first_seen_s"], pid))
    names = {}
    for label, group in by_label.items():
        for i, (_, pid) in enumerate(sorted(group), 1):
            names[pid] = label if len(group) == 1 else f"{label} #{i}"
    return names


def _ratio(late: int, early: int) -> float | None:
    return round(late / early, 4) if early > 0 else None


def compare(early: dict[str, Any], late: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per process seen at either snapshot (the same pid is the same process), largest
    late RSS first: RSS and VmRSS at both and their ratios (None where a snapshot lacks it)."""
    a, b = early["processes"], late["processes"]
    union = {**a, **b}
    labels = numbered_labels(union)
    rows = []
    for pid in union:
        row: dict[str, Any] = {"pid": pid, "label": labels[pid]}
        for name, snap in (("early", a), ("late", b)):
            memory = snap.get(pid)
            row[f"rss_{name}_kb"] = rss_kb(memory) if memory else None
            row[f"vmrss_{name}_kb"] = memory["VmRSS"] if memory else None
            row[f"{name}_fields"] = {k: memory[k] for k in MEMORY_FIELDS} if memory else None
        both = pid in a and pid in b
        row["status"] = "both" if both else ("gone" if pid in a else "new")
        row["ratio"] = _ratio(row["rss_late_kb"], row["rss_early_kb"]) if both else None
        row["vmrss_ratio"] = _ratio(row["vmrss_late_kb"], row["vmrss_early_kb"]) if both else None
        rows.append(row)
    rows.sort(key=lambda r: -(r["rss_late_kb"] or r["rss_early_kb"] or 0))
    return rows


def process_timelines(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The timeline's snapshots as one row per process: its RSS (kB) at each point, None where it
    was not running; processes named as in `compare`, largest last RSS first."""
    union: dict[int, dict[str, Any]] = {}
    for point in points:
        union.update(point["processes"])
    labels = numbered_labels(union)
    rows = []
    for pid in union:
        rss = [rss_kb(point["processes"][pid]) if pid in point["processes"] else None for point in points]
        rows.append({"pid": pid, "label": labels[pid], "rss_kb": rss})
    rows.sort(key=lambda r: -next((v for v in reversed(r["rss_kb"]) if v is not None), 0))
    return {"steps": [point["step"] for point in points], "t_s": [point["t_s"] for point in points], "rows": rows}


def rss_growth(rows: list[dict[str, Any]], key: str = "ratio") -> tuple[float, str]:
    """The largest ratio over processes present at both snapshots, and its process's label."""
    compared = [r for r in rows if r[key] is not None]
    if not compared:
        raise ValueError("no process was seen at both snapshots")
    top = max(compared, key=lambda r: r[key])
    return top[key], top["label"]


def trainer_args(config: SoakConfig, assets: Path, passthrough: list[str]) -> list[str]:
    """The demo's trainer flags, with the soak's length, no checkpoints and no evaluation."""
    return ["--config", config.trainer_config, "--data.path", str(assets / "arithmetic.jsonl"),
            "--num_steps", str(config.num_steps), "--optim.total_steps", str(config.num_steps),
            "--checkpoint_every", "0", "--checkpoint_at_end", "false", "--eval.every", "0", *passthrough]

