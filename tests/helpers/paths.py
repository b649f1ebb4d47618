"""Where things are: the checkout, the tests' own scripts, golden files and data."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"
GOLDEN = TESTS / "golden"
DATA = TESTS / "data"
