"""README.md is a guide that fits on a page and maps docs/; every relative link of README.md and docs/
resolves to a file of the repository, and an anchor to a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.paths import ROOT

pytestmark = pytest.mark.one_lane

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_BYTES = 25_000
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _links(page: Path) -> list[str]:
    """The link targets of a markdown page, outside its code blocks."""
    return _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as `-`, repeats `-N`."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", page.read_text(encoding="utf-8")), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_fits_the_size_of_a_guide() -> None:
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, (
        f"README.md is {size:,} bytes, over {MAX_README_BYTES:,}: move reference text into a page of docs/"
    )


def test_readme_links_every_docs_page() -> None:
    linked = {(README.parent / target.split("#")[0]).resolve() for target in _links(README)}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"README.md's map of docs/ does not link {unlinked}"


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in _pages():
        for target in _links(page):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:: not a file of the repository
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no file {path})")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {path or page.name})")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
