"""The checks CI runs on the shape of the code catch what they are for (tools/code_shape.py, tools/copies.py)."""

from __future__ import annotations

import importlib.util
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
