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
"""

from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # prepare_demo, also when loaded by path

from prepare_demo import supervised_warm_up  # noqa: E402
from reasoning_gym_tasks import ReasoningGymConfig, reasoning_gym_records  # noqa: E402
from run_config import load_config  # noqa: E402
from sample_processing_utils import Sample  # noqa: E402
from tiny_model import TinyModelConfig, write_tiny_model  # noqa: E402

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
    seed: int = 0
    """Seed of the model's initialisation, the warm-up prompts and their random answers."""

    def __post_init__(self) -> None:
        if "{question}" not in self.prompt_template:
            raise ValueError(f"PrepareRgModelConfig.prompt_template must contain {{question}}, got {self.prompt_template!r}")
        for name in ("warmup_steps", "warmup_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PrepareRgModelConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.warmup_lr > 0:
            raise ValueError(f"PrepareRgModelConfig.warmup_lr must be > 0, got {self.warmup_lr!r}")


def warmup_prompts(args: PrepareRgModelConfig) -> list[str]:
    """The prompt texts the warm-up draws from (generated with a seed of their own)."""
    config = ReasoningGymConfig(tasks=("basic_arithmetic",), size=1000, seed=args.seed + 1000, options=args.options)
    return [args.prompt_template.format(question=r["question"]) for r in reasoning_gym_records(config)]


def warm_up(model_dir: Path, prompts: list[str], args: PrepareRgModelConfig) -> None:
    """Supervised steps on uniformly random answers (0..MAX_ANSWER, then EOS); saves over model_dir."""
    def batch(tokenizer, rng: random.Random) -> list[Sample]:
        return [Sample(input_token_ids=tokenizer(rng.choice(prompts))["input_ids"], gt_answer="",
                       output_token_ids=tokenizer(str(rng.randint(0, MAX_ANSWER)))["input_ids"]
                       + [tokenizer.eos_token_id])
                for _ in range(args.warmup_batch_size)]

    supervised_warm_up(model_dir, batch, args.warmup_steps, args.warmup_lr, args.seed, log_every=25)


def main(argv: list[str] | None = None) -> None:
    args = load_config(PrepareRgModelConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    model_dir = write_tiny_model(Path(args.out_dir) / "model", TinyModelConfig(seed=args.seed))
    warm_up(model_dir, warmup_prompts(args), args)
    print(f"model: {model_dir}")


if __name__ == "__main__":
    main()
