"""Where a run's rollouts come from besides single-turn sampling: `EnvironmentConfig` (a class
following rollouts/environments.py's protocol, the trainer's `sampling.environment`) and
`VerifiersEnvConfig` (a `verifiers` environment, `sampling.verifiers`, run by
rollouts/verifiers_env.py).

Records every side reads: the trainer checks them at start-up (`check()` imports the environment
class or the verifiers taskset, so a misspelt name fails in one line before any engine starts),
the batcher sends them inside `SamplingConfig`, the generation workers run them. Imports no Ray,
vLLM or torch; `verifiers` is imported only by resolve() and check().
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from dataclasses import dataclass, field, fields
from typing import Any

# A verifiers seat's harness and runtime when VerifiersEnvConfig.options pins none: verifiers'
# own tool-less chat program ("null") as a local process, which needs no container, network or uv
# (verifiers_env.prepare_chat_program registers this interpreter for it).
DEFAULT_SEAT: dict[str, Any] = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}

# VerifiersEnvConfig.check's error is one line: pydantic's multi-line reports are joined and cut here.
_CHECK_LINE_CHARS = 400

# verifiers 0.4.0 looks a plugin id up as `verifiers.v1.tasksets.<id>` first, and that lookup
# raises for a dotted id (its parent package does not exist) instead of falling back to the id
# itself; a dotted module is therefore imported here and handed over under a flat alias.
_DOTTED_PLUGIN_ALIAS_SEPARATOR = "__"


def verifiers_plugin_id(plugin_id: str) -> str:
    """The id to give verifiers for `plugin_id`: itself when it has no dot, else the flat alias
    under which the dotted module, imported here, sits in sys.modules."""
    if "." not in plugin_id:
        return plugin_id
    alias = plugin_id.replace(".", _DOTTED_PLUGIN_ALIAS_SEPARATOR)
    sys.modules.setdefault(alias, importlib.import_module(plugin_id))
    return alias


@dataclass(kw_only=True, frozen=True)
class VerifiersEnvConfig:
    """A `verifiers` (0.4.0, verifiers.v1) environment as the rollout source (the trainer's
    `sampling.verifiers`; docs/environments.md "verifiers environments"): each generation worker
    runs the environment in-process with verifiers' own rollout code against its own loopback
    OpenAI-compatible endpoint (verifiers_env.py), and the environment's rubric gives the reward."""

    taskset: str = ""
    """The verifiers taskset id: an importable module exporting one `vf.Taskset` subclass in
    `__all__`, importable on the generation workers: a top-level name or a dotted module path
    (e.g. "async_grpo.demo_assets.verifiers_arith", the example). "": off."""
    env: str = ""
    """The verifiers Env id: "" for the taskset's own (else verifiers' SingleAgentEnv, one agent,
    single- or multi-turn as its harness plays it), or a shipped/installed one such as "user-sim"
    (a modelled user converses with the trained assistant: multi-turn)."""
    max_turns: int | None = None
    """Model turns per agent run at most (each seat's AgentConfig.max_turns unless `options` pins
    it); None: the environment's own limit."""
    max_total_tokens: int = 1024
    """Tokens of one trained conversation at most (prompt, every turn and every observation): the
    seats' AgentConfig.max_total_tokens unless `options` pins it, and what the trainer's token
    budget check reads."""
    options: dict[str, Any] = field(default_factory=dict, hash=False)  # a dict: SamplingConfig stays hashable
    """More of the verifiers [env] config (JSON values), merged over the defaults, e.g.
    {"user": {"max_turns": 3}}; on the command line one JSON object. Seats whose harness or
    runtime it leaves unset play the in-process chat program ("null" harness, "subprocess" runtime)."""

    def __post_init__(self) -> None:
        check_options_object(self)
        for name in ("taskset", "env"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"VerifiersEnvConfig.{name} must be a string, got {getattr(self, name)!r}")
        if self.env and not self.taskset:
            raise ValueError(f"VerifiersEnvConfig.env {self.env!r} needs a taskset (VerifiersEnvConfig.taskset)")
        check_episode_limits(self)

    @property
    def enabled(self) -> bool:
        return bool(self.taskset)

    def resolve(self) -> Any:
        """The verifiers EnvConfig this names (imports verifiers.v1 and the taskset): the env and
        taskset ids, `options`, and for each seat `options` leaves unset the in-process chat
        program (DEFAULT_SEAT) and this config's turn and token limits."""
        import verifiers.v1 as vf
        from verifiers.v1.configs.agent import agent_config_fields

        taskset = verifiers_plugin_id(self.taskset)
        data: dict[str, Any] = {"id": self.env, "taskset": {"id": taskset}, **self.options}
        data["taskset"] = {**data.get("taskset", {}), "id": taskset}
        for role in agent_config_fields(vf.resolve_env_config(dict(data))):
            seat = dict(data.get(role) or {})
            for key, value in (*DEFAULT_SEAT.items(), ("max_turns", self.max_turns),
                               ("max_total_tokens", self.max_total_tokens)):
                if value is not None:
                    seat.setdefault(key, value)
            data[role] = seat
        return vf.resolve_env_config(data)

    def check(self) -> str:
        """Import verifiers, the taskset and the Env class and validate the env config before any
        worker starts: the Env class's name, or ValueError in one line naming what is wrong."""
        try:
            import verifiers.v1 as vf
            from verifiers.v1.utils.loaders import taskset_class

            config = self.resolve()
            taskset_class(config.taskset.id)
            env_class = vf.environment_class(config.taskset.id, config.id)
        except ImportError as exc:
            raise ValueError(f"sampling.verifiers (taskset {self.taskset!r}, env {self.env!r}): cannot import: "
                             f"{exc}") from None
        except Exception as exc:  # pydantic's validation errors and verifiers' own refusals, as one line
            line = " ".join(str(exc).split())[:_CHECK_LINE_CHARS] or type(exc).__name__
            raise ValueError(f"sampling.verifiers (taskset {self.taskset!r}, env {self.env!r}): {line}") from None
        return env_class.__name__


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

    def make(self) -> Any:
        """A fresh environment for one rollout (an environments.Environment)."""
        return load_environment_class(self.name)(**self.options)


def check_options_object(config: Any) -> None:
    """Parse config.options when the command line gave it as JSON text, then check it is a dict
    with str keys; ValueError naming the config class otherwise. Shared by the environment configs
    (EnvironmentConfig and VerifiersEnvConfig, here)."""
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
