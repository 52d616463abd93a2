"""Typed run configuration: nested frozen dataclasses filled from a YAML/TOML file and CLI flags.

Every field of a config dataclass becomes a flag: top-level fields as `--name`, fields of a
nested section as `--section.name`. Precedence: defaults < config file < CLI flags. Unknown keys
(in the file or on the command line) are errors that name the key, and each section's own
`__post_init__` validation runs on the final values. A bool flag alone means true
(`--enforce_eager`, or `--enforce_eager false`); a list field takes one or more values
(`--seeds 0 1 2`, or JSON: `--seeds "[0, 1, 2]"`); `none` sets an optional field to None.

Parsing is tyro's (requirements_base.txt pins it), chosen over jsonargparse and pydantic-settings
because it takes our plain frozen dataclasses as they are (pydantic-settings wants pydantic
models), reads each field's docstring as its help, and names nested fields `--section.name` with
a list's values as separate words (jsonargparse: JSON or `--name+`, and no bare bool flag). Its
constructor registry adds what it lacks: flattened and positional fields, bare-or-valued bools,
`none`. A config file goes to tyro as the flags it stands for, ahead of the command line's, so
both are typed and checked alike and the later flag wins; tyro's boxed error paragraphs become
one line through its parse-error hook (`tyro._errors`, private: hence the exact pin). What a
config class declares, walked, and a config written back out are config_schema.py's.

A field declared with `flattened(default)` embeds a section whose fields stay at the top level
of the embedding config: no `--section.` prefix on its flags, no `section:` mapping in a file,
and the section's defaults are those of `default` (so two configs can embed one section, each
with defaults of its own, while each field, its type, docstring and validation are declared
once, in the section). `config_to_flags(section)` turns a section back into the flags that
give it, for a launcher that starts a child with the same options:

    @dataclass(kw_only=True, frozen=True)
    class DispatcherConfig:
        engine: EngineConfig = flattened(EngineConfig())   # --max_num_seqs, --dtype, ...

    config_to_flags(EngineConfig(max_num_seqs=256))  # ['--max_num_seqs', '256']

`flattened(SectionClass)` (the class, no instance) embeds a required section: its fields take
the class's own defaults, and its required fields are required flags of the embedding config.

A field declared with `derived(default)` is filled by the program from another config (the local
launcher's copy of the options its workers read from the trainer's config): no flag, no file key,
not written back out, so the option has one source.

A field declared with `positional()` is given on the command line without a flag (a list field:
one or more words, `compare runs/a runs/b`), or under its name in a file; a config has at most
one. A program of subcommands (`metrics.py plot ...`, `metrics.py compare ...`) names one config
class per command and loads the one its first word picks with `load_command`.

Every entry point of the project parses its command line this way, so defaults live in one
place, the config class:

    cfg = load_config(TrainerConfig, ["--config", "demo.yaml", "--optim.lr", "3e-4"])
    save_config(cfg, run_dir / "config.yaml")
    own, rest = split_passthrough(sys.argv[1:])  # launchers: flags after `--` go to a child
    command, cfg = load_command({"plot": PlotConfig, "compare": CompareConfig}, sys.argv[1:], prog)

A value a config refuses ends an entry point with one line naming the program and the field, exit
status 2, before anything starts (`exit_config_error`); so does a command-line error, an unknown
flag naming the closest known ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import io
import json
import sys
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Mapping, NoReturn, TypeVar

import tyro
import yaml
from tyro.constructors import (
    MISSING_NONPROP, ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo, StructConstructorSpec,
    StructFieldSpec, StructTypeInfo,
)

from async_grpo.config.config_schema import (
    _default_hint, _field, _field_default, _field_docs, _field_types, _flag_words, _flags, _is_dataclass_type,
    _is_flattened, _is_input, _is_list_type, _is_positional, _keys, _leaves, _positional_label, _positional_name,
    _type_name,
)
from async_grpo.config.config_schema import (  # noqa: F401 (re-exported: the entry points import them from here)
    config_reference, config_to_dict, config_to_flags, derived, derived_flags, flattened, positional, save_config,
)

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or flag that does not fit the config's schema."""


CONFIG_ERROR_EXIT = 2
"""Exit status of a command line or config that cannot be used (argparse's, for the same kind of error)."""


def exit_config_error(program: str, error: Exception | str) -> NoReturn:
    """`program: error` as one line on stderr, then exit CONFIG_ERROR_EXIT: no traceback."""
    print(f"{program}: {error}", file=sys.stderr, flush=True)
    raise SystemExit(CONFIG_ERROR_EXIT)


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(flags before the first `--`, everything after it): a launcher's own flags and its child's."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


_CONFIG_HELP = "--config FILE: a YAML or TOML file of these keys (defaults < file < flags)."


def load_config(cls: type[T], argv: list[str], description: str = "") -> T:
    """Build `cls` from defaults, then `--config FILE` (YAML or TOML), then `--key value` flags."""
    _keys(cls)  # refuse repeated keys and a second positional field before parsing anything
    positional_name = _positional_name(cls)
    file, argv = _pop_config_file(list(argv))
    values = _read_file(file) if file is not None else {}
    try:
        file_words = _file_words(cls, values)
    except ConfigError as exc:
        raise ConfigError(f"config file {file}: {exc}") from None
    from_file = values.get(positional_name, dataclasses.MISSING) if positional_name else dataclasses.MISSING
    prog = Path(sys.argv[0]).name
    shown = io.StringIO()  # --help, written at once: `--help | head` then ends without a BrokenPipeError
    try:
        with tyro._errors.on_parse_error(_OneLineErrors(cls, prog, argv, file_words, file)), \
                contextlib.redirect_stdout(shown):
            unbuilt = tyro.cli(cls, args=_json_lists_split(cls, _spaced_values_attached(file_words + argv)), prog=prog,
                               description=f"{description}\n\n{_CONFIG_HELP}".strip(), registry=_registry(from_file),
                               config=(tyro.conf.FlagConversionOff,), use_underscores=True)
    except SystemExit:
        with contextlib.suppress(BrokenPipeError):
            sys.stdout.write(shown.getvalue())
            sys.stdout.flush()
        raise
    required = positional_name and _field_default(_field(cls, positional_name)) is dataclasses.MISSING
    if required and from_file is dataclasses.MISSING and unbuilt.kwargs.get(positional_name) == []:
        # tyro takes no words for a list (nargs "*"); a required one needs at least one.
        _missing(cls, [positional_name], [_positional_label(positional_name, _field_types(cls)[positional_name])])
    return unbuilt.build("")


def _missing(cls: type, names: list[str], flags: list[str]) -> NoReturn:
    """A ConfigError for required fields left out, caused by the TypeError the dataclass's own
    __init__ would raise: an entry point tells "nothing given" by it (trainer_core.config_error_line)."""
    message = (f"{cls.__name__}: missing {len(names)} required keyword-only argument{'s' if len(names) > 1 else ''}: "
               f"{' and '.join(repr(name.rsplit('.', 1)[-1]) for name in names)} ({', '.join(flags)})")
    raise ConfigError(message) from TypeError(message)


def _pop_config_file(argv: list[str]) -> tuple[Path | None, list[str]]:
    """(the `--config FILE` path or None, argv without it)."""
    for i, word in enumerate(argv):
        if word == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1]), argv[:i] + argv[i + 2 :]
        if word.startswith("--config="):
            return Path(word.partition("=")[2]), argv[:i] + argv[i + 1 :]
    return None, argv


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        with path.open("rb" if path.suffix == ".toml" else "r") as stream:  # YAML's errors then name the file
            data = tomllib.load(stream) if path.suffix == ".toml" else yaml.safe_load(stream)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: {' '.join(str(exc).split())}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def _yaml_lines(path: Path) -> dict[str, int]:
    """{dotted key: its line} of a YAML file, for errors that name the line (TOML: none)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
            lines[f"{prefix}{key.value}"] = key.start_mark.line + 1
            walk(value, f"{prefix}{key.value}.")

    if path.suffix != ".toml":
        with path.open() as stream:
            walk(yaml.compose(stream), "")
    return lines


def _file_words(cls: type, values: dict[str, Any], prefix: str = "") -> list[str]:
    """The flags a file's mapping for cls stands for (its positional field left out), to go before
    the command line's: unknown keys and a value where a section belongs are ConfigErrors."""
    known = _keys(cls)
    unknown = set(values) - set(known)
    if unknown:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    words: list[str] = []
    for f, tp, _, _ in _leaves(cls):
        if f.name not in values or _is_positional(f):
            continue
        if not _is_dataclass_type(tp):
            words += [f"--{prefix}{f.name}", *_flag_words(values[f.name])]
        elif isinstance(values[f.name], dict):
            words += _file_words(tp, values[f.name], f"{prefix}{f.name}.")
        else:
            raise ConfigError(f"{prefix}{f.name}: expected a section (mapping), got {values[f.name]!r}")
    return words


def _spaced_values_attached(argv: list[str]) -> list[str]:
    """argv with a value that starts with '-' and holds a space (`--b "--max_lag 1"`) joined to its
    flag (`--b=--max_lag 1`): argparse's rule (such a word is never a flag), which tyro lacks."""
    words: list[str] = []
    for word in argv:
        previous = words[-1] if words else ""
        if word.startswith("-") and " " in word and previous.startswith("--") and "=" not in previous:
            words[-1] = f"{previous}={word}"
        else:
            words.append(word)
    return words


def _json_lists_split(cls: type, argv: list[str]) -> list[str]:
    """argv with a JSON list after a list flag (`--seeds "[0, 1]"`) as the words tyro takes (`0 1`)."""
    list_flags = {f"--{dotted}" for dotted, tp, _ in _flags(cls) if _is_list_type(tp)}
    words: list[str] = []
    for previous, word in zip([""] + argv, argv):
        items = None
        if previous in list_flags and word.startswith("["):
            with contextlib.suppress(json.JSONDecodeError):
                items = json.loads(word)
        words += [str(item) for item in items] if isinstance(items, list) else [word]
    return words


@dataclasses.dataclass
class _Unbuilt:
    """A section's parsed values, built by load_config rather than by tyro, so that a section's own
    validation error names where the section sits (`sampling.reward: ...`)."""

    cls: type
    kwargs: dict[str, Any]

    def build(self, where: str) -> Any:
        kwargs = {name: value.build(where if _is_flattened(_field(self.cls, name)) else f"{where}.{name}".lstrip("."))
                  if isinstance(value, _Unbuilt) else value for name, value in self.kwargs.items()}
        try:
            return self.cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where or self.cls.__name__}: {exc}") from exc


def _registry(positional_from_file: Any) -> ConstructorRegistry:
    """tyro's rules for our config dataclasses (_field_spec); the positional field defaults to a
    config file's value when it gives one."""
    registry = ConstructorRegistry()
    registry.primitive_rule(_our_primitives)

    @registry.struct_rule
    def _config_fields(info: StructTypeInfo) -> StructConstructorSpec | None:
        if not _is_dataclass_type(info.type):
            return None
        base = info.default if dataclasses.is_dataclass(info.default) else None
        docs, types_by_name = _field_docs(info.type), _field_types(info.type)
        specs = []
        for f in (f for f in dataclasses.fields(info.type) if _is_input(f)):
            default = getattr(base, f.name) if base is not None else _field_default(f)
            if _is_positional(f) and positional_from_file is not dataclasses.MISSING:
                default = positional_from_file
            specs.append(_field_spec(f, types_by_name[f.name], docs.get(f.name, ""), default))
        return StructConstructorSpec(instantiate=lambda **kwargs: _Unbuilt(info.type, kwargs), fields=tuple(specs))

    return registry


def _field_spec(f: dataclasses.Field, tp: Any, doc: str, default: Any) -> StructFieldSpec:
    """One field for tyro: a flattened section without its prefix, a positional field without a
    flag, a value's help ending in _default_hint."""
    hint, default = _default_hint(default), MISSING_NONPROP if default is dataclasses.MISSING else default
    if _is_flattened(f):
        return StructFieldSpec(name=f.name, type=Annotated[tp, tyro.conf.arg(name="")], default=default, helptext=doc)
    if _is_dataclass_type(tp):
        return StructFieldSpec(name=f.name, type=tp, default=default, helptext=doc)
    markers: list[Any] = [tyro.conf.arg(help_behavior_hint=hint)]
    if _is_positional(f):  # in brackets when a list: a config file may give it instead
        label = _positional_label(f.name, tp)
        markers = [tyro.conf.Positional,
                   tyro.conf.arg(help_behavior_hint=hint, metavar=f"[{label}]" if _is_list_type(tp) else label)]
    return StructFieldSpec(name=f.name, type=Annotated[(tp, *markers)], default=default, helptext=doc)


_TRUE_WORDS, _FALSE_WORDS, _NONE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off"), ("none", "null")


def _our_primitives(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    """What our flags take beyond tyro's own: a bool flag alone or with true/false (tyro: a
    --flag/--no-flag pair), `none` for None (tyro: `None`), a JSON object for a dict field."""
    if info.type is bool:
        return PrimitiveConstructorSpec(nargs=(0, 1), metavar="[BOOL]", instance_from_str=_bool_from_words,
                                        is_instance=lambda x: isinstance(x, bool),
                                        str_from_instance=lambda x: [str(x).lower()])
    if info.type is type(None):
        return PrimitiveConstructorSpec(nargs=1, metavar="none", instance_from_str=_none_from_words,
                                        is_instance=lambda x: x is None, str_from_instance=lambda x: ["none"])
    if typing.get_origin(info.type) is dict:
        return PrimitiveConstructorSpec(nargs=1, metavar="JSON", instance_from_str=lambda words: json.loads(words[0]),
                                        is_instance=lambda x: isinstance(x, dict),
                                        str_from_instance=lambda x: [json.dumps(x)])
    return None


def _bool_from_words(words: list[str]) -> bool:
    if not words:  # the bare flag
        return True
    if words[0].lower() not in _TRUE_WORDS + _FALSE_WORDS:
        raise ValueError(f"expected true/false, got {words[0]!r}")
    return words[0].lower() in _TRUE_WORDS


def _none_from_words(words: list[str]) -> None:
    if words[0].lower() not in _NONE_WORDS:
        raise ValueError(f"expected none, got {words[0]!r}")


class _OneLineErrors:
    """tyro's parse-error hook (tyro._errors is private: requirements_base.txt pins tyro exactly):
    each error as one line naming the flag, or the config file that set it. A command-line error
    (an unknown flag, a flag without its value) ends the program with exit_config_error; a value a
    field refuses raises ConfigError for the entry point to report."""

    def __init__(self, cls: type, prog: str, argv: list[str], file_words: list[str], file: Path | None):
        self.cls, self.prog, self.argv, self.file_words, self.file = cls, prog, argv, file_words, file
        self.file_lines = _yaml_lines(file) if file is not None else {}

    def __call__(self, event: tyro._errors.ParseErrorEvent) -> None:
        unrecognized = getattr(event, "tokens", None) or getattr(event, "unrecognized_tokens", None)
        if unrecognized:
            self._unknown(unrecognized)
        if isinstance(event, tyro._errors.MissingArgs):
            self._missing_args(event.missing_arguments)
        if isinstance(event, tyro._errors.InvalidChoice):
            raise ConfigError(f"{self._where(event.argument, event.value)}: {event.value!r} is not one of "
                              f"{list(event.choices)}")
        if isinstance(event, (tyro._errors.BadValue, tyro._errors.InstantiationFailure)) and event.argument:
            self._bad_value(event.argument, getattr(event, "reason", None) or event.message)

    def _unknown(self, tokens: list[str]) -> NoReturn:
        flags = [token for token in tokens if token.startswith("-")]
        known = [f"--{dotted}" for dotted, _, _ in _flags(self.cls)]
        elsewhere = derived_flags(self.cls)
        hints = []
        for flag in flags:
            name = flag.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=2)
            if name in elsewhere:
                hints.append(f"{flag} (set by {elsewhere[name]})")
            else:
                hints.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
        what = f"unknown flag{'s' if len(flags) > 1 else ''} {', '.join(hints)}" if flags else f"extra words {tokens}"
        exit_config_error(self.prog, f"{what}; --help lists the flags")

    def _missing_args(self, arguments: list[Any]) -> NoReturn:
        names = [_name(arg.arg) for arg in arguments]
        given = [name for name in names if f"--{name}" in self.argv + self.file_words]
        if given:  # the flag is there, its value is not
            exit_config_error(self.prog, f"--{given[0]}: expected one argument; --help lists the flags")
        _missing(self.cls, names, [f"--{name}" for name in names])

    def _bad_value(self, argument: Any, reason: str) -> NoReturn:
        given = self._given(argument)
        if not given:
            exit_config_error(self.prog, f"--{_name(argument)}: expected one argument; --help lists the flags")
        if not reason.startswith("expected"):  # tyro's words are int()'s and float()'s: ours name the type
            reason = f"expected {_type_name(argument.field.type_stripped)}, got {' '.join(given)!r}"
        raise ConfigError(f"{self._where(argument)}: {reason}")

    def _given(self, argument: Any) -> list[str]:
        """The words after the argument's flag where it was last given (a list flag: all of them)."""
        words, flag = self.file_words + self.argv, f"--{_name(argument)}"
        given = words[len(words) - words[::-1].index(flag) :] if flag in words else []
        return given[: next((i for i, word in enumerate(given) if word.startswith("--")), len(given))]

    def _where(self, argument: Any, item: str | None = None) -> str:
        """The field's dotted name (with the index of `item`, a list's refused item), after the
        config file's name and the key's line when the file, not a flag, gave it."""
        name, given = _name(argument), self._given(argument)
        if item is not None and _is_list_type(argument.field.type_stripped) and item in given:
            name += f"[{given.index(item)}]"
        flag = f"--{_name(argument)}"
        from_file = self.file is not None and not any(w == flag or w.startswith(f"{flag}=") for w in self.argv)
        line = f":{self.file_lines[_name(argument)]}" if _name(argument) in self.file_lines else ""
        return f"config file {self.file}{line}: {name}" if from_file else name


def _name(argument: Any) -> str:
    """The dotted field name of a tyro argument (`inner.lr`; a positional one's own name)."""
    flags = argument.lowered.name_or_flags
    return flags[0].lstrip("-") if flags and flags[0].startswith("--") else argument.field.intern_name


def _first_line(cls: type) -> str:
    return (inspect.getdoc(cls) or "").split("\n", 1)[0]


def load_command(commands: Mapping[str, type], argv: list[str], prog: str) -> tuple[str, Any]:
    """(command, its config) for `prog COMMAND [flags]`: the first word of argv picks the config
    class in `commands`, load_config builds it from the words after (--help: the class's
    docstring, then its flags). No command, or one not in `commands`: SystemExit with the usage."""
    if not argv or argv[0] not in commands:
        lines = [f"usage: {prog} {{{','.join(commands)}}} [--flag value ...] (--help per command)"]
        lines += [f"  {name}: {_first_line(cls)}" for name, cls in commands.items()]
        if argv and argv[0] in ("-h", "--help"):
            print("\n".join(lines))
            raise SystemExit(0)
        raise SystemExit("\n".join(lines))
    command, rest = argv[0], list(argv[1:])
    return command, load_config(commands[command], rest, description=inspect.getdoc(commands[command]) or "")
