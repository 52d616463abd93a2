"""Algorithm variants on the demo task: reward at fixed steps, several seeds each, one table.

    .venv/bin/python -m benchmarks.algorithms                          # 6 variants x 3 seeds, 100 steps each
    .venv/bin/python -m benchmarks.algorithms --variants baseline rloo --seeds 0 --num_steps 20   # a quick look

What runs: the demo (`configs/demo.yaml`, the bundled tiny model and prompts from
`scripts/prepare_demo.py`, 2 trainer ranks x 16 prompts x 16 rollouts, 4 PPO epochs per step) on
one local cluster (one vLLM generation worker, one reference logprob worker) that stays up for
every run; each run is its own `torchrun trainer_core.py` from the same starting model (its first
push replaces whatever weights the workers hold), with `--num_steps N --optim.total_steps N`, no
checkpoints and no evaluation. A variant is the demo plus a few trainer flags (VARIANTS below).

Printed (and written to <out_dir>/algorithms.json): per variant and seed, the mean reward of every
generated rollout (`reward/mean_generated`: dynamic sampling's `reward/mean` covers only the groups
it trains) over the `--window` steps ending at each of `--at_steps`; then per variant the median over seeds and the
range. The last line is `algorithms: <variant>=<median at the last step> ...`. A run that fails
is reported with its log's tail and the table marks it; the script exits 1 if any failed.
No claim that one variant is better unless the seeds' ranges separate.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from async_grpo.config.run_config import flattened
from benchmarks.clusters import AttachConfig, local_cluster
from benchmarks.harness import (
    apply_smoke, DEFAULT_DEMO_ASSETS, demo_assets, demo_trainer_flags, DemoAssets, fresh_run_dir,
    interrupt_on_sigterm, load_bench_config, REPO_ROOT, reward_at, run_engine, run_trainer, setup_logging,
    summary_line,
)
from local_cluster import LocalCluster, LocalClusterConfig

logger = logging.getLogger(__name__)

VARIANTS: dict[str, list[str]] = {
    "baseline": [],  # the demo: GRPO, k3 KL 0.05 in the loss, per-sample token mean
    "kl_in_reward_adaptive": ["--loss.kl_in_reward", "true", "--loss.kl_controller", "adaptive",
                              "--loss.target_kl", "1.0", "--loss.kl_horizon", "10000"],
    # The same with dr_grpo: without the std division, equal-reward groups' KL differences stay at
    # their own (small) scale instead of being scaled to unit advantages (see RESULTS.md).
    "kl_in_reward_adaptive_dr_grpo": ["--loss.kl_in_reward", "true", "--loss.kl_controller", "adaptive",
                                      "--loss.target_kl", "1.0", "--loss.kl_horizon", "10000",
                                      "--algorithm.estimator", "dr_grpo"],
    "dynamic_sampling": ["--sampling.drop_zero_variance_groups", "true", "--sampling.max_resample_rounds", "2"],
    "token_mean": ["--loss.aggregation", "token_mean"],
    "gspo": ["--loss.ratio_level", "sequence"],
    "rloo": ["--algorithm.estimator", "rloo"],
}
# LoRA (issue 13): r=16, alpha=32 on every linear layer, sharded adapter push; the lr is the
# swept setting (full fine-tuning, the baseline, uses 1e-3). The cluster's generation worker then
# serves adapters (max_lora_rank LORA_RANK).
LORA_RANK = 16
for _lr in ("3e-3", "5e-3", "7e-3", "1e-2", "1.4e-2"):
    VARIANTS[f"lora_r16_lr{_lr}"] = ["--model.lora.r", str(LORA_RANK), "--model.lora.alpha", str(2 * LORA_RANK),
                                     "--optim.lr", _lr, "--weight_push_mode", "sharded"]
SMOKE = {"variants": ["baseline"], "seeds": [0], "num_steps": 3, "at_steps": [3], "window": 1}
DEFAULT_VARIANTS = ["baseline", "kl_in_reward_adaptive", "dynamic_sampling", "token_mean", "gspo", "rloo"]


@dataclass(kw_only=True, frozen=True)
class AlgorithmsConfig:
    """Command line of `python -m benchmarks.algorithms`."""

    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    """Variants to run (names in VARIANTS; the issue's six by default)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Trainer seeds (data order, sampling, torch)."""
    num_steps: int = 100
    """Steps per run (the cosine schedule ends there too)."""
    at_steps: list[int] = field(default_factory=lambda: [50, 100])
    """Steps at which the table reports the reward."""
    window: int = 10
    """Steps averaged for each reported reward (ending at the step)."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's model, prompts and evaluation table (written by scripts/prepare_demo.py if missing)."""
    out_dir: str = str(REPO_ROOT / "runs" / "algorithms")
    """Runs go to <out_dir>/<variant>-seed<seed>."""
    cluster: AttachConfig = flattened(AttachConfig())
    """`--attach` (benchmarks/clusters.py)."""
    smoke: bool = False
    """Smoke mode: the baseline, seed 0, 3 steps (SMOKE); checks that the command runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        if any(not 0 < s <= self.num_steps for s in self.at_steps):
            raise ValueError(f"at_steps {self.at_steps} must lie in (0, num_steps={self.num_steps}]")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


def run_variant(cluster: LocalCluster, assets: DemoAssets, name: str, seed: int, config: AlgorithmsConfig) -> dict:
    run_dir = fresh_run_dir(Path(config.out_dir) / f"{name}-seed{seed}")
    args = [*demo_trainer_flags(assets, run_dir, num_steps=config.num_steps, seed=seed), *VARIANTS[name]]
    run = run_trainer(cluster, args, run_dir)
    records = run.records
    result = {"variant": name, "seed": seed, "exit_code": run.exit_code, "wall_s": run.wall_s,
              "steps": len(records), "rewards": {str(s): reward_at(records, s, config.window) for s in config.at_steps}}
    for key in ("counts/dropped_zero_variance_groups", "counts/resampled_prompts", "kl/beta"):
        values = [r[key] for r in records if key in r]
        if values:
            result[key + "_last"] = values[-1]
    logger.info("%s seed %d: exit %d, %d steps in %.0f s, rewards %s", name, seed, run.exit_code, len(records),
                result["wall_s"], result["rewards"])
    return result


def print_table(results: list[dict], config: AlgorithmsConfig) -> None:
    steps = [str(s) for s in config.at_steps]
    print(f"\nreward/mean, mean of the {config.window} steps ending at each step; per seed, then median [min-max]")
    print("| variant | seed | " + " | ".join(f"step {s}" for s in steps) + " | wall s |")
    print("|---|---|" + "---|" * len(steps) + "---|")
    for r in results:
        cells = [f"{r['rewards'][s]:.3f}" if r["rewards"][s] is not None else "failed" for s in steps]
        print(f"| {r['variant']} | {r['seed']} | " + " | ".join(cells) + f" | {r['wall_s']:.0f} |")
    print("\n| variant | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    last: list[tuple[str, str]] = []
    for name in config.variants:
        cells = []
        for s in steps:
            values = [r["rewards"][s] for r in results if r["variant"] == name and r["rewards"][s] is not None]
            cells.append(f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]" if values else "-")
            if s == steps[-1]:
                last.append((name, f"{statistics.median(values):.3f}" if values else "failed"))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n" + summary_line("algorithms", dict(last)))


def main(argv: list[str] | None = None) -> int:
    config = load_bench_config(AlgorithmsConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging()
    interrupt_on_sigterm()  # a kill unwinds like Ctrl-C: the cluster and the running trainer stop too
    assets = demo_assets(config.assets_dir)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora = any(name.startswith("lora_") for name in config.variants)
    cluster_config = LocalClusterConfig(model_path=str(assets.model), log_dir=str(out / "cluster-logs"),
                                        engine=run_engine(config.smoke, max_lora_rank=LORA_RANK if lora else 0))
    results = []
    with local_cluster(cluster_config, config.cluster.attach) as cluster:
        for name in config.variants:
            for seed in config.seeds:
                results.append(run_variant(cluster, assets, name, seed, config))
                (out / "algorithms.json").write_text(json.dumps(results, indent=1))
    print_table(results, config)
    return 1 if any(r["exit_code"] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
