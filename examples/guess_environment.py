"""A complete multi-turn environment: guess the secret number, told "higher" or "lower" each turn.

    .venv/bin/python -m examples.run_environment --environment examples.guess_environment:GuessNumber
"""

from __future__ import annotations

import re

from async_grpo.rollouts.environments import EnvPrompt, Reset, StepResult, Turn

_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """One rollout: the model guesses; a right guess scores 1 and ends it, a wrong one gets a hint."""

    def __init__(self, low: int = 1, high: int = 100) -> None:
        self.low, self.high = low, high

    def reset(self, prompt: EnvPrompt) -> Reset:
        # The secret is the record's gold answer, so every rollout of a prompt plays the same game.
        self.secret = int(prompt.gt_answer)
        return Reset(messages=[{"role": "user", "content": f"Guess my number between {self.low} and "
                                                           f"{self.high}. Answer with one number."}])

    def step(self, turn: Turn) -> StepResult:
        guesses = _NUMBER.findall(turn.text)
        if not guesses:
            return StepResult(messages=[{"role": "user", "content": "Answer with one number."}])
        guess = int(guesses[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(messages=[{"role": "user", "content": f"{guess} is wrong: go {hint}."}])
