"""The two data paths (TrainerConfig.data_path) on the demo: time waiting for data, bytes over Ray.

    .venv/bin/python benchmarks/data_path.py                       # 2 repeats x 20 steps per path
    .venv/bin/python benchmarks/data_path.py --num_steps 5 --repeats 1   # a quick look

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
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from benchmarks.algorithms import ensure_assets  # noqa: E402
from benchmarks.realistic_run import interrupt_on_sigterm  # noqa: E402
from local_cluster import LocalCluster, LocalClusterConfig  # noqa: E402
from metrics import read_metrics  # noqa: E402
from run_config import load_config  # noqa: E402

logger = logging.getLogger("data_path")

PATHS = ("per_rank", "rank0")
KEYS = ("timing/wait_s", "timing/step_s", "data/ray_bytes", "data/scatter_bytes")


@dataclass(kw_only=True, frozen=True)
class DataPathBenchConfig:
    """Command line of `python benchmarks/data_path.py`."""

    num_steps: int = 20
    """Steps per run (the first of each run is left out of the figures)."""
    repeats: int = 2
    """Runs per path, alternating between the paths."""
    seed: int = 0
    """Trainer seed of every run."""
    assets_dir: str = str(REPO_ROOT / "runs" / "demo-assets")
    """The demo's model and prompts (made by scripts/prepare_demo.py if missing)."""
    out_dir: str = str(REPO_ROOT / "runs" / "data-path")
    """Runs go to <out_dir>/<path>-<repeat>."""


def run_one(cluster: LocalCluster, path: str, repeat: int, config: DataPathBenchConfig) -> list[dict]:
    assets = Path(config.assets_dir)
    run_dir = Path(config.out_dir) / f"{path}-{repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    args = ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--run_dir", str(run_dir),
            "--model.model_path", str(assets / "model"), "--data.path", str(assets / "arithmetic.jsonl"),
            "--seed", str(config.seed), "--num_steps", str(config.num_steps),
            "--optim.total_steps", str(max(config.num_steps, 6)), "--checkpoint_every", "0",
            "--checkpoint_at_end", "false", "--progress_bar", "false", "--tensorboard", "false",
            "--eval.every", "0", "--data_path", path]
    started = time.monotonic()
    code = cluster.run_trainer(args, nproc_per_node=2, log_path=run_dir / "trainer.log")
    if code != 0:
        raise RuntimeError(f"{path} run {repeat} exited {code}; see {run_dir / 'trainer.log'}")
    records = read_metrics(run_dir / "metrics.jsonl")
    logger.info("%s run %d: %d steps in %.0f s", path, repeat, len(records), time.monotonic() - started)
    return records[1:]


def summarise(records: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for key in KEYS:
        values = [r[key] for r in records]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    config = load_config(DataPathBenchConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    interrupt_on_sigterm()
    assets = Path(config.assets_dir)
    ensure_assets(assets)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict]] = {path: [] for path in PATHS}
    cluster_config = LocalClusterConfig(model_path=str(assets / "model"), log_dir=str(out / "cluster-logs"))
    with LocalCluster(cluster_config) as cluster:
        cluster.start_workers()
        for repeat in range(config.repeats):
            for path in PATHS:
                records[path].extend(run_one(cluster, path, repeat, config))
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
    print(f"\ndata_path: wait_ratio={wait:.3f} step_ratio={step:.3f} ray_bytes_per_step=per_rank:{ray_bytes['per_rank']:.0f}"
          f",rank0:{ray_bytes['rank0']:.0f} scatter_bytes_per_step=rank0:{summary['rank0']['data/scatter_bytes']['median']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
