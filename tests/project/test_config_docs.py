"""docs/config.md is generated from the config classes (scripts/config_docs.py): it must be
current, and it must name every flag the entry points accept."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from async_grpo.config.run_config import _flags, config_reference
from support.paths import REPO_ROOT


def _script():
    spec = importlib.util.spec_from_file_location("config_docs", REPO_ROOT / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_current() -> None:
    assert (REPO_ROOT / "docs" / "config.md").read_text() == _script().render(), (
        "docs/config.md is stale: run .venv/bin/python scripts/config_docs.py")


@pytest.mark.parametrize("module, name", [("async_grpo.trainer.config", "TrainerConfig"),
                                          ("local_cluster", "LocalClusterConfig"),
                                          ("worker_dispatcher", "DispatcherConfig")])
def test_every_flag_is_in_the_reference_with_its_help(module: str, name: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    text = "\n".join(config_reference(cls))
    for dotted, _, help_text in _flags(cls):  # what --help prints: flags from the parser's own walk
        row = next((line for line in text.splitlines() if line.startswith(f"| `--{dotted}` |")), None)
        assert row is not None, f"--{dotted} missing from the reference"
        doc = help_text.split(" (default: ")[0].split(" (required)")[0].replace("%%", "%").replace("|", "\\|")
        assert doc in row, f"--{dotted}: its docstring is not in its row"

