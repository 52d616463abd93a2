"""Where a trainer run's CPU goes, per process kind: the A/B runner's AbPlan.profile_cpu_s.

A sampler thread reads /proc/<pid>/stat of every process in this process's tree (a LocalCluster's
Ray head is started in this process, so its raylet, the actors, the vLLM engine cores, the
dispatchers, torchrun and the trainer ranks all descend from it) and, on an attached cluster, of
that head's raylet and its descendants. Between two marks (the end of the run's first `skip`
steps and the end of its last counted step) it takes each process's user and kernel CPU seconds
and minor page faults, summed per kind (process_monitor.process_kind); `print_kinds` prints them per
step with `cores`, a kind's CPU seconds per wall second.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import run_trainer, TrainerRun
from benchmarks.process_monitor import Counters, environ_rank, process_kind, process_label, read_counters, read_proc

logger = logging.getLogger(__name__)

LAUNCHER = "launcher (this process)"
COUNTERS = ("user_s", "kernel_s", "faults")


def raylet_pids(gcs_address: str) -> list[int]:
    """The raylet of the Ray head at gcs_address (a cluster another process owns); [] for ''."""
    import psutil

    if not gcs_address:
        return []
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if (cmdline := p.info["cmdline"] or []) and Path(cmdline[0]).name == "raylet"
            and f"--gcs-address={gcs_address}" in cmdline]


def tree_pids(extra_roots: list[int]) -> list[int]:
    """This process and every descendant, and each of extra_roots with its descendants."""
    import psutil

    pids = []
    for root in [os.getpid(), *extra_roots]:
        try:
            pids += [root, *(child.pid for child in psutil.Process(root).children(recursive=True))]
        except psutil.NoSuchProcess:
            continue
    return pids


def kind_of(pid: int, label: str) -> str:
    """A process's kind (process_monitor.process_kind); this process is the launcher."""
    return LAUNCHER if pid == os.getpid() else process_kind(label)


def label_of(pid: int) -> str:
    cmdline = (read_proc(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
    return process_label(cmdline, rank=environ_rank(pid))


class TreeSampler:
    """Polls the tree's counters; `mark()` keeps the current reading of every live process."""

    def __init__(self, poll_s: float, extra_roots: list[int]) -> None:
        self.poll_s = poll_s
        self.extra_roots = extra_roots
        self.latest: dict[int, tuple[str, Counters]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def _poll(self) -> None:
        for pid in tree_pids(self.extra_roots):
            counters = read_counters(pid)
            if counters is not None:
                with self._lock:
                    # A Ray worker takes its actor's title only after start-up: keep asking until known.
                    known = pid in self.latest and kind_of(pid, self.latest[pid][0]) != "other"
                    label = self.latest[pid][0] if known else label_of(pid)
                    self.latest[pid] = (label, counters)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> dict[int, tuple[str, Counters]]:
        self._poll()
        with self._lock:
            return dict(self.latest)


@dataclass(slots=True)
class CpuWindow:
    """CPU seconds and minor faults per process kind over `steps` steps and `wall_s` seconds."""

    kinds: dict[str, dict[str, float]]
    """Per kind: user_s, kernel_s, faults (totals over the window) and processes."""
    steps: int
    wall_s: float

    @classmethod
    def between(cls, start: dict[int, tuple[str, Counters]], end: dict[int, tuple[str, Counters]], steps: int,
                wall_s: float) -> "CpuWindow":
        """Processes that started inside the window count from zero."""
        kinds: dict[str, dict[str, float]] = {}
        for pid, (label, last) in end.items():
            first = start[pid][1] if pid in start else Counters(0.0, 0.0, 0)
            kind = kind_of(pid, label)
            if kind == "other":
                logger.info("process kind 'other': %s (pid %d)", label, pid)
            row = kinds.setdefault(kind, {"user_s": 0.0, "kernel_s": 0.0, "faults": 0.0, "processes": 0})
            row["user_s"] += last.user_s - first.user_s
            row["kernel_s"] += last.kernel_s - first.kernel_s
            row["faults"] += last.minor_faults - first.minor_faults
            row["processes"] += 1
        return cls(kinds=kinds, steps=steps, wall_s=wall_s)

    @classmethod
    def pooled(cls, windows: list["CpuWindow"]) -> "CpuWindow":
        """Several runs' windows as one (totals summed)."""
        kinds: dict[str, dict[str, float]] = {}
        for window in windows:
            for kind, row in window.kinds.items():
                total = kinds.setdefault(kind, dict.fromkeys(row, 0.0))
                for key, value in row.items():
                    total[key] += value
        return cls(kinds=kinds, steps=sum(w.steps for w in windows), wall_s=sum(w.wall_s for w in windows))

    def per_step(self) -> dict[str, dict[str, float]]:
        """Per kind, busiest first: user_s, kernel_s and faults per step, and cores (CPU s per wall s)."""
        rows = {kind: {**{key: row[key] / self.steps for key in COUNTERS},
                       "cores": (row["user_s"] + row["kernel_s"]) / self.wall_s}
                for kind, row in self.kinds.items()}
        return dict(sorted(rows.items(), key=lambda kv: -(kv[1]["user_s"] + kv[1]["kernel_s"])))

    @property
    def cores(self) -> float:
        """The machine's busy cores over the window (every kind's CPU seconds per wall second)."""
        return sum(row["user_s"] + row["kernel_s"] for row in self.kinds.values()) / self.wall_s


def _wait_for_records(metrics: Path, count: int, trainer: threading.Thread) -> float:
    """Block until metrics.jsonl holds `count` records (or the trainer ended); the time then."""
    while trainer.is_alive():
        if metrics.is_file() and sum(1 for _ in metrics.open()) >= count:
            break
        time.sleep(0.05)
    return time.monotonic()


def profiled_run(cluster: Any, args: list[str], run_dir: Path, *, window: tuple[int, int], poll_s: float,
                 attach: str = "", timeout_s: float | None = None) -> tuple[TrainerRun, CpuWindow]:
    """harness.run_trainer with the tree's CPU taken between the window's two record counts."""
    result: dict[str, TrainerRun] = {}
    with TreeSampler(poll_s, raylet_pids(attach)) as sampler:
        trainer = threading.Thread(target=lambda: result.update(
            run=run_trainer(cluster, args, run_dir, timeout_s=timeout_s)))
        trainer.start()
        began = _wait_for_records(run_dir / "metrics.jsonl", window[0], trainer)
        start = sampler.mark()
        ended = _wait_for_records(run_dir / "metrics.jsonl", window[1], trainer)
        end = sampler.mark()
        trainer.join()
    return result["run"], CpuWindow.between(start, end, window[1] - window[0], ended - began)


def print_kinds(window: CpuWindow) -> None:
    """The per-kind table, per step, with the machine's total on the last row."""
    print(f"  {'kind':26} {'user s':>8} {'kernel s':>9} {'faults':>10} {'cores':>6}")
    total = {"user_s": 0.0, "kernel_s": 0.0, "faults": 0.0, "cores": 0.0}
    for kind, row in window.per_step().items():
        print(f"  {kind:26} {row['user_s']:8.3f} {row['kernel_s']:9.3f} {row['faults']:10.0f} {row['cores']:6.2f}")
        for key in total:
            total[key] += row[key]
    print(f"  {'all':26} {total['user_s']:8.3f} {total['kernel_s']:9.3f} {total['faults']:10.0f} {total['cores']:6.2f}")
