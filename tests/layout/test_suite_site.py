"""The suite's own start-up file (tests/site/sitecustomize.py): the processes the tests start import the training
stack with the collector's first threshold raised, and the tests' own process runs at the interpreter's."""

from __future__ import annotations

import gc
import subprocess
import sys


def test_a_process_a_test_starts_imports_with_the_first_threshold_raised() -> None:
    probe = "import gc; print(gc.get_threshold()[0])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120).stdout
    assert int(out) == 10_000


def test_the_tests_own_process_runs_at_the_interpreters_thresholds() -> None:
    site = sys.modules.get("sitecustomize")
    assert gc.get_threshold() == getattr(site, "DEFAULT_THRESHOLD", gc.get_threshold())
    assert gc.get_threshold()[0] != 10_000
