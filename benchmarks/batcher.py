"""How full the experience batcher's minibatches are on a realistic step (packing only, no Ray).

    .venv/bin/python -m benchmarks.batcher                 # defaults below, several windows
    .venv/bin/python -m benchmarks.batcher --windows 0 16  # compare chosen reorder windows

A synthetic step: `prompts` prompts x `rollouts` rollouts, prompt lengths ~ N(150, 50), output
lengths log-normal (median 300, long tail cut at max_tokens), fed to `MinibatchPacker` in random
completion order. Metrics, averaged over `trials` seeded steps:

- fill: real tokens / (minibatches x max_tokens_per_gpu) over the minibatches that closed during
  the step, i.e. excluding each rank's final partial minibatch (flushed at step end) and padding;
  this is what the packing policy controls.
- fill_with_tail: the same over every minibatch of the step, final partial and padding
  minibatches included (padding counts as zero real tokens); bounded by how the step's total
  splits into whole budgets per rank, whatever the policy.
- early: fraction of loss-carrying minibatches sent before the step's last rollout arrived.
- sent_at: mean over loss-carrying minibatches of the fraction of the step's rollouts that had
  arrived when it was sent (1.0 = at step end); the cost of holding rollouts back to pack better.

The LAST line is key=value for the configured `--window` (default: the BatcherConfig default).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Literal

from async_grpo.batching.batcher_config import BatcherConfig
from async_grpo.batching.batcher_messages import PADDING_LOSS_WEIGHT, Minibatch
from async_grpo.batching.minibatch_packer import MinibatchPacker

from benchmarks.harness import apply_smoke, load_bench_config
from sample_processing_utils import Sample

_PROMPT_MEAN, _PROMPT_STD = 150.0, 50.0  # typical math-prompt lengths in tokens
_MIN_PROMPT_TOKENS = 8  # a prompt shorter than this is not a realistic question
_OUTPUT_MEDIAN = 300.0  # median completion length of a math model early in training
_OUTPUT_SIGMA = 0.9  # log-space spread: ~1.5% of completions reach max_tokens=2048
_FILL_TARGET = 0.95
_DEFAULT_WINDOW = BatcherConfig.__dataclass_fields__["reorder_window"].default


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """Shape of the synthetic step."""

    ranks: int
    """Trainer ranks (world_size)."""
    prompts: int
    """Prompts per step, over all ranks."""
    rollouts: int
    """Rollouts per prompt (sampling n)."""
    max_tokens: int
    """Generation cap: output lengths are cut here."""
    budget: int
    """max_tokens_per_gpu of one minibatch."""
    arrival: str
    """'sample': rollouts arrive one by one in random order; 'prompt': whole groups arrive
    together (what the batcher does: a prompt's rollouts are packed when all are ready)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "prompts", "rollouts", "max_tokens", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.arrival not in ("sample", "prompt"):
            raise ValueError(f"BenchConfig.arrival must be 'sample' or 'prompt', got {self.arrival!r}")


SMOKE = {"trials": 1, "prompts": 8, "rollouts": 2, "windows": [0, 4]}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class BatcherFillConfig:
    """Command line of `python -m benchmarks.batcher`: the synthetic step and the windows to compare."""

    ranks: int = 8
    """Trainer ranks (world_size)."""
    prompts: int = 64
    """Prompts per step, over all ranks."""
    rollouts: int = 16
    """Rollouts per prompt (sampling n)."""
    max_tokens: int = 2048
    """Generation cap: output lengths are cut here."""
    budget: int = 16384
    """max_tokens_per_gpu of one minibatch."""
    arrival: Literal["sample", "prompt"] = "prompt"
    """'sample': rollouts arrive one by one in random order; 'prompt': whole groups arrive together."""
    trials: int = 20
    """Seeded steps each window's metrics are averaged over."""
    seed: int = 0
    """Seed of the first step (step t uses seed + t, the same for every window)."""
    windows: list[int] = field(default_factory=lambda: [0, 4, 16, 64])
    """Reorder windows to compare (`--windows "[]"`: none, only the LAST line's)."""
    window: int = _DEFAULT_WINDOW
    """Reorder window of the LAST line; the default is BatcherConfig.reorder_window's."""

    smoke: bool = False
    """Smoke mode: 1 trial of 8 prompts x 2 rollouts, windows 0 and 4 (SMOKE); checks that the command still
    runs, its figures mean nothing."""

    def step(self) -> BenchConfig:
        """The synthetic step's shape."""
        return BenchConfig(ranks=self.ranks, prompts=self.prompts, rollouts=self.rollouts,
                           max_tokens=self.max_tokens, budget=self.budget, arrival=self.arrival)


@dataclass(slots=True)
class StepResult:
    """Packing outcome of one synthetic step."""

    fill: float
    fill_with_tail: float
    early: float
    sent_at: float
    minibatches_per_rank: int
    padding: int
    rank_token_spread: int


def synthetic_step(cfg: BenchConfig, rng: random.Random) -> list[Sample]:
    """Rollouts of one step in arrival order (token ids are zeros: only lengths matter)."""
    groups: list[list[Sample]] = []
    for prompt_id in range(cfg.prompts):
        prompt_len = max(_MIN_PROMPT_TOKENS, round(rng.gauss(_PROMPT_MEAN, _PROMPT_STD)))
        group = []
        for _ in range(cfg.rollouts):
            out_len = min(cfg.max_tokens, max(1, round(rng.lognormvariate(math.log(_OUTPUT_MEDIAN), _OUTPUT_SIGMA))))
            group.append(Sample(input_token_ids=[0] * prompt_len, gt_answer="", prompt_id=prompt_id,
                                output_token_ids=[0] * out_len))
        groups.append(group)
    if cfg.arrival == "prompt":
        rng.shuffle(groups)
        return [s for g in groups for s in g]
    samples = [s for g in groups for s in g]
    rng.shuffle(samples)
    return samples


def pack_step(samples: list[Sample], cfg: BenchConfig, window: int) -> StepResult:
    """Feed one step to the packer and measure its minibatches."""
    packer = MinibatchPacker(step=0, world_size=cfg.ranks, max_tokens_per_gpu=cfg.budget, reorder_window=window)
    during: list[Minibatch] = []
    sent_at: list[float] = []
    for arrived, sample in enumerate(samples, start=1):
        ready = packer.add(sample)
        during.extend(ready)
        sent_at.extend(arrived / len(samples) for mb in ready if mb.loss_weight != PADDING_LOSS_WEIGHT)
    at_end = packer.finish()
    real = [mb for mb in during + at_end if mb.loss_weight != PADDING_LOSS_WEIGHT]
    closed = [mb for mb in during if mb.loss_weight != PADDING_LOSS_WEIGHT]
    # Each rank's final partial minibatch is its last real one; count it out of `fill`.
    last_index = {mb.rank: mb.index for mb in real}
    full = [mb for mb in real if mb.index != last_index[mb.rank]]
    all_mbs = during + at_end
    return StepResult(
        fill=sum(mb.num_tokens for mb in full) / (len(full) * cfg.budget) if full else float("nan"),
        fill_with_tail=sum(mb.num_tokens for mb in real) / (len(all_mbs) * cfg.budget),
        early=len(closed) / len(real),
        sent_at=(sum(sent_at) + len(real) - len(closed)) / len(real),
        minibatches_per_rank=max(packer.minibatches_per_rank),
        padding=packer.padding_minibatches,
        rank_token_spread=max(packer.rank_tokens) - min(packer.rank_tokens),
    )


def run(cfg: BenchConfig, window: int, trials: int, seed: int) -> dict[str, float]:
    """Mean metrics over `trials` steps (same seeds for every window, so windows compare fairly)."""
    results = [pack_step(synthetic_step(cfg, random.Random(seed + t)), cfg, window) for t in range(trials)]
    return {
        "fill": statistics.fmean(r.fill for r in results),
        "fill_min": min(r.fill for r in results),
        "fill_with_tail": statistics.fmean(r.fill_with_tail for r in results),
        "early": statistics.fmean(r.early for r in results),
        "sent_at": statistics.fmean(r.sent_at for r in results),
        "minibatches_per_rank": statistics.fmean(r.minibatches_per_rank for r in results),
        "padding": statistics.fmean(r.padding for r in results),
        "rank_token_spread": statistics.fmean(r.rank_token_spread for r in results),
    }


def _format(values: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def main(argv: list[str] | None = None) -> None:
    args = load_bench_config(BatcherFillConfig, argv, description=__doc__)
    args = apply_smoke(args, SMOKE)
    cfg = args.step()
    print(f"# {cfg}, trials={args.trials}, seed={args.seed}")
    for window in args.windows:
        print(f"window={window} {_format(run(cfg, window, args.trials, args.seed))}")
    final = run(cfg, args.window, args.trials, args.seed)
    print(f"window={args.window} target={_FILL_TARGET} {_format(final)}")


if __name__ == "__main__":
    main()
