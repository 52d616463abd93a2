"""The environment protocol of multi-turn rollouts, and the typed config that names one.

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

`EnvironmentConfig.check()` imports the class and binds `options` to its signature at start-up,
so a misspelt name or option fails in one line before any engine starts.

Pure: imports no Ray, vLLM or torch.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
from dataclasses import dataclass, field, fields
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


@dataclass(kw_only=True, frozen=True)
class EnvironmentConfig:
    """Which environment multi-turn rollouts run, and their limits (the trainer's `sampling.environment`)."""

    name: str = ""
    """The environment class as "module:Class" (importable on the generation workers), e.g.
    "async_grpo.rollouts.tool_environment:ToolEnvironment". "": no environment, single-turn rollouts."""
    max_turns: int = 4
    """Model turns per rollout at most; the rollout ends after that many."""
    max_total_tokens: int = 1024
    """Tokens of a whole rollout at most (prompt, every turn and every observation): what it
    occupies in the engine's context and in a packed batch. Each turn may sample
    min(sampling.max_tokens, what is left); a rollout with nothing left ends truncated."""
    options: dict[str, Any] = field(default_factory=dict, hash=False)  # a dict: SamplingConfig stays hashable
    """Keyword arguments of the class's constructor (JSON values), checked against its signature;
    on the command line one JSON object (--sampling.environment.options '{"tools": ["calculator"]}')."""

    def __post_init__(self) -> None:
        check_options_object(self)
        if not isinstance(self.name, str) or (self.name and self.name.count(":") != 1):
            raise ValueError(f"EnvironmentConfig.name must be 'module:Class' or '', got {self.name!r}")
        check_episode_limits(self)

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def check(self) -> type:
        """Import the class and bind `options` to its constructor; the class, or ValueError in
        one line naming what is wrong. Call it at start-up, before any engine starts."""
        cls = load_environment_class(self.name)
        try:
            inspect.signature(cls).bind(**self.options)
        except TypeError as exc:
            raise ValueError(f"environment.options {sorted(self.options)} do not fit {self.name}: {exc}") from None
        return cls

    def make(self) -> Environment:
        """A fresh environment for one rollout."""
        return load_environment_class(self.name)(**self.options)


def check_options_object(config: Any) -> None:
    """Parse config.options when the command line gave it as JSON text, then check it is a dict
    with str keys; ValueError naming the config class otherwise. Shared by the environment configs
    (EnvironmentConfig here, sampling.VerifiersEnvConfig)."""
    owner = type(config).__name__
    if isinstance(config.options, str):
        try:
            object.__setattr__(config, "options", json.loads(config.options))  # frozen dataclasses
        except json.JSONDecodeError as exc:
            raise ValueError(f"{owner}.options must be a JSON object, got {config.options!r} ({exc})") from None
    if not isinstance(config.options, dict) or not all(isinstance(k, str) for k in config.options):
        raise ValueError(f"{owner}.options must be a dict with str keys, got {config.options!r}")


def check_episode_limits(config: Any) -> None:
    """config.max_turns (None allowed where the field's default is None) and
    config.max_total_tokens must be ints >= 1 (bool refused); ValueError naming the field."""
    owner = type(config).__name__
    optional = {f.name for f in fields(config) if f.default is None}
    for name in ("max_turns", "max_total_tokens"):
        value = getattr(config, name)
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            allowed = " or None" if name in optional else ""
            raise ValueError(f"{owner}.{name} must be an int >= 1{allowed}, got {value!r}")


def load_environment_class(name: str) -> type:
    """The class "module:Class" names, checked to have reset and step; ValueError otherwise."""
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"environment.name {name!r}: cannot import module {module_name!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"environment.name {name!r}: module {module_name!r} has no class {class_name!r}")
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if missing:
        raise ValueError(f"environment.name {name!r}: the class has no {' or '.join(missing)} method")
    return cls
