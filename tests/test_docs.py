"""The README's and docs/'s relative links lead somewhere: each names a file of the repository, and each #anchor one
of that file's headings, as GitHub spells them (the README points into results.md's numbered sections, whose titles
are long: a retitled section breaks them silently otherwise)."""

import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
HEADING = re.compile(r"(#{1,6}) (.+)")


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, every character but letters, digits, '_', '-' and spaces dropped,
    spaces as '-' (so "2 × H200" gives "2--h200")."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache  # results.md is the target of most links: parsed once
def anchors(path: Path) -> frozenset[str]:
    """The ids of a Markdown file's headings outside code blocks; a repeated heading gets -1, -2, ... as on GitHub."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else HEADING.match(line)
        if m:
            base = github_anchor(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    return frozenset(ids)


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", t)]


def test_the_anchor_rule_matches_githubs_spelling():
    assert github_anchor("37. Kernel v45: the forward's tiles, below 2k keys (2 × H200, 2026-11-29)") == (
        "37-kernel-v45-the-forwards-tiles-below-2k-keys-2--h200-2026-11-29")
    assert github_anchor("The everyday launch") == "the-everyday-launch"


def test_the_docs_have_relative_links_to_check():
    assert sum(len(relative_links(p)) for p in DOCS) > 20


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_and_a_heading_there(doc):
    broken = []
    for target in relative_links(doc):
        path, _, fragment = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading of {linked.name} has this id")
    assert not broken, f"{doc.name}: " + "; ".join(broken)
