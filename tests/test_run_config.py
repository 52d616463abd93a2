"""Config loading: defaults < file < flags, typed coercion, and errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from run_config import ConfigError, load_config, save_config, split_passthrough


@dataclass(kw_only=True, frozen=True)
class _Inner:
    lr: float = 1e-3
    schedule: Literal["constant", "cosine"] = "constant"
    betas: tuple[float, float] = (0.9, 0.999)
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"_Inner.lr must be > 0, got {self.lr}")


@dataclass(kw_only=True, frozen=True)
class _Outer:
    path: str
    steps: int = 10
    resume: bool = False
    inner: _Inner = field(default_factory=_Inner)


def test_precedence_defaults_file_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("path: a\nsteps: 5\ninner:\n  lr: 0.5\n  schedule: cosine\n")
    cfg = load_config(_Outer, ["--config", str(cfg_file), "--inner.lr", "0.25", "--resume", "true"])
    assert cfg == _Outer(path="a", steps=5, resume=True, inner=_Inner(lr=0.25, schedule="cosine"))


def test_toml_lists_and_none(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('path = "p"\n[inner]\nbetas = [0.8, 0.95]\n')
    cfg = load_config(_Outer, ["--config", str(cfg_file), "--inner.cap", "none"])
    assert cfg.inner.betas == (0.8, 0.95) and cfg.inner.cap is None
    assert load_config(_Outer, ["--path", "p", "--inner.cap", "2.5"]).inner.cap == 2.5


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--path", "p", "--steps", "ten"], "steps: expected int"),
        (["--path", "p", "--inner.schedule", "linear"], "inner.schedule: 'linear' is not one of"),
        (["--path", "p", "--inner.lr", "-1"], "_Inner.lr must be > 0"),
        (["--path", "p", "--resume", "maybe"], "resume: expected true/false"),
    ],
)
def test_bad_values_name_the_field(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        load_config(_Outer, argv)


def test_unknown_file_key_is_an_error(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("path: a\ninner:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match=r"inner: unknown key\(s\) \['learning_rate'\]"):
        load_config(_Outer, ["--config", str(cfg_file)])


def test_saved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(_Outer, ["--path", "p", "--inner.betas", "[0.5, 0.6]"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(_Outer, ["--config", str(tmp_path / "resolved.yaml")]) == cfg


@dataclass(kw_only=True, frozen=True)
class _Flags:
    enabled: bool = False
    """A switch."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Seeds, one or more."""
    pair: tuple[float, float] = (0.5, 0.5)
    """Two numbers."""


def test_bare_bool_flag_means_true_and_takes_an_explicit_value():
    assert load_config(_Flags, ["--enabled"]).enabled is True
    assert load_config(_Flags, ["--enabled", "false"]).enabled is False
    assert load_config(_Flags, []).enabled is False


def test_list_flags_take_several_values_or_one_json_list():
    assert load_config(_Flags, ["--seeds", "3", "4", "5"]).seeds == [3, 4, 5]
    assert load_config(_Flags, ["--seeds", "[6, 7]"]).seeds == [6, 7]
    assert load_config(_Flags, ["--pair", "0.1", "0.2"]).pair == (0.1, 0.2)
    with pytest.raises(ConfigError, match="seeds"):
        load_config(_Flags, ["--seeds", "x"])


def test_split_passthrough_cuts_at_the_first_double_dash():
    assert split_passthrough(["--a", "1", "--", "--b", "2", "--", "x"]) == (["--a", "1"], ["--b", "2", "--", "x"])
    assert split_passthrough(["--a", "1"]) == (["--a", "1"], [])


def test_help_shows_each_fields_docstring_and_default(capsys):
    with pytest.raises(SystemExit):
        load_config(_Flags, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Seeds, one or more. (default: [0])" in out
    assert "A switch. (default: False)" in out
