"""Every relative link in the repository's Markdown (README, docs/, benchmarks/results/) reaches a file that
exists and, where it names a section (`file.md#anchor`, `#anchor`), a heading that has that anchor as GitHub
renders it. A renamed heading (a section that stops being the "newest") or a moved result breaks links
silently otherwise."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MARKDOWN = sorted([*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md"), *(REPO / "benchmarks").rglob("*.md"),
                   *(REPO / "notebooks").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _outside_code(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings: lowercased, punctuation but hyphens and underscores dropped,
    spaces as hyphens, a repeated one suffixed -1, -2, ..."""
    seen: Counter[str] = Counter()
    out = set()
    for line in _outside_code(text):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return out


def test_the_anchor_rule_is_githubs():
    text = "# Issue 40's points (2026-12-03, newest)\n```\n# not a heading\n```\n## `cpu-bf16`: x_y\n## A\n## A\n"
    assert anchors(text) == {"issue-40s-points-2026-12-03-newest", "cpu-bf16-x_y", "a", "a-1"}


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_their_files_and_sections(path: Path):
    broken = []
    for line in _outside_code(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                broken.append(f"{target}: no such section")
    assert not broken, broken
