"""Write the signature blocks of docs/interfaces.md from the code itself (inspect), so the contract
between files cannot drift from the files.

    .venv/bin/python scripts/interface_docs.py           # rewrite the blocks of docs/interfaces.md
    .venv/bin/python scripts/interface_docs.py --check   # exit 1 if a block is stale or prose repeats a signature

A block is a comment naming what to show, one module a line (the module that defines each
name), then the generated code block, up to its end marker:

    <!-- signatures
    vllm_registry: RegistryConfig, get_or_create_registry, RegistryActor.*
    async_grpo.routing.worker_lifecycle: WorkerState
    -->
    ```python
    ...generated...
    ```
    <!-- /signatures -->

A name is a constant (`NAME = value`), a function (its signature), a class (its constructor; an Enum
its members, an exception its base), `Class.method` (one method) or `Class.*` (every public method
defined on the class: an actor's remote calls). The prose around the blocks names these without
argument lists (`submit`, `health()` for one taking none): an argument list in the prose for a name
a block shows is reported, since it would drift. tests/project/test_interface_docs.py runs the
check, so a changed signature fails the tests until this is rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

DOC = REPO_ROOT / "docs" / "interfaces.md"
BLOCK = re.compile(r"(<!-- signatures\n(?P<spec>.*?)-->\n)```python\n.*?```\n(<!-- /signatures -->)", re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# An inline code span that reads as a call: an optional `async `, a dotted name, an argument list.
CALL = re.compile(r"^(?:async )?(?P<name>[A-Za-z_][\w.]*)\((?P<args>.*)\)")
WIDTH = 110  # a signature longer than this is wrapped, its parameters packed under its name
INDENT = "    "
# Ray's tracing adds this keyword to every actor method; no caller passes it.
RAY_PARAM_PREFIX = "_ray_"


class DocError(ValueError):
    """A block names something the code does not define where it says, or prose repeats a signature."""


def _annotation(annotation: Any) -> str:
    """As written in the code (our modules postpone annotations, so they are strings already)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _value(value: Any) -> str:
    """A default or constant as a reader would write it: a config instance by its non-default fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = [f"{f.name}={_value(getattr(value, f.name))}" for f in dataclasses.fields(value)
                   if f.init and _differs(_field_default(f), getattr(value, f.name))]
        return f"{type(value).__name__}({', '.join(changed)})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__qualname__
    return repr(value)


class _Call:
    """A default made by calling a named function (time.monotonic): shown as the call, since its
    value differs from run to run."""

    def __init__(self, function: Any) -> None:
        self.text = f"{getattr(function, '__name__', repr(function))}()"

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Call) and other.text == self.text


def _differs(default: Any, value: Any) -> bool:
    """Whether a config instance's field is worth showing: not its default (a call's value unknown)."""
    return not isinstance(default, _Call) and default != value


def _field_default(f: dataclasses.Field) -> Any:
    """The field's default; a factory that is a class or a lambda (a config section, an empty
    list) called for its value, any other shown as its call."""
    factory = f.default_factory
    if factory is dataclasses.MISSING:
        return f.default
    if inspect.isclass(factory) or getattr(factory, "__name__", "") == "<lambda>":
        return factory()
    return _Call(factory)


def _dataclass_defaults(cls: type) -> dict[str, Any]:
    """Each field's default (inspect shows `<factory>` for a factory's)."""
    return {f.name: _field_default(f) for f in dataclasses.fields(cls) if f.init}


def _params(signature: inspect.Signature, defaults: dict[str, Any] | None = None) -> list[str]:
    """The parameters as in a def, `*` and `/` included; `self` and Ray's own parameters left out."""
    words: list[str] = []
    kinds = inspect.Parameter
    params = [p for p in signature.parameters.values()
              if p.name != "self" and not p.name.startswith(RAY_PARAM_PREFIX)]
    for i, p in enumerate(params):
        if p.kind is kinds.KEYWORD_ONLY and not any(q.kind in (kinds.KEYWORD_ONLY, kinds.VAR_POSITIONAL)
                                                    for q in params[:i]):
            words.append("*")
        text = {kinds.VAR_POSITIONAL: "*", kinds.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        default = (defaults or {}).get(p.name, p.default)
        if default is not p.empty and default is not dataclasses.MISSING:
            text += (" = " if p.annotation is not p.empty else "=") + _value(default)
        words.append(text)
        last_positional_only = i + 1 == len(params) or params[i + 1].kind is not kinds.POSITIONAL_ONLY
        if p.kind is kinds.POSITIONAL_ONLY and last_positional_only:
            words.append("/")
    return words


def _signature_line(head: str, params: list[str], returns: str = "") -> str:
    """`head(params) -> returns` on one line, or wrapped with the parameters packed under it."""
    tail = f" -> {returns}" if returns else ""
    line = f"{head}({', '.join(params)}){tail}"
    if len(line) <= WIDTH:
        return line
    rows, row = [], ""
    for word in params:
        candidate = f"{row} {word}," if row else f"{INDENT}{word},"
        if row and len(candidate) > WIDTH:
            rows.append(row)
            candidate = f"{INDENT}{word},"
        row = candidate
    rows.append(row)
    return "\n".join([f"{head}(", *rows, f"){tail}"])


def _function(head: str, function: Any) -> str:
    signature = inspect.signature(function)
    returns = "" if signature.return_annotation is signature.empty else _annotation(signature.return_annotation)
    prefix = "async " if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function) else ""
    return _signature_line(prefix + head, _params(signature), returns)


def _plain_class(cls: Any) -> type:
    """A Ray actor class's own class (ray.remote wraps it), else cls."""
    metadata = getattr(cls, "__ray_metadata__", None)
    return metadata.modified_class.__bases__[0] if metadata is not None else cls


def _class(name: str, cls: type) -> str:
    if issubclass(cls, enum.Enum):
        return f"class {name}({_bases(cls)}): {', '.join(member.name for member in cls)}"
    if issubclass(cls, BaseException):
        return f"class {name}({_bases(cls)})"
    if dataclasses.is_dataclass(cls):
        return _signature_line(name, _params(inspect.signature(cls), _dataclass_defaults(cls)))
    return _signature_line(name, _params(inspect.signature(cls.__init__)))


def _bases(cls: type) -> str:
    return ", ".join(base.__name__ for base in cls.__bases__)


def _public_methods(cls: type) -> list[str]:
    return [name for name, member in vars(cls).items() if not name.startswith("_")
            and (inspect.isfunction(member) or isinstance(member, (property, staticmethod, classmethod)))]


def _member(cls: type, name: str, method: str) -> str:
    member = inspect.getattr_static(cls, method, None)
    if member is None:
        raise DocError(f"{name} has no attribute {method!r}")
    if isinstance(member, property):
        returns = inspect.signature(member.fget).return_annotation
        return f"{name}.{method}: {_annotation(returns)}  # property"
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    return _function(f"{name}.{method}", member)


def _resolve(module_name: str, name: str) -> Any:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DocError(f"{DOC.name} names module {module_name}, which does not import: {exc}") from None
    if not hasattr(module, name):
        raise DocError(f"{DOC.name} names {module_name}:{name}, which {module_name} does not define")
    obj = getattr(module, name)
    home = getattr(obj, "__module__", module_name) if callable(obj) else module_name  # a constant has no home
    if home != module_name:
        raise DocError(f"{DOC.name} names {module_name}:{name}, which is defined in {home}: name it there")
    return obj


def render_entry(module_name: str, entry: str) -> Iterator[str]:
    """The lines one name of a block gives."""
    name, _, method = entry.partition(".")
    obj = _resolve(module_name, name)
    if method:
        cls = _plain_class(obj)
        methods = _public_methods(cls) if method == "*" else [method]
        for one in methods:
            yield _member(cls, name, one)
    elif inspect.isclass(obj) or hasattr(obj, "__ray_metadata__"):
        yield _class(name, _plain_class(obj))
    elif callable(obj):
        yield _function(name, obj)
    else:
        yield f"{name} = {_value(obj)}"


def _spec_lines(spec: str) -> Iterator[tuple[str, list[str]]]:
    """(module, names) per line of a block's comment."""
    for line in spec.strip().splitlines():
        module_name, colon, names = line.partition(":")
        if not colon:
            raise DocError(f"{DOC.name}: a signatures line is 'module: name, name', got {line!r}")
        yield module_name.strip(), [n.strip() for n in names.split(",") if n.strip()]


def render_block(spec: str) -> str:
    lines: list[str] = []
    for module_name, names in _spec_lines(spec):
        if lines:
            lines.append("")
        lines.append(f"# {module_name.replace('.', '/')}.py")
        for entry in names:
            lines.extend(render_entry(module_name, entry))
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    """The document with every signature block regenerated."""
    return BLOCK.sub(lambda m: f"{m.group(1)}```python\n{render_block(m.group('spec'))}```\n{m.group(3)}", text)


def shown_names(text: str) -> dict[str, bool]:
    """Every name a block shows (functions and methods by their last part), and whether it takes
    arguments: prose may write `name()` only for one that takes none."""
    shown: dict[str, bool] = {}
    for match in BLOCK.finditer(text):
        for module_name, names in _spec_lines(match.group("spec")):
            for entry in names:
                for line in render_entry(module_name, entry):
                    head = CALL.match(line.replace("\n", " ").removeprefix("class "))
                    if head is not None:
                        name = head.group("name").split(".")[-1]
                        shown[name] = shown.get(name, False) or bool(head.group("args").strip())
    return shown


def prose_problems(text: str) -> list[str]:
    """Inline code in the prose that gives an argument list for a name a block shows."""
    prose = BLOCK.sub("", text)
    shown = shown_names(text)
    problems = []
    for span in INLINE_CODE.findall(prose):
        call = CALL.match(span)
        if call is None:
            continue
        name = call.group("name").split(".")[-1]
        if name in shown and (call.group("args").strip() or shown[name]):
            problems.append(f"`{span}` repeats or guesses the signature a block shows: write `{call.group('name')}`")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/interfaces.md differs from the code")
    args = parser.parse_args()
    text = DOC.read_text()
    try:
        fresh = render(text)
        problems = prose_problems(fresh)
    except DocError as exc:
        print(f"scripts/interface_docs.py: {exc}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"{DOC.relative_to(REPO_ROOT)}: {problem}", file=sys.stderr)
    if args.check:
        if fresh != text:
            print(f"{DOC.relative_to(REPO_ROOT)} is stale: run python scripts/interface_docs.py", file=sys.stderr)
            return 1
        return 1 if problems else 0
    if fresh != text:
        DOC.write_text(fresh)
        print(f"wrote {DOC.relative_to(REPO_ROOT)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
