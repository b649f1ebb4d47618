"""The checks CI runs on the shape of the code catch what they are for (tools/code_shape.py, tools/copies.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / name), *args], capture_output=True, text=True)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "pkg"
    package.mkdir(parents=True)
    for name, text in files.items():
        (package / name).write_text(text, encoding="utf-8")
    return package


def test_code_shape_names_long_modules_long_functions_and_wide_parameter_lists(tmp_path):
    body = "".join(f"    x{k} = {k}\n" for k in range(85))
    package = _package(
        tmp_path,
        {
            "long.py": f"def long_one():\n{body}    return x0\n",
            "wide.py": "def wide(a, b, c, d, e, f, g, h, i):\n    return a\n\n\n"
            "class K:\n    def ok(self, a):\n        return a\n",
            "big.py": "".join(f"V{k} = {k}\n" for k in range(501)),
        },
    )
    done = _tool("code_shape.py", str(package))
    assert done.returncode == 1
    assert "modules over 500 lines: 1" in done.stdout and "big.py" in done.stdout
    assert "functions over 80 lines: 1" in done.stdout and "long_one" in done.stdout
    assert "functions over 8 parameters: 1" in done.stdout and "wide" in done.stdout
    assert "K.ok" not in done.stdout  # self is not a parameter a caller passes


def test_code_shape_passes_a_small_package(tmp_path):
    done = _tool("code_shape.py", str(_package(tmp_path, {"small.py": "def f(a):\n    return a\n"})))
    assert done.returncode == 0, done.stdout


@pytest.mark.skipif(importlib.util.find_spec("pylint") is None, reason="needs pylint: pip install 'hfscale[test]'")
def test_copies_finds_a_block_written_twice_and_nothing_in_distinct_code(tmp_path):
    block = "".join(f"    v{k} = v{k - 1} * {k} + 1\n" for k in range(1, 10))
    one = f"def first(v0):\n{block}    return v9\n"
    two = f"def second(v0):\n{block}    return v9 - 1\n"
    copied = _tool("copies.py", str(_package(tmp_path / "a", {"one.py": one, "two.py": two})))
    assert copied.returncode == 1
    assert "one.py" in copied.stdout and "two.py" in copied.stdout
    distinct = _tool("copies.py", str(_package(tmp_path / "b", {"one.py": one, "two.py": "def g(a):\n    return a\n"})))
    assert distinct.returncode == 0, distinct.stdout


def test_a_killed_builds_lock_is_removed_and_a_running_builds_is_kept(tmp_path):
    """A build killed midway left torch's lock file behind and the next CI run waited on it for 12 minutes."""
    spec = importlib.util.spec_from_file_location("build_deepspeed_ops", REPO / "tools" / "build_deepspeed_ops.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    old, fresh = tmp_path / "py311_cpu" / "cpu_adam" / "lock", tmp_path / "py311_cpu" / "fused_adam" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    now = fresh.stat().st_mtime
    os.utime(old, (now - tool.STALE_LOCK_S - 60, now - tool.STALE_LOCK_S - 60))
    assert tool.remove_stale_locks(tmp_path, now=now) == [old]
    assert not old.exists() and fresh.exists()
