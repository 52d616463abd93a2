"""The demo with settings A against settings B: the runner behind benchmarks/demo_ab.py and the
presets that compare two settings (data_path.py, checkpoint_async.py, async_overlap.py,
step_profile.py; inflight.py takes its round order and tables).

Each round runs the job (the demo unless the plan names another: configs/demo.yaml with its
assets, harness.demo_trainer_flags, so no checkpoints and no evaluation) once with A's trainer
flags, then once with B's (B first in odd rounds with `swap`), same seed, each in its own run_dir
(<out_dir>/<name>-<round>): alternating, so a slow drift in a shared machine's load falls on
both. Each run's first `skip` and last `tail` steps are left out of the figures. The workers take
what they read from the trainer's config (local_cluster.with_trainer_settings) and a side's own
launcher flags: where A's and B's workers differ, each run gets a cluster of its own (and
`--attach` is refused); otherwise one cluster serves every run. A plan without B runs A alone.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.clusters import local_cluster
from benchmarks.cpu_profile import CpuWindow, profiled_run
from benchmarks.harness import (
    DEFAULT_DEMO_ASSETS, demo_assets, demo_trainer_flags, for_trainer, fresh_run_dir, run_engine, run_trainer,
)

logger = logging.getLogger(__name__)

# What the A/B scripts report per step (metrics.jsonl keys and with_derived's); a key a run lacks is skipped.
DEFAULT_METRICS = ("timing/step_s", "timing/wait_s", "timing/busy_s", "timing/train_s", "timing/push_s",
                   "timing/batcher_generate_s_mean", "timing/batcher_logprob_s_mean",
                   "data/ray_bytes", "data/scatter_bytes", "reward/mean")


@dataclass(frozen=True)
class Side:
    """One setting: its name (run folders, table rows, summary keys), its trainer flags, and
    local_cluster.py flags for the workers of its runs (e.g. `--tune_processes false`)."""

    name: str
    flags: tuple[str, ...]
    launcher: tuple[str, ...] = ()

    @classmethod
    def parse(cls, name: str, flags: str, launcher: str = "") -> "Side":
        """A side from shell-quoted strings of trainer and launcher flags ('' = the demo as configured)."""
        return cls(name=name, flags=tuple(shlex.split(flags)), launcher=tuple(shlex.split(launcher)))


@dataclass(kw_only=True, frozen=True)
class AbPlan:
    """What to run: two sides (or A alone), how many rounds of how many steps, and where."""

    a: Side
    b: Side | None
    """None: A alone (a profile of it, no ratios)."""
    rounds: int
    num_steps: int
    skip: int
    out_dir: str
    smoke: bool
    tail: int = 0
    """Steps left out at the end of each run (e.g. max_lag 1's last, with no next step to overlap)."""
    swap: bool = False
    """B before A in odd rounds (A B, B A, ...), not A first in every round."""
    attach: str = ""
    seed: int = 0
    """The demo's --seed."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's model, prompts and evaluation table."""
    flags: tuple[str, ...] = ()
    """Trainer flags of both sides, after the demo's (or the job's) and before the side's own."""
    job: Callable[[Path], list[str]] | None = None
    """Trainer flags of another job than the demo, given a run's run_dir (with --num_steps)."""
    cluster: Any = None
    """The workers' LocalClusterConfig (None: the demo's)."""
    timeout_s: float | None = None
    """A run's time limit (None: none)."""
    profile_cpu_s: float = 0.0
    """> 0: sample every process's CPU this often during each run's counted steps (cpu_profile.py)."""

    @property
    def sides(self) -> tuple[Side, ...]:
        return (self.a,) if self.b is None else (self.a, self.b)

    def __post_init__(self) -> None:
        if self.b is not None and self.a.name == self.b.name:
            raise ValueError(f"AbPlan: the two sides need different names, both are {self.a.name!r}")
        if self.rounds < 1:
            raise ValueError(f"AbPlan.rounds must be >= 1, got {self.rounds}")
        if self.skip < 0 or self.tail < 0 or self.skip + self.tail >= self.num_steps:
            raise ValueError(f"AbPlan.skip and tail must leave a step of num_steps, got {self.skip} and {self.tail} "
                             f"of {self.num_steps}")


@dataclass(frozen=True)
class Run:
    """One run's counted steps (metrics records, with_derived), and its CPU when profiled."""

    records: list[dict[str, Any]]
    cpu: CpuWindow | None = None


@dataclass(frozen=True)
class Spread:
    """Median and range of one metric over a side's steps."""

    median: float
    low: float
    high: float

    def cell(self) -> str:
        return f"{self.median:.3g} [{self.low:.3g}-{self.high:.3g}]"


def schedule(names: tuple[str, ...], rounds: int, swap: bool = False) -> Iterator[tuple[int, str]]:
    """(round, side) in run order: every side once per round, the order reversed in odd rounds with swap."""
    for round_index in range(rounds):
        yield from ((round_index, name) for name in (names[::-1] if swap and round_index % 2 else names))


def _trainer_args(plan: AbPlan, side: Side, run_dir: Path) -> list[str]:
    if plan.job is not None:
        return [*plan.job(run_dir), *plan.flags, *side.flags]
    assets = demo_assets(plan.assets_dir)
    return [*demo_trainer_flags(assets, run_dir, num_steps=plan.num_steps, seed=plan.seed), *plan.flags, *side.flags]


def cluster_config(plan: AbPlan, side: Side) -> Any:
    """The LocalClusterConfig of a side's runs: the plan's (or the demo's) with the side's launcher
    flags and the trainer settings the workers read."""
    from async_grpo.config.run_config import config_to_flags, load_config
    from local_cluster import LocalClusterConfig

    out = Path(plan.out_dir)
    base = plan.cluster or LocalClusterConfig(model_path=str(demo_assets(plan.assets_dir).model),
                                              log_dir=str(out / "cluster-logs"), engine=run_engine(plan.smoke))
    if side.launcher:
        base = load_config(LocalClusterConfig, [*config_to_flags(base), *side.launcher])
    return for_trainer(base, _trainer_args(plan, side, out / "probe"))


@contextmanager
def _started(config: Any, attach: str = "") -> Iterator[Any]:
    with local_cluster(config, attach) as cluster:
        if not attach:
            for line in cluster.cpu_plan.lines():
                logger.info("%s", line)
        yield cluster


@contextmanager
def _clusters(plan: AbPlan, cluster: Any) -> Iterator[Any]:
    """Yields a function side -> the cluster its runs go to: `cluster` when given, one shared
    cluster when both sides' workers are configured alike, else a fresh one per run."""
    if cluster is not None:
        yield lambda side: nullcontext(cluster)
        return
    configs = {side.name: cluster_config(plan, side) for side in plan.sides}
    if all(config == configs[plan.a.name] for config in configs.values()):
        with _started(configs[plan.a.name], plan.attach) as shared:
            yield lambda side: nullcontext(shared)
        return
    if plan.attach:
        raise ValueError(f"{plan.a.name} and {plan.b.name} configure the workers differently: each needs a cluster "
                         "of its own, leave --attach out")
    yield lambda side: _started(configs[side.name])


def _load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_ab(plan: AbPlan, cluster: Any = None) -> dict[str, list[Run]]:
    """Every side's runs, round by round (plan.skip and plan.tail steps left out of each);
    RuntimeError with the trainer log's tail if a run fails. `cluster`: a started LocalCluster
    that every run goes to (its caller's: e.g. with an actor of its own registered) instead of
    the plan's."""
    Path(plan.out_dir).mkdir(parents=True, exist_ok=True)
    sides = {side.name: side for side in plan.sides}
    runs: dict[str, list[Run]] = {name: [] for name in sides}
    counted = (plan.skip, plan.num_steps - plan.tail)
    with _clusters(plan, cluster) as cluster_for:
        for round_index, name in schedule(tuple(sides), plan.rounds, plan.swap):
            side = sides[name]
            run_dir = fresh_run_dir(Path(plan.out_dir) / f"{name}-{round_index}")
            args = _trainer_args(plan, side, run_dir)
            cpu = None
            with cluster_for(side) as on:
                if plan.profile_cpu_s > 0:
                    run, cpu = profiled_run(on, args, run_dir, window=counted, poll_s=plan.profile_cpu_s,
                                            attach=plan.attach, timeout_s=plan.timeout_s)
                else:
                    run = run_trainer(on, args, run_dir, timeout_s=plan.timeout_s)
            records = [with_derived(r) for r in run.require(plan.num_steps)[slice(*counted)]]
            step_s = statistics.median(r["timing/step_s"] for r in records)
            print(f"{name} round {round_index}: {plan.num_steps} steps in {run.wall_s:.0f} s, median step_s "
                  f"{step_s:.3f} over {len(records)} (load average now {_load_average()})", flush=True)
            runs[name].append(Run(records=records, cpu=cpu))
    return runs


def with_derived(record: dict[str, Any]) -> dict[str, Any]:
    """A step's record with figures computed from its own metrics: timing/busy_s = step_s - wait_s,
    the trainer's time not spent waiting for data (what generation can overlap with at max_lag >= 1)."""
    if "timing/step_s" in record and "timing/wait_s" in record:
        return {**record, "timing/busy_s": record["timing/step_s"] - record["timing/wait_s"]}
    return record


def pooled(runs: dict[str, list[Run]]) -> dict[str, list[dict[str, Any]]]:
    """Each side's records of all its runs together."""
    return {name: [record for run in side_runs for record in run.records] for name, side_runs in runs.items()}


def summarise(records: list[dict[str, Any]], metrics: tuple[str, ...]) -> dict[str, Spread]:
    """Median and range of each metric the records carry."""
    out = {}
    for key in metrics:
        values = [r[key] for r in records if key in r]
        if values:
            out[key] = Spread(statistics.median(values), min(values), max(values))
    return out


def ratio(summaries: dict[str, dict[str, Spread]], key: str, over: str, under: str) -> float:
    """summaries[over][key] / summaries[under][key] as medians (nan when the latter is 0)."""
    below = summaries[under][key].median
    return summaries[over][key].median / below if below else math.nan


def overlap_ideal(generation_s: float, busy_s: float) -> float:
    """The step-time ratio overlapping generation (G) with the trainer's busy time (T) gives at
    best, one pipeline stage each: (G + T) / max(G, T), 2 at G = T."""
    return (generation_s + busy_s) / max(generation_s, busy_s)


def print_table(summaries: dict[str, dict[str, Spread]], metrics: tuple[str, ...], label: str = "side") -> None:
    """A markdown table: one row per side, one column per metric both sides carry, median [min-max]."""
    keys = [k for k in metrics if all(k in s for s in summaries.values())]
    print(f"| {label} | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, summary in summaries.items():
        print(f"| {name} | " + " | ".join(summary[k].cell() for k in keys) + " |")
