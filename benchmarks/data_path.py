"""The two data paths (TrainerConfig.data_path) on the demo: time waiting for data, bytes over Ray.

    .venv/bin/python -m benchmarks.data_path                       # 2 repeats x 20 steps per path
    .venv/bin/python -m benchmarks.data_path --num_steps 5 --repeats 1   # a quick look

A preset of benchmarks/demo_ab.py (the runner in benchmarks/ab_parts.py): A = `--data_path
per_rank`, B = `--data_path rank0`, on one local cluster with the demo's workers (a vLLM generation
worker and a reference logprob worker) that stays up; `torchrun --nproc_per_node=2 trainer_core.py`
with `configs/demo.yaml` for `--num_steps` steps, alternately per_rank and rank0 (per_rank, rank0,
per_rank, ...: slow drift of a shared machine hits both), same seed, no checkpoints, no evaluation.

Per path, over every step of every repeat except each run's first (start-up):
- `timing/wait_s`: the step's seconds a rank spent waiting for its next message (the largest over
  ranks): generation, logprobs and the transport together (demo: max_lag 0, so mostly generation);
- `timing/step_s`;
- `data/ray_bytes`, `data/scatter_bytes`: token and per-token-value payload (8 bytes per value,
  data_path.payload_nbytes) received over Ray, and through the process group, per step.
Printed: median and range per path, the rank0/per_rank ratio of the medians, and the last line
`data_path: wait_ratio=<rank0/per_rank median wait_s> step_ratio=<...> ray_bytes_per_step=...
 scatter_bytes_per_step=...`.
Written to <out_dir>/data_path.json.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from async_grpo.config.run_config import flattened
from benchmarks.ab_parts import AbPlan, pooled, print_table, ratio, run_ab, Side, summarise
from benchmarks.clusters import AttachConfig
from benchmarks.harness import (
    apply_smoke, DEFAULT_DEMO_ASSETS, interrupt_on_sigterm, load_bench_config, REPO_ROOT, setup_logging, summary_line,
)

logger = logging.getLogger(__name__)

PER_RANK = Side("per_rank", ("--data_path", "per_rank"))
RANK0 = Side("rank0", ("--data_path", "rank0"))
KEYS = ("timing/wait_s", "timing/step_s", "data/ray_bytes", "data/scatter_bytes")
SKIP_STEPS = 1  # each run's first step: start-up


@dataclass(kw_only=True, frozen=True)
class DataPathBenchConfig:
    """Command line of `python -m benchmarks.data_path`."""

    num_steps: int = 20
    """Steps per run (the first of each run is left out of the figures)."""
    repeats: int = 2
    """Runs per path, alternating between the paths."""
    seed: int = 0
    """Trainer seed of every run."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's model, prompts and evaluation table (made by scripts/prepare_demo.py if missing)."""
    out_dir: str = str(REPO_ROOT / "runs" / "data-path")
    """Runs go to <out_dir>/<path>-<repeat>."""
    cluster: AttachConfig = flattened(AttachConfig())
    """`--attach` (benchmarks/clusters.py)."""
    smoke: bool = False
    """Smoke mode: 2 steps, 1 repeat (SMOKE); checks that the command runs, its figures mean nothing."""


SMOKE = {"num_steps": 2, "repeats": 1}


def main(argv: list[str] | None = None) -> int:
    config = load_bench_config(DataPathBenchConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging()
    interrupt_on_sigterm()
    plan = AbPlan(a=PER_RANK, b=RANK0, rounds=config.repeats, num_steps=config.num_steps, seed=config.seed,
                  skip=SKIP_STEPS, assets_dir=config.assets_dir, out_dir=config.out_dir, smoke=config.smoke,
                  attach=config.cluster.attach)
    records = pooled(run_ab(plan))
    summary = {path: summarise(rs, KEYS) for path, rs in records.items()}
    (Path(config.out_dir) / "data_path.json").write_text(json.dumps({
        "summary": {p: {k: {"median": v.median, "min": v.low, "max": v.high} for k, v in s.items()}
                    for p, s in summary.items()},
        "steps_per_path": {p: len(rs) for p, rs in records.items()}}, indent=1))
    print(f"\n{len(records[PER_RANK.name])} steps per path (each run's first step left out); median [min-max]")
    print_table(summary, KEYS, label="path")
    # rank0: Ray carries every byte to rank 0 only; the other ranks' share goes by scatter.
    ray_bytes = {p: summary[p]["data/ray_bytes"].median for p in summary}
    print("\n" + summary_line("data_path", {
        "wait_ratio": f"{ratio(summary, 'timing/wait_s', RANK0.name, PER_RANK.name):.3f}",
        "step_ratio": f"{ratio(summary, 'timing/step_s', RANK0.name, PER_RANK.name):.3f}",
        "ray_bytes_per_step": f"per_rank:{ray_bytes['per_rank']:.0f},rank0:{ray_bytes['rank0']:.0f}",
        "scatter_bytes_per_step": f"rank0:{summary['rank0']['data/scatter_bytes'].median:.0f}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
