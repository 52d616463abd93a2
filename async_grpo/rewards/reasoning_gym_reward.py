"""reasoning-gym's own scorers as a reward function (`async_grpo.rewards.reasoning_gym_reward:score`).

Prompts built by `data.format: reasoning_gym` (dataset.py) carry the generated entry in their
record (question, answer, metadata with `source_dataset`) and `data_source`
"reasoning_gym/<task>", which rewards.RewardConfig routes here by default. The completion's answer
is the content of its last <answer>...</answer> tags when it has them (reasoning-gym's
convention for reasoning models), else the whole completion stripped; the task's scorer
(`reasoning_gym.get_score_answer_fn`) gives a score in [0, 1], and 1.0 counts as solved.

Imports no Ray, vLLM or torch. Imports reasoning-gym at import time (seconds): the verifier
pool imports a function's module before its first call, outside the call's deadline.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import reasoning_gym

# The data_source prefix of reasoning-gym prompts (dataset.py writes "reasoning_gym/<task>").
DATA_SOURCE_PREFIX = "reasoning_gym/"
FUNCTION = "async_grpo.rewards.reasoning_gym_reward:score"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# reasoning-gym's scorers give 1.0 for a fully correct answer (some give partial credit below it).
SOLVED_SCORE = 1.0


def extract_answer(completion: str) -> str:
    """The last <answer>...</answer> content, else the completion, stripped."""
    tagged = _ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def score(prompt: Mapping[str, Any], completion: str, token_ids: Sequence[int],
          metadata: Mapping[str, Any]) -> dict[str, float]:
    """The task's own score of the completion's answer (see the module docstring)."""
    entry = {"question": prompt["question"], "answer": prompt["answer"], "metadata": prompt["metadata"]}
    scorer = reasoning_gym.get_score_answer_fn(prompt["metadata"]["source_dataset"])
    value = float(scorer(extract_answer(completion), entry))
    return {"score": value, "solved": float(value >= SOLVED_SCORE)}
