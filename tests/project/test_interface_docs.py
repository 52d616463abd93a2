"""docs/interfaces.md's signature blocks are generated from the code (scripts/interface_docs.py):
they must be current, and the prose must not repeat an argument list a block shows."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import sys
import types
from dataclasses import dataclass, field

import pytest

from support.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "interfaces.md"


def _script():
    spec = importlib.util.spec_from_file_location("interface_docs", REPO_ROOT / "scripts" / "interface_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def regenerated() -> tuple[str, str]:
    """(docs/interfaces.md, the same regenerated), made once per module. A module fixture is set up
    before the fast tier's per-test guard on child processes: vLLM probes its platform once, on
    first import, with `uname -p` (as when the test modules that import vllm_worker are collected)."""
    text = DOC.read_text()
    return text, _script().render(text)


def test_docs_interfaces_md_is_current(regenerated: tuple[str, str]) -> None:
    text, fresh = regenerated
    assert text == fresh, "docs/interfaces.md is stale: run .venv/bin/python scripts/interface_docs.py"


def test_the_prose_names_what_the_blocks_show_without_argument_lists(regenerated: tuple[str, str]) -> None:
    assert _script().prose_problems(regenerated[1]) == []


@dataclass(kw_only=True, frozen=True)
class _Engine:
    seqs: int = 128
    dtype: str = "auto"


class _Kind(str, enum.Enum):
    GEN = "gen"
    LOGPROB = "logprob"


class _Gone(RuntimeError):
    pass


@dataclass(kw_only=True, frozen=True)
class _WorkerConfig:
    model_path: str
    engine: _Engine = field(default_factory=lambda: _Engine(seqs=256))
    kinds: list[str] = field(default_factory=list)
    kind: _Kind = _Kind.GEN


class _Worker:
    def __init__(self, name: str, config: _WorkerConfig, *, _ray_trace_ctx: object = None) -> None:
        self.name = name

    async def generate(self, prompt: str, n: int = 1) -> list[str]:
        return [prompt] * n

    def health(self) -> bool:
        return True

    def _private(self) -> None:
        """Not part of the contract."""


def _long(first_argument_with_a_long_name: int, second_argument_with_a_long_name: str,
          *, third_argument_with_a_long_name: float = 0.5) -> dict[str, int]:
    return {}


LIMIT = 4


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> str:
    module = types.ModuleType("fake_interfaces")
    for obj in (_Engine, _Kind, _Gone, _WorkerConfig, _Worker, _long):
        monkeypatch.setattr(obj, "__module__", "fake_interfaces")
        setattr(module, obj.__name__, obj)
    module.LIMIT = LIMIT
    module.borrowed = dataclasses.replace  # defined elsewhere: a block must name its home
    monkeypatch.setitem(sys.modules, "fake_interfaces", module)
    return "fake_interfaces"


def _doc(spec: str, prose: str = "") -> str:
    return f"# t\n\n<!-- signatures\n{spec}\n-->\n```python\nstale\n```\n<!-- /signatures -->\n\n{prose}\n"


def test_a_block_shows_constructors_methods_enums_errors_and_constants(fake_module: str) -> None:
    script = _script()
    doc = script.render(_doc(f"{fake_module}: LIMIT, _Kind, _Gone, _WorkerConfig, _Worker, _Worker.*, _long"))
    block = doc.split("```python\n")[1].split("```")[0]
    assert block.splitlines() == [
        "# fake_interfaces.py",
        "LIMIT = 4",
        "class _Kind(str, Enum): GEN, LOGPROB",
        "class _Gone(RuntimeError)",
        # A config default by the fields it changes; a factory's value; an enum member by name.
        "_WorkerConfig(",  # past the width: the parameters packed under the name
        "    *, model_path: str, engine: _Engine = _Engine(seqs=256), kinds: list[str] = [], kind: _Kind = _Kind.GEN,",
        ")",
        "_Worker(name: str, config: _WorkerConfig)",  # Ray's tracing keyword left out
        "async _Worker.generate(prompt: str, n: int = 1) -> list[str]",
        "_Worker.health() -> bool",
        "_long(",
        "    first_argument_with_a_long_name: int, second_argument_with_a_long_name: str, *,",
        "    third_argument_with_a_long_name: float = 0.5,",
        ") -> dict[str, int]",
    ]
    assert script.render(doc) == doc


def test_the_prose_may_name_a_call_but_not_give_its_arguments(fake_module: str) -> None:
    script = _script()
    doc = script.render(_doc(f"{fake_module}: _Worker.*, _long",
                             "`health()` and `_long`; `generate(prompt)`, `generate()`, `other(x)`"))
    assert script.prose_problems(doc) == [
        "`generate(prompt)` repeats or guesses the signature a block shows: write `generate`",
        "`generate()` repeats or guesses the signature a block shows: write `generate`",
    ]


def test_a_name_the_module_does_not_define_fails_naming_where_it_is(fake_module: str) -> None:
    script = _script()
    with pytest.raises(script.DocError, match="fake_interfaces:missing, which fake_interfaces does not define"):
        script.render(_doc(f"{fake_module}: missing"))
    with pytest.raises(script.DocError, match="fake_interfaces:borrowed, which is defined in dataclasses: name it"):
        script.render(_doc(f"{fake_module}: borrowed"))
    with pytest.raises(script.DocError, match="_Worker has no attribute 'stop'"):
        script.render(_doc(f"{fake_module}: _Worker.stop"))
