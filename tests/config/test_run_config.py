"""Config loading: defaults < file < flags, typed coercion, and errors that name the key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from async_grpo.config.run_config import (
    ConfigError, config_reference, config_to_dict, config_to_flags, derived, flattened, load_command, load_config,
    positional, save_config, split_passthrough,
)


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


@dataclass(kw_only=True, frozen=True)
class _Engine:
    seqs: int = 128
    """Sequences per step."""
    eager: bool = False
    """Skip compilation."""
    kv: int | None = None
    """KV-cache bytes."""

    def __post_init__(self) -> None:
        if self.seqs < 1:
            raise ValueError(f"_Engine.seqs must be >= 1, got {self.seqs}")


@dataclass(kw_only=True, frozen=True)
class _Launcher:
    name: str = "x"
    """Who."""
    engine: _Engine = flattened(_Engine(seqs=256, kv=1024))
    """The engine, with this launcher's defaults."""
    inner: _Inner = field(default_factory=_Inner)


def test_a_flattened_section_takes_top_level_flags_and_file_keys_with_its_embedders_defaults(tmp_path: Path) -> None:
    assert load_config(_Launcher, []).engine == _Engine(seqs=256, kv=1024)
    cfg = load_config(_Launcher, ["--seqs", "8", "--eager"])
    assert cfg.engine == _Engine(seqs=8, eager=True, kv=1024)  # kv keeps the launcher's default
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("name: y\nkv: null\ninner:\n  lr: 0.5\n")
    assert load_config(_Launcher, ["--config", str(cfg_file)]) == _Launcher(
        name="y", engine=_Engine(seqs=256, kv=None), inner=_Inner(lr=0.5))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['engine.seqs'\]"):
        load_config(_Launcher, ["--config", str(_write(tmp_path / "d.yaml", "engine.seqs: 3\n"))])
    with pytest.raises(ConfigError, match="_Engine.seqs must be >= 1"):  # the section's own validation
        load_config(_Launcher, ["--seqs", "0"])
    with pytest.raises(SystemExit):
        load_config(_Launcher, ["--engine.seqs", "3"])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_flattened_section_saves_flat_and_round_trips(tmp_path: Path) -> None:
    cfg = load_config(_Launcher, ["--seqs", "4", "--inner.lr", "0.5"])
    assert config_to_dict(cfg)["seqs"] == 4 and "engine" not in config_to_dict(cfg)
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(_Launcher, ["--config", str(tmp_path / "resolved.yaml")]) == cfg


def test_help_and_reference_show_the_embedders_defaults(capsys) -> None:
    reference = "\n".join(config_reference(_Launcher))
    assert "| `--seqs` | `int` | `256` | Sequences per step. |" in reference
    assert "--engine" not in reference
    with pytest.raises(SystemExit):
        load_config(_Launcher, ["--help"])
    assert "Sequences per step. (default: 256)" in " ".join(capsys.readouterr().out.split())


def test_config_to_flags_gives_the_non_default_fields_and_loads_back() -> None:
    engine = _Engine(seqs=256, eager=True, kv=None)
    assert config_to_flags(engine) == ["--seqs", "256", "--eager"]
    assert config_to_flags(_Engine()) == []
    assert config_to_flags(_Engine(kv=None), baseline=_Engine(kv=5)) == ["--kv", "none"]
    launcher = _Launcher(name="z", engine=_Engine(seqs=3, kv=1024), inner=_Inner(betas=(0.1, 0.2), cap=1.5))
    words = config_to_flags(launcher)
    assert words == ["--name", "z", "--seqs", "3", "--inner.betas", "[0.1, 0.2]", "--inner.cap", "1.5"]
    assert load_config(_Launcher, words) == launcher
    assert load_config(_Launcher, config_to_flags(_Launcher(engine=_Engine(eager=True, kv=None)))) == _Launcher(
        engine=_Engine(eager=True, kv=None))


@dataclass(kw_only=True, frozen=True)
class _Shared:
    """An option two programs read (worker_options.EngineTransferConfig's pattern)."""

    backend: str = "a"
    """Which backend."""


@dataclass(kw_only=True, frozen=True)
class _Extended(_Shared):
    port: int = 1
    """One program's own setting beside it."""


@dataclass(kw_only=True, frozen=True)
class _Filled:
    name: str = "x"
    """Who."""
    shared: _Shared = derived(_Shared(), "the other config's --shared.backend")
    """Set by the program from another config."""


def test_a_field_a_base_declares_is_a_flag_with_its_docstring() -> None:
    assert load_config(_Extended, ["--backend", "b", "--port", "2"]) == _Extended(backend="b", port=2)
    reference = "\n".join(config_reference(_Extended))
    assert "| `--backend` | `str` | `'a'` | Which backend. |" in reference


def test_a_derived_field_is_no_flag_no_file_key_and_not_written_back(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    filled = _Filled(name="y", shared=_Shared(backend="b"))  # what the program sets
    assert "backend" not in config_to_dict(filled) and "shared" not in config_to_dict(filled)
    assert config_to_flags(filled) == ["--name", "y"]
    reference = "\n".join(config_reference(_Filled))
    assert "`--shared" not in reference and "--backend" not in reference
    save_config(filled, tmp_path / "resolved.yaml")
    assert load_config(_Filled, ["--config", str(tmp_path / "resolved.yaml")]) == _Filled(name="y")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['shared'\]"):
        load_config(_Filled, ["--config", str(_write(tmp_path / "d.yaml", "shared:\n  backend: b\n"))])
    for flag in ("--shared.backend", "--backend"):
        with pytest.raises(SystemExit):
            load_config(_Filled, [flag, "b"])
        err = capsys.readouterr().err
        assert f"unknown flag {flag}" in err
        assert ("(set by the other config's --shared.backend)" in err) == (flag == "--backend"), err


@dataclass(kw_only=True, frozen=True)
class _Clash:
    seqs: int = 1
    engine: _Engine = flattened(_Engine())


def test_a_flattened_key_that_repeats_another_is_refused() -> None:
    with pytest.raises(TypeError, match=r"repeat the key\(s\) \['seqs'\]"):
        load_config(_Clash, [])


@dataclass(kw_only=True, frozen=True)
class _Compare:
    """Compare runs."""

    runs: list[str] = positional()
    """Run directories."""
    out: str = "x.png"
    """The figure."""
    levels: list[float] = field(default_factory=lambda: [0.5])
    """Levels."""


def test_a_positional_field_takes_the_words_without_a_flag_or_a_file_key(tmp_path: Path) -> None:
    assert load_config(_Compare, ["a", "b", "--out", "y.png"]) == _Compare(runs=["a", "b"], out="y.png")
    assert load_config(_Compare, ["--out", "y.png", "a"]).runs == ["a"]
    # A list flag before the words would take them: they come first or after a single-value flag.
    assert load_config(_Compare, ["a", "--levels", "0.1", "0.2"]) == _Compare(runs=["a"], levels=[0.1, 0.2])
    file = _write(tmp_path / "c.yaml", "runs: [c, d]\n")
    assert load_config(_Compare, ["--config", str(file)]).runs == ["c", "d"]
    assert load_config(_Compare, ["--config", str(file), "e"]).runs == ["e"]  # the command line wins
    with pytest.raises(ConfigError, match="missing 1 required keyword-only argument: 'runs'"):
        load_config(_Compare, ["--out", "y.png"])
    with pytest.raises(SystemExit):
        load_config(_Compare, ["--runs", "a"])


def test_a_positional_field_in_help_reference_and_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        load_config(_Compare, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[RUNS ...]" in out and "Run directories. (required)" in out
    assert "| `RUNS ...` (positional) | `list[str]` | required | Run directories. |" in config_reference(_Compare)
    config = _Compare(runs=["a", "b"], levels=[0.7])
    assert config_to_flags(config) == ["a", "b", "--levels", "[0.7]"]
    assert load_config(_Compare, config_to_flags(config)) == config


@dataclass(kw_only=True, frozen=True)
class _TwoPositionals:
    first: str = positional()
    second: str = positional()


def test_two_positional_fields_are_refused() -> None:
    with pytest.raises(TypeError, match="one positional field at most"):
        load_config(_TwoPositionals, ["a", "b"])


@dataclass(kw_only=True, frozen=True)
class _Data:
    path: str
    """Prompt file."""
    rows: int = 4
    """Rows to read."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("_Data.path must not be empty")


@dataclass(kw_only=True, frozen=True)
class _Check:
    data: _Data = flattened(_Data)
    """The data section, every field a top-level flag."""
    model: str
    """Model folder."""


def test_a_flattened_section_class_is_required_with_its_own_defaults(tmp_path: Path) -> None:
    assert load_config(_Check, ["--path", "p", "--model", "m"]) == _Check(data=_Data(path="p"), model="m")
    assert load_config(_Check, ["--path", "p", "--rows", "2", "--model", "m"]).data == _Data(path="p", rows=2)
    with pytest.raises(ConfigError, match="missing 1 required keyword-only argument: 'path'"):
        load_config(_Check, ["--model", "m"])
    with pytest.raises(ConfigError, match="_Data.path must not be empty"):  # the section's own validation
        load_config(_Check, ["--path", "", "--model", "m"])
    assert "| `--path` | `str` | required | Prompt file. |" in config_reference(_Check)
    assert "| `--rows` | `int` | `4` | Rows to read. |" in config_reference(_Check)
    config = _Check(data=_Data(path="p", rows=3), model="m")
    assert config_to_flags(config) == ["--path", "p", "--rows", "3", "--model", "m"]
    save_config(config, tmp_path / "resolved.yaml")
    assert load_config(_Check, ["--config", str(tmp_path / "resolved.yaml")]) == config


def test_load_command_picks_the_config_by_the_first_word(capsys) -> None:
    commands = {"compare": _Compare, "flags": _Flags}
    assert load_command(commands, ["compare", "a"], "prog") == ("compare", _Compare(runs=["a"]))
    assert load_command(commands, ["flags", "--enabled"], "prog") == ("flags", _Flags(enabled=True))
    for argv in ([], ["plot"], ["--enabled"]):
        with pytest.raises(SystemExit) as info:
            load_command(commands, argv, "prog")
        assert str(info.value).splitlines()[:2] == [
            "usage: prog {compare,flags} [--flag value ...] (--help per command)", "  compare: Compare runs."]
    with pytest.raises(SystemExit) as info:
        load_command(commands, ["--help"], "prog")
    assert info.value.code == 0 and "  compare: Compare runs." in capsys.readouterr().out


def test_a_misspelt_flag_is_one_line_naming_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    """A user's typo gets one line, exit 2, and the flag meant; not argparse's usage block."""
    from async_grpo.trainer.config import TrainerConfig

    with pytest.raises(SystemExit) as info:
        load_config(TrainerConfig, ["--num_stepz", "10", "--max_lagg", "1"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "unknown flags --num_stepz (did you mean --num_steps?), --max_lagg (did you mean --max_lag?)" in err
    with pytest.raises(SystemExit) as info:
        load_config(TrainerConfig, ["--num_steps"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and "--num_steps: expected one argument" in err


def test_a_file_value_is_checked_as_a_flag_and_its_error_names_the_file(tmp_path: Path) -> None:
    """The file's keys go to the parser as the flags they stand for, ahead of the command line's."""
    cfg_file = _write(tmp_path / "c.yaml", "path: a\nsteps: ten\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {cfg_file}:2: steps: expected int, got 'ten'")):
        load_config(_Outer, ["--config", str(cfg_file)])
    assert load_config(_Outer, ["--config", str(cfg_file), "--steps", "3"]).steps == 3  # the flag wins
    with pytest.raises(ConfigError, match=r"^inner: _Inner.lr must be > 0"):  # a section's error names the section
        load_config(_Outer, ["--path", "p", "--inner.lr", "-1"])
    with pytest.raises(ConfigError, match=re.escape(f"config file {cfg_file}: inner: expected a section")):
        load_config(_Outer, ["--config", str(_write(cfg_file, "path: a\ninner: 3\n"))])


def test_a_value_that_starts_with_dashes_and_holds_a_space_is_a_value() -> None:
    """`--path "--max_lag 1"` (benchmarks/demo_ab.py passes trainer flags so) is argparse's value,
    never a flag; the `=` form and a bool flag before a flag keep working."""
    assert load_config(_Outer, ["--path", "--max_lag 1", "--steps", "3"]).path == "--max_lag 1"
    assert load_config(_Outer, ["--path=--x=1"]).path == "--x=1"
    assert load_config(_Outer, ["--resume", "--path", "a"]) == _Outer(path="a", resume=True)
