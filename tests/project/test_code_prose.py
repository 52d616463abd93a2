"""Code prose stays a reference, not a diary (figures and dates live in benchmarks/RESULTS.md and
git), read from the source and the config classes, nothing run:

- no date in the package or the spine files: a figure that justifies a default names the
  RESULTS.md section that holds it, and that section carries the date;
- every entry point's config field has help (what `--help` and docs/config.md print) of at most
  MAX_FIELD_HELP_CHARS characters.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator
from pathlib import Path

from async_grpo.config.run_config import _field_docs
from support.paths import REPO_ROOT

SPINE_FILES = ("trainer_core.py", "worker_dispatcher.py", "vllm_worker.py", "logprob_worker.py", "vllm_registry.py",
               "vllm_experience_batcher.py", "grpo_loss.py", "sample_processing_utils.py", "setup_model.py",
               "local_cluster.py")
_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December"
           "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
DATE = re.compile(r"\b20\d{2}-[01]\d-[0-3]\d\b"  # 2026-11-21
                  rf"|\b(?:{_MONTHS})\.? [0-3]?\d(?:st|nd|rd|th)?,? 20\d{{2}}\b"  # November 21, 2026
                  rf"|\b[0-3]?\d (?:{_MONTHS})\.? 20\d{{2}}\b")  # 21 November 2026
# Long enough for what a field does, its unit and when to change it; past this, help turns into the
# reasoning behind the default, which `--help` prints on every flag and which goes stale. That
# belongs in a comment above the field, the class docstring or the RESULTS.md section it cites.
MAX_FIELD_HELP_CHARS = 300


def _code_files() -> list[Path]:
    return sorted((REPO_ROOT / "async_grpo").rglob("*.py")) + [REPO_ROOT / name for name in SPINE_FILES]


def _entry_points() -> list[type]:
    """The classes scripts/config_docs.py documents (its render())."""
    from async_grpo.launch.status_command import StatusConfig
    from async_grpo.trainer.config import TrainerConfig
    from local_cluster import LocalClusterConfig
    from worker_dispatcher import DispatcherConfig
    return [TrainerConfig, LocalClusterConfig, DispatcherConfig, StatusConfig]


def _dataclasses_in(tp: typing.Any) -> Iterator[type]:
    """The dataclasses a field's annotation names (itself, or inside Optional, list, ...)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        yield tp
    for arg in typing.get_args(tp):
        yield from _dataclasses_in(arg)


def _field_helps() -> dict[str, str]:
    """'Class.field' -> its help, for every entry point and every section below it."""
    helps: dict[str, str] = {}
    seen: set[type] = set()
    pending = _entry_points()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        docs: dict[str, str] = {}
        for base in reversed(cls.__mro__):  # inherited fields carry their docstrings in their base
            if dataclasses.is_dataclass(base):
                docs.update(_field_docs(base))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                helps[f"{cls.__name__}.{f.name}"] = docs.get(f.name, "")
                pending.extend(_dataclasses_in(hints[f.name]))
    return helps


def test_no_dates_in_code() -> None:
    found = [f"{path.relative_to(REPO_ROOT)}:{number}: {match.group(0)}"
             for path in _code_files()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             for match in DATE.finditer(line)]
    assert not found, ("dates in code (cite the benchmarks/RESULTS.md section instead; git keeps the history):\n"
                       + "\n".join(found))


def test_date_pattern() -> None:
    for text in ("on 2026-11-21", "November 21, 2026", "Nov 21 2026", "21 November 2026"):
        assert DATE.search(text), text
    for text in ("steps 50-300", "0.23-0.25 s", "Ray 2.60", "issue 58", "seeds 0-2"):
        assert not DATE.search(text), text


def test_entry_points_are_walked() -> None:
    helps = _field_helps()
    assert len(helps) > 100, len(helps)
    assert all(any(name.startswith(f"{cls.__name__}.") for name in helps) for cls in _entry_points())


def test_field_help_is_short() -> None:
    long = {name: len(text) for name, text in _field_helps().items() if len(text) > MAX_FIELD_HELP_CHARS}
    assert not long, (f"{len(long)} config field(s) with help over {MAX_FIELD_HELP_CHARS} characters (what it does, "
                      "its unit, when to change it; reasons in a comment above the field):\n"
                      + "\n".join(f"{name}: {n}" for name, n in sorted(long.items())))
