"""Soak: does any process of the system keep growing over a long run? RSS per process at two steps.

    cd /work/main && .venv/bin/python -m benchmarks.soak                       # 300 steps of the demo, ~10 min
    .venv/bin/python -m benchmarks.soak --num_steps 12 --early_step 4 --work_dir runs/soak-quick
                                                                              # ~3 min: checks the plumbing
    .venv/bin/python -m benchmarks.soak --timeline_every 25                    # + every process's RSS every 25 steps
    .venv/bin/python -m benchmarks.soak ... -- --prompts_per_rank 4            # trainer flags go after `--`

What runs: the demo (scripts/demo.sh) as a user runs it: `local_cluster.py` on the bundled tiny
model from `scripts/prepare_demo.py` (written to `--assets_dir` unless already there), one vLLM
generation worker, one logprob worker, `torchrun --nproc_per_node=2 trainer_core.py` with
`configs/demo.yaml`, changed only where a soak needs it: `--num_steps` steps (and the cosine
schedule's `optim.total_steps` with it), no checkpoints (`checkpoint_every 0`,
`checkpoint_at_end false`), no evaluation (`eval.every 0`). Trainer flags after `--` go last and
win.

Measured (benchmarks/realistic_run.py's ProcessMonitor walks this process's tree and labels every
process: trainer ranks, torchrun, the vLLM EngineCore, the worker actors, registries, batcher,
verifier processes, dispatchers, GCS, raylet and Ray's idle workers):
- Per process, its resident memory when metrics.jsonl first holds `--early_step` records and when
  it holds `--num_steps` (the run's last step done; metrics.jsonl is checked every 0.2 s, so the
  trainer ranks are still there before they exit). RSS here is RssAnon + RssShmem from
  /proc/<pid>/status: the process's private memory plus the shared memory it has touched (Ray's
  object store, /dev/shm). File-backed pages (RssFile: code, libraries, mapped model files) are
  left out: the kernel drops and re-reads them at will, and they do not grow with a leak. VmRSS
  (all three) is reported beside it. Growth = RSS at the late step / RSS at the early step, per
  process present at both; `rss_growth` is the largest (target < 1.10). Processes seen at one
  step only (a restarted worker, Ray's idle workers coming and going) are listed, not compared.
- With `--timeline_every N`, the same reading of every process each time metrics.jsonl gains N
  records: whether a process that grew between the two snapshots levels off or keeps rising.
  Printed for the processes that grew by 5% or more; all of them are in report.json.
- Ray's object store: used = cluster_resources()["object_store_memory"] -
  available_resources()["object_store_memory"] (public Ray API; the raylet reports the store's
  use in its available resources; `ray.util.state` needs the dashboard, which local runs leave
  off). A small probe process joins the cluster as a driver when the head is up and writes a
  reading every second; the reading nearest each snapshot is reported, with the largest seen
  over the run. Beside it: the raylet's RssShmem (store pages resident) and the
  space used on /dev/shm (a tmpfs shared with anything else on the machine).
- Every `--poll_s` seconds the tree's private memory (sum of RssAnon), the largest shared
  memory and the machine's used memory (other jobs included) go to a timeline.

Printed: the per-process table, the object store, the step times; the LAST line is
`soak: steps=... early_step=... rss_growth=<max ratio> process="<its label>" target=1.10 met=yes|no
...`. Everything goes to `<work_dir>/report.json`. A failed run (non-zero exit, a snapshot not
taken) prints the last lines of its logs and exits 1; a run that completes exits 0 whether or
not the target is met. MB here is 10^6 bytes.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from async_grpo.config.run_config import config_to_dict, split_passthrough
from async_grpo.telemetry.metrics import read_metrics
from benchmarks.harness import (
    apply_smoke, DemoAssets, interrupt_on_sigterm, launcher_engine_flags, load_bench_config, REPO_ROOT,
    setup_logging,
)
from benchmarks.process_monitor import (
    KB, LogWatcher, ProcessMonitor, RunFailed, count_lines, format_table, parse_status, phase_of, print_failure,
    run_polled,
)
from benchmarks.soak_parts import (
    SMOKE, TARGET_GROWTH, SoakConfig, compare, process_timelines, read_memory, rss_growth, trainer_args,
)

logger = logging.getLogger(__name__)

MB = 1e6
TIMELINE_PRINT_RATIO = 1.05  # the printed timeline leaves out processes within 5% of flat
OWN_LABEL = "soak.py (this benchmark)"
PROBE_LABEL = "object-store probe (this benchmark)"
STEP_POLL_S = 0.2  # how often metrics.jsonl is checked: the ranks exit ~1 s after their last record
PROBE_INTERVAL_S = 1.0  # object-store readings: two cheap GCS calls each, so a reading lies within ~1 s of a snapshot
_RAY_HEAD = re.compile(r"Ray head at (\S+) ")  # local_cluster.py's log line


class SoakMonitor(ProcessMonitor):
    """ProcessMonitor that reads the whole tree at most every `every_s` (unless forced), names this
    benchmark's own processes, and takes snapshots of every process's current memory."""

    def __init__(self, started: float, every_s: float) -> None:
        super().__init__(started, OWN_LABEL)
        self.every_s = every_s
        self.own_pids: dict[int, str] = {os.getpid(): OWN_LABEL}
        self._last_sample = -math.inf

    def sample(self, phase: str, force: bool = False) -> None:
        if not force and time.monotonic() - self._last_sample < self.every_s:
            return
        self._last_sample = time.monotonic()
        super().sample(phase)
        for pid, label in self.own_pids.items():
            record = self.records.get(pid)
            if record is not None:
                record.label = record.anchor = label

    def snapshot(self, step: int, phase: str) -> dict[str, Any]:
        """Every live process of the run (this benchmark's own left out) with its memory now."""
        self.sample(phase, force=True)
        t = time.monotonic() - self.started
        processes = {}
        for pid, record in sorted(self.records.items()):
            if pid in self.own_pids:
                continue
            memory = read_memory(pid)
            if memory is not None:
                processes[pid] = {"label": record.label, "first_seen_s": record.first_seen_s, **memory}
        return {"step": step, "t_s": round(t, 1), "unix_time": time.time(), "processes": processes}


# ---- Ray's object store ---------------------------------------------------------------------------

def run_object_store_probe(address: str, out_path: str, interval_s: float) -> None:
    """Join the cluster at `address` as a driver and append a JSON line of the object store's use
    to `out_path` every `interval_s`, until the cluster goes away or this process's parent exits.
    Runs in its own process (probe_command), so the benchmark itself never joins the cluster."""
    import ray

    from async_grpo.runtime.ray_access import join_cluster

    parent = os.getppid()
    join_cluster(address, namespace="soak-probe", timeout_s=30.0, log_to_driver=False)
    with open(out_path, "a") as out:
        while os.getppid() == parent:
            try:
                capacity = ray.cluster_resources().get("object_store_memory", 0.0)
                available = ray.available_resources().get("object_store_memory", 0.0)
            except Exception as exc:  # the head is stopping: the run is over
                out.write(json.dumps({"unix_time": time.time(), "error": repr(exc)[:200]}) + "\n")
                return
            out.write(json.dumps({"unix_time": time.time(), "capacity_bytes": capacity,
                                  "used_bytes": capacity - available}) + "\n")
            out.flush()
            time.sleep(interval_s)


def probe_command(address: str, out_path: Path, interval_s: float) -> list[str]:
    code = ("import sys; from benchmarks.soak import run_object_store_probe; "
            "run_object_store_probe(sys.argv[1], sys.argv[2], float(sys.argv[3]))")
    return [sys.executable, "-c", code, address, str(out_path), str(interval_s)]  # run with cwd=REPO_ROOT


def read_probe(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    readings = []
    for line in lines:
        try:
            readings.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            continue
    return [r for r in readings if "used_bytes" in r]


def nearest_reading(readings: list[dict[str, Any]], unix_time: float) -> dict[str, Any] | None:
    if not readings:
        return None
    best = min(readings, key=lambda r: abs(r["unix_time"] - unix_time))
    return {**best, "age_s": round(unix_time - best["unix_time"], 2)}


def dev_shm_used_bytes() -> int:
    stat = os.statvfs("/dev/shm")
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


# ---- the run -------------------------------------------------------------------------------------

def prepare_assets(config: SoakConfig, assets: Path) -> bool:
    """Write the demo's starting model and prompts unless complete; whether they were reused."""
    if DemoAssets(root=assets).complete():
        return True
    command = [sys.executable, str(REPO_ROOT / "scripts" / "prepare_demo.py"), "--out_dir", str(assets),
               "--num_prompts", str(config.num_prompts)]
    logger.info("preparing the demo's assets: %s", " ".join(command[1:]))
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RunFailed(f"prepare_demo.py exited with {result.returncode}:\n{result.stderr[-3000:]}")
    return False



class SoakRun:
    """Runs local_cluster.py under the monitor; takes the snapshots as metrics.jsonl grows."""

    def __init__(self, config: SoakConfig, work_dir: Path, monitor: SoakMonitor) -> None:
        self.config = config
        self.run_dir = work_dir / "run"
        self.log = work_dir / "local_cluster.log"
        self.probe_path = work_dir / "object_store.jsonl"
        self.monitor = monitor
        self.watcher = LogWatcher(self.log, (self.run_dir, "*.log"))  # *_worker.log and run.log (every INFO line)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.timeline: list[dict[str, Any]] = []  # snapshots every config.timeline_every steps
        self._next_timeline_step = config.timeline_every
        self.probe: subprocess.Popen | None = None
        self.running = False

    def phase(self) -> str:
        return phase_of(self.watcher, count_lines(self.metrics_path), self.config.num_steps, self.running)

    def on_poll(self) -> None:
        self.watcher.poll()
        if self.probe is None and "ray_head_started" in self.watcher.events:
            self._start_probe()
        done = count_lines(self.metrics_path)
        for name, step in (("early", self.config.early_step), ("late", self.config.num_steps)):
            if name not in self.snapshots and done >= step:
                self.snapshots[name] = self.take_snapshot(done)
                logger.info("snapshot %s at %d steps: %d processes", name, done,
                            len(self.snapshots[name]["processes"]))
        every = self.config.timeline_every
        if every and done >= self._next_timeline_step:
            self.timeline.append(self.monitor.snapshot(done, self.phase()))
            self._next_timeline_step = (done // every + 1) * every

    def take_snapshot(self, done: int) -> dict[str, Any]:
        snapshot = self.monitor.snapshot(done, self.phase())
        raylet = [p for p in snapshot["processes"].values() if p["label"] == "raylet"]
        snapshot["raylet_shmem_kb"] = raylet[0]["RssShmem"] if raylet else None
        snapshot["dev_shm_used_bytes"] = dev_shm_used_bytes()
        meminfo = parse_status(Path("/proc/meminfo").read_text())
        snapshot["machine_used_kb"] = meminfo["MemTotal"] - meminfo["MemAvailable"]
        return snapshot

    def _start_probe(self) -> None:
        # local_cluster.py logs the head's address at INFO: in run_dir/run.log since the quiet
        # console (in its console log with --log_level info).
        lines = [line for path in (self.log, self.run_dir / "run.log") if path.exists()
                 for line in path.read_text(errors="replace").splitlines()]
        match = next((m for m in map(_RAY_HEAD.search, lines) if m), None)
        if match is None:
            return
        self.probe_path.unlink(missing_ok=True)
        with (self.log.parent / "object_store_probe.log").open("w") as probe_log:
            self.probe = subprocess.Popen(probe_command(match.group(1), self.probe_path, PROBE_INTERVAL_S),
                                          cwd=REPO_ROOT, stdout=probe_log, stderr=subprocess.STDOUT)
        self.monitor.own_pids[self.probe.pid] = PROBE_LABEL
        logger.info("object-store probe started (pid %d) on %s", self.probe.pid, match.group(1))

    def stop_probe(self) -> None:
        if self.probe is not None and self.probe.poll() is None:
            self.probe.send_signal(signal.SIGTERM)
            try:
                self.probe.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.probe.kill()
                self.probe.wait()

    def run(self, command: list[str]) -> str:
        """Run the cluster; '' on success, else what failed."""
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)  # metrics.jsonl appends, and a checkpoint there would be resumed from
        self.running = True
        try:
            rc = run_polled(command, self.log, self.monitor, timeout_s=self.config.timeout_s, phase=self.phase,
                            on_poll=self.on_poll, poll_s=STEP_POLL_S, new_session=True)
            failure = f"local_cluster.py exited with {rc}" if rc != 0 else ""
        except TimeoutError as exc:
            failure = str(exc)
        finally:
            self.running = False
            self.stop_probe()
        missing = [name for name in ("early", "late") if name not in self.snapshots]
        if not failure and missing:
            failure = f"no {' or '.join(missing)} snapshot: metrics.jsonl has {count_lines(self.metrics_path)} records"
        return failure


def object_store_summary(snapshots: dict[str, dict[str, Any]], readings: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "method": "ray.cluster_resources() - ray.available_resources(), 'object_store_memory', from a probe driver",
        "readings": len(readings),
        "max_used_bytes": max((r["used_bytes"] for r in readings), default=None),
        "capacity_bytes": readings[-1]["capacity_bytes"] if readings else None,
        "timeline_columns": ["unix_time", "used_bytes"],
        "timeline": [[round(r["unix_time"], 1), r["used_bytes"]] for r in readings],
    }
    for name, snapshot in snapshots.items():
        summary[name] = {"step": snapshot["step"], "reading": nearest_reading(readings, snapshot["unix_time"]),
                         "raylet_shmem_kb": snapshot["raylet_shmem_kb"],
                         "dev_shm_used_bytes": snapshot["dev_shm_used_bytes"]}
    return summary


def run(config: SoakConfig, passthrough: list[str]) -> dict[str, Any]:
    started_wall, started = time.time(), time.monotonic()
    work_dir = Path(config.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    assets = Path(config.assets_dir).resolve() if config.assets_dir else work_dir / "assets"
    reused = prepare_assets(config, assets)
    monitor = SoakMonitor(started, every_s=config.poll_s)
    soak = SoakRun(config, work_dir, monitor)
    command = [sys.executable, str(REPO_ROOT / "local_cluster.py"), "--model_path", str(assets / "model"),
               "--run_dir", str(soak.run_dir), "--nproc_per_node", str(config.nproc_per_node),
               *launcher_engine_flags(config.smoke), "--", *trainer_args(config, assets, passthrough)]
    logger.info("running: %s (log: %s)", " ".join(command[1:]), soak.log)
    failure = soak.run(command)
    records = read_metrics(soak.metrics_path) if soak.metrics_path.is_file() else []
    report: dict[str, Any] = {
        "status": "failed" if failure else "ok",
        "failure": failure,
        "command": " ".join([sys.executable, *sys.argv]),
        "cluster_command": " ".join(command),
        "config": config_to_dict(config),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "mem_total_gb": round(monitor.mem_total_kb * KB / 1e9, 2),
                    "baseline_used_gb": round(monitor.baseline_used_kb * KB / 1e9, 2)},
        "assets": {"dir": str(assets), "reused": reused},
        "rss_definition": "RssAnon + RssShmem (kB, /proc/<pid>/status)",
        "snapshots": soak.snapshots,
        "steps": len(records),
        "step_s_median": statistics.median(r["timing/step_s"] for r in records) if records else None,
        "reward_last10": (statistics.mean(r["reward/mean"] for r in records[-10:])
                          if records and "reward/mean" in records[-1] else None),
        "duration_s": round(time.time() - started_wall, 1),
        "object_store": object_store_summary(soak.snapshots, read_probe(soak.probe_path)),
        "rss_timeline": process_timelines(soak.timeline) if soak.timeline else None,
        "rss_timeline_snapshots": soak.timeline,
        "process_peaks": monitor.table_rows(),
        "timeline_columns": ["t_s", "tree_private_gb", "largest_shared_gb", "machine_used_gb"],
        "timeline": monitor.timeline,
        "logs": {"local_cluster": str(soak.log), "run_dir": str(soak.run_dir),
                 "workers": sorted(str(p) for p in soak.run_dir.glob("*_worker.log"))},
    }
    if "early" in soak.snapshots and "late" in soak.snapshots:
        rows = compare(soak.snapshots["early"], soak.snapshots["late"])
        growth, label = rss_growth(rows)
        vm_growth, vm_label = rss_growth(rows, "vmrss_ratio")
        report.update(rows=rows, rss_growth=growth, rss_growth_process=label, vmrss_growth=vm_growth,
                      vmrss_growth_process=vm_label, target=TARGET_GROWTH, met=growth < TARGET_GROWTH)
    (work_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


# ---- output --------------------------------------------------------------------------------------

def _mb(kb: int | None) -> str:
    return "-" if kb is None else f"{kb * KB / MB:.1f}"


def _r(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}"


def process_table(rows: list[dict[str, Any]], early_step: int, late_step: int) -> str:
    return format_table(
        ["process", "pid", f"RSS@{early_step} MB", f"RSS@{late_step} MB", "ratio",
         f"VmRSS@{early_step} MB", f"VmRSS@{late_step} MB", "VmRSS ratio", "seen"],
        [[r["label"], str(r["pid"]), _mb(r["rss_early_kb"]), _mb(r["rss_late_kb"]), _r(r["ratio"]),
          _mb(r["vmrss_early_kb"]), _mb(r["vmrss_late_kb"]), _r(r["vmrss_ratio"]), r["status"]] for r in rows],
    )


def timeline_table(timeline: dict[str, Any], pids: set[int]) -> str:
    return format_table(
        ["process", *(f"@{step}" for step in timeline["steps"])],
        [[r["label"], *(_mb(v) for v in r["rss_kb"])] for r in timeline["rows"] if r["pid"] in pids],
    )


def _bytes_mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.1f}"


def print_report(report: dict[str, Any]) -> None:
    snapshots = report["snapshots"]
    if "rows" in report:
        early, late = snapshots["early"]["step"], snapshots["late"]["step"]
        print(f"\nMemory per process when metrics.jsonl held {early} and {late} step records (MB = 1e6 bytes; "
              f"RSS = RssAnon + RssShmem, VmRSS also counts file pages; seen: both snapshots, or gone/new):")
        print(process_table(report["rows"], early, late))
        print(f"\nlargest RSS growth {report['rss_growth']:.3f} ({report['rss_growth_process']}); "
              f"largest VmRSS growth {report['vmrss_growth']:.3f} ({report['vmrss_growth_process']})")
    timeline = report["rss_timeline"]
    if timeline and "rows" in report:
        grew = {r["pid"] for r in report["rows"] if r["ratio"] is not None and r["ratio"] >= TIMELINE_PRINT_RATIO}
        print(f"\nRSS (MB) every {report['config']['timeline_every']} steps of the processes that grew by "
              f"{TIMELINE_PRINT_RATIO:.2f}x or more between the snapshots (all processes: report.json):")
        print(timeline_table(timeline, grew))
    store = report["object_store"]
    print(f"\nRay object store ({store['method']}; {store['readings']} readings, capacity "
          f"{_bytes_mb(store['capacity_bytes'])} MB):")
    for name in ("early", "late"):
        if name in store:
            s = store[name]
            reading = s["reading"]
            when = f"{abs(reading['age_s']):.1f} s {'before' if reading['age_s'] >= 0 else 'after'}" if reading else ""
            used = f"{_bytes_mb(reading['used_bytes'])} MB used (read {when} the snapshot)" if reading else "no reading"
            print(f"  at {s['step']} steps: {used}; raylet RssShmem {_mb(s['raylet_shmem_kb'])} MB; "
                  f"/dev/shm used {_bytes_mb(s['dev_shm_used_bytes'])} MB")
    print(f"  largest used over the run: {_bytes_mb(store['max_used_bytes'])} MB")
    if report["step_s_median"] is not None:
        print(f"\n{report['steps']} steps, median step {report['step_s_median']:.2f} s, mean reward of the last 10 "
              f"{report['reward_last10']}; whole command {report['duration_s']:.0f} s; report: "
              f"{Path(report['logs']['run_dir']).parent / 'report.json'}")


def _store_used(report: dict[str, Any], name: str) -> str:
    reading = report["object_store"].get(name, {}).get("reading")
    return _bytes_mb(reading["used_bytes"]) if reading else "-"


def final_line(report: dict[str, Any]) -> str:
    snapshots = report["snapshots"]
    return (f"soak: steps={snapshots['late']['step']} early_step={snapshots['early']['step']} "
            f"rss_growth={report['rss_growth']:.3f} process=\"{report['rss_growth_process']}\" "
            f"target={report['target']:.2f} met={'yes' if report['met'] else 'no'} "
            f"vmrss_growth={report['vmrss_growth']:.3f} object_store_used_mb={_store_used(report, 'early')}"
            f"->{_store_used(report, 'late')} object_store_max_mb={_bytes_mb(report['object_store']['max_used_bytes'])}")


def main(argv: list[str] | None = None) -> int:
    own, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    config = load_bench_config(SoakConfig, own, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging()
    interrupt_on_sigterm()  # so run_polled stops local_cluster.py, which stops everything it started
    try:
        report = run(config, passthrough)
    except RunFailed as exc:
        print(f"soak: FAILED: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if report["status"] != "ok":
        print_failure(report, "soak")
        return 1
    print(final_line(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
