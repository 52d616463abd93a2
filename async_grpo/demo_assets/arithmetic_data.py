"""The demo's arithmetic task as prompt files: sampled problems for training, every problem once for evaluation.

Records are generic-format JSONL ({"prompt": "3+4=", "gt_answer": "7"}, data/prompt_record.py); the
command line is data/dataset.py's:

    python -m async_grpo.data.dataset write-arithmetic --out data.jsonl --num_samples 1000 --seed 0
"""

from __future__ import annotations

import json
import logging
import operator
import os
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The generic format's fields (data/prompt_record.py), spelt out here: data/dataset.py's
# write-arithmetic command imports this module, so it cannot import data/ (async_grpo.LAYERS).
PROMPT_TEXT_FIELD, ANSWER_FIELD = "prompt", "gt_answer"

ARITHMETIC_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def write_arithmetic_dataset(
    path: str | Path,
    num_samples: int,
    seed: int,
    max_operand: int = 9,
    min_operand: int = 0,
    operators: tuple[str, ...] = ("+",),
) -> Path:
    """Write `num_samples` prompts such as {"prompt": "3+4=", "gt_answer": "7"} as JSONL.

    Operands are drawn uniformly from [min_operand, max_operand], operators uniformly from
    `operators` (any of + - *), all from `seed`. The defaults give the demo's single-digit sums.
    The file is written to a temporary name first, so a reader never sees half of it.
    """
    if num_samples < 1:
        raise ValueError(f"write_arithmetic_dataset: num_samples must be >= 1, got {num_samples}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"write_arithmetic_dataset: need 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}"
        )
    unknown = [op for op in operators if op not in ARITHMETIC_OPERATORS]
    if not operators or unknown:
        raise ValueError(
            f"write_arithmetic_dataset: operators must be a non-empty subset of {sorted(ARITHMETIC_OPERATORS)}, "
            f"got {list(operators)}"
        )
    rng = random.Random(seed)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for _ in range(num_samples):
            a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
            op = rng.choice(operators)
            f.write(json.dumps({PROMPT_TEXT_FIELD: f"{a}{op}{b}=", ANSWER_FIELD: str(ARITHMETIC_OPERATORS[op](a, b))}) + "\n")
    os.replace(partial, out)
    logger.info("wrote %d arithmetic prompts to %s", num_samples, out)
    return out


def write_arithmetic_table(
    path: str | Path, max_operand: int = 9, min_operand: int = 0, operators: tuple[str, ...] = ("+",)
) -> Path:
    """Write every problem `a op b` with a, b in [min_operand, max_operand] exactly once, as JSONL.

    An evaluation set that covers the task instead of sampling it: the defaults give the 100
    single-digit sums "0+0=" ... "9+9=", in that order (operator, then a, then b), so two
    evaluations always see the same prompts. Written to a temporary name first, like
    write_arithmetic_dataset.
    """
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"write_arithmetic_table: need 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}"
        )
    unknown = [op for op in operators if op not in ARITHMETIC_OPERATORS]
    if not operators or unknown or len(set(operators)) != len(operators):
        raise ValueError(
            f"write_arithmetic_table: operators must be distinct members of {sorted(ARITHMETIC_OPERATORS)}, "
            f"got {list(operators)}"
        )
    operands = range(min_operand, max_operand + 1)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for op in operators:
            for a in operands:
                for b in operands:
                    record = {PROMPT_TEXT_FIELD: f"{a}{op}{b}=", ANSWER_FIELD: str(ARITHMETIC_OPERATORS[op](a, b))}
                    f.write(json.dumps(record) + "\n")
    os.replace(partial, out)
    logger.info("wrote %d arithmetic problems to %s", len(operators) * len(operands) ** 2, out)
    return out


@dataclass(kw_only=True, frozen=True)
class WriteArithmeticConfig:
    """Write the demo's addition prompts as JSONL (the `write-arithmetic` command of dataset.py)."""

    out: str = ""
    """File to write."""
    num_samples: int = 0
    """Prompts to write."""
    seed: int = 0
    """Seed of the operands and operators."""
    min_operand: int = 0
    """Smallest operand."""
    max_operand: int = 9
    """Largest operand."""
    operators: str = "+"
    """Operators to draw from, e.g. '+-*'."""

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("WriteArithmeticConfig.out must be set (--out)")
        if self.num_samples < 1:
            raise ValueError(f"WriteArithmeticConfig.num_samples must be >= 1 (--num_samples), got {self.num_samples}")
