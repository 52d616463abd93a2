"""Shared prompts against whole samples: one training pass over the same GRPO minibatch, both ways.

    .venv/bin/python -m benchmarks.shared_prompts                     # a demo rank's minibatch, ~30 s
    .venv/bin/python -m benchmarks.shared_prompts --min_prompt 150 --max_prompt 250 \
        --min_answer 50 --max_answer 400 --prompts 4 --n 16             # longer prompts and answers

Writes the bundled tiny model (the demo's shape, 0.32M parameters; no network) to a temporary
folder, draws `--prompts` prompts with `--n` answers each (lengths uniform in their ranges; the
defaults are a demo rank's share of a step: 32 prompts x 8 answers, prompts of 4-6 tokens, answers
of 1-4), and runs one training pass (TokenLogprobModel's forward, grpo_loss, backward) on the
minibatch packed whole and packed with model.share_prompts (each prompt once, then its answers).
The two losses are compared first, so both compute the same step; then both are timed
alternately `--reps` times (harness.interleaved_medians). The last line:
speedup=<whole s / shared s> (wall clock), cpu_speedup (the same from CPU time), and both streams'
token counts.
"""

from __future__ import annotations

import logging
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from async_grpo.model.packed_attention import PACKED_SDPA
from async_grpo.demo_assets.tiny_model import write_tiny_model
from benchmarks.harness import apply_smoke, interleaved_medians, load_bench_config, setup_logging, summary_line
from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import PackedBatch, Sample, post_process_batch
from setup_model import TokenLogprobModel, load_causal_lm

LOSS_MATCH_RTOL = 1e-4  # fp32: the layouts sum the same terms in other orders
FIRST_TOKEN_ID = 2  # the tiny tokenizer's ids 0 and 1 are EOS and PAD
SMOKE = {"prompts": 2, "n": 2, "reps": 1, "warmup": 0}


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """What to measure: the command line of `python -m benchmarks.shared_prompts`."""

    prompts: int = 32
    """Distinct prompts in the minibatch."""
    n: int = 8
    """Answers per prompt (a demo rank gets 8 of each prompt's 16: the packer alternates ranks)."""
    min_prompt: int = 4
    """Shortest prompt, tokens."""
    max_prompt: int = 6
    """Longest prompt, tokens."""
    min_answer: int = 1
    """Shortest answer, tokens."""
    max_answer: int = 4
    """Longest answer, tokens (the demo's sampling.max_tokens)."""
    warmup: int = 2
    """Untimed passes per layout before timing."""
    reps: int = 15
    """Timed passes per layout; the median is reported."""
    seed: int = 0
    """Seed of the sample draw."""
    threads: int = 1
    """torch intra-op threads (a demo trainer rank runs one)."""
    smoke: bool = False
    """Smoke mode: 2 prompts x 2 answers, one repetition (SMOKE); its figures mean nothing."""

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.n < 1:
            raise ValueError(f"BenchConfig.prompts and n must be >= 1, got {self.prompts}, {self.n}")
        if not 1 <= self.min_prompt <= self.max_prompt or not 1 <= self.min_answer <= self.max_answer:
            raise ValueError("BenchConfig: 1 <= min_prompt <= max_prompt and 1 <= min_answer <= max_answer required")
        if self.reps < 1 or self.warmup < 0 or self.threads < 1:
            raise ValueError("BenchConfig.reps >= 1, warmup >= 0 and threads >= 1 required")


def draw_groups(config: BenchConfig, vocab: int) -> list[Sample]:
    """`prompts` groups of `n` answers, grouped as the batcher delivers them, random advantages."""
    rng = random.Random(config.seed)
    samples = []
    for prompt_id in range(config.prompts):
        prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(rng.randint(config.min_prompt, config.max_prompt))]
        for _ in range(config.n):
            length = rng.randint(config.min_answer, config.max_answer)
            samples.append(Sample(input_token_ids=prompt, gt_answer="", prompt_id=prompt_id,
                                  output_token_ids=[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)],
                                  sampling_logprobs=[0.0] * length, advantage=rng.gauss(0.0, 1.0)))
    return samples


def training_pass(model: TokenLogprobModel, batch: PackedBatch) -> float:
    """Forward, the GRPO loss and backward on one minibatch; returns the loss."""
    logprobs, _ = model.score(batch.inputs)
    loss, _ = grpo_loss(logprobs, batch, LossConfig())
    loss.backward()
    return loss.item()


def run(config: BenchConfig, model_dir: Path) -> dict[str, float]:
    write_tiny_model(model_dir)
    model = TokenLogprobModel(load_causal_lm(model_dir, attn_implementation=PACKED_SDPA)).train()
    samples = draw_groups(config, model.causal_lm.config.vocab_size)
    whole, shared = post_process_batch(samples), post_process_batch(samples, share_prompts=True)
    whole_loss, shared_loss = training_pass(model, whole), training_pass(model, shared)
    model.zero_grad(set_to_none=True)
    if abs(whole_loss - shared_loss) > LOSS_MATCH_RTOL * max(1.0, abs(whole_loss)):
        raise RuntimeError(f"whole loss {whole_loss} != shared loss {shared_loss}: the layouts disagree")
    medians = interleaved_medians({"whole": lambda: training_pass(model, whole),
                                   "shared": lambda: training_pass(model, shared)}, model,
                                  warmup=config.warmup, reps=config.reps)
    return {
        "speedup": medians["whole"].wall_s / medians["shared"].wall_s,
        "cpu_speedup": medians["whole"].cpu_s / medians["shared"].cpu_s,
        "whole_s": medians["whole"].wall_s,
        "shared_s": medians["shared"].wall_s,
        "whole_tokens": whole.num_tokens,
        "shared_tokens": shared.num_tokens,
        "samples": len(samples),
    }


def main(argv: list[str] | None = None) -> None:
    config = apply_smoke(load_bench_config(BenchConfig, argv, description=__doc__), SMOKE)
    setup_logging(logging.WARNING)
    torch.set_num_threads(config.threads)
    with tempfile.TemporaryDirectory(prefix="bench-shared-prompts-") as tmp:
        result = run(config, Path(tmp))
    print(f"{config.prompts} prompts x {config.n} answers: one training pass over {result['whole_tokens']} tokens "
          f"packed whole {result['whole_s'] * 1e3:.1f} ms, over {result['shared_tokens']} tokens with shared "
          f"prompts {result['shared_s'] * 1e3:.1f} ms (medians of {config.reps})")
    print(summary_line("shared_prompts", {key: f"{value:.3f}" if isinstance(value, float) else value
                                          for key, value in result.items()}))


if __name__ == "__main__":
    main()
