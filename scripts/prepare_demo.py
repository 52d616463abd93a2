"""Make the demo's starting model and data: a tiny Qwen2 that knows the answer *format* only.

    python scripts/prepare_demo.py --out_dir runs/demo-assets

1. Writes a randomly initialised tiny Qwen2 + char tokenizer (tiny_model.write_tiny_model).
2. Warms it up with supervised steps on "a+b=" followed by a *random* number (0-18) and EOS. The
   random answers teach the shape of an answer (digits, then stop) but not arithmetic, so the
   GRPO run starts at chance level (about 1 in 19 correct) and any rise is learned from rewards.
   The warm-up is short and gentle (50 steps at lr 1e-3) on purpose: fitting random answers
   teaches the model to ignore the operands, which it must unlearn before it can add. After the
   earlier 150 steps at lr 3e-3, 200 supervised steps on the true sums reached 21% greedy
   accuracy, against 93% after this warm-up and 90% with none (benchmarks/learnability.py), and
   GRPO was held back alike (benchmarks/RESULTS.md, "Learning").
3. Writes the training prompts (arithmetic_data.write_arithmetic_dataset) and the evaluation table
   (arithmetic_data.write_arithmetic_table: each of the 100 single-digit sums exactly once). The task has
   only 100 distinct problems and the training prompts cover them all, so the evaluation measures
   greedy accuracy on the whole task, not generalisation to unseen problems.

The SFT loss is the mean negative logprob of the answer tokens, computed with the trainer's own
packed path (TokenLogprobModel), and the model is saved with save_pretrained (safetensors).
"""

from __future__ import annotations

import logging
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.demo_assets.arithmetic_data import write_arithmetic_dataset, write_arithmetic_table  # noqa: E402
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model  # noqa: E402
from sample_processing_utils import Sample, get_input_for_logprobs  # noqa: E402
from setup_model import TokenLogprobModel, load_causal_lm, load_tokenizer  # noqa: E402

logger = logging.getLogger("prepare_demo")

MAX_SUM = 18  # largest sum of two single digits: random answers are drawn from 0..MAX_SUM


@dataclass(kw_only=True, frozen=True)
class PrepareDemoConfig:
    """Command line of `python scripts/prepare_demo.py`."""

    out_dir: str
    """Folder to write model/, arithmetic.jsonl and arithmetic_eval.jsonl to."""
    warmup_steps: int = 50
    """Supervised format warm-up steps on random answers (0: none)."""
    warmup_batch_size: int = 64
    """Prompts per warm-up step."""
    warmup_lr: float = 1e-3
    """AdamW learning rate of the warm-up."""
    num_prompts: int = 2000
    """Training prompts written to arithmetic.jsonl."""
    seed: int = 0
    """Seed of the model's initialisation, the warm-up and the training prompts."""


def format_warmup_samples(tokenizer, batch_size: int, rng: random.Random) -> list[Sample]:
    """Prompts "a+b=" with a uniformly random (so uninformative) answer and EOS as the output."""
    samples = []
    for _ in range(batch_size):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        prompt = tokenizer(f"{a}+{b}=")["input_ids"]
        answer = tokenizer(str(rng.randint(0, MAX_SUM)))["input_ids"] + [tokenizer.eos_token_id]
        samples.append(Sample(input_token_ids=prompt, gt_answer="", output_token_ids=answer))
    return samples


def supervised_warm_up(model_dir: Path, make_batch: Callable[[Any, random.Random], list[Sample]], steps: int,
                       lr: float, seed: int, *, log_every: int = 50, what: str = "format warm-up",
                       loss_name: str = "answer-token NLL", cosine: bool = False) -> None:
    """AdamW steps on the mean negative logprob of each batch's sampled tokens (the trainer's packed
    path), make_batch(tokenizer, rng) drawing each batch from one random.Random(seed); saves the
    model over model_dir. The lr is constant, or with cosine decays from lr to 0 over the steps.
    The tool demo's, the judge demo's and the reasoning-gym model's warm-ups run it too."""
    tokenizer = load_tokenizer(model_dir)
    causal_lm = load_causal_lm(model_dir)
    model = TokenLogprobModel(causal_lm).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scale = (lambda step: 0.5 * (1.0 + math.cos(math.pi * step / steps))) if cosine else (lambda step: 1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
    rng = random.Random(seed)
    for step in range(steps):
        logprobs, _ = model.score(get_input_for_logprobs(make_batch(tokenizer, rng)))
        loss = -logprobs.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps - 1:
            logger.info("%s step %d/%d: %s %.3f", what, step, steps, loss_name, loss.item())
    causal_lm.save_pretrained(model_dir, safe_serialization=True)


def warm_up_format(model_dir: Path, steps: int, batch_size: int, lr: float, seed: int) -> None:
    """Supervised steps on random answers; saves the result over model_dir."""
    supervised_warm_up(model_dir, lambda tokenizer, rng: format_warmup_samples(tokenizer, batch_size, rng),
                       steps, lr, seed)


def main(argv: list[str] | None = None) -> None:
    args = load_config(PrepareDemoConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    out_dir = Path(args.out_dir)
    model_dir = write_tiny_model(out_dir / "model", TinyModelConfig(seed=args.seed))
    warm_up_format(model_dir, args.warmup_steps, args.warmup_batch_size, args.warmup_lr, args.seed)
    data_path = out_dir / "arithmetic.jsonl"
    write_arithmetic_dataset(data_path, num_samples=args.num_prompts, seed=args.seed)
    eval_path = write_arithmetic_table(out_dir / "arithmetic_eval.jsonl")
    print(f"model: {model_dir}\ndata: {data_path}\neval: {eval_path}")


if __name__ == "__main__":
    main()
