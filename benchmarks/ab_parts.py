"""The demo with settings A against settings B: the runner behind benchmarks/demo_ab.py and the
presets that compare two sets of trainer flags (data_path.py, checkpoint_async.py).

Each round runs the job (the demo unless the plan names another: configs/demo.yaml with its
assets, harness.demo_trainer_flags, so no checkpoints and no evaluation) once with A's trainer
flags, then once with B's, same seed, each in its own run_dir (<out_dir>/<name>-<round>):
alternating, so a slow drift in a shared machine's load falls on both. Each run's first `skip`
steps (start-up) are left out of the figures. The workers take what they read from the trainer's
config (local_cluster.with_trainer_settings): where A's and B's differ there, each run gets a
cluster of its own (and `--attach` is refused); otherwise one cluster serves every run.
"""

from __future__ import annotations

import logging
import math
import shlex
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.clusters import local_cluster
from benchmarks.harness import (
    DEFAULT_DEMO_ASSETS, demo_assets, demo_trainer_flags, for_trainer, fresh_run_dir, run_engine, run_trainer,
)

logger = logging.getLogger(__name__)

# What the A/B scripts report per step (metrics.jsonl keys); a key a run does not log is skipped.
DEFAULT_METRICS = ("timing/step_s", "timing/wait_s", "timing/train_s", "timing/push_s",
                   "timing/batcher_generate_s_mean", "timing/batcher_logprob_s_mean",
                   "data/ray_bytes", "data/scatter_bytes", "reward/mean")


@dataclass(frozen=True)
class Side:
    """One setting: its name (run folders, table rows, summary keys) and its trainer flags."""

    name: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, name: str, flags: str) -> "Side":
        """A side from a shell-quoted string of trainer flags ('' = the demo as configured)."""
        return cls(name=name, flags=tuple(shlex.split(flags)))


@dataclass(kw_only=True, frozen=True)
class AbPlan:
    """What to run: two sides, how many rounds of how many steps, and where."""

    a: Side
    b: Side
    rounds: int
    num_steps: int
    skip: int
    out_dir: str
    smoke: bool
    attach: str = ""
    seed: int = 0
    """The demo's --seed."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's model, prompts and evaluation table."""
    job: Callable[[Path], list[str]] | None = None
    """Trainer flags of another job than the demo, given a run's run_dir (with --num_steps)."""
    cluster: Any = None
    """That job's LocalClusterConfig (None: the demo's)."""
    timeout_s: float | None = None
    """A run's time limit (None: none)."""

    def __post_init__(self) -> None:
        if self.a.name == self.b.name:
            raise ValueError(f"AbPlan: the two sides need different names, both are {self.a.name!r}")
        if self.rounds < 1:
            raise ValueError(f"AbPlan.rounds must be >= 1, got {self.rounds}")
        if not 0 <= self.skip < self.num_steps:
            raise ValueError(f"AbPlan.skip must be in [0, num_steps), got {self.skip} with num_steps {self.num_steps}")


@dataclass(frozen=True)
class Spread:
    """Median and range of one metric over a side's steps."""

    median: float
    low: float
    high: float

    def cell(self) -> str:
        return f"{self.median:.3g} [{self.low:.3g}-{self.high:.3g}]"


def _trainer_args(plan: AbPlan, side: Side, run_dir: Path) -> list[str]:
    if plan.job is not None:
        return [*plan.job(run_dir), *side.flags]
    assets = demo_assets(plan.assets_dir)
    return [*demo_trainer_flags(assets, run_dir, num_steps=plan.num_steps, seed=plan.seed), *side.flags]


@contextmanager
def _clusters(plan: AbPlan) -> Iterator[Any]:
    """Yields a function side -> the cluster its runs go to: one shared cluster when both sides'
    workers are configured alike, else a fresh one per run."""
    out = Path(plan.out_dir)

    def config_for(side: Side) -> Any:
        from local_cluster import LocalClusterConfig

        base = plan.cluster or LocalClusterConfig(model_path=str(demo_assets(plan.assets_dir).model),
                                                  log_dir=str(out / "cluster-logs"), engine=run_engine(plan.smoke))
        return for_trainer(base, _trainer_args(plan, side, out / "probe"))

    configs = {side.name: config_for(side) for side in (plan.a, plan.b)}
    if configs[plan.a.name] == configs[plan.b.name]:
        with local_cluster(configs[plan.a.name], plan.attach) as cluster:
            yield lambda side: nullcontext(cluster)
        return
    if plan.attach:
        raise ValueError(f"{plan.a.name} and {plan.b.name} configure the workers differently: each needs a cluster "
                         "of its own, leave --attach out")
    yield lambda side: local_cluster(configs[side.name])


def run_ab(plan: AbPlan) -> dict[str, list[list[dict[str, Any]]]]:
    """Every side's runs, round by round, as their metrics records (each run's first plan.skip
    steps left out); RuntimeError with the trainer log's tail if a run fails."""
    Path(plan.out_dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict[str, Any]]]] = {plan.a.name: [], plan.b.name: []}
    with _clusters(plan) as cluster_for:
        for round_index in range(plan.rounds):
            for side in (plan.a, plan.b):
                run_dir = fresh_run_dir(Path(plan.out_dir) / f"{side.name}-{round_index}")
                with cluster_for(side) as cluster:
                    run = run_trainer(cluster, _trainer_args(plan, side, run_dir), run_dir, timeout_s=plan.timeout_s)
                steps = run.require(plan.num_steps)
                logger.info("%s round %d: %d steps in %.0f s", side.name, round_index, len(steps), run.wall_s)
                runs[side.name].append(steps[plan.skip:])
    return runs


def pooled(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    """Each side's records of all its runs together."""
    return {name: [record for run in side_runs for record in run] for name, side_runs in runs.items()}


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


def print_table(summaries: dict[str, dict[str, Spread]], metrics: tuple[str, ...], label: str = "side") -> None:
    """A markdown table: one row per side, one column per metric both sides carry, median [min-max]."""
    keys = [k for k in metrics if all(k in s for s in summaries.values())]
    print(f"| {label} | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, summary in summaries.items():
        print(f"| {name} | " + " | ".join(summary[k].cell() for k in keys) + " |")
