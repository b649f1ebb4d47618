"""hfscale as a user gets it: a wheel installed in a fresh virtual environment, run from an empty folder.

The wheel is built from this source tree (copied first, so the build leaves nothing in the checkout) and installed
with ``--no-deps`` into a new venv made ``--without-pip``. That venv sees the test environment's packages (torch,
transformers, accelerate, ...) through a ``.pth`` file listing its site-packages folders, so nothing is downloaded;
a ``.pth`` file's plain lines are only appended to ``sys.path``, the ``.pth`` files inside those folders are not run,
so an editable install of hfscale there stays invisible and the venv's own site-packages, where the wheel lands,
comes first. Every command runs from an empty folder with the venv's ``bin`` first on PATH and no PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers.paths import REPO

SOURCE_RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("setuptools") is None,
        reason="building the wheel offline needs setuptools in the test environment: pip install 'hfscale[test]'",
    ),
]


def _run(command: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _source_version() -> str:
    """``__version__`` as this source tree states it, read without importing (the version pyproject.toml takes)."""
    import ast

    tree = ast.parse((REPO / "hfscale" / "__init__.py").read_text(encoding="utf-8"))
    (value,) = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
    ]
    return value


def _build_wheel(tmp: Path) -> Path:
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    # hfscale/recipes is a real folder (the checkout's recipes/ links to it), copied as files.
    shutil.copytree(REPO / "hfscale", source / "hfscale", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp / "dist"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), "."]
    _run(command, cwd=source, env={**os.environ, "PIP_NO_INDEX": "1"})
    (wheel,) = dist.glob("hfscale-*.whl")
    return wheel


def _make_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=dict(os.environ))
    python = venv / "bin" / "python"
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=tmp,
            env=_clean_env(venv),
        ).stdout.strip()
    )
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    ours |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    (purelib / "hfscale-test-env.pth").write_text("".join(f"{p}\n" for p in sorted(ours) if Path(p).is_dir()))
    command = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--no-deps",
        "--no-index",
        "--ignore-installed",
        str(wheel),
    ]
    _run(command, cwd=tmp, env=dict(os.environ))
    return venv


def _clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_wheel_in_a_fresh_venv_runs_a_shipped_recipe_by_name(tmp_path):
    wheel = _build_wheel(tmp_path)
    venv = _make_venv(tmp_path, wheel)
    env = _clean_env(venv)
    work = tmp_path / "empty"
    work.mkdir()
    hfscale = str(venv / "bin" / "hfscale")

    where = _run([str(venv / "bin" / "python"), "-c", "import hfscale; print(hfscale.__file__)"], cwd=work, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    # One version: the wheel's name, the installed metadata and the package's __version__ (pyproject reads it).
    version = _source_version()
    assert wheel.name == f"hfscale-{version}-py3-none-any.whl"
    read = "import hfscale; from importlib.metadata import version; print(version('hfscale'), hfscale.__version__)"
    assert _run([str(venv / "bin" / "python"), "-c", read], cwd=work, env=env).stdout.split() == [version] * 2

    listed = _run([hfscale, "recipes"], cwd=work, env=env).stdout.splitlines()
    assert sorted(line.split()[0] for line in listed[1:] if line.strip() and not line.startswith("Run ")) == (
        SOURCE_RECIPES
    )
    shown = _run([hfscale, "recipes", "show", "cpu_small"], cwd=work, env=env).stdout
    assert shown == (REPO / "recipes" / "cpu_small.yaml").read_text(encoding="utf-8")

    dry = _run([hfscale, "sweep", "cpu_small", "--dry-run"], cwd=work, env=env).stdout
    assert dry.startswith("recipe cpu_small: ")
    # The trials are launched with the venv's interpreter, so they import the venv's hfscale too.
    assert f"{venv / 'bin' / 'python'} -m accelerate.commands.launch" in dry

    # One run of one trial (the baseline) keeps this test short; the whole recipe is the same path, more times.
    command = [hfscale, "sweep", "cpu_small", "--only", "fp32", "--repeats", "1", "--run-dir", "run"]
    _run(command, cwd=work, env=env, timeout=600)
    run = work / "run"
    assert sorted(p.name for p in work.iterdir()) == ["run"]
    assert (run / "recipe.yaml").read_text(encoding="utf-8") == shown
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(row["trial"], row["repeat"], row["status"]) for row in rows] == [("fp32", 0, "ok")]
    assert rows[0]["repeats"] == 1  # what --repeats asked, recorded on the row
    for name in ("report.md", "report.html"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    assert "| fp32 |" in (run / "report.md").read_text(encoding="utf-8")
    recorded = json.loads((run / "environment.json").read_text(encoding="utf-8"))
    assert recorded["hfscale"]["version"] == recorded["packages"]["hfscale"] == version
