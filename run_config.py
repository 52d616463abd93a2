"""Typed run configuration: nested frozen dataclasses filled from a YAML/TOML file and CLI flags.

Every field of a config dataclass becomes a flag: top-level fields as `--name`, fields of a
nested section as `--section.name`. Precedence: defaults < config file < CLI flags. Unknown keys
(in the file or on the command line) are errors that name the key, and each section's own
`__post_init__` validation runs on the final values. A bool flag alone means true
(`--enforce_eager`, or `--enforce_eager false`); a list field takes one or more values
(`--seeds 0 1 2`, or JSON: `--seeds "[0, 1, 2]"`).

Every entry point of the project parses its command line this way, so defaults live in one
place, the config class:

    cfg = load_config(TrainerConfig, ["--config", "demo.yaml", "--optim.lr", "3e-4"])
    save_config(cfg, run_dir / "config.yaml")
    own, rest = split_passthrough(sys.argv[1:])  # launchers: flags after `--` go to a child
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or flag that does not fit the config's schema."""


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


def _build(cls: type[T], values: dict[str, Any], where: str) -> T:
    """Instantiate a (possibly nested) config dataclass from a dict of raw values."""
    types_by_name = _field_types(cls)
    unknown = set(values) - set(types_by_name)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {sorted(unknown)}; known: {sorted(types_by_name)}")
    kwargs: dict[str, Any] = {}
    for name, tp in types_by_name.items():
        if name not in values:
            continue
        key = f"{where}.{name}" if where else name
        if _is_dataclass_type(tp):
            section = values[name]
            if not isinstance(section, dict):
                raise ConfigError(f"{key}: expected a section (mapping), got {section!r}")
            kwargs[name] = _build(tp, section, key)
        else:
            kwargs[name] = _coerce(values[name], tp, key)
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


def _flags(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted flag name, annotated type, help) of every leaf field, nested sections flattened."""
    flags = []
    docs = _field_docs(cls)
    defaults = {f.name: _field_default(f) for f in dataclasses.fields(cls)}
    for name, tp in _field_types(cls).items():
        dotted = f"{prefix}{name}"
        if _is_dataclass_type(tp):
            flags.extend(_flags(tp, dotted + "."))
            continue
        default = defaults.get(name, dataclasses.MISSING)
        shown = "required" if default is dataclasses.MISSING else f"default: {default!r}"
        # argparse formats help with %: escape it so docs may mention percentages.
        flags.append((dotted, tp, f"{docs.get(name, '')} ({shown})".strip().replace("%", "%%")))
    return flags


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


def load_config(cls: type[T], argv: list[str], description: str = "") -> T:
    """Build `cls` from defaults, then `--config FILE` (YAML or TOML), then `--key value` flags."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML or TOML file with config values")
    for dotted, tp, help_text in _flags(cls):
        if tp is bool:
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


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples as lists), for saving and logging."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


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
    docs = _field_docs(cls)
    heading = f"`{prefix.rstrip('.')}` ({cls.__name__})" if prefix else cls.__name__
    summary = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
    lines = [f"### {heading}", "", summary, "", "| flag | type | default | meaning |", "|---|---|---|---|"]
    sections: list[tuple[str, type]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = _field_types(cls)[f.name]
        if _is_dataclass_type(tp):
            sections.append((f"{prefix}{f.name}.", tp))
            lines.append(f"| `--{prefix}{f.name}.*` | section | | {_cell(docs.get(f.name, ''))} (below) |")
            continue
        value = _field_default(f)
        default = "required" if value is dataclasses.MISSING else f"`{value!r}`"
        lines.append(f"| `--{prefix}{f.name}` | `{_cell(_type_name(tp))}` | {_cell(default)} | "
                     f"{_cell(docs.get(f.name, ''))} |")
    lines.append("")
    for section_prefix, section_cls in sections:
        lines += config_reference(section_cls, section_prefix)
    return lines
