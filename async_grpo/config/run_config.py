"""Typed run configuration: nested frozen dataclasses filled from a YAML/TOML file and CLI flags.

Every field of a config dataclass becomes a flag: top-level fields as `--name`, fields of a
nested section as `--section.name`. Precedence: defaults < config file < CLI flags. Unknown keys
(in the file or on the command line) are errors that name the key, and each section's own
`__post_init__` validation runs on the final values. A bool flag alone means true
(`--enforce_eager`, or `--enforce_eager false`); a list field takes one or more values
(`--seeds 0 1 2`, or JSON: `--seeds "[0, 1, 2]"`).

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

import argparse
import ast
import copy
import dataclasses
import difflib
import inspect
import json
import sys
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, NoReturn, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or flag that does not fit the config's schema."""


CONFIG_ERROR_EXIT = 2
"""Exit status of a command line or config that cannot be used (argparse's, for the same kind of error)."""


def exit_config_error(program: str, error: Exception | str) -> NoReturn:
    """`program: error` as one line on stderr, then exit CONFIG_ERROR_EXIT: no traceback."""
    print(f"{program}: {error}", file=sys.stderr, flush=True)
    raise SystemExit(CONFIG_ERROR_EXIT)


_FLATTEN = "run_config.flatten"  # dataclass field metadata key marking a flattened section
_POSITIONAL = "run_config.positional"  # dataclass field metadata key marking a positional field


def flattened(default: Any) -> Any:
    """A dataclass field embedding the section `default` (a frozen config dataclass instance),
    whose fields are top-level flags and file keys of the embedding config (module docstring).
    Given the section's class instead, the field is required and its fields take the class's
    defaults (its required fields: required flags)."""
    if not dataclasses.is_dataclass(default):
        raise TypeError(f"flattened() needs a config dataclass instance or class, got {default!r}")
    if isinstance(default, type):
        return dataclasses.field(metadata={_FLATTEN: True})
    return dataclasses.field(default_factory=lambda: default, metadata={_FLATTEN: True})


def positional() -> Any:
    """A required dataclass field given on the command line without a flag: a list field takes
    one or more words, any other field one. A config has at most one (module docstring)."""
    return dataclasses.field(metadata={_POSITIONAL: True})


def _is_flattened(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(_FLATTEN))


def _is_positional(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(_POSITIONAL))


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a value from YAML/TOML/CLI text to the field's annotated type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: {value!r} fits none of {tp}: {'; '.join(errors)}")
    if origin is Literal:
        for choice in args:
            if value == choice or str(value) == str(choice):
                return choice
        raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
    if origin in (list, tuple):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and value[0].startswith("["):
            value = value[0]  # one JSON list given to a multi-value flag
        try:
            items = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: expected a list, got {value!r} ({exc})") from None
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        converted = [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(items)]
        return tuple(converted) if origin is tuple else converted
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float, str):
        try:
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    return value


def _flat_sections(cls: type) -> dict[str, tuple[type, Any]]:
    """{field name: (section class, default instance)} of cls's flattened sections."""
    types_by_name = _field_types(cls)
    return {f.name: (types_by_name[f.name], _field_default(f)) for f in dataclasses.fields(cls)
            if f.init and _is_flattened(f)}


def _keys(cls: type) -> list[str]:
    """The keys cls takes in a file or as flags: its own fields, a flattened section's fields in
    its place. TypeError when two of them share a name (a flag would mean two things)."""
    keys: list[str] = []
    sections = _flat_sections(cls)
    for name in _field_types(cls):
        keys += _keys(sections[name][0]) if name in sections else [name]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise TypeError(f"{cls.__name__}: flattened sections repeat the key(s) {repeated}")
    return keys


def _build(cls: type[T], values: dict[str, Any], where: str, base: Any = None) -> T:
    """Instantiate a (possibly nested) config dataclass from a dict of raw values; fields that
    `values` leaves out take `base`'s values when given, else their defaults."""
    types_by_name = _field_types(cls)
    unknown = set(values) - set(_keys(cls))
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {sorted(unknown)}; known: {sorted(_keys(cls))}")
    kwargs: dict[str, Any] = {}
    for name, (section_cls, default) in _flat_sections(cls).items():
        own = {key: values[key] for key in _keys(section_cls) if key in values}
        section_base = getattr(base, name) if base is not None else default
        required = section_base is dataclasses.MISSING
        if own or required:  # at the embedding's level: errors name the keys as the user wrote them
            kwargs[name] = _build(section_cls, own, where, base=None if required else section_base)
    for name, tp in types_by_name.items():
        if name not in values or name in kwargs:
            continue
        key = f"{where}.{name}" if where else name
        if _is_dataclass_type(tp):
            section = values[name]
            if not isinstance(section, dict):
                raise ConfigError(f"{key}: expected a section (mapping), got {section!r}")
            kwargs[name] = _build(tp, section, key)
        else:
            kwargs[name] = _coerce(values[name], tp, key)
    if base is not None:
        kwargs = {name: kwargs[name] if name in kwargs else getattr(base, name) for name in types_by_name}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise ConfigError(f"--{dotted}: {key} is not a section")
    target[keys[-1]] = value


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (our configs document every field so)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source (e.g. built in a REPL): flags without help
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for field_node, doc_node in zip(body, body[1:]):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                and isinstance(doc_node, ast.Expr) and isinstance(doc_node.value, ast.Constant)
                and isinstance(doc_node.value.value, str)):
            docs[field_node.target.id] = " ".join(doc_node.value.value.split())
    return docs


def _field_default(f: dataclasses.Field) -> Any:
    """The field's default value (its factory called), or dataclasses.MISSING when required."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _leaves(cls: type, base: Any = None) -> Iterator[tuple[dataclasses.Field, Any, str, Any]]:
    """(field, annotated type, docstring, default) of cls's fields, a flattened section's fields
    in its place (their defaults: the section instance the embedding gives). A nested section's
    default is its class's defaults; `base` (a section instance) overrides every default."""
    docs = _field_docs(cls)
    types_by_name = _field_types(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = getattr(base, f.name) if base is not None else _field_default(f)
        if _is_flattened(f):  # a required section (no default): its class's own defaults
            yield from _leaves(types_by_name[f.name], None if default is dataclasses.MISSING else default)
        else:
            yield f, types_by_name[f.name], docs.get(f.name, ""), default


def _flags(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted flag name, annotated type, help) of every leaf field, nested sections flattened."""
    _keys(cls)  # refuse repeated keys before building a parser
    flags = []
    for f, tp, doc, default in _leaves(cls):
        dotted = f"{prefix}{f.name}"
        if _is_dataclass_type(tp):
            flags.extend(_flags(tp, dotted + "."))
            continue
        shown = "required" if default is dataclasses.MISSING else f"default: {default!r}"
        # argparse formats help with %: escape it so docs may mention percentages.
        flags.append((dotted, tp, f"{doc} ({shown})".strip().replace("%", "%%")))
    return flags


def _positional_name(cls: type) -> str | None:
    """The name of cls's positional field (flattened sections' included), or None; TypeError when
    it has several (which words would go where is then unclear) or one inside a nested section."""
    names = _positional_fields(cls)
    if len(names) > 1 or any("." in name for name in names):
        raise TypeError(f"{cls.__name__}: one positional field at most, at the top level; got {names}")
    return names[0] if names else None


def _positional_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every positional field of cls, nested sections' included."""
    names = []
    for f, tp, _, _ in _leaves(cls):
        if _is_positional(f):
            names.append(f"{prefix}{f.name}")
        if _is_dataclass_type(tp):
            names += _positional_fields(tp, f"{prefix}{f.name}.")
    return names


def _positional_label(name: str, tp: Any) -> str:
    """How the reference shows a positional field (argparse writes --help's): `RUN_DIRS ...` for a list."""
    return name.upper() + (" ..." if _is_list_type(tp) else "")


def _is_list_type(tp: Any) -> bool:
    """list[...] or tuple[...], also inside `| None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_list_type(arg) for arg in typing.get_args(tp) if arg is not type(None))
    return typing.get_origin(tp) in (list, tuple)


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(flags before the first `--`, everything after it): a launcher's own flags and its child's."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


class _OneLineErrors(argparse.ArgumentParser):
    """argparse with its command-line errors as one line (no usage block): an unknown flag names
    the closest known ones, as a user who misspelt one expects."""

    def error(self, message: str) -> NoReturn:
        unknown = message.partition("unrecognized arguments: ")[2].split()
        flags = [word for word in unknown if word.startswith("-")]
        if flags:
            known = [option for action in self._actions for option in action.option_strings]
            hints = []
            for flag in flags:
                close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=2)
                hints.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
            message = f"unknown flag{'s' if len(flags) > 1 else ''} {', '.join(hints)}"
        exit_config_error(self.prog, f"{message}; --help lists the flags")


def load_config(cls: type[T], argv: list[str], description: str = "") -> T:
    """Build `cls` from defaults, then `--config FILE` (YAML or TOML), then `--key value` flags."""
    parser = _OneLineErrors(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML or TOML file with config values")
    positional = _positional_name(cls)
    for dotted, tp, help_text in _flags(cls):
        if dotted == positional:  # absent from the command line: a file may give it
            parser.add_argument(dotted, default=argparse.SUPPRESS, metavar=dotted.upper(),
                                nargs="*" if _is_list_type(tp) else "?", help=help_text)
        elif tp is bool:
            parser.add_argument(f"--{dotted}", dest=dotted, default=argparse.SUPPRESS, metavar="BOOL",
                                nargs="?", const="true", help=help_text)
        elif _is_list_type(tp):
            parser.add_argument(f"--{dotted}", dest=dotted, default=argparse.SUPPRESS, metavar="VALUE", nargs="+",
                                help=help_text)
        else:
            parser.add_argument(f"--{dotted}", dest=dotted, default=argparse.SUPPRESS, metavar="VALUE",
                                help=help_text)
    args = vars(parser.parse_args(argv))
    file_path = args.pop("config", None)
    values = _read_file(file_path) if file_path else {}
    for dotted, raw in args.items():
        _set_dotted(values, dotted, raw)
    return _build(cls, values, "")


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


def _as_dict(config: Any) -> dict[str, Any]:
    """dataclasses.asdict, with a flattened section's fields in the section's place."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _is_flattened(f):
            values.update(_as_dict(value))
        elif dataclasses.is_dataclass(value):
            values[f.name] = _as_dict(value)
        else:
            values[f.name] = copy.deepcopy(value)
    return values


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples as lists), for saving and logging; flattened
    sections' fields at the level of the config that embeds them, as in a file."""
    return json.loads(json.dumps(_as_dict(config)))


def _flag_words(value: Any) -> list[str]:
    """A value as the words after its flag: load_config reads them back to the same value."""
    if value is None:
        return ["none"]
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, (list, tuple)):
        return [json.dumps(list(value))]
    return [str(value)]


def config_to_flags(config: Any, baseline: Any = None) -> list[str]:
    """The flags that give `config` to a program loading its class: one `--name value` per field
    whose value differs from `baseline`'s (default: the class's own defaults; a field without a
    default always), in field order; a bool that is true as the bare flag. A nested section's
    flags are `--section.name`; a flattened section's are its fields' own."""
    words = _to_flags(config, baseline, "")
    positional = _positional_name(type(config))
    if positional is None:
        return words
    # The positional field's words lead: argparse takes them before the first flag.
    value = _as_dict(config)[positional]
    return [str(v) for v in value] + words if isinstance(value, (list, tuple)) else [str(value)] + words


def _to_flags(config: Any, baseline: Any, prefix: str) -> list[str]:
    words: list[str] = []
    for f in dataclasses.fields(config):
        if not f.init or _is_positional(f):
            continue
        value = getattr(config, f.name)
        default = getattr(baseline, f.name) if baseline is not None else _field_default(f)
        if dataclasses.is_dataclass(value):
            section_base = default if dataclasses.is_dataclass(default) else None
            words += _to_flags(value, section_base, prefix if _is_flattened(f) else f"{prefix}{f.name}.")
        elif default is dataclasses.MISSING or value != default:
            flag = f"--{prefix}{f.name}"
            words += [flag] if value is True else [flag, *_flag_words(value)]
    return words


def save_config(config: Any, path: Path) -> None:
    """Write the resolved config as YAML (loadable again with --config)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def _type_name(tp: Any) -> str:
    """A type as a reader writes it: `int`, `str | None`, `list[str]`, `'a' | 'b'`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(arg) for arg in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(arg) for arg in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "None"
    if tp is Ellipsis:
        return "..."
    return getattr(tp, "__name__", str(tp))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_reference(cls: type, prefix: str = "") -> list[str]:
    """Markdown for `cls` and each nested section: a heading, the class's docstring, and a table
    of its fields (flag, type, default, the field's docstring). docs/config.md is made of these
    (scripts/config_docs.py), so the reference cannot drift from the classes."""
    heading = f"`{prefix.rstrip('.')}` ({cls.__name__})" if prefix else cls.__name__
    summary = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
    lines = [f"### {heading}", "", summary, "", "| flag | type | default | meaning |", "|---|---|---|---|"]
    sections: list[tuple[str, type]] = []
    for f, tp, doc, value in _leaves(cls):
        if _is_dataclass_type(tp):
            sections.append((f"{prefix}{f.name}.", tp))
            lines.append(f"| `--{prefix}{f.name}.*` | section | | {_cell(doc)} (below) |")
            continue
        default = "required" if value is dataclasses.MISSING else f"`{value!r}`"
        flag = f"`{_positional_label(f.name, tp)}` (positional)" if _is_positional(f) else f"`--{prefix}{f.name}`"
        lines.append(f"| {flag} | `{_cell(_type_name(tp))}` | {_cell(default)} | {_cell(doc)} |")
    lines.append("")
    for section_prefix, section_cls in sections:
        lines += config_reference(section_cls, section_prefix)
    return lines
