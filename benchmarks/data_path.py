"""The two data paths (TrainerConfig.data_path) on the demo: time waiting for data, bytes over Ray.

    .venv/bin/python -m benchmarks.data_path                       # 2 repeats x 20 steps per path
    .venv/bin/python -m benchmarks.data_path --num_steps 5 --repeats 1   # a quick look

What runs: one local cluster with the demo's workers (a vLLM generation worker and a reference
logprob worker) that stays up; then `torchrun --nproc_per_node=2 trainer_core.py` with
`configs/demo.yaml` for `--num_steps` steps, alternately with `--data_path per_rank` and
`--data_path rank0` (per_rank, rank0, per_rank, ...: slow drift of a shared machine hits both),
same seed, no checkpoints, no evaluation.

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
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from async_grpo.config.run_config import flattened
from benchmarks.clusters import AttachConfig, local_cluster
from benchmarks.harness import (
    apply_smoke, DEFAULT_DEMO_ASSETS, demo_assets, demo_trainer_flags, DemoAssets, fresh_run_dir,
    interrupt_on_sigterm, load_bench_config, REPO_ROOT, run_engine, run_trainer, setup_logging, summary_line,
)
from local_cluster import LocalCluster, LocalClusterConfig

logger = logging.getLogger(__name__)

PATHS = ("per_rank", "rank0")
KEYS = ("timing/wait_s", "timing/step_s", "data/ray_bytes", "data/scatter_bytes")


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


def run_one(cluster: LocalCluster, assets: DemoAssets, path: str, repeat: int,
            config: DataPathBenchConfig) -> list[dict]:
    run_dir = fresh_run_dir(Path(config.out_dir) / f"{path}-{repeat}")
    args = [*demo_trainer_flags(assets, run_dir, num_steps=config.num_steps, seed=config.seed), "--data_path", path]
    run = run_trainer(cluster, args, run_dir)
    if run.exit_code != 0:
        raise RuntimeError(f"{path} run {repeat} exited {run.exit_code}; see {run.log}")
    logger.info("%s run %d: %d steps in %.0f s", path, repeat, len(run.records), run.wall_s)
    return run.records[1:]


def summarise(records: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for key in KEYS:
        values = [r[key] for r in records]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    config = load_bench_config(DataPathBenchConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging()
    interrupt_on_sigterm()
    assets = demo_assets(config.assets_dir)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict]] = {path: [] for path in PATHS}
    cluster_config = LocalClusterConfig(model_path=str(assets.model), log_dir=str(out / "cluster-logs"),
                                        engine=run_engine(config.smoke))
    with local_cluster(cluster_config, config.cluster.attach) as cluster:
        for repeat in range(config.repeats):
            for path in PATHS:
                records[path].extend(run_one(cluster, assets, path, repeat, config))
    summary = {path: summarise(rs) for path, rs in records.items()}
    (out / "data_path.json").write_text(json.dumps({"summary": summary, "steps_per_path": {
        p: len(rs) for p, rs in records.items()}}, indent=1))
    print(f"\n{len(records['per_rank'])} steps per path (each run's first step left out); median [min-max]")
    print("| path | " + " | ".join(KEYS) + " |")
    print("|---|" + "---|" * len(KEYS))
    for path in PATHS:
        cells = [f"{s['median']:.3g} [{s['min']:.3g}-{s['max']:.3g}]" for s in summary[path].values()]
        print(f"| {path} | " + " | ".join(cells) + " |")
    wait = summary["rank0"]["timing/wait_s"]["median"] / summary["per_rank"]["timing/wait_s"]["median"]
    step = summary["rank0"]["timing/step_s"]["median"] / summary["per_rank"]["timing/step_s"]["median"]
    # rank0: Ray carries every byte to rank 0 only; the other ranks' share goes by scatter.
    ray_bytes = {p: summary[p]["data/ray_bytes"]["median"] for p in PATHS}
    print("\n" + summary_line("data_path", {
        "wait_ratio": f"{wait:.3f}", "step_ratio": f"{step:.3f}",
        "ray_bytes_per_step": f"per_rank:{ray_bytes['per_rank']:.0f},rank0:{ray_bytes['rank0']:.0f}",
        "scatter_bytes_per_step": f"rank0:{summary['rank0']['data/scatter_bytes']['median']:.0f}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
