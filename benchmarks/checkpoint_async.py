"""Step-time cost of checkpoints: synchronous saves vs background saves (`checkpoint_async`).

    cd /work/main && .venv/bin/python -m benchmarks.checkpoint_async            # ~5-8 min on 2 cores
    .venv/bin/python -m benchmarks.checkpoint_async --hidden_size 256 --num_layers 2 --num_steps 8
    .venv/bin/python -m benchmarks.checkpoint_async --model_dir M --attach 127.0.0.1:PORT   # on a running cluster serving M

A preset of the A/B runner (benchmarks/ab_parts.py) on a job of its own instead of the demo: one
local cluster (one real vLLM generation worker, no logprob worker: logprob_role none) serves
`torchrun --nproc_per_node=2 trainer_core.py` runs of the same short job, alternating
checkpoint_async false and true (`--rounds` pairs), each from step 0 in its own run_dir with a
checkpoint every `--checkpoint_every` steps. The model is a random-weight Qwen2 wider than the
demo's (`--hidden_size`, `--num_layers`), so that a checkpoint (weights + AdamW state, about 3x the
fp32 weights) takes visible time to write; or `--model_dir`'s, which `--attach` needs: the running
cluster's generation worker must serve the model the trainer pushes (the suite's smoke attaches to
its demo cluster with the demo model).

Per mode, from metrics.jsonl:
- `timing/checkpoint_s` of every step that checkpointed (the seconds the training loop was blocked
  by checkpointing: the whole save when synchronous; the snapshot into CPU copies, plus any wait
  for the previous save, in the background), its median and all values;
- the median `timing/step_s` of the steps right after a checkpoint (a background write shares
  the CPU with them) and of the other steps (a step's own step_s never includes its save; the
  first `--skip_steps` are left out: start-up);
- the run's training time, `time_s` of its last record (the wait for the last background save at
  exit is not in it).

The LAST line is key=value pairs:
`checkpoint_async: weights_mb=... sync_checkpoint_s=<median> ... blocked_ratio=<async/sync>`
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_grpo.config.run_config import flattened
from async_grpo.demo_assets.arithmetic_data import write_arithmetic_dataset
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from benchmarks.ab_parts import AbPlan, run_ab, Side
from benchmarks.clusters import AttachConfig
from benchmarks.harness import (
    apply_smoke, load_bench_config, run_engine, setup_logging, summarize_checkpoint_run, summary_line,
)
from local_cluster import LocalClusterConfig

logger = logging.getLogger(__name__)

SYNC = Side("sync", ("--checkpoint_async", "false"))
BACKGROUND = Side("async", ("--checkpoint_async", "true"))
MAX_MODEL_LEN = 64  # arithmetic prompts are <= 16 tokens; completions are 4 tokens
KV_CACHE_BYTES = 128 * 2**20  # plenty for 64-token sequences; small enough on a busy machine
TRAINER_TIMEOUT_S = 1200
# The demo model's width: vLLM's CPU attention has no kernel for a head size of 16 (hidden 64 / 4 heads).
SMOKE = {"hidden_size": 128, "num_layers": 1, "intermediate_size": 256, "num_steps": 3, "checkpoint_every": 2,
         "skip_steps": 0, "rounds": 1}


@dataclass(kw_only=True, frozen=True)
class CheckpointBenchConfig:
    """benchmarks/checkpoint_async.py: the same run with synchronous and background checkpoints."""

    work_dir: str = ""
    """Where model, data, runs and logs go ('' = a fresh temporary folder)."""
    model_dir: str = ""
    """An existing model to train instead of writing a random one ('' = write one with the three
    sizes below, which are then the ones used); needed with --attach."""
    cluster: AttachConfig = flattened(AttachConfig())
    hidden_size: int = 512
    """Width of the random Qwen2 (the demo model's is 128)."""
    num_layers: int = 4
    """Its decoder layers."""
    intermediate_size: int = 1536
    """Its MLP width."""
    num_steps: int = 12
    """Steps per run."""
    checkpoint_every: int = 2
    """Checkpoint every this many steps (and after the last)."""
    rounds: int = 1
    """Pairs of runs (synchronous, then background)."""
    skip_steps: int = 2
    """Leading steps of each run left out of the step-time medians (start-up)."""
    prompts_per_rank: int = 4
    """Prompts per rank per step."""
    rollouts: int = 4
    """Rollouts per prompt (sampling.n)."""
    smoke: bool = False
    """Smoke mode: a 1-layer, 128-wide model, 3 steps, a checkpoint every 2 (SMOKE); checks that the command
    runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "checkpoint_every", "rounds", "prompts_per_rank", "rollouts"):
            if getattr(self, name) < 1:
                raise ValueError(f"CheckpointBenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.skip_steps < 0:
            raise ValueError(f"CheckpointBenchConfig.skip_steps must be >= 0, got {self.skip_steps}")
        if self.cluster.attach and not self.model_dir:
            raise ValueError("CheckpointBenchConfig.attach needs model_dir (--model_dir): the model the attached "
                             "cluster serves, which the trainer pushes its weights to")
        if self.model_dir and not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"CheckpointBenchConfig.model_dir {self.model_dir!r} holds no config.json")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _prepare(config: CheckpointBenchConfig, work: Path) -> tuple[Path, Path]:
    model = Path(config.model_dir) if config.model_dir else write_tiny_model(work / "model", TinyModelConfig(
        hidden_size=config.hidden_size, num_layers=config.num_layers, intermediate_size=config.intermediate_size,
        max_position_embeddings=MAX_MODEL_LEN * 2))
    data = write_arithmetic_dataset(work / "prompts.jsonl", num_samples=500, seed=0)
    return model, data


def _job(config: CheckpointBenchConfig, model: Path, data: Path, run_dir: Path) -> list[str]:
    """The trainer flags both modes share (the mode's --checkpoint_async comes from its Side)."""
    return ["--run_dir", str(run_dir), "--model.model_path", str(model), "--data.path", str(data),
            "--num_steps", str(config.num_steps), "--checkpoint_every", str(config.checkpoint_every),
            "--keep_checkpoints", "2",
            "--prompts_per_rank", str(config.prompts_per_rank), "--sampling.n", str(config.rollouts),
            "--sampling.max_tokens", "4", "--data.max_prompt_tokens", "16", "--max_tokens_per_gpu", "256",
            "--max_lag", "1", "--logprob_role", "none", "--loss.kl_coef", "0",
            "--progress_bar", "false", "--tensorboard", "false"]


def main(argv: list[str] | None = None) -> None:
    config = load_bench_config(CheckpointBenchConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging()
    work = Path(config.work_dir or tempfile.mkdtemp(prefix="checkpoint-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model, data = _prepare(config, work)
    weights_mb = (model / "model.safetensors").stat().st_size / 2**20
    cluster_config = LocalClusterConfig(
        model_path=str(model), log_dir=str(work / "logs"), generation_workers=1, logprob_workers=0,
        engine=run_engine(config.smoke, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN),
    )
    plan = AbPlan(a=SYNC, b=BACKGROUND, rounds=config.rounds, num_steps=config.num_steps, skip=0, out_dir=str(work),
                  smoke=config.smoke, attach=config.cluster.attach, cluster=cluster_config,
                  job=lambda run_dir: _job(config, model, data, run_dir), timeout_s=TRAINER_TIMEOUT_S)
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode, mode_runs in run_ab(plan).items():
        runs[mode] = [summarize_checkpoint_run(run.records, config.checkpoint_every, config.skip_steps)
                      for run in mode_runs]
        for round_index, summary in enumerate(runs[mode]):
            print(f"{mode} round {round_index}: checkpoint_s {[round(x, 3) for x in summary['checkpoint_s']]}, "
                  f"step after a checkpoint {_median(summary['step_after_checkpoint_s']):.3f} s, "
                  f"other steps {_median(summary['other_step_s']):.3f} s, run {summary['time_s']:.1f} s")
    out: dict[str, float] = {"weights_mb": round(weights_mb, 1)}
    for mode, summaries in runs.items():
        checkpoint_s = [x for s in summaries for x in s["checkpoint_s"]]
        out[f"{mode}_checkpoint_s"] = round(_median(checkpoint_s), 4)
        out[f"{mode}_step_after_checkpoint_s"] = round(_median([x for s in summaries for x in s["step_after_checkpoint_s"]]), 3)
        out[f"{mode}_other_step_s"] = round(_median([x for s in summaries for x in s["other_step_s"]]), 3)
        out[f"{mode}_run_s"] = round(_median([s["time_s"] for s in summaries]), 1)
        print(f"{mode}: all timing/checkpoint_s {[round(x, 4) for x in checkpoint_s]}")
    out["blocked_ratio"] = round(out["async_checkpoint_s"] / out["sync_checkpoint_s"], 3)
    print(summary_line("checkpoint_async", out))


if __name__ == "__main__":
    main()
