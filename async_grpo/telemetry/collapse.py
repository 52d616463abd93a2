"""Saying, during a run, that its policy may be collapsing.

A run can learn and then lose it: the tool demo on seed 3 reached a 10-step mean reward of 0.62
by step 11 and ended at 0.37, its first-token entropy at 0.002 from step 10 on while the reward
fell (issue 38), and nothing in the run's output said so. `CollapseWatch` reads each step's
record as rank 0 logs it and warns once per sign, on the console and in the run log:

- low entropy: first-token entropy has stayed below `entropy_floor` for `entropy_steps` steps in
  a row while the 10-step mean reward is more than `best_margin` below its best (a policy that
  became deterministic and is doing worse than it did; the main demo's answer is its first token,
  so its entropy falls legitimately as it learns, but its reward stays at its best);
- reward drop: the 10-step mean reward has fallen more than `reward_drop` below its best.

Each step's record gains `collapse/reward_below_best` (best 10-step mean minus the current one)
and `counts/collapse_warnings` (warnings so far, 0-2), so trackers and reports can see it too.
docs/console.md says how to read the warnings and where the defaults come from.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from async_grpo.telemetry.run_report import WINDOW

logger = logging.getLogger(__name__)

REWARD_KEY = "reward/mean"
ENTROPY_KEY = "entropy/first_token"


@dataclass(kw_only=True, frozen=True)
class CollapseConfig:
    """When the trainer warns that its policy may be collapsing (docs/console.md)."""

    enabled: bool = True
    """Watch the run's records and warn; false: no warnings and no collapse/* metrics."""
    entropy_floor: float = 0.01
    """First-token entropy (nats) below which the first token counts as decided."""
    entropy_steps: int = 5
    """Steps in a row below entropy_floor, with the reward below its best, before the warning."""
    best_margin: float = 0.05
    """How far below its best the 10-step mean reward must be for low entropy to count (a run
    that converged sits within sampling noise of its best)."""
    reward_drop: float = 0.15
    """Warn when the 10-step mean reward has fallen this far below its best."""
    window: int = WINDOW
    """Steps in the trailing mean reward (run_report.WINDOW, the README's 10-step mean)."""

    def __post_init__(self) -> None:
        if not self.entropy_floor > 0:
            raise ValueError(f"CollapseConfig.entropy_floor must be > 0, got {self.entropy_floor}")
        for name in ("entropy_steps", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"CollapseConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("best_margin", "reward_drop"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"CollapseConfig.{name} must be in [0, 1], got {getattr(self, name)}")


class CollapseWatch:
    """Follows the records of one run (in step order) and says when it may be collapsing."""

    def __init__(self, config: CollapseConfig) -> None:
        self.config = config
        self._rewards: deque[float] = deque(maxlen=config.window)
        self._best: float | None = None
        self._low_entropy_steps = 0
        self._warned: set[str] = set()

    def observe(self, step: int, record: dict[str, float]) -> dict[str, float]:
        """The collapse metrics of this step's record; logs each warning the first time it holds."""
        if not self.config.enabled or REWARD_KEY not in record:
            return {}
        self._rewards.append(record[REWARD_KEY])
        if len(self._rewards) < self.config.window:
            return {"collapse/reward_below_best": 0.0, "counts/collapse_warnings": float(len(self._warned))}
        mean = sum(self._rewards) / len(self._rewards)
        self._best = mean if self._best is None else max(self._best, mean)
        below = self._best - mean
        entropy = record.get(ENTROPY_KEY)
        low = entropy is not None and entropy < self.config.entropy_floor and below > self.config.best_margin
        self._low_entropy_steps = self._low_entropy_steps + 1 if low else 0
        if self._low_entropy_steps >= self.config.entropy_steps:
            self._warn("entropy", f"step {step}: first-token entropy {entropy:.3g} has stayed below "
                                  f"{self.config.entropy_floor:g} for {self._low_entropy_steps} steps while the "
                                  f"{self.config.window}-step mean reward ({mean:.3f}) is {below:.3f} below its best "
                                  f"({self._best:.3f}): the policy may be collapsing (docs/console.md)")
        if below > self.config.reward_drop:
            self._warn("reward", f"step {step}: the {self.config.window}-step mean reward ({mean:.3f}) has fallen "
                                 f"{below:.3f} below its best ({self._best:.3f}): the run is getting worse "
                                 f"(docs/console.md)")
        return {"collapse/reward_below_best": below, "counts/collapse_warnings": float(len(self._warned))}

    def _warn(self, sign: str, message: str) -> None:
        if sign not in self._warned:
            self._warned.add(sign)
            logger.warning("%s", message)
