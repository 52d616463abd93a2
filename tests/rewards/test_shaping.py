"""Reward shaping (shaping.py) and the sampling config's stop and reward sections: pure, no engine.

    .venv/bin/python -m pytest tests/rewards/test_shaping.py -q
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import yaml

from async_grpo.config.run_config import ConfigError, config_to_dict, load_config
from async_grpo.config.reward_config import RewardConfig
from async_grpo.rewards.shaping import ShapedReward, format_matches, shape_reward
from async_grpo.config.sampling import SamplingConfig

BOXED = r"\\boxed\{.+\}"
BOXED_FORMAT = RewardConfig(format_pattern=BOXED, format_bonus=0.1, format_penalty=0.2)


@dataclass(kw_only=True, frozen=True)
class _Entry:
    """Nests SamplingConfig as TrainerConfig does, so the flags read --sampling.<field>."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)


# (verdict, text, verified, expected reward, expected format_matched), decided by hand for BOXED_FORMAT.
SHAPING_CASES = [
    (1.0, "so it is \\boxed{7}", True, 1.1, True),
    (0.0, "so it is \\boxed{8}", True, 0.1, True),
    (1.0, "so it is 7", True, 0.8, False),
    (0.0, "so it is 8", True, -0.2, False),
    # No answer at all (the verifier's parse failure, verdict 0) pays the penalty like any other.
    (0.0, "I cannot solve this", True, -0.2, False),
    # Reasoning spans lines: the pattern's "." crosses newlines.
    (1.0, "first\n\\boxed{\n7\n}", True, 1.1, True),
    # An empty box does not match ".+"; the box may sit anywhere in the text.
    (0.0, "\\boxed{}", True, -0.2, False),
    (1.0, "\\boxed{7} and then more words", True, 1.1, True),
    # A truncated completion given truncated_reward is neither verified nor shaped.
    (0.0, "\\boxed{7", False, 0.0, None),
    (-0.5, "so it is \\boxed{7}", False, -0.5, None),
]


@pytest.mark.parametrize(("verdict", "text", "verified", "expected", "matched"), SHAPING_CASES)
def test_shape_reward_matches_hand_made_expectations(verdict, text, verified, expected, matched) -> None:
    got = shape_reward(verdict, text, verified=verified, config=BOXED_FORMAT)
    assert got.reward == pytest.approx(expected, abs=1e-12)
    assert got.format_matched is matched


def test_no_pattern_leaves_the_verdict_alone() -> None:
    plain = RewardConfig()
    assert shape_reward(1.0, "\\boxed{7}", verified=True, config=plain) == ShapedReward(reward=1.0, format_matched=None)
    assert shape_reward(0.0, "7", verified=True, config=plain) == ShapedReward(reward=0.0, format_matched=None)
    assert format_matches("anything", plain) is None


def test_a_pattern_without_bonus_or_penalty_only_counts() -> None:
    counting = RewardConfig(format_pattern=r"^\d+$")
    assert shape_reward(1.0, "7", verified=True, config=counting) == ShapedReward(1.0, format_matched=True)
    assert shape_reward(1.0, "it is 7", verified=True, config=counting) == ShapedReward(1.0, format_matched=False)


def test_anchors_apply_to_the_whole_text() -> None:
    tagged = RewardConfig(format_pattern=r"^<think>.*</think>.*\\boxed\{.+\}\s*$", format_bonus=0.2)
    assert format_matches("<think>a\nb</think> so \\boxed{3}\n", tagged) is True
    assert format_matches("preamble <think>a</think> \\boxed{3}", tagged) is False
    assert format_matches("<think>a</think> \\boxed{3} trailing words", tagged) is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format_pattern": "\\boxed{(.+"}, "RewardConfig.format_pattern .* is not a valid regex"),
        ({"format_pattern": ""}, "RewardConfig.format_pattern must be a non-empty regex"),
        ({"format_pattern": BOXED, "format_bonus": -0.1}, "RewardConfig.format_bonus must be a finite number >= 0"),
        ({"format_pattern": BOXED, "format_bonus": 1.0}, "RewardConfig.format_bonus must be < 1"),
        ({"format_pattern": BOXED, "format_penalty": float("inf")}, "RewardConfig.format_penalty must be a finite"),
        ({"format_pattern": BOXED, "format_penalty": -1.0}, "RewardConfig.format_penalty must be a finite"),
        ({"format_bonus": 0.1}, "format_pattern is None"),
        ({"format_penalty": 0.1}, "format_pattern is None"),
    ],
)
def test_reward_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop": ["</answer>", ""]}, "SamplingConfig.stop must hold non-empty strings"),
        ({"stop": "</answer>"}, "SamplingConfig.stop must be a list"),
        ({"stop": [3]}, "SamplingConfig.stop must hold non-empty strings"),
        ({"stop_token_ids": [5, -1]}, "SamplingConfig.stop_token_ids must hold ints >= 0"),
        ({"stop_token_ids": [True]}, "SamplingConfig.stop_token_ids must hold ints >= 0"),
        ({"stop_token_ids": ["5"]}, "SamplingConfig.stop_token_ids must hold ints >= 0"),
        ({"reward": {"format_pattern": BOXED}}, "SamplingConfig.reward must be a RewardConfig"),
    ],
)
def test_sampling_config_rejects_bad_stops(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_sampling_defaults_stop_on_eos_only_and_shape_nothing() -> None:
    sampling = SamplingConfig()
    assert (sampling.stop, sampling.stop_token_ids, sampling.reward) == ((), (), RewardConfig())
    # Lists given in code are stored as tuples: the config is frozen and stays hashable.
    given = SamplingConfig(stop=["</answer>"], stop_token_ids=[5])
    assert (given.stop, given.stop_token_ids) == (("</answer>",), (5,))
    hash(given)


def test_flags_and_config_file_fill_stop_and_reward(tmp_path) -> None:
    argv = [
        "--sampling.stop", "</answer>", "\n\nQuestion:",
        "--sampling.stop_token_ids", "5", "7",
        "--sampling.reward.format_pattern", BOXED,
        "--sampling.reward.format_bonus", "0.1",
        "--sampling.reward.format_penalty", "0.2",
    ]
    cfg = load_config(_Entry, argv)
    assert cfg.sampling.stop == ("</answer>", "\n\nQuestion:")
    assert cfg.sampling.stop_token_ids == (5, 7)
    assert cfg.sampling.reward == BOXED_FORMAT
    # The resolved config written next to a run loads back equal.
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert load_config(_Entry, ["--config", str(path)]) == cfg


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"sampling.reward: RewardConfig.format_pattern '\(' is not a valid regex"):
        load_config(_Entry, ["--sampling.reward.format_pattern", "("])
    with pytest.raises(ConfigError, match="SamplingConfig.stop_token_ids must hold ints >= 0"):
        load_config(_Entry, ["--sampling.stop_token_ids", "-3"])
