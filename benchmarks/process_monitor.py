"""Peak memory of every process in a run's tree, and what the run's logs say about its progress.

Used by benchmarks that start a whole system (realistic_run.py, soak.py): `ProcessMonitor` walks
this process's tree and keeps each process's peak RSS (VmHWM), private and shared memory, labelled
by role (`process_label`); `LogWatcher` follows growing logs for the run's events; `run_polled`
runs a command while sampling the tree; `print_failure` shows a failed run's logs. For CPU
profiles (cpu_profile.py, scripts/suite_profile.py): `read_counters` (a process's CPU seconds and page
faults) and `process_kind` (a label's kind: trainer ranks, engine core, Ray, ...).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from async_grpo.launch.dispatcher_logs import REGISTERED_PATTERN
from benchmarks.harness import REPO_ROOT

logger = logging.getLogger(__name__)

KB = 1024  # /proc reports kB (KiB)
GB = 1e9
LOG_TAIL_LINES = 40
PEAK_TOLERANCE_KB = 32 * 1024  # "phase at peak": the first phase within this (or the fraction below) of the peak
PEAK_TOLERANCE_FRAC = 0.02
STOP_GRACE_S = 180.0  # local_cluster stops the trainer (30 s grace), dispatchers (30 s each), Ray
_ASCTIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


# ---- processes -------------------------------------------------------------------------------

IDLE_RAY_WORKER = "Ray idle worker"
UNKNOWN_RANK = "trainer rank ?"
_RAY_TITLES = {  # ray:: process titles (the actor class; Ray appends the running method)
    "GenerationWorkerActor": "generation worker actor",
    "LogprobWorkerActor": "logprob worker actor",
    "RegistryActor": "registry actor",
    "ExperienceBatcherActor": "experience batcher actor",
    "VerifierPoolActor": "verifier pool actor",
    "VerifierShardActor": "verifier shard actor",
    "IDLE": IDLE_RAY_WORKER,
    "DashboardAgent": "Ray dashboard agent",
    "RuntimeEnvAgent": "Ray runtime-env agent",
}
_SCRIPT_LABELS = (  # (substring of the command line, label), first match wins
    ("torch.distributed.run", "torchrun"),  # before trainer_core.py, which its command line names
    ("local_cluster.py", "local_cluster.py (Ray head driver)"),
    ("async_grpo.demo_assets.tiny_model", "prepare: model writer (tiny_model)"),
    ("gcs_server", "Ray GCS server"),
    ("dashboard/dashboard.py", "Ray dashboard head"),
    ("log_monitor.py", "Ray log monitor"),
    ("autoscaler/_private/monitor.py", "Ray monitor"),
)


def is_weak_label(label: str) -> bool:
    """A label that a later look at the process may improve: a Ray worker before its actor
    arrives, a process seen before its title was set (named after its executable), a trainer rank
    before its RANK was read."""
    return label in (IDLE_RAY_WORKER, UNKNOWN_RANK) or "(under " in label


def process_label(cmdline: str, *, rank: str | None = None, parent_label: str = "", anchor: str = "",
                  own_label: str | None = None) -> str:
    """A readable role for a process of the run, from its command line (Ray workers: their title).

    parent_label: the parent process's label; anchor: the nearest ancestor's label that is not
    weak (is_weak_label), used to name helper processes (compilers, ...); own_label: given for the
    benchmark's own process, which it names.
    """
    if own_label is not None:
        return own_label
    for needle, label in _SCRIPT_LABELS[:1]:
        if needle in cmdline:
            return label
    if "trainer_core.py" in cmdline:
        return f"trainer rank {rank}" if rank is not None else UNKNOWN_RANK
    if "worker_dispatcher.py" in cmdline:
        mode = re.search(r"--mode[= ](\w+)", cmdline)
        return f"dispatcher ({mode.group(1) if mode else '?'})"
    if "EngineCore" in cmdline:
        return "vLLM EngineCore"
    if cmdline.startswith("ray::"):
        # Ray titles a named actor's process '<actor name>:<class>' (logprob-worker-0:LogprobWorkerActor)
        # in some of its phases, a nameless one '<class>': the class decides the role.
        title = re.split(r"[.\s]", cmdline[len("ray::"):], maxsplit=1)[0].rsplit(":", 1)[-1]
        return _RAY_TITLES.get(title, f"Ray actor {title}")
    first = cmdline.split(" ", 1)[0]
    if os.path.basename(first) == "raylet":
        return "raylet"
    for needle, label in _SCRIPT_LABELS[1:]:
        if needle in cmdline:
            return label
    if "multiprocessing.forkserver" in cmdline:
        if parent_label.startswith("forkserver of "):
            return "verifier process" if "verifier" in parent_label else f"process forked by {parent_label[14:]}"
        return f"forkserver of {anchor or parent_label}"
    if "multiprocessing.resource_tracker" in cmdline:
        return f"resource tracker of {anchor or parent_label}"
    return f"{os.path.basename(first)[:40]} (under {anchor or parent_label or '?'})"


def python_role(cmdline: str) -> str:
    """A Python process no other label names, by what it runs: 'python -m <module>', 'python
    <script>.py' or 'python -c <the code's start>' (a test's probe, multiprocessing's children)."""
    words = cmdline.split()
    for flag in ("-m", "-c"):
        if flag in words[1:-1]:
            rest = words[words.index(flag) + 1:]
            return f"python {flag} {rest[0] if flag == '-m' else ' '.join(rest)[:40]}"
    script = next((word for word in words[1:] if word.endswith(".py")), None)
    return f"python {Path(script).name}" if script else "python (under ?)"


def parse_status(text: str) -> dict[str, int]:
    """The kB fields of /proc/<pid>/status (VmHWM, VmRSS, RssAnon, RssFile, RssShmem, ...) or /proc/meminfo."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0])
    return out


def read_proc(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the process is gone (or not ours)
        return None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc/<pid>/stat's utime and stime are in these
# Fields of /proc/<pid>/stat after the command (the 2nd field, in parentheses): minflt is the 10th
# field of the line, utime the 14th, stime the 15th (proc(5)); after the ')' they are at 7, 11, 12.
_MINFLT, _UTIME, _STIME = 7, 11, 12
PROCESS_KINDS = (  # (label prefix, kind), first match wins
    ("trainer rank", "trainer ranks"), ("torchrun", "torchrun"), ("vLLM EngineCore", "engine core"),
    ("generation worker actor", "generation worker"), ("logprob worker actor", "logprob worker"),
    ("experience batcher actor", "batcher"), ("registry actor", "registries"),
    ("verifier", "verifier pool"), ("forkserver of", "verifier pool"), ("resource tracker of", "verifier pool"),
    ("cc1plus", "compilers (torch inductor)"), ("g++", "compilers (torch inductor)"), ("dispatcher", "dispatchers"),
    ("raylet", "Ray"), ("Ray ", "Ray"), (IDLE_RAY_WORKER, "Ray"),
)


def process_kind(label: str) -> str:
    """The kind (PROCESS_KINDS) of a process_label; 'other' for the rest."""
    return next((kind for prefix, kind in PROCESS_KINDS if label.startswith(prefix)), "other")


@dataclass(slots=True)
class Counters:
    """One process's cumulative counters at one reading."""

    user_s: float
    kernel_s: float
    minor_faults: int


def stat_fields(text: str) -> list[str]:
    """The fields of a /proc/<pid>/stat line after the command name (which may hold spaces)."""
    return text[text.rindex(")") + 2:].split()


def read_counters(pid: int) -> Counters | None:
    """/proc/<pid>/stat's user and kernel CPU seconds and minor faults (None: the process is gone)."""
    text = read_proc(f"/proc/{pid}/stat")
    return None if text is None else counters_of(stat_fields(text))


def counters_of(fields: list[str]) -> Counters:
    """The counters in a stat line's fields (stat_fields)."""
    return Counters(user_s=int(fields[_UTIME]) / CLOCK_TICKS, kernel_s=int(fields[_STIME]) / CLOCK_TICKS,
                    minor_faults=int(fields[_MINFLT]))


def environ_rank(pid: int) -> str | None:
    text = read_proc(f"/proc/{pid}/environ")
    if text is None:
        return None
    for entry in text.split("\0"):
        if entry.startswith("RANK="):
            return entry[len("RANK="):]
    return None


@dataclass
class ProcessRecord:
    """What the monitor keeps of one process."""

    pid: int
    label: str
    cmdline: str
    first_seen_s: float
    last_seen_s: float
    anchor: str = ""  # the label itself, or the nearest ancestor's that is not weak
    peak_rss_kb: int = 0  # VmHWM, the kernel's own high-water mark
    peak_anon_kb: int = 0  # polled max of RssAnon
    peak_shmem_kb: int = 0  # polled max of RssShmem
    rises: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (VmHWM, phase) when it rose

    @property
    def phase_at_peak(self) -> str:
        """The phase in which VmHWM first came within PEAK_TOLERANCE of its final value (later
        rises by a few MB, e.g. at shutdown, do not move it)."""
        near = self.peak_rss_kb - max(PEAK_TOLERANCE_KB, PEAK_TOLERANCE_FRAC * self.peak_rss_kb)
        return next((phase for hwm, phase in self.rises if hwm >= near), "")

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "label": self.label, "cmdline": self.cmdline[:300],
                "peak_rss_gb": round(self.peak_rss_kb * KB / GB, 3), "peak_anon_gb": round(self.peak_anon_kb * KB / GB, 3),
                "peak_shmem_gb": round(self.peak_shmem_kb * KB / GB, 3), "phase_at_peak": self.phase_at_peak,
                "first_seen_s": round(self.first_seen_s, 1), "last_seen_s": round(self.last_seen_s, 1)}


def merge_rows(records: list[ProcessRecord]) -> list[dict[str, Any]]:
    """One row per process, largest peak first. Processes sharing a label get #1, #2 (by start
    order); helper processes still weakly labelled (compilers, ...) are merged into one row per
    label: peaks are the largest of them, `count` says how many."""
    by_label: dict[str, list[ProcessRecord]] = {}
    for record in sorted(records, key=lambda r: (r.first_seen_s, r.pid)):
        by_label.setdefault(record.label, []).append(record)
    rows = []
    for label, group in by_label.items():
        if len(group) > 1 and "(under " in label:
            top = max(group, key=lambda r: r.peak_rss_kb)
            row = top.as_dict()
            row.update(label=f"{label} x{len(group)}", count=len(group),
                       peak_anon_gb=round(max(r.peak_anon_kb for r in group) * KB / GB, 3),
                       peak_shmem_gb=round(max(r.peak_shmem_kb for r in group) * KB / GB, 3))
            rows.append(row)
            continue
        for i, record in enumerate(group, 1):
            row = record.as_dict()
            row["label"] = label if len(group) == 1 else f"{label} #{i}"
            row["count"] = 1
            rows.append(row)
    rows.sort(key=lambda r: -r["peak_rss_gb"])
    return rows


class ProcessMonitor:
    """Peak memory of every process in this process's tree, and coincident totals, per poll.

    The run's total at one poll is the tree's private memory (sum of RssAnon) plus the largest
    shared memory (RssShmem) of any one process: the processes share one object store, whose
    pages RSS counts in each process that touched them.
    """

    def __init__(self, started: float, own_label: str) -> None:
        import psutil

        self.own_label = own_label  # the benchmark's own process (the root of the tree)
        self._psutil = psutil
        self._root = psutil.Process(os.getpid())
        self.started = started
        self.records: dict[int, ProcessRecord] = {}
        meminfo = parse_status(read_proc("/proc/meminfo") or "")
        self.mem_total_kb = meminfo["MemTotal"]
        self.baseline_used_kb = meminfo["MemTotal"] - meminfo["MemAvailable"]
        self.peak_used_kb = self.baseline_used_kb
        self.peak_total_kb = 0
        self.peak_total_phase = ""
        self.peak_total_at_s = 0.0
        self.peak_tree_anon_kb = 0
        self.timeline: list[list[float]] = []  # [t_s, tree private GB, largest shared GB, machine used GB]
        self.poll_cpu_s = 0.0

    def sample(self, phase: str) -> None:
        cpu0 = time.process_time()
        now = time.monotonic() - self.started
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            processes = [self._root]
        processes.sort(key=lambda proc: proc.pid)  # parents first, mostly (pids are allocated upwards)
        tree_anon = max_shmem = 0
        for proc in processes:
            status = read_proc(f"/proc/{proc.pid}/status")
            if status is None:
                continue
            record = self._identify(proc, now)
            if record is None:
                continue
            fields = parse_status(status)
            record.last_seen_s = now
            hwm = fields.get("VmHWM", 0)
            if hwm > record.peak_rss_kb:
                record.peak_rss_kb = hwm
                record.rises.append((hwm, phase))
            record.peak_anon_kb = max(record.peak_anon_kb, fields.get("RssAnon", 0))
            record.peak_shmem_kb = max(record.peak_shmem_kb, fields.get("RssShmem", 0))
            tree_anon += fields.get("RssAnon", 0)
            max_shmem = max(max_shmem, fields.get("RssShmem", 0))
        meminfo = parse_status(read_proc("/proc/meminfo") or "")
        used = meminfo["MemTotal"] - meminfo["MemAvailable"]
        self.peak_used_kb = max(self.peak_used_kb, used)
        self.peak_tree_anon_kb = max(self.peak_tree_anon_kb, tree_anon)
        if tree_anon + max_shmem > self.peak_total_kb:
            self.peak_total_kb, self.peak_total_phase, self.peak_total_at_s = tree_anon + max_shmem, phase, now
        self.timeline.append([round(now, 1), round(tree_anon * KB / GB, 3), round(max_shmem * KB / GB, 3),
                              round(used * KB / GB, 3)])
        self.poll_cpu_s += time.process_time() - cpu0

    def _identify(self, proc: Any, now: float) -> ProcessRecord | None:
        """The process's record, its label refreshed (a weak label never replaces a strong one)."""
        record = self.records.get(proc.pid)
        try:
            cmdline = " ".join(proc.cmdline()) or proc.name()
            parent = self.records.get(proc.ppid())
        except self._psutil.Error:
            return record
        if record is not None and record.cmdline == cmdline and not is_weak_label(record.label):
            return record
        label = process_label(
            cmdline, rank=environ_rank(proc.pid) if "trainer_core.py" in cmdline else None,
            parent_label=parent.label if parent else "", anchor=parent.anchor if parent else "",
            own_label=self.own_label if proc.pid == os.getpid() else None,
        )
        if record is None:
            record = ProcessRecord(pid=proc.pid, label=label, cmdline=cmdline, first_seen_s=now, last_seen_s=now)
            self.records[proc.pid] = record
        elif is_weak_label(label) and not is_weak_label(record.label):
            return record
        record.label, record.cmdline = label, cmdline
        record.anchor = record.label if not is_weak_label(label) else (parent.anchor if parent else "")
        return record

    def table_rows(self) -> list[dict[str, Any]]:
        return merge_rows(list(self.records.values()))


# ---- the run's progress and stages -------------------------------------------------------------

def line_time(line: str) -> float | None:
    """Unix time of a log line starting with logging's asctime (local time), else None."""
    match = _ASCTIME.match(line)
    if not match:
        return None
    return datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


_EVENTS = (  # (regex on a log line, event name; {0} = the first group)
    (re.compile(r"Ray head at "), "ray_head_started"),
    (re.compile(r"(\S+) worker registered"), "registered:{0}"),
    (re.compile(r"starting trainer: "), "trainer_started"),
    (re.compile(r"FSDP2 model from "), "trainer_model_built"),
    (re.compile(r"pushed weights v0 "), "initial_push_done"),
    (REGISTERED_PATTERN, "worker_log_registered:{0}"),
    (re.compile(r"checkpoint written: "), "checkpoint_written"),
    (re.compile(r"training finished at step"), "training_finished"),
    (re.compile(r"local cluster stopped"), "cluster_stopped"),
)


class LogWatcher:
    """Follows growing logs (a fixed one plus any matching a glob) and records when each event
    first appeared: the line's own timestamp, or when it was read for lines without one."""

    def __init__(self, path: Path, extra_glob: tuple[Path, str] | None = None) -> None:
        self.path = path
        self.extra_glob = extra_glob
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.events: dict[str, float] = {}

    def poll(self) -> None:
        paths = [self.path]
        if self.extra_glob is not None:
            folder, pattern = self.extra_glob
            paths += sorted(folder.glob(pattern))
        for path in paths:
            self._read_new(path)

    def _read_new(self, path: Path) -> None:
        offset = self._offsets.get(path, 0)
        try:
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            return
        self._offsets[path] = offset + len(chunk)
        lines = (self._partial.get(path, "") + chunk.decode(errors="replace")).split("\n")
        self._partial[path] = lines.pop()
        for line in lines:
            self.feed(line)

    def feed(self, line: str, now: float | None = None) -> None:
        line = line.rstrip("\r")
        for pattern, name in _EVENTS:
            match = pattern.search(line)
            if match:
                self.events.setdefault(name.format(*match.groups()), line_time(line) or now or time.time())


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def phase_of(watcher: LogWatcher, steps_done: int, num_steps: int, cluster_running: bool) -> str:
    """The run's phase, from what the logs and metrics.jsonl show so far."""
    events = watcher.events
    if not cluster_running:
        return "prepare" if "ray_head_started" not in events else "shutdown"
    if "trainer_started" not in events:
        return "cluster start"
    if steps_done >= num_steps:
        return "final checkpoint" if "training_finished" not in events else "shutdown"
    if steps_done > 0 or "initial_push_done" in events:
        return f"step {steps_done}"
    return "trainer start-up (first push)" if "trainer_model_built" in events else "trainer start-up (model load)"



# ---- output ----------------------------------------------------------------------------------

def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def process_table(rows: list[dict[str, Any]]) -> str:
    return format_table(
        ["process", "peak RSS GB", "peak private GB", "peak shared GB", "phase at peak", "pid"],
        [[r["label"], f"{r['peak_rss_gb']:.2f}", f"{r['peak_anon_gb']:.2f}", f"{r['peak_shmem_gb']:.2f}",
          r["phase_at_peak"], str(r["pid"])] for r in rows],
    )




_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")


def first_errors(path: Path, limit: int = 5) -> list[str]:
    """The first distinct `SomethingError: message` lines of a log (the root cause usually comes
    before torchrun's and local_cluster's own summaries), rank prefixes dropped."""
    seen: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return seen
    for line in text.splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if _ERROR_LINE.search(line) and "ChildFailedError" not in line and line not in seen:
            seen.append(line)
            if len(seen) == limit:
                break
    return seen


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


# ---- the benchmark ---------------------------------------------------------------------------

class RunFailed(RuntimeError):
    """The run did not complete; the message names the logs to read."""



def run_polled(command: list[str], log: Path, monitor: ProcessMonitor, *, timeout_s: float,
               phase: Callable[[], str], on_poll: Callable[[], None] = lambda: None, poll_s: float = 2.0,
               new_session: bool = False) -> int:
    """Run `command` (output to `log`), sampling the process tree every poll_s; its exit code.

    On timeout or interruption the child gets SIGTERM (local_cluster then stops everything it
    started), and SIGKILL after STOP_GRACE_S.
    """
    deadline = time.monotonic() + timeout_s
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                   start_new_session=new_session)
        try:
            while process.poll() is None:
                on_poll()
                monitor.sample(phase())
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{Path(command[1]).name} still running after {timeout_s:.0f} s")
                try:
                    process.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    pass
            on_poll()
            return process.returncode
        except BaseException:
            if process.poll() is None:
                logger.warning("stopping %s (SIGTERM, then SIGKILL after %.0f s)", Path(command[1]).name, STOP_GRACE_S)
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            raise


def print_failure(report: dict[str, Any], program: str) -> None:
    """To stderr: the tail of every log of a failed run, the first errors found in them, the failure."""
    paths = [Path(p) for p in [report["logs"]["local_cluster"], *report["logs"]["workers"]]]
    for path in paths:
        print(f"\n---- last lines of {path} ----\n{tail(path)}", file=sys.stderr)
    errors = [f"  {path.name}: {line}" for path in paths for line in first_errors(path)]
    if errors:
        print("\nfirst errors in the logs:\n" + "\n".join(errors), file=sys.stderr)
    print(f"\n{program}: FAILED: {report['failure']}", file=sys.stderr)

