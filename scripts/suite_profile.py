"""Where the test suite's CPU goes: per process kind, per test, and how many vLLM engines, trainer
launches and Ray heads each test started.

    .venv/bin/python scripts/suite_profile.py               # the README's `bash scripts/test.sh` (~40 min on 2 cores)
    .venv/bin/python scripts/suite_profile.py --command "bash scripts/test.sh tests/system/test_end_to_end.py"
    .venv/bin/python scripts/suite_profile.py --smoke true  # plumbing check (a two-second command)

It runs `command` and, until it exits, reads every process on the machine once per `poll_s`:
its user and kernel CPU seconds (/proc/<pid>/stat), its role (benchmarks/process_monitor.py's
labels, grouped into its process kinds) and the test it belongs to: the PYTEST_CURRENT_TEST
that it inherited from the pytest process that started it (or that started its Ray head: the
actors of the tests' shared Ray session are all filed under the test that started that session).
A process's CPU is its last reading (one that lives under `poll_s` is missed; the machine's own
total, from /proc/stat, is printed beside the sum). Processes already running when it starts
count only what they use afterwards.

Prints a table of CPU seconds per kind, the `top_labels` process roles within them with how many
processes had each, the `top` tests by CPU with their engine starts (vLLM engine-core processes),
trainer launches (torchrun) and Ray heads (GCS servers), the `top` sets of tests that were running
while the machine's cores stood idle (tests/conftest.py writes when each test starts and ends to the
file harness.SUITE_TIMELINE_ENV names; each poll's idle CPU-seconds go to the tests running at its
middle), and

    suite_profile: wall_s=... machine_cpu_s=... idle_cpu_s=... attributed_cpu_s=... engine_starts=...
    trainer_launches=... ray_heads=... exit=...

Run it on a quiet machine: every process is counted, the suite's or not.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: scripts/ is no package

from benchmarks.harness import (  # noqa: E402
    apply_smoke, load_bench_config, REPO_ROOT, setup_logging, SUITE_TIMELINE_ENV, summary_line,
)
from benchmarks.process_monitor import (  # noqa: E402
    CLOCK_TICKS, counters_of, environ_rank, format_table, process_kind, process_label, python_role, read_proc,
    stat_fields,
)

# The smoke's command: half a CPU-second, filed under a test name of its own.
_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass"
SMOKE = {"command": "PYTEST_CURRENT_TEST='suite_profile_smoke (call)' " + shlex.join([sys.executable, "-c", _BURN]),
         "poll_s": 0.1}
_STARTTIME = 19  # in stat_fields: the 22nd field of /proc/<pid>/stat (proc(5))
_TEST_PHASE = re.compile(r" \((setup|call|teardown)\)$")
NO_TEST = "(outside any test)"


@dataclass(kw_only=True, frozen=True)
class SuiteProfileConfig:
    """What to run and how to read it: the command line of `scripts/suite_profile.py`."""

    command: str = "bash scripts/test.sh"
    """The command to profile (run by bash from the repository root)."""
    poll_s: float = 1.0
    """How often /proc is read."""
    top: int = 40
    """Tests listed, by CPU seconds."""
    top_labels: int = 30
    """Process roles listed (the labels within the kinds: 'Ray actor X', 'Ray GCS server', ...), by CPU seconds."""
    smoke: bool = False
    """Smoke mode (SMOKE): a command that spends half a CPU-second; checks the plumbing."""

    def __post_init__(self) -> None:
        if not self.poll_s > 0:
            raise ValueError(f"SuiteProfileConfig.poll_s must be > 0, got {self.poll_s}")
        if self.top < 1 or self.top_labels < 1:
            raise ValueError(f"SuiteProfileConfig.top and top_labels must be >= 1, got {self.top}, {self.top_labels}")


@dataclass(slots=True)
class Seen:
    """One process (pid and start time) as last read."""

    label: str
    test: str
    cpu_s: float
    cpu_at_first_sight_s: float
    existed_at_start: bool


@dataclass
class SuiteSampler:
    """Every process of the machine, read once per poll."""

    processes: dict[tuple[int, int], Seen] = field(default_factory=dict)

    def poll(self, first: bool = False) -> None:
        me = os.getpid()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            stat = read_proc(f"/proc/{pid}/stat")
            if stat is None:
                continue
            fields = stat_fields(stat)
            key = (pid, int(fields[_STARTTIME]))  # pid and start time: a reused pid is another process
            counters = counters_of(fields)
            cpu = counters.user_s + counters.kernel_s
            seen = self.processes.get(key)
            if seen is None:
                seen = self.processes[key] = Seen(label="", test=_test_of(pid), cpu_s=cpu, cpu_at_first_sight_s=cpu,
                                                  existed_at_start=first)
            seen.cpu_s = cpu
            if not seen.label or seen.label.startswith(("Ray idle", "python")):  # titles arrive late
                seen.label = _label(pid)


def _label(pid: int) -> str:
    cmdline = (read_proc(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
    if "-m pytest" in cmdline:
        return "pytest (a tier's process)"
    script = re.search(r"-m (benchmarks\.\w+)", cmdline)
    if script:
        return f"benchmark script {script.group(1)}"
    label = process_label(cmdline, rank=environ_rank(pid)) if cmdline else ""
    return python_role(cmdline) if re.match(r"python[\d.]* \(under ", label) else label


def _test_of(pid: int) -> str:
    """The test (node id, phase dropped) in whose environment the process started."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return NO_TEST
    for item in environ:
        if item.startswith(b"PYTEST_CURRENT_TEST="):
            return _TEST_PHASE.sub("", item.split(b"=", 1)[1].decode(errors="replace"))
    return NO_TEST


def machine_cpu_s() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine since boot (/proc/stat's first line)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / CLOCK_TICKS, idle / CLOCK_TICKS


def idle_by_running_tests(idle: list[tuple[float, float, float]], timeline: str) -> dict[str, float]:
    """Idle CPU-seconds per set of running tests: each (begin, end, idle) poll's idle goes to the
    tests running at its middle (`timeline`: SUITE_TIMELINE_ENV's `<time> start|end <node id>` lines)."""
    spans: list[tuple[float, float, str]] = []
    started: dict[str, float] = {}
    for line in timeline.splitlines():
        at, event, nodeid = line.split(" ", 2)
        if event == "start":
            started[nodeid] = float(at)
        elif nodeid in started:
            spans.append((started.pop(nodeid), float(at), nodeid))
    spans += [(at, math.inf, nodeid) for nodeid, at in started.items()]  # still running when the command ended
    by_tests: dict[str, float] = defaultdict(float)
    for begin, end, seconds in idle:
        middle = (begin + end) / 2
        running = sorted(nodeid for first, last, nodeid in spans if first <= middle <= last)
        by_tests[" + ".join(running) or "(no test running)"] += seconds
    return by_tests


def kind(label: str) -> str:
    if label.startswith(("pytest", "benchmark script")):
        return label.split(" ", 1)[0] if label.startswith("pytest") else "benchmark scripts"
    return process_kind(label)


def report(sampler: SuiteSampler, top: int, top_labels: int, idle_by_tests: dict[str, float]) -> dict[str, Any]:
    """Print the tables; return the totals of the summary line."""
    by_kind: dict[str, float] = defaultdict(float)
    by_label: dict[str, float] = defaultdict(float)
    processes_of: Counter = Counter()
    by_test: dict[str, float] = defaultdict(float)
    starts: dict[str, Counter] = defaultdict(Counter)
    for seen in sampler.processes.values():
        cpu = seen.cpu_s - (seen.cpu_at_first_sight_s if seen.existed_at_start else 0.0)
        if seen.existed_at_start and cpu <= 0:
            continue
        by_kind[kind(seen.label)] += cpu
        by_label[seen.label] += cpu
        processes_of[seen.label] += 1
        by_test[seen.test] += cpu
        for what, label in (("engines", "vLLM EngineCore"), ("trainer launches", "torchrun"),
                            ("Ray heads", "Ray GCS server")):
            if seen.label == label and not seen.existed_at_start:
                starts[seen.test][what] += 1
    print(format_table(["kind", "CPU s"], [[k, f"{v:.0f}"] for k, v in sorted(by_kind.items(), key=lambda x: -x[1])]))
    labels = sorted(by_label.items(), key=lambda x: -x[1])[:top_labels]
    print(format_table(["CPU s", "processes", "role (kind)"],
                       [[f"{cpu:.0f}", str(processes_of[label]), f"{label or '(not read)'} ({kind(label)})"]
                        for label, cpu in labels]))
    rows = [[f"{cpu:.0f}", str(starts[test]["engines"]), str(starts[test]["trainer launches"]),
             str(starts[test]["Ray heads"]), test] for test, cpu in sorted(by_test.items(), key=lambda x: -x[1])[:top]]
    print(format_table(["CPU s", "engines", "trainer launches", "Ray heads", "test"], rows))
    idle_rows = sorted(idle_by_tests.items(), key=lambda x: -x[1])[:top]
    print(format_table(["idle CPU s", "tests running meanwhile"], [[f"{s:.0f}", tests] for tests, s in idle_rows]))
    total = Counter()
    for counts in starts.values():
        total.update(counts)
    return {"attributed_cpu_s": round(sum(by_kind.values())), "engine_starts": total["engines"],
            "trainer_launches": total["trainer launches"], "ray_heads": total["Ray heads"]}


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    config = apply_smoke(load_bench_config(SuiteProfileConfig, argv,
                                     description=__doc__), SMOKE)
    sampler = SuiteSampler()
    sampler.poll(first=True)
    busy0, idle0 = machine_cpu_s()
    began = time.monotonic()
    print(f"suite_profile: running {config.command}", flush=True)
    with tempfile.NamedTemporaryFile("r", prefix="suite-timeline-", suffix=".txt") as timeline:
        command = subprocess.Popen(["bash", "-c", config.command], cwd=REPO_ROOT,
                                   env={**os.environ, SUITE_TIMELINE_ENV: timeline.name})
        idle: list[tuple[float, float, float]] = []  # (begin, end, idle CPU-s) per poll
        last_at, last_idle = time.time(), idle0
        while command.poll() is None:
            time.sleep(config.poll_s)
            sampler.poll()
            now, (_, idle_now) = time.time(), machine_cpu_s()
            idle.append((last_at, now, idle_now - last_idle))
            last_at, last_idle = now, idle_now
        sampler.poll()
        idle_by_tests = idle_by_running_tests(idle, timeline.read())
    busy1, idle1 = machine_cpu_s()
    figures = {"wall_s": round(time.monotonic() - began), "machine_cpu_s": round(busy1 - busy0),
               "idle_cpu_s": round(idle1 - idle0), **report(sampler, config.top, config.top_labels, idle_by_tests),
               "exit": command.returncode}
    print(summary_line("suite_profile", figures))
    sys.exit(command.returncode)  # a failing suite fails its profile too


if __name__ == "__main__":
    main()
