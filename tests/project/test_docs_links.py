"""The README and the guides in docs/ stay connected: every relative link reaches a file that exists
(and, with `#anchor`, a heading of that file), and the README's layout table names every top-level
module.

Anchors follow GitHub's rule: the heading's text, lower-cased, with everything but letters,
digits, `_`, `-` and spaces removed, spaces turned into `-`, and `-1`, `-2`, ... appended to
repeated headings.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from support.paths import REPO_ROOT

DOCUMENTS = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")])

# `[text](target)` and `![alt](target)`; a target has no spaces (an optional "title" is cut off).
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = ("http://", "https://", "mailto:")


def _prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a link inside a code block is not a link)."""
    lines, in_fence = [], False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors_of(path: Path) -> frozenset[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(path):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


def relative_links(path: Path) -> list[str]:
    """Every link target in `path` that points inside the repository."""
    targets = []
    for line in _prose_lines(path):
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link either
        targets += [t for t in _LINK.findall(line) if not t.startswith(_EXTERNAL)]
    return targets


def broken_links(path: Path) -> list[str]:
    """`path`'s relative links whose file or heading does not exist, each with the reason."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Data path: `per_rank` or `rank0`\n")
    page.write_text("# Page\n\n[ok](other.md#data-path-per_rank-or-rank0) [self](#page)\n"
                    "[gone](missing.md) [bad anchor](other.md#nowhere) [web](https://example.com)\n"
                    "```\n[in a code block](missing-too.md)\n```\n`[inline code](missing-three.md)`\n")
    assert [line.split(":")[0] for line in broken_links(page)] == ["missing.md", "other.md#nowhere"]


def test_slugs_follow_githubs_rule():
    assert _slug("The registry's routing cost") == "the-registrys-routing-cost"
    assert _slug("Data path: `per_rank` or `rank0`") == "data-path-per_rank-or-rank0"
    assert _slug("LoRA (adapter-only RL)") == "lora-adapter-only-rl"


def test_the_readme_layout_table_names_every_top_level_module():
    """A module added without a line in the README's table is invisible to the next reader."""
    table_rows = [line for line in _prose_lines(REPO_ROOT / "README.md") if line.startswith("| `")]
    named = {name for row in table_rows for name in re.findall(r"`(\w+)\.py`", row.split("|")[1])}
    modules = {p.stem for p in REPO_ROOT.glob("*.py")}
    assert sorted(modules - named) == []
