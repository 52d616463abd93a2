"""EnvironmentConfig: the environment a config names is checked at start-up, in one line.

    .venv/bin/python -m pytest tests/rollouts/test_environments.py -q
"""

from __future__ import annotations

import pytest

from async_grpo.config.rollout_sources import EnvironmentConfig
from async_grpo.rollouts.environments import Reset, StepResult
from async_grpo.config.rollout_sources import VerifiersEnvConfig
from async_grpo.rollouts.tool_environment import ToolEnvironment


def test_a_named_environment_is_imported_and_its_options_bound() -> None:
    config = EnvironmentConfig(name="async_grpo.rollouts.tool_environment:ToolEnvironment", options={"tools": ["calculator"]})
    assert config.check() is ToolEnvironment
    env = config.make()
    assert isinstance(env, ToolEnvironment) and env.tools == ("calculator",)
    assert not EnvironmentConfig().enabled and config.enabled


@pytest.mark.parametrize(("name", "options", "message"), [
    ("no_such_module_xyz:Env", {}, "cannot import module 'no_such_module_xyz'"),
    ("async_grpo.rollouts.tool_environment:NoSuchClass", {}, "has no class 'NoSuchClass'"),
    ("async_grpo.rollouts.environments:EnvPrompt", {}, "has no reset or step method"),
    ("async_grpo.rollouts.tool_environment:ToolEnvironment", {"tool": ["calculator"]}, r"options \['tool'\] do not fit"),
])
def test_a_bad_environment_fails_in_one_line(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        EnvironmentConfig(name=name, options=options).check()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("fields", "field"), [
    ({"name": "no_colon"}, "name"), ({"name": "a:b:c"}, "name"), ({"max_turns": 0}, "max_turns"),
    ({"max_total_tokens": True}, "max_total_tokens"), ({"options": {1: 2}}, "options"),
])
def test_config_rejects_bad_fields(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"EnvironmentConfig.{field}"):
        EnvironmentConfig(**fields)


def test_records_refuse_two_observations_and_bad_rewards() -> None:
    with pytest.raises(ValueError, match="at most one of messages / text / token_ids"):
        StepResult(messages=[{"role": "tool", "content": "x"}], token_ids=[1])
    with pytest.raises(ValueError, match="finite"):
        StepResult(reward=float("nan"))
    with pytest.raises(ValueError, match="not both"):
        Reset(messages=[{"role": "user", "content": "x"}], token_ids=[1])


def test_options_from_the_command_line_are_one_json_object() -> None:
    from async_grpo.config.run_config import load_config

    config = load_config(EnvironmentConfig, ["--name", "async_grpo.rollouts.tool_environment:ToolEnvironment",
                                             "--options", '{"tools": ["python"]}'])
    assert config.options == {"tools": ["python"]}
    with pytest.raises(ValueError, match="EnvironmentConfig.options must be a JSON object"):
        EnvironmentConfig(options="{tools")


@pytest.mark.parametrize("config_class", [EnvironmentConfig, VerifiersEnvConfig])
@pytest.mark.parametrize("field, value, message", [
    ("options", "{tools", "options must be a JSON object"),
    ("options", "[1, 2]", "options must be a dict with str keys"),
    ("options", {1: 2}, "options must be a dict with str keys"),
    ("max_turns", 0, "max_turns must be an int >= 1"),
    ("max_turns", True, "max_turns must be an int >= 1"),
    ("max_turns", 2.0, "max_turns must be an int >= 1"),
    ("max_total_tokens", 0, "max_total_tokens must be an int >= 1, got 0"),
    ("max_total_tokens", None, "max_total_tokens must be an int >= 1, got None"),
])
def test_both_environment_configs_name_the_class_and_field(config_class: type, field: str, value: object,
                                                           message: str) -> None:
    with pytest.raises(ValueError, match=f"^{config_class.__name__}.{message}"):
        config_class(**{field: value})


def test_max_turns_none_means_the_environments_own_limit_only_for_verifiers() -> None:
    assert VerifiersEnvConfig(max_turns=None).max_turns is None  # the verifiers env keeps its own limit
    with pytest.raises(ValueError, match="EnvironmentConfig.max_turns must be an int >= 1, got None"):
        EnvironmentConfig(max_turns=None)
