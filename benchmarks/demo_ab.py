"""The demo with settings A against settings B: medians of each step's metrics and B/A ratios.

    .venv/bin/python -m benchmarks.demo_ab --a "--max_lag 0" --b "--max_lag 1"   # 2 rounds x 20 steps
    .venv/bin/python -m benchmarks.demo_ab --a "" --b "--model.share_prompts false" --rounds 3 --steps 30
    .venv/bin/python -m benchmarks.demo_ab --a_name per_rank --a "--data_path per_rank" \\
        --b_name rank0 --b "--data_path rank0"   # what data_path.py runs
    .venv/bin/python -m benchmarks.demo_ab --b_launcher "--tune_processes false"   # launcher flags of B's workers

`--a` and `--b` are trainer flags (trainer_core.py's, one shell-quoted string each, '' for the
demo as configured; one word alone is written `--b=--max_lag=1`) added to the demo's
(configs/demo.yaml with its assets, seed `--seed`, no checkpoints, no evaluation); `--a_launcher`
and `--b_launcher` are local_cluster.py flags for each side's workers. Each round runs
A, then B, for `--steps` steps each on a local cluster (benchmarks/ab_parts.py says when the two
share one); each run's first `--skip` steps are left out. Printed: a table of every `--metrics` key
both sides log (median [min-max] over their steps), then the last line
`demo_ab: <key>_ratio=<B median / A median> a_<key>=<A median> b_<key>=<B median> ...` for each
(<key>: the metric's name after its '/', e.g. step_s, wait_s, ray_bytes). Written to
<out_dir>/demo_ab.json. Presets over the same runner: data_path.py, async_overlap.py,
step_profile.py, and checkpoint_async.py on a job of its own.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from async_grpo.config.run_config import flattened
from benchmarks.ab_parts import AbPlan, DEFAULT_METRICS, pooled, print_table, ratio, run_ab, Side, summarise
from benchmarks.clusters import AttachConfig
from benchmarks.harness import (
    apply_smoke, DEFAULT_DEMO_ASSETS, interrupt_on_sigterm, load_bench_config, REPO_ROOT, setup_logging, summary_line,
)

logger = logging.getLogger(__name__)

SMOKE = {"steps": 2, "rounds": 1}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class DemoAbConfig:
    """Command line of `python -m benchmarks.demo_ab`."""

    a: str = ""
    """Setting A: trainer flags on top of the demo's, as one shell-quoted string ('' = the demo as configured)."""
    b: str = ""
    """Setting B: trainer flags on top of the demo's, as one shell-quoted string."""
    a_name: str = "A"
    """A's name in the table, the run folders and the JSON."""
    b_name: str = "B"
    """B's name."""
    a_launcher: str = ""
    """local_cluster.py flags for A's workers, one shell-quoted string (e.g. '--tune_processes false'); sides
    whose workers differ get a cluster each."""
    b_launcher: str = ""
    """local_cluster.py flags for B's workers."""
    rounds: int = 2
    """Pairs of runs (A, then B)."""
    steps: int = 20
    """Demo steps per run."""
    skip: int = 1
    """Steps left out at the start of each run (start-up)."""
    seed: int = 0
    """Trainer seed of every run."""
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    """metrics.jsonl keys to compare (a key neither run logs is left out)."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's model, prompts and evaluation table (made by scripts/prepare_demo.py if missing)."""
    out_dir: str = str(REPO_ROOT / "runs" / "demo-ab")
    """Runs go to <out_dir>/<name>-<round>."""
    cluster: AttachConfig = flattened(AttachConfig())
    """`--attach` (benchmarks/clusters.py); only when A and B configure the workers alike."""
    smoke: bool = False
    """Smoke mode: 2 steps, 1 round (SMOKE); checks that the command runs, its figures mean nothing."""


def short_name(key: str) -> str:
    """A metric's name in the summary line: after its last '/' (timing/step_s -> step_s)."""
    return key.rsplit("/", 1)[-1]


def main(argv: list[str] | None = None) -> int:
    config = apply_smoke(load_bench_config(DemoAbConfig, argv, description=__doc__), SMOKE)
    setup_logging()
    interrupt_on_sigterm()
    a = Side.parse(config.a_name, config.a, config.a_launcher)
    b = Side.parse(config.b_name, config.b, config.b_launcher)
    plan = AbPlan(a=a, b=b, rounds=config.rounds, num_steps=config.steps, seed=config.seed, skip=config.skip,
                  assets_dir=config.assets_dir, out_dir=config.out_dir, smoke=config.smoke,
                  attach=config.cluster.attach)
    metrics = tuple(config.metrics)
    records = pooled(run_ab(plan))
    summaries = {name: summarise(rs, metrics) for name, rs in records.items()}
    (Path(config.out_dir) / "demo_ab.json").write_text(json.dumps({
        **{key: {"name": s.name, "flags": list(s.flags), "launcher": list(s.launcher)}
           for key, s in (("a", a), ("b", b))},
        "steps_per_side": {n: len(rs) for n, rs in records.items()},
        "summary": {n: {k: asdict(v) for k, v in s.items()} for n, s in summaries.items()}}, indent=1))
    print("\n" + "; ".join(f"{s.name}: {' '.join(s.flags) or '(the demo)'}"
                           + (f" (launcher {' '.join(s.launcher)})" if s.launcher else "") for s in (a, b)))
    print(f"{len(records[a.name])} steps per side (each run's first {config.skip} left out); median [min-max]")
    print_table(summaries, metrics)
    figures = {}
    for key in metrics:
        if key in summaries[a.name] and key in summaries[b.name]:
            name = short_name(key)
            figures[f"{name}_ratio"] = f"{ratio(summaries, key, b.name, a.name):.3f}"
            figures[f"a_{name}"] = f"{summaries[a.name][key].median:.4g}"
            figures[f"b_{name}"] = f"{summaries[b.name][key].median:.4g}"
    print("\n" + summary_line("demo_ab", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
