"""Make a starting model for the reasoning-gym recipes: the demo's tiny Qwen2, warmed up on the
reasoning-gym prompt format instead of "a+b=".

    python scripts/prepare_rg_model.py --out_dir runs/rg-assets

scripts/prepare_demo.py's gentle warm-up (50 supervised steps at lr 1e-3 on *random* answers, so
the model learns the answer format but not arithmetic) on the prompts configs/rg_*.yaml train on
("Calculate 4 + 1.=": reasoning-gym's basic_arithmetic, sums of two numbers 0-10, with the
configs' "{question}=" template). Why: the demo's model, warmed up on "a+b=", learns the sums in
the reasoning-gym format about 3.5x slower even with the answers given (greedy accuracy after 200
supervised steps 0.25, against 0.86 on its own format), while a model warmed up on the new format
reached 0.83 after 150; no RL run learns faster than that bound (docs/rewards.md).

That format warm-up alone still left GRPO flat at chance on most seeds: the model must first learn
to *read* the two operands out of 17 characters, and at 5% correct rollouts the reward barely
signals it. `--read_fraction 0.5 --warmup_steps 300` (configs/rg_basic_arithmetic_read.yaml's
model) mixes in reading examples, "Calculate 4 + 1.?" -> "4,1": the model learns to pick out the
operands (greedy 100% on all 121 questions) while its sums stay at chance (4.9% sampled; the script
prints both), and GRPO then learns the sums as fast as the demo learns its own format. The sum
itself is never shown.

    python scripts/prepare_rg_model.py --out_dir runs/rg-read-assets --read_fraction 0.5 --warmup_steps 300
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # prepare_demo, also when loaded by path

from prepare_demo import supervised_warm_up  # noqa: E402

from async_grpo.config.run_config import load_config  # noqa: E402
from async_grpo.data.reasoning_gym_tasks import ReasoningGymConfig, reasoning_gym_records  # noqa: E402
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model  # noqa: E402
from sample_processing_utils import Sample  # noqa: E402
from setup_model import load_causal_lm, load_tokenizer  # noqa: E402

logger = logging.getLogger("prepare_rg_model")

# The options of configs/rg_basic_arithmetic*.yaml: sums of two numbers 0-10 (reasoning-gym draws
# operands from 0 to 10**digits inclusive), so answers range over 0-20.
DEFAULT_OPTIONS = ('{"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, '
                   '"operators": ["+"], "allow_parentheses": false, "allow_negation": false}}')
MAX_ANSWER = 20


@dataclass(kw_only=True, frozen=True)
class PrepareRgModelConfig:
    """Command line of `python scripts/prepare_rg_model.py`."""

    out_dir: str
    """Folder to write model/ to."""
    options: str = DEFAULT_OPTIONS
    """reasoning-gym options of the prompts (data.reasoning_gym.options of the config to train)."""
    prompt_template: str = "{question}="
    """data.prompt_template of the config to train."""
    warmup_steps: int = 50
    """Supervised format warm-up steps on random answers."""
    warmup_batch_size: int = 64
    """Prompts per warm-up step."""
    warmup_lr: float = 1e-3
    """AdamW learning rate of the warm-up."""
    read_fraction: float = 0.0
    """Share of warm-up examples that teach *reading* the operands instead of answering: the
    question with `read_marker` in place of the template's "=", answered with the operands
    themselves ("Calculate 4 + 1.?" -> "4,1"). The sum is never shown (the "=" prompts keep their
    random answers); see docs/rewards.md for why reading is the step GRPO finds hard here."""
    read_marker: str = "?"
    """Last character of a reading prompt (must differ from the template's last character)."""
    report_samples: int = 8
    """Sampled answers per question in the closing report of how the model starts (0: no report)."""
    seed: int = 0
    """Seed of the model's initialisation, the warm-up prompts and their random answers."""

    def __post_init__(self) -> None:
        if "{question}" not in self.prompt_template:
            raise ValueError(f"PrepareRgModelConfig.prompt_template must contain {{question}}, got {self.prompt_template!r}")
        if self.report_samples < 0:
            raise ValueError(f"PrepareRgModelConfig.report_samples must be >= 0, got {self.report_samples!r}")
        for name in ("warmup_steps", "warmup_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrepareRgModelConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.read_fraction <= 1.0:
            raise ValueError(f"PrepareRgModelConfig.read_fraction must be in [0, 1], got {self.read_fraction!r}")
        if len(self.read_marker) != 1 or self.prompt_template.endswith(self.read_marker):
            raise ValueError(f"PrepareRgModelConfig.read_marker must be one character other than the prompt "
                             f"template's last, got {self.read_marker!r}")
        if not self.warmup_lr > 0:
            raise ValueError(f"PrepareRgModelConfig.warmup_lr must be > 0, got {self.warmup_lr!r}")


def warmup_records(args: PrepareRgModelConfig) -> list[dict]:
    """The records the warm-up draws from (generated with a seed of their own)."""
    config = ReasoningGymConfig(tasks=("basic_arithmetic",), size=1000, seed=args.seed + 1000, options=args.options)
    return reasoning_gym_records(config)


def answer_prompt(record: dict, args: PrepareRgModelConfig) -> str:
    """The training prompt of a record ("Calculate 4 + 1.=" with the configs' template)."""
    return args.prompt_template.format(question=record["question"])


def warmup_prompts(args: PrepareRgModelConfig) -> list[str]:
    """The prompt texts the warm-up answers at random."""
    return [answer_prompt(r, args) for r in warmup_records(args)]


def reading_example(record: dict, marker: str) -> tuple[str, str]:
    """("Calculate 4 + 1.?", "4,1"): the question with `marker`, answered with its operands."""
    operands = [term for term in record["metadata"]["expression"].split() if term.lstrip("-").isdigit()]
    return record["question"] + marker, ",".join(operands)


def warm_up(model_dir: Path, records: list[dict], args: PrepareRgModelConfig) -> None:
    """Supervised steps on uniformly random answers (0..MAX_ANSWER, then EOS), mixed with reading
    examples at read_fraction; saves over model_dir."""
    prompts = [answer_prompt(r, args) for r in records]

    def example(tokenizer, rng: random.Random) -> Sample:
        # With read_fraction 0 no extra draw is made, so the default model is the one saved before.
        if args.read_fraction > 0 and rng.random() < args.read_fraction:
            prompt, completion = reading_example(rng.choice(records), args.read_marker)
        else:
            prompt, completion = rng.choice(prompts), str(rng.randint(0, MAX_ANSWER))
        return Sample(input_token_ids=tokenizer(prompt)["input_ids"], gt_answer="",
                      output_token_ids=tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id])

    def batch(tokenizer, rng: random.Random) -> list[Sample]:
        return [example(tokenizer, rng) for _ in range(args.warmup_batch_size)]

    supervised_warm_up(model_dir, batch, args.warmup_steps, args.warmup_lr, args.seed, log_every=25)


def starting_accuracy(model_dir: Path, records: list[dict], args: PrepareRgModelConfig,
                      complete: Callable[..., str | None] | None = None) -> dict[str, float]:
    """How the saved model starts, on each distinct question of the records: the share whose
    operands it reads back greedily ("?" prompts), and the share of sums it gets right greedily and
    when sampled at temperature 1 within the configs' 4 tokens (the training prompts, "="): the sums
    should stay at chance."""
    if complete is None:
        from benchmarks.learnability import complete  # the supervised bound's own decoding loop

    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir).eval()
    questions = {r["question"]: r for r in records}
    torch.manual_seed(args.seed)
    read = greedy = sampled = 0
    with torch.no_grad():
        for record in questions.values():
            prompt, operands = reading_example(record, args.read_marker)
            read += complete(model, tokenizer, tokenizer(prompt)["input_ids"], sample=False,
                             max_new_tokens=len(operands) + 1) == operands
            answer_ids = tokenizer(answer_prompt(record, args))["input_ids"]
            greedy += complete(model, tokenizer, answer_ids, sample=False) == record["answer"]
            sampled += sum(complete(model, tokenizer, answer_ids, sample=True) == record["answer"]
                           for _ in range(args.report_samples))
    n = len(questions)
    return {"questions": n, "reads_operands": read / n, "sum_greedy": greedy / n,
            "sum_sampled": sampled / (n * args.report_samples)}


def main(argv: list[str] | None = None) -> None:
    args = load_config(PrepareRgModelConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    model_dir = write_tiny_model(Path(args.out_dir) / "model", TinyModelConfig(seed=args.seed))
    records = warmup_records(args)
    warm_up(model_dir, records, args)
    if args.report_samples:
        start = starting_accuracy(model_dir, records, args)
        print(f"starting model on the {start['questions']} distinct questions: reads the operands "
              f"{start['reads_operands']:.3f} (greedy), sums {start['sum_greedy']:.3f} greedy / "
              f"{start['sum_sampled']:.3f} sampled (chance {1 / (MAX_ANSWER + 1):.3f})")
    print(f"model: {model_dir}")


if __name__ == "__main__":
    main()
