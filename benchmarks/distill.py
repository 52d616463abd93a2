"""On-policy distillation on the demo task: a student distilled from a teacher that solves it,
against plain GRPO from the same start, several seeds each.

    bash scripts/demo.sh                               # once: trains the teacher (runs/demo/checkpoints/step_000450)
    .venv/bin/python -m benchmarks.distill --teacher_path runs/demo/checkpoints/step_000450

What runs: one local cluster with the demo's workers (a vLLM generation worker and a reference
logprob worker on the demo's starting model, the format-only warm-up of scripts/prepare_demo.py)
plus one teacher worker (`worker_dispatcher.py --mode teacher`) on `--teacher_path`; then, per
seed, `torchrun trainer_core.py` with `configs/demo.yaml` for `--num_steps` steps (cosine schedule
ending there, no checkpoints), once per variant:

    grpo       the demo as it is (reward only)
    distill         distill.teacher, distill.use_reward false, distill.coef --coef: the teacher's
                    per-token logprobs are the only learning signal; the reward is only measured
    distill_reward  the same on top of the GRPO reward (distill.use_reward true)
    distill_baseline  distill with distill.baseline group_mean (the group's mean reverse KL
                    subtracted, as GRPO subtracts the group's mean reward)

`--distill_lr` overrides optim.lr of the distill variants (the demo's lr was tuned for GRPO).

Every run evaluates greedy accuracy on the demo's 100 sums every `--eval_every` steps. Printed
and written to <out_dir>/distill.json: per variant and seed, reward/mean (10-step means) and the
greedy eval accuracy at each evaluation, then the median and range over seeds. The teacher's own
greedy accuracy is measured first by a zero-step evaluation run through the same workers
(`--teacher_eval`). The last line is `distill: teacher=<acc> grpo=<median final acc>
distill=<median final acc>`.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from async_grpo.config.run_config import flattened
from benchmarks.clusters import AttachConfig, local_cluster
from benchmarks.harness import (
    DEFAULT_DEMO_ASSETS, demo_assets, demo_trainer_flags, DemoAssets, fresh_run_dir, interrupt_on_sigterm,
    load_bench_config, REPO_ROOT, reward_at, run_engine, run_trainer, setup_logging, summary_line,
)
from local_cluster import LocalCluster, LocalClusterConfig

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class DistillBenchConfig:
    """Command line of `python -m benchmarks.distill`."""

    teacher_path: str = ""
    """The teacher: a model folder sharing the demo's tokenizer (a trained demo checkpoint); required
    unless --smoke (which uses the demo's starting model)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Trainer seeds."""
    variants: list[str] = field(default_factory=lambda: ["grpo", "distill"])
    """Which of grpo, distill, distill_reward, distill_baseline to run."""
    num_steps: int = 60
    """Steps per run."""
    eval_every: int = 20
    """Greedy evaluation every this many steps (and after the last)."""
    coef: float = 1.0
    """distill.coef of the distill variants."""
    distill_lr: float | None = None
    """optim.lr of the distill variants (None: the demo's)."""
    teacher_eval: bool = True
    """Measure the teacher's greedy accuracy first."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's starting model, prompts and evaluation table."""
    out_dir: str = str(REPO_ROOT / "runs" / "distill")
    """Runs go to <out_dir>/<variant>-seed<seed>."""
    cluster: AttachConfig = flattened(AttachConfig())
    """`--attach` (benchmarks/clusters.py)."""
    smoke: bool = False
    """Smoke mode: the distill variant, seed 0, 2 steps, the demo's starting model as the teacher (SMOKE); checks
    that the command runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        if not self.teacher_path and not self.smoke:
            raise ValueError("DistillBenchConfig.teacher_path must be set (a trained demo checkpoint)")
        unknown = set(self.variants) - {"grpo", "distill", "distill_reward", "distill_baseline"}
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: grpo, distill, distill_reward, "
                             "distill_baseline")


SMOKE = {"seeds": [0], "variants": ["distill"], "num_steps": 2, "eval_every": 2}


def variant_args(name: str, config: DistillBenchConfig) -> list[str]:
    if name == "grpo":
        return []
    args = ["--distill.teacher", "true", "--distill.use_reward", str(name == "distill_reward").lower(),
            "--distill.coef", str(config.coef)]
    if name == "distill_baseline":
        args += ["--distill.baseline", "group_mean"]
    return args + (["--optim.lr", str(config.distill_lr)] if config.distill_lr is not None else [])


def run_one(cluster: LocalCluster, assets: DemoAssets, name: str, seed: int, config: DistillBenchConfig,
            num_steps: int) -> dict:
    run_dir = fresh_run_dir(Path(config.out_dir) / f"{name}-seed{seed}")
    args = [*demo_trainer_flags(assets, run_dir, num_steps=num_steps, seed=seed, eval_every=config.eval_every),
            *variant_args(name, config)]
    run = run_trainer(cluster, args, run_dir)
    records = run.records
    evals = {str(r["step"] + 1): r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    rewards = {str(s): reward_at(records, s, 10) for s in range(config.eval_every, num_steps + 1, config.eval_every)}
    kl = [r["distill/reverse_kl"] for r in records if "distill/reverse_kl" in r]
    result = {"variant": name, "seed": seed, "exit_code": run.exit_code, "wall_s": run.wall_s,
              "eval_accuracy": evals, "rewards": rewards, "reverse_kl_first_last": [kl[0], kl[-1]] if kl else None}
    logger.info("%s seed %d: exit %d in %.0f s, eval %s, rewards %s", name, seed, run.exit_code, result["wall_s"],
                evals, rewards)
    return result


def teacher_accuracy(cluster: LocalCluster, assets: DemoAssets, config: DistillBenchConfig) -> float | None:
    """Greedy accuracy of the teacher through the same generation worker: a one-step run that
    starts from the teacher's weights at lr 1e-12 (Adam's first step moves a weight by about lr)
    and evaluates the weights it pushed after that step."""
    run_dir = fresh_run_dir(Path(config.out_dir) / "teacher-eval")
    args = [*demo_trainer_flags(assets, run_dir, num_steps=1, eval_every=1, total_steps=450),
            "--model.model_path", config.teacher_path, "--optim.lr", "1e-12", "--optim.warmup_steps", "0",
            "--optim.schedule", "constant", "--logprob_role", "none", "--loss.kl_coef", "0"]
    run = run_trainer(cluster, args, run_dir)
    return run.records[-1].get("eval/accuracy") if run.exit_code == 0 and run.records else None


def print_table(results: list[dict], teacher: float | None, config: DistillBenchConfig) -> None:
    steps = sorted({s for r in results for s in r["eval_accuracy"]}, key=int)
    print(f"\ngreedy eval accuracy on the 100 sums (teacher: {teacher}); reward/mean = 10-step mean")
    print("| variant | seed | " + " | ".join(f"eval@{s}" for s in steps) + " | "
          + " | ".join(f"reward@{s}" for s in steps) + " |")
    print("|---|---|" + "---|" * (2 * len(steps)))
    for r in results:
        evals = [f"{r['eval_accuracy'].get(s, float('nan')):.2f}" for s in steps]
        rewards = [f"{r['rewards'].get(s):.3f}" if r["rewards"].get(s) is not None else "-" for s in steps]
        print(f"| {r['variant']} | {r['seed']} | " + " | ".join(evals) + " | " + " | ".join(rewards) + " |")
    last = {"teacher": teacher}
    for name in config.variants:
        finals = [r["eval_accuracy"][steps[-1]] for r in results if r["variant"] == name and steps
                  and steps[-1] in r["eval_accuracy"]]
        if finals:
            print(f"{name}: final eval accuracy median {statistics.median(finals):.2f} "
                  f"[{min(finals):.2f}-{max(finals):.2f}] over {len(finals)} seeds")
        last[name] = f"{statistics.median(finals):.2f}" if finals else "failed"
    print("\n" + summary_line("distill", last))


def main(argv: list[str] | None = None) -> int:
    config = load_bench_config(DistillBenchConfig, argv, description=__doc__)
    setup_logging()
    interrupt_on_sigterm()
    assets = demo_assets(config.assets_dir)
    if config.smoke:
        config = replace(config, **SMOKE, teacher_path=config.teacher_path or str(assets.model))
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cluster_config = LocalClusterConfig(model_path=str(assets.model), log_dir=str(out / "cluster-logs"),
                                        teacher_model_path=config.teacher_path, teacher_workers=1,
                                        engine=run_engine(config.smoke))
    results: list[dict] = []
    with local_cluster(cluster_config, config.cluster.attach) as cluster:
        teacher = teacher_accuracy(cluster, assets, config) if config.teacher_eval else None
        logger.info("teacher greedy accuracy: %s", teacher)
        for seed in config.seeds:
            for name in config.variants:
                results.append(run_one(cluster, assets, name, seed, config, config.num_steps))
                (out / "distill.json").write_text(json.dumps({"teacher_accuracy": teacher, "runs": results}, indent=1))
    print_table(results, teacher, config)
    return 1 if any(r["exit_code"] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
