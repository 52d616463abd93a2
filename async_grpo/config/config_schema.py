"""What a config class declares, walked once for every use: its keys and flags (a flattened
section's fields in its place, `flattened`), its positional field (`positional`), each field's
docstring and default; and a config written back out as a dict, a YAML file, the flags that
give it (`config_to_flags`) or the Markdown reference docs/config.md is made of. run_config.py
parses with these; its docstring says how the flags read.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal

import yaml

_FLATTEN = "run_config.flatten"  # dataclass field metadata key marking a flattened section
_POSITIONAL = "run_config.positional"  # dataclass field metadata key marking a positional field
_DERIVED = "run_config.derived"  # dataclass field metadata key marking a field the program fills


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


def derived(default: Any, source: str = "") -> Any:
    """A dataclass field the program fills from another config (e.g. the local launcher's copy of
    what the trainer's config says its workers need): no flag, no file key, not written back out,
    so the value has one source. `default` is a frozen value, used until the program sets it;
    `source` names where to set it, for the error a flag of the field's name gets."""
    return dataclasses.field(default_factory=lambda: default, metadata={_DERIVED: source or True})


def derived_flags(cls: type) -> dict[str, str]:
    """The flags a user might try for cls's derived fields (the field's name, or each field of a
    derived dataclass), each with where the value is set instead."""
    found: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        source = f.metadata.get(_DERIVED)
        if not source:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        names = [g.name for g in dataclasses.fields(default)] if dataclasses.is_dataclass(default) else [f.name]
        for name in names:
            found[f"--{name}"] = source if isinstance(source, str) else "another config"
    return found


def _is_input(f: dataclasses.Field) -> bool:
    """Whether a flag or file key gives the field (not init=False, not derived)."""
    return f.init and not f.metadata.get(_DERIVED)


def _is_flattened(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(_FLATTEN))


def _is_positional(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get(_POSITIONAL))


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if _is_input(f)}


def _field_default(f: dataclasses.Field) -> Any:
    """The field's default value (its factory called), or dataclasses.MISSING when required."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _flat_sections(cls: type) -> dict[str, tuple[type, Any]]:
    """{field name: (section class, default instance)} of cls's flattened sections."""
    types_by_name = _field_types(cls)
    return {f.name: (types_by_name[f.name], _field_default(f)) for f in dataclasses.fields(cls)
            if _is_input(f) and _is_flattened(f)}


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


@functools.cache  # parsing a class's source is most of a load's time; a class's docs never change
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (our configs document every field so), a
    field a base class declares (a shared option record, worker_options) included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    """The docstrings under the fields `cls`'s own body declares."""
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


def _leaves(cls: type, base: Any = None) -> Iterator[tuple[dataclasses.Field, Any, str, Any]]:
    """(field, annotated type, docstring, default) of cls's fields, a flattened section's fields
    in its place (their defaults: the section instance the embedding gives). A nested section's
    default is its class's defaults; `base` (a section instance) overrides every default."""
    docs = _field_docs(cls)
    types_by_name = _field_types(cls)
    for f in dataclasses.fields(cls):
        if not _is_input(f):
            continue
        default = getattr(base, f.name) if base is not None else _field_default(f)
        if _is_flattened(f):  # a required section (no default): its class's own defaults
            yield from _leaves(types_by_name[f.name], None if default is dataclasses.MISSING else default)
        else:
            yield f, types_by_name[f.name], docs.get(f.name, ""), default


def _flags(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted flag name, annotated type, help as --help ends it) of every flag of cls, nested
    sections' fields included, positional fields not (they have no flag)."""
    flags = []
    for f, tp, doc, default in _leaves(cls):
        if _is_dataclass_type(tp):
            flags += _flags(tp, f"{prefix}{f.name}.")
        elif not _is_positional(f):
            flags.append((f"{prefix}{f.name}", tp, f"{doc} {_default_hint(default)}".strip()))
    return flags


def _default_hint(default: Any) -> str:
    """How help ends: the default as Python writes it (tyro would print a list's items), or required."""
    return "(required)" if default is dataclasses.MISSING else f"(default: {default!r})"


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
    """How the reference and --help show a positional field: `RUN_DIRS ...` for a list."""
    return name.upper() + (" ..." if _is_list_type(tp) else "")


def _is_list_type(tp: Any) -> bool:
    """list[...] or tuple[...], also inside `| None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_list_type(arg) for arg in typing.get_args(tp) if arg is not type(None))
    return typing.get_origin(tp) in (list, tuple)


def _as_dict(config: Any) -> dict[str, Any]:
    """dataclasses.asdict, with a flattened section's fields in the section's place."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not _is_input(f):
            continue
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
    if isinstance(value, dict):
        return [json.dumps(value)]
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
    # The positional field's words lead: a list flag before them would take them as its own.
    value = _as_dict(config)[positional]
    return [str(v) for v in value] + words if isinstance(value, (list, tuple)) else [str(value)] + words


def _to_flags(config: Any, baseline: Any, prefix: str) -> list[str]:
    words: list[str] = []
    for f in dataclasses.fields(config):
        if not _is_input(f) or _is_positional(f):
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
