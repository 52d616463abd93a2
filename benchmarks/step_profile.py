"""Where a demo step's time and CPU go, per process kind, and today's settings against a baseline.

    python -m benchmarks.step_profile                          # 60 demo steps, the current defaults
    python -m benchmarks.step_profile --baseline true          # also the same run under the settings
                                                               # before issue 37: speedup=
    python -m benchmarks.step_profile --smoke true             # plumbing check (a few steps)
    python -m benchmarks.step_profile -- --max_lag 1           # trainer flags after --: the current run's
    python -m benchmarks.step_profile --attach 127.0.0.1:PORT  # on a running local cluster (benchmarks/clusters.py)

A preset of the A/B runner (benchmarks/ab_parts.py) with its CPU profile (benchmarks/cpu_profile.py):
A, `current`, runs the demo (configs/demo.yaml with its assets; seed 5, no evaluation, no
checkpoints) for `num_steps` steps with the trainer flags after `--`; from the end of step `skip`
to the end of the last step every process's user and kernel CPU seconds and minor page faults are
taken, and printed per process kind (user s/step, kernel s/step, faults/step, cores: CPU seconds
per wall second, the machine's total on the last row) with the step's split (medians over the
same steps of timing/step_s, wait_s, train_s, push_s and the batcher's generate and logprob means).
With `--baseline true`, B, `baseline`, runs the same steps after it with the settings of before
issue 37 (every process on glibc's 256 KiB mmap and trim thresholds, no thread settings, max_lag 0,
FSDP units per decoder layer resharding after forward, every sample packed whole in training:
launcher `--tune_processes false`, trainer BASELINE_TRAINER_FLAGS, not the flags after `--`), in a
cluster of its own, and speedup=<baseline median step / current median step> is printed. The runs
go one after the other on the same machine; absolute times differ between machines, the ratio is
what to compare.

The LAST line: `step_profile: median_step_s=... cores=... trainer_faults_per_step=...` (the
current run's), with `baseline_step_s=... speedup=...` under --baseline.

With `--attach` the run goes to a cluster another process started (the tests' smoke shares one):
the sampler then reads this process's tree (the trainer) and the attached head's raylet with its
descendants (the actors and engine cores), not that cluster's dispatchers; the per-kind rows also
hold whatever else that cluster runs. `--baseline` needs a cluster of its own (its settings are
the workers' too) and refuses `--attach`.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from async_grpo.config.run_config import flattened, split_passthrough
from benchmarks.ab_parts import AbPlan, run_ab, Side, summarise
from benchmarks.clusters import AttachConfig
from benchmarks.cpu_profile import CpuWindow, print_kinds
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging, summary_line

logger = logging.getLogger("benchmarks.step_profile")

# The demo's trainer settings before issue 37, where configs/demo.yaml or a default has changed since.
BASELINE_TRAINER_FLAGS = ("--max_lag", "0", "--model.reshard_after_forward", "true", "--model.share_prompts", "false",
                          "--model.fsdp_per_layer_min_params", "0")
BASELINE = Side("baseline", BASELINE_TRAINER_FLAGS, launcher=("--tune_processes", "false"))

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


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    own, trainer_flags = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    config = apply_smoke(load_bench_config(ProfileConfig, own, description=__doc__), SMOKE)
    current = Side("current", tuple(trainer_flags))
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        plan = AbPlan(a=current, b=BASELINE if config.baseline else None, rounds=1, num_steps=config.num_steps,
                      skip=config.skip, seed=config.seed, assets_dir=config.assets, out_dir=tmp, smoke=config.smoke,
                      attach=config.cluster.attach, profile_cpu_s=config.poll_s)
        runs = run_ab(plan)
    steps: dict[str, float] = {}
    cpu: dict[str, CpuWindow] = {}
    for name, side_runs in runs.items():
        cpu[name] = CpuWindow.pooled([run.cpu for run in side_runs])
        split = summarise([r for run in side_runs for r in run.records], STEP_SPLIT)
        steps[name] = split["timing/step_s"].median
        print(f"\n{name}: {cpu[name].wall_s:.1f} s over the profiled steps; per step:")
        print_kinds(cpu[name])
        print("  step split (medians): " + ", ".join(f"{k.removeprefix('timing/')} {v.median:.3f} s"
                                                     for k, v in split.items()))
    trainer = cpu[current.name].per_step().get("trainer ranks", {})
    figures: dict[str, Any] = {"median_step_s": round(steps[current.name], 3),
                               "cores": round(cpu[current.name].cores, 2),
                               "trainer_faults_per_step": round(trainer.get("faults", 0))}
    if config.baseline:
        figures.update(baseline_step_s=round(steps[BASELINE.name], 3),
                       speedup=round(steps[BASELINE.name] / steps[current.name], 3))
    print(summary_line("step_profile", figures))


if __name__ == "__main__":
    main()
