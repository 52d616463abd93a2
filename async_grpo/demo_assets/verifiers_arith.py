"""A small `verifiers` (verifiers.v1) taskset: sums of two numbers, scored by a rubric.

The example that `sampling.verifiers.taskset="verifiers_arith"` trains on (docs/environments.md,
"verifiers environments"), written as any verifiers environment is: a TaskData with the
answer, a Task whose `@vf.reward` methods are the rubric, and a Taskset whose `load` yields the
tasks. With no Env id it runs as verifiers' SingleAgentEnv (one answer, single-turn); with
`env="user-sim"` a modelled user converses with the assistant about the same sum (multi-turn).

Rubric (the reward is the weighted sum): `correct` (weight 1) is 1 when the answer is among the
reply's numbers; `digits` (weight DIGITS_WEIGHT) is the share of the reply's non-blank
characters that are digits, a dense signal toward answering with a number.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["ArithTaskset"]

SYSTEM_PROMPT = "Answer with a number."
DIGITS_WEIGHT = 0.5  # below `correct`'s 1: a reply of digits must not pay as much as the sum
NUMBER = re.compile(r"[0-9]+")


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """Tasks the taskset yields (a training run picks task prompt_id % num_tasks)."""
    max_operand: int = 9
    """Operands are drawn from [0, max_operand]."""
    seed: int = 0
    """Seed of the operands."""


class ArithData(vf.TaskData):
    answer: str
    """The sum, in decimal digits."""


def correct_score(reply: str, answer: str) -> float:
    """1.0 when `answer` is one of the numbers in `reply`, else 0.0."""
    return 1.0 if answer in NUMBER.findall(reply) else 0.0


def digits_score(reply: str) -> float:
    """The share of `reply`'s non-blank characters that are decimal digits (0.0 for a blank reply)."""
    visible = [c for c in reply if not c.isspace()]
    return sum(c in "0123456789" for c in visible) / len(visible) if visible else 0.0


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return correct_score(trace.last_reply or "", self.data.answer)

    @vf.reward(weight=DIGITS_WEIGHT)
    async def digits(self, trace: vf.Trace) -> float:
        return digits_score(trace.last_reply or "")


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> Iterator[ArithTask]:
        rng = random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            data = ArithData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT, answer=str(a + b))
            yield ArithTask(data, self.config.task)
