"""The README and docs/: every relative link and image leads to a file in the tree, and every
``#anchor`` to a heading of its page, as GitHub and the Hub render them; the README stays a front
page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors: each heading lower-cased, punctuation but '-' and '_' dropped, spaces to '-'."""
    found = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"#+ (.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            found.add(text.replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m.group(1))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for link in links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(link)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(link)
    assert broken == []


def test_the_readme_is_a_front_page_that_links_every_guide():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {(REPO / link.partition("#")[0]).resolve() for link in links(REPO / "README.md")}
    guides = {p.resolve() for p in (REPO / "docs").glob("*.md")} | {(REPO / "docs/benchmarks/index.md").resolve()}
    assert guides - linked == set()


def test_every_benchmark_page_is_listed_on_the_benchmarks_index():
    index = REPO / "docs" / "benchmarks" / "index.md"
    listed = {(index.parent / link.partition("#")[0]).resolve() for link in links(index)}
    pages = {p.resolve() for p in index.parent.glob("*.md")} - {index.resolve()}
    assert pages - listed == set()


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](missing.md) [here](#title) [nowhere](#nope)\n")
    assert links(page) == ["missing.md", "#title", "#nope"] and anchors(page) == {"title"}
