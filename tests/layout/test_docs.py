"""The README and the user guide name files and Python objects that exist: a page that points at a module moved by
a refactor is a broken page, even when mkdocs (which checks links between pages) builds it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from helpers.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_PATH = re.compile(r"`((?:hfscale|tests|benchmarks|tools|results|docs)/[A-Za-z0-9_./-]+)`")
DOTTED = re.compile(r"`(hfscale(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")
"""``runs/cpu_small-TIMESTAMP``, ``trials/NAME``: a path with a placeholder in capitals names no one file."""


def _resolves(dotted: str) -> bool:
    """``hfscale.a.b.C``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_path_and_object_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    paths = {m.rstrip("/.") for m in REPO_PATH.findall(text) if not PLACEHOLDER.search(m)}
    assert sorted(p for p in paths if not (REPO / p).exists()) == []
    assert sorted(name for name in set(DOTTED.findall(text)) if not _resolves(name)) == []


def test_the_check_catches_a_moved_module() -> None:
    assert _resolves("hfscale.measure.flops") and not _resolves("hfscale.flops")
    assert _resolves("hfscale.strategy.Strategy") and not _resolves("hfscale.strategy.Stratagem")


def test_every_guide_page_is_linked_from_the_readme_and_in_the_site_navigation() -> None:
    readme, site = (REPO / "README.md").read_text(encoding="utf-8"), (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    for page in sorted((REPO / "docs").glob("*.md")):
        assert page.name in site, page.name
        assert page.name == "index.md" or f"](docs/{page.name})" in readme, page.name
