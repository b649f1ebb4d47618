"""The floors of the house are checked, not hoped for: import-linter fails an import against them.

``lint-imports`` (tox -e lint, .ci/run) checks the contracts in pyproject.toml on the real tree; this test shows on a
copy of the tree that a module importing a floor above its own, or a cycle between two modules of one package,
breaks them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("importlinter") is None, reason="needs import-linter: pip install 'hfscale[test]'"
)
# `lint-imports`, run with this interpreter whatever PATH holds.
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _copy_tree(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "hfscale", tmp_path / "hfscale", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache"], cwd=tree, env=env, capture_output=True, text=True)


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + f"\n\n{line}\n", encoding="utf-8")


def test_the_tree_keeps_its_floors(tmp_path):
    done = _lint(_copy_tree(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def test_an_import_from_a_floor_above_breaks_the_contract(tmp_path):
    tree = _copy_tree(tmp_path)
    # A record type reaching up into the sweep, inside a function: the kind of import 0.3 had.
    _append(tree / "hfscale" / "records" / "row.py", "def _late():\n    from hfscale.sweep import loop  # noqa")
    done = _lint(tree)
    assert done.returncode == 1
    assert "hfscale.records is not allowed to import hfscale.sweep" in done.stdout
    assert "hfscale.records.row -> hfscale.sweep.loop" in done.stdout


def test_a_cycle_inside_a_package_breaks_the_contract(tmp_path):
    tree = _copy_tree(tmp_path)
    # units -> text -> units: a cycle on one floor, however low.
    _append(tree / "hfscale" / "core" / "units.py", "from hfscale.core import text  # noqa")
    _append(tree / "hfscale" / "core" / "text.py", "from hfscale.core import units  # noqa")
    done = _lint(tree)
    assert done.returncode == 1
    assert "No cycles are allowed in hfscale.core" in done.stdout
