"""Where the tests find the repository: its root, tests/ itself, and the child programs the tests
start (tests/programs/)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS.parent
PROGRAMS = TESTS / "programs"
