"""How learnable is the demo's starting model? Supervised steps on the true sums, per warm-up.

    .venv/bin/python -m benchmarks.learnability --warmups 0:0 150:3e-3 150:1e-3 50:1e-3

For each `steps:lr` format warm-up (scripts/prepare_demo.py's, on random answers; 0:0 = none),
the script builds the tiny Qwen2 from the same seed, warms it up, measures how many sampled
answers are well formed (1-2 digits then end-of-sequence) and correct, and then trains it with
*supervised* steps on the correct sums (AdamW lr 1e-3, 32 problems per step, answer-token NLL),
printing the greedy accuracy on all 100 single-digit sums every 50 steps.

Why: no RL run can learn the table faster than supervised training on the answers themselves,
so this bounds what GRPO can reach from a given start. It showed that the demo's earlier warm-up
(150 steps at lr 3e-3) left a model at 21% greedy accuracy after 200 supervised steps, against
90% from a fresh initialisation: fitting random answers teaches the model to ignore the
operands, which it must then unlearn (benchmarks/RESULTS.md, "Learning").
"""

from __future__ import annotations

import random
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from benchmarks.harness import apply_smoke, load_bench_config, load_prepare_demo
from setup_model import load_causal_lm, load_tokenizer

PROBLEMS = [(a, b) for a in range(10) for b in range(10)]
SFT_LR = 1e-3
SFT_BATCH = 32
WELL_FORMED = re.compile(r"\d{1,2}")
MAX_NEW_TOKENS = 4


SMOKE = {"warmups": ["0:0", "2:1e-3"], "sft_steps": 2, "every": 1}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class LearnabilityConfig:
    """Command line of `python -m benchmarks.learnability`."""

    warmups: list[str] = field(default_factory=lambda: ["0:0", "150:3e-3", "150:1e-3"])
    """Format warm-ups to compare, each as steps:lr (0:0 = no warm-up)."""
    sft_steps: int = 200
    """Supervised steps on the true sums after each warm-up."""
    every: int = 50
    """Greedy accuracy on all 100 sums is measured every this many supervised steps."""
    seed: int = 0
    """Seed of the model, its warm-up and the problems drawn."""
    threads: int = 1
    """torch intra-op threads."""
    smoke: bool = False
    """Smoke mode: no warm-up and a 2-step one, 2 SFT steps (SMOKE); checks that the command still runs, its
    figures mean nothing."""


def encode(tokenizer, a: int, b: int) -> tuple[list[int], list[int]]:
    return tokenizer(f"{a}+{b}=")["input_ids"], tokenizer(str(a + b))["input_ids"] + [tokenizer.eos_token_id]


@torch.no_grad()
def complete(model, tokenizer, prompt: list[int], sample: bool, max_new_tokens: int = MAX_NEW_TOKENS) -> str | None:
    """The answer text if the completion ends with EOS within max_new_tokens, else None."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        token = int(torch.multinomial(torch.softmax(logits, -1), 1)) if sample else int(logits.argmax())
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(ids[len(prompt):])
        ids.append(token)
    return None


def greedy_accuracy(model, tokenizer) -> float:
    return sum(complete(model, tokenizer, encode(tokenizer, a, b)[0], sample=False) == str(a + b)
               for a, b in PROBLEMS) / len(PROBLEMS)


def sampled_format(model, tokenizer, num: int, rng: random.Random) -> tuple[float, float]:
    """(well-formed share, correct share) of sampled answers to random problems."""
    formed = correct = 0
    for _ in range(num):
        a, b = rng.choice(PROBLEMS)
        text = complete(model, tokenizer, encode(tokenizer, a, b)[0], sample=True)
        formed += text is not None and WELL_FORMED.fullmatch(text) is not None
        correct += text == str(a + b)
    return formed / num, correct / num


def supervised_curve(model, tokenizer, steps: int, every: int, rng: random.Random) -> list[tuple[int, float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    curve = []
    for step in range(1, steps + 1):
        loss = torch.zeros(())
        for a, b in (rng.choice(PROBLEMS) for _ in range(SFT_BATCH)):
            prompt, answer = encode(tokenizer, a, b)
            logits = model(input_ids=torch.tensor([prompt + answer]), use_cache=False).logits[0]
            logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(answer)[:, None])
            loss = loss - logp.mean()
        optimizer.zero_grad()
        (loss / SFT_BATCH).backward()
        optimizer.step()
        if step % every == 0:
            curve.append((step, greedy_accuracy(model, tokenizer)))
    return curve


def main(argv: list[str] | None = None) -> None:
    args = load_bench_config(LearnabilityConfig, argv, description=__doc__)
    args = apply_smoke(args, SMOKE)
    torch.set_num_threads(args.threads)
    for spec in args.warmups:
        steps, lr = int(spec.split(":")[0]), float(spec.split(":")[1])
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(args.seed)
            model_dir = write_tiny_model(Path(tmp) / "model", TinyModelConfig(seed=args.seed))
            if steps:
                load_prepare_demo().warm_up_format(model_dir, steps, 64, lr, args.seed)
            tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir)
            rng = random.Random(args.seed)
            formed, correct = sampled_format(model, tokenizer, 400, rng)
            curve = supervised_curve(model.train(), tokenizer, args.sft_steps, args.every, rng)
        points = " ".join(f"{s}:{acc:.2f}" for s, acc in curve)
        print(f"warmup={steps}@{lr:g} well_formed={formed:.2f} sampled_correct={correct:.3f} "
              f"sft_greedy_accuracy_by_step {points}", flush=True)


if __name__ == "__main__":
    main()
