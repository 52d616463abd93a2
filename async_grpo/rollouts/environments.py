"""The environment protocol of multi-turn rollouts (the config that names one is
config/rollout_sources.EnvironmentConfig).

An environment is a class the user writes (docs/environments.md); one instance serves one rollout:

    class Guess:
        def __init__(self, secret: int = 7) -> None: ...
        async def reset(self, prompt: EnvPrompt) -> Reset: ...      # the first messages (or tokens)
        async def step(self, turn: Turn) -> StepResult: ...         # the model's turn -> observation

The rollout loop (multi_turn.py) calls `reset` once, then after every model turn `step`, until the
environment says done, `max_turns` turns were sampled or the rollout's tokens reach
`max_total_tokens`. The rollout's reward is the sum of the rewards its steps returned.

`reset` and `step` may be `async def` (awaited on the engine's event loop: they must not block
it) or plain `def` (run in a worker thread, so a slow tool never stalls the engine serving the
other rollouts).

    environment: {name: "async_grpo.rollouts.tool_environment:ToolEnvironment", max_turns: 4, max_total_tokens: 1024,
                  options: {tools: ["calculator"]}}

`EnvironmentConfig.check()` (config/rollout_sources.py) imports the class and binds `options` to its signature at start-up,
so a misspelt name or option fails in one line before any engine starts.

Pure: imports no Ray, vLLM or torch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

Message = dict[str, str]
"""A chat message as chat templates take it: {"role": ..., "content": ...}."""
TOOL_ROLE = "tool"
"""The role of a tool's answer in chat templates (Qwen's renders it inside <tool_response>)."""


@dataclass(slots=True, frozen=True)
class EnvPrompt:
    """What `reset` gets: the dataset's prompt of this rollout."""

    record: dict[str, Any] | None
    """The dataset record the prompt came from (Sample.record: all its fields), None if absent."""
    gt_answer: str
    """The record's gold answer (Sample.gt_answer), "" when the dataset has none."""
    prompt_token_ids: list[int]
    """The dataset's rendered prompt (Sample.input_token_ids)."""
    rollout_index: int = 0
    """Which of the prompt's n rollouts this is (0 .. n-1)."""


@dataclass(slots=True, frozen=True)
class Reset:
    """The start of a rollout: at most one of messages / token_ids; neither keeps the dataset's
    prompt tokens as they are."""

    messages: list[Message] | None = None
    """The first conversation, rendered with the model's chat template plus the assistant opener."""
    token_ids: list[int] | None = None
    """The prompt as token ids, used verbatim (the environment owns the template then)."""

    def __post_init__(self) -> None:
        if self.messages is not None and self.token_ids is not None:
            raise ValueError("Reset: give messages or token_ids, not both")
        if self.token_ids is not None and not self.token_ids:
            raise ValueError("Reset.token_ids is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("Reset.messages is empty")


@dataclass(slots=True, frozen=True)
class Turn:
    """One model turn, as `step` sees it."""

    index: int
    """0 for the model's first turn."""
    token_ids: list[int]
    """The tokens the engine sampled in this turn (its stop token included when it stopped)."""
    text: str
    """The engine's text of those tokens."""
    finish_reason: str
    """'stop' (end of turn, EOS or stop string) or 'length' (cut at the turn's token limit)."""


@dataclass(slots=True, frozen=True)
class StepResult:
    """An environment's answer to one model turn. The observation is at most one of messages /
    text / token_ids; none appends nothing (the next turn continues right after the model's)."""

    messages: list[Message] | None = None
    """New messages (e.g. tool results); their tokens are the chat template's rendering of just
    these messages plus the opener of the assistant's next turn (multi_turn.ChatRenderer)."""
    text: str | None = None
    """Observation text appended as it is: the tokenizer's encoding of just this text, no chat
    template (for models without one, or environments that write their own turn markers)."""
    token_ids: list[int] | None = None
    """Observation tokens appended verbatim (the environment then writes any turn opener itself)."""
    reward: float = 0.0
    """Reward of this step; the rollout's reward is the sum over its steps."""
    done: bool = False
    """The rollout ends after this step (no observation is appended then)."""

    def __post_init__(self) -> None:
        given = [name for name in ("messages", "text", "token_ids") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"StepResult: give at most one of messages / text / token_ids, got {' and '.join(given)}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"StepResult.reward must be a finite number, got {self.reward!r}")


@runtime_checkable
class Environment(Protocol):
    """One rollout's environment (a fresh instance per rollout); methods may be sync or async."""

    def reset(self, prompt: EnvPrompt) -> Reset: ...

    def step(self, turn: Turn) -> StepResult: ...
