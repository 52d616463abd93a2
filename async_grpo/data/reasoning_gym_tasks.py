"""Procedural prompts from the `reasoning-gym` package (data.format reasoning_gym): the config and the records.

dataset.py turns the records into Samples (the question is the prompt text); shaping.py routes
their data_source to reasoning_gym_reward.py, the task's own scorer. Imports reasoning_gym only
when records are generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from async_grpo.config.reward_config import REASONING_GYM_SOURCE_PREFIX
from async_grpo.data.prompt_record import DatasetError



@dataclass(kw_only=True, frozen=True)
class ReasoningGymConfig:
    """Procedural prompts from the `reasoning-gym` package (data.format reasoning_gym)."""

    tasks: tuple[str, ...] = ()
    """reasoning-gym dataset names, e.g. ["basic_arithmetic", "leg_counting"]; prompts are dealt
    round robin over them."""
    size: int = 1000
    """Prompts generated in all."""
    seed: int = 0
    """Generation seed (task i uses seed + i): the same config gives the same prompts."""
    options: str = ""
    """JSON object of per-task keyword arguments for reasoning_gym.create_dataset, e.g.
    '{"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}'; "" for none."""

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str) or not all(isinstance(t, str) and t for t in self.tasks):
            raise ValueError(f"ReasoningGymConfig.tasks must be a list of dataset names, got {self.tasks!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"ReasoningGymConfig.size must be an int >= 1, got {self.size!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"ReasoningGymConfig.seed must be an int, got {self.seed!r}")
        options = self.task_options()
        unknown = sorted(set(options) - set(self.tasks))
        if unknown:
            raise ValueError(f"ReasoningGymConfig.options names tasks not in tasks: {unknown}")

    def task_options(self) -> dict[str, dict[str, Any]]:
        """`options` parsed: task name -> keyword arguments."""
        if not self.options:
            return {}
        try:
            options = json.loads(self.options)
        except json.JSONDecodeError as exc:
            raise ValueError(f"ReasoningGymConfig.options is not valid JSON: {exc}") from None
        if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
            raise ValueError(f"ReasoningGymConfig.options must be a JSON object of objects, got {self.options!r}")
        return options


def reasoning_gym_records(config: ReasoningGymConfig) -> list[dict[str, Any]]:
    """The generated entries as records: question, answer, metadata (JSON values: reasoning-gym
    keeps tuples in its metadata) and data_source "reasoning_gym/<task>"; dealt round robin over
    the tasks, deterministic in the config."""
    try:
        import reasoning_gym
    except ImportError:
        raise DatasetError("data.format reasoning_gym needs the reasoning-gym package (requirements_base.txt)") from None
    per_task = [config.size // len(config.tasks) + (i < config.size % len(config.tasks))
                for i in range(len(config.tasks))]
    generated = []
    for i, (task, count) in enumerate(zip(config.tasks, per_task)):
        if count == 0:
            generated.append([])
            continue
        try:
            entries = reasoning_gym.create_dataset(task, size=count, seed=config.seed + i,
                                                   **config.task_options().get(task, {}))
        except Exception as exc:  # noqa: BLE001 - an unknown name or bad option, reported in one line
            raise DatasetError(f"data.reasoning_gym.tasks: cannot create {task!r}: {type(exc).__name__}: {exc}") from None
        generated.append([json.loads(json.dumps(entry, default=str)) for entry in entries])
    records = []
    for position in range(max(per_task)):
        for task, entries in zip(config.tasks, generated):
            if position < len(entries):
                entry = entries[position]
                records.append({**entry, "data_source": f"{REASONING_GYM_SOURCE_PREFIX}{task}"})
    return records
