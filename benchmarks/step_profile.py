"""Where a demo step's time and CPU go, per process kind, and today's settings against a baseline.

    python -m benchmarks.step_profile                          # 60 demo steps, the current defaults
    python -m benchmarks.step_profile --baseline true          # also the same run under the settings
                                                               # before issue 37: speedup=
    python -m benchmarks.step_profile --smoke true             # plumbing check (a few steps)
    python -m benchmarks.step_profile -- --max_lag 1           # trainer flags after --: the current run's
    python -m benchmarks.step_profile --attach 127.0.0.1:PORT  # on a running local cluster (benchmarks/clusters.py)

A LocalCluster runs the demo (configs/demo.yaml with its assets; seed 5, no evaluation, no
checkpoints) for `num_steps` steps. A sampler thread reads /proc/<pid>/stat of every process in
this process's tree every `poll_s` (the Ray head is started in this process, so its raylet, the
actors, the vLLM engine cores, the dispatchers, torchrun and the trainer ranks all descend from
it). From the end of step `skip` to the end of the last step it takes each process's user and
kernel CPU seconds and its minor page faults, and reports per process kind:

    kind | user s/step | kernel s/step | faults/step | cores

with `cores` the kind's CPU seconds per wall second, the machine's total on the last row, and the
step's split (medians over the same steps of timing/step_s, wait_s, train_s, push_s and the
batcher's generate and logprob means). With `--baseline true` it runs the same steps again with
the settings of before issue 37 (every process on glibc's 256 KiB mmap and trim thresholds, no
thread settings, max_lag 0, FSDP units per decoder layer resharding after forward, every sample
packed whole in training: `--tune_processes false -- --max_lag 0 --model.reshard_after_forward true
--model.share_prompts false --model.fsdp_per_layer_min_params 0`) and prints
speedup=<baseline median step / current median step>. The runs go one after the other on the
same machine; absolute times differ between machines, the ratio is what to compare.

With `--attach` the run goes to a cluster another process started (the tests' smoke shares one):
the sampler then reads this process's tree (the trainer) and the attached head's raylet with its
descendants (the actors and engine cores), not that cluster's dispatchers; the per-kind rows also
hold whatever else that cluster runs. `--baseline` needs a cluster of its own (its settings are
the workers' too) and refuses `--attach`.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_grpo.config.run_config import flattened, split_passthrough
from benchmarks.clusters import AttachConfig, local_cluster
from benchmarks.harness import (
    apply_smoke, demo_assets, demo_trainer_flags, for_trainer, fresh_run_dir, load_bench_config, run_engine,
    run_trainer, setup_logging, summary_line,
)
from benchmarks.process_monitor import (
    Counters, environ_rank, process_kind, process_label, read_counters, read_proc,
)

logger = logging.getLogger("benchmarks.step_profile")

# The demo's trainer settings before issue 37, where configs/demo.yaml or a default has changed since.
BASELINE_TRAINER_FLAGS = ["--max_lag", "0", "--model.reshard_after_forward", "true", "--model.share_prompts", "false",
                          "--model.fsdp_per_layer_min_params", "0"]

SMOKE = {"num_steps": 4, "skip": 2, "poll_s": 0.2}
STEP_SPLIT = ("timing/step_s", "timing/wait_s", "timing/train_s", "timing/push_s", "timing/batcher_generate_s_mean",
              "timing/batcher_logprob_s_mean")


@dataclass(kw_only=True, frozen=True)
class ProfileConfig:
    """What to profile: the command line of `python -m benchmarks.step_profile`."""

    num_steps: int = 60
    """Demo steps per run."""
    skip: int = 5
    """Steps left out at the start (engine warm-up, first pushes)."""
    seed: int = 5
    """The trainer's --seed."""
    poll_s: float = 0.5
    """How often the sampler reads /proc."""
    baseline: bool = False
    """Also run the settings of before issue 37 (--tune_processes false, BASELINE_TRAINER_FLAGS) and print speedup=."""
    assets: str = "runs/demo-assets"
    """The demo's model, prompts and evaluation table (scripts/prepare_demo.py writes them)."""
    smoke: bool = False
    """Smoke mode (SMOKE): a few steps, uncompiled engines; checks the command runs, its figures mean nothing."""
    cluster: AttachConfig = flattened(AttachConfig())
    """`--attach`: run on that running local cluster instead of starting one (not with --baseline)."""

    def __post_init__(self) -> None:
        if self.baseline and self.cluster.attach:
            raise ValueError("ProfileConfig.baseline runs the workers under other settings: it needs a cluster of its "
                             "own, leave --attach out")
        if not 0 <= self.skip < self.num_steps:
            raise ValueError(f"ProfileConfig.skip must be in [0, num_steps), got {self.skip}")
        if not self.poll_s > 0:
            raise ValueError(f"ProfileConfig.poll_s must be > 0, got {self.poll_s}")


def kind_of(label: str) -> str:
    """The kind of a process (process_monitor.process_kind); this benchmark's own process is the launcher."""
    return "launcher (this process)" if label == "step_profile" else process_kind(label)


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


def label_of(pid: int) -> str:
    if pid == os.getpid():
        return "step_profile"
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
                    known = pid in self.latest and kind_of(self.latest[pid][0]) != "other"
                    label = self.latest[pid][0] if known else label_of(pid)
                    self.latest[pid] = (label, counters)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> dict[int, tuple[str, Counters]]:
        self._poll()
        with self._lock:
            return dict(self.latest)


def per_kind(start: dict[int, tuple[str, Counters]], end: dict[int, tuple[str, Counters]],
             steps: int, wall_s: float) -> dict[str, dict[str, float]]:
    """Per kind: user and kernel CPU seconds per step, minor faults per step, cores; processes
    that started inside the window count from zero."""
    rows: dict[str, dict[str, float]] = {}
    for pid, (label, last) in end.items():
        first = start[pid][1] if pid in start else Counters(0.0, 0.0, 0)
        if kind_of(label) == "other":
            logger.info("process kind 'other': %s (pid %d)", label, pid)
        row = rows.setdefault(kind_of(label), {"user": 0.0, "kernel": 0.0, "faults": 0.0, "processes": 0})
        row["user"] += last.user_s - first.user_s
        row["kernel"] += last.kernel_s - first.kernel_s
        row["faults"] += last.minor_faults - first.minor_faults
        row["processes"] += 1
    return {kind: {"user_s": r["user"] / steps, "kernel_s": r["kernel"] / steps, "faults": r["faults"] / steps,
                   "cores": (r["user"] + r["kernel"]) / wall_s, "processes": r["processes"]}
            for kind, r in sorted(rows.items(), key=lambda kv: -(kv[1]["user"] + kv[1]["kernel"]))}


def wait_for_records(metrics: Path, count: int, trainer: threading.Thread) -> float:
    """Block until metrics.jsonl holds `count` records (or the trainer ended); the time then."""
    while trainer.is_alive():
        if metrics.is_file() and sum(1 for _ in metrics.open()) >= count:
            break
        time.sleep(0.05)
    return time.monotonic()


@dataclass(slots=True)
class Profile:
    name: str
    kinds: dict[str, dict[str, float]]
    split: dict[str, float]
    wall_s: float


def profile_run(config: ProfileConfig, name: str, launcher: dict[str, Any], trainer_flags: list[str],
                work: Path) -> Profile:
    """One demo run under `launcher` (LocalClusterConfig fields) and extra trainer flags."""
    from local_cluster import LocalClusterConfig

    assets = demo_assets(config.assets)
    run_dir = fresh_run_dir(work / name)
    args = demo_trainer_flags(assets, run_dir, num_steps=config.num_steps, seed=config.seed) + trainer_flags
    cluster_config = for_trainer(LocalClusterConfig(model_path=str(assets.model), log_dir=str(run_dir / "logs"),
                                                    engine=run_engine(config.smoke), **launcher), args)
    with local_cluster(cluster_config, config.cluster.attach) as cluster:
        sampler = TreeSampler(config.poll_s, raylet_pids(config.cluster.attach))
        sampler.start()
        result: dict[str, Any] = {}
        trainer = threading.Thread(target=lambda: result.update(run=run_trainer(cluster, args, run_dir)))
        trainer.start()
        metrics = run_dir / "metrics.jsonl"
        began = wait_for_records(metrics, config.skip, trainer)
        start = sampler.mark()
        ended = wait_for_records(metrics, config.num_steps, trainer)
        end = sampler.mark()
        trainer.join()
        sampler.stop()
    records = result["run"].require(config.num_steps)[config.skip:]
    steps = len(records)
    split = {key: statistics.median(r[key] for r in records) for key in STEP_SPLIT if key in records[0]}
    return Profile(name=name, kinds=per_kind(start, end, steps, ended - began), split=split, wall_s=ended - began)


def print_profile(profile: Profile) -> None:
    print(f"\n{profile.name}: {profile.wall_s:.1f} s over the profiled steps; per step:")
    print(f"  {'kind':26} {'user s':>8} {'kernel s':>9} {'faults':>10} {'cores':>6}")
    total = {"user_s": 0.0, "kernel_s": 0.0, "faults": 0.0, "cores": 0.0}
    for kind, row in profile.kinds.items():
        print(f"  {kind:26} {row['user_s']:8.3f} {row['kernel_s']:9.3f} {row['faults']:10.0f} {row['cores']:6.2f}")
        for key in total:
            total[key] += row[key]
    print(f"  {'all':26} {total['user_s']:8.3f} {total['kernel_s']:9.3f} {total['faults']:10.0f} {total['cores']:6.2f}")
    print("  step split (medians): " + ", ".join(f"{k.removeprefix('timing/')} {v:.3f} s" for k, v in profile.split.items()))


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    own, trainer_flags = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    config = apply_smoke(load_bench_config(ProfileConfig, own, description=__doc__), SMOKE)
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        current = profile_run(config, "current", {}, trainer_flags, Path(tmp))
        print_profile(current)
        figures: dict[str, Any] = {"median_step_s": round(current.split["timing/step_s"], 3),
                                   "cores": round(sum(r["cores"] for r in current.kinds.values()), 2),
                                   "trainer_faults_per_step": round(current.kinds.get("trainer ranks", {}).get("faults", 0))}
        if config.baseline:
            before = profile_run(config, "baseline (before issue 37)", {"tune_processes": False},
                                 BASELINE_TRAINER_FLAGS, Path(tmp))
            print_profile(before)
            figures.update(baseline_step_s=round(before.split["timing/step_s"], 3),
                           speedup=round(before.split["timing/step_s"] / current.split["timing/step_s"], 3))
    print(summary_line("step_profile", figures))


if __name__ == "__main__":
    main()
