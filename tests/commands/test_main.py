"""The ``hfscale`` command: dispatch, and shipped recipes by name (``hfscale recipes``, ``hfscale sweep NAME``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO

from hfscale.commands.main import COMMANDS, main
from hfscale.recipes.catalog import recipe_names, resolve_recipe, shipped_recipe
from hfscale.recipes.recipe import load_recipe


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    """A folder without recipe files, as a user who installed the wheel has."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"  {name} " in out
    assert "recipes" in COMMANDS


def test_unknown_command_is_refused(capsys):
    assert main(["recipe"]) == 2
    assert "unknown command 'recipe'; expected one of" in capsys.readouterr().err


def test_recipes_lists_name_device_trials_and_description(empty_cwd, capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "device", "trials", "description"]
    for name in recipe_names():
        recipe = load_recipe(name)
        row = next(line for line in lines if line.split()[:1] == [name])
        assert row.split()[1:3] == [recipe.device, str(len(recipe.trials))]
        assert row.endswith(" ".join(recipe.description.split()))
    assert main(["recipes", "list"]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_listing_the_recipes_builds_no_model(empty_cwd):
    """The listing reads the shipped files and builds no model config: that imported transformers (and peft, for
    llama_1b's LoRA trials), 6-7 s on 2 cores, and printed transformers' warnings about configs nobody asked for."""
    probe = (
        "import sys\n"
        "from hfscale.commands.main import main\n"
        "assert main(['recipes']) == 0\n"
        "print('LOADED', sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.splitlines()[-1] == "LOADED []", out.stderr[-2000:]
    assert out.stderr == ""


def test_recipes_show_prints_the_file_as_shipped(empty_cwd, capsys):
    assert main(["recipes", "show", "cpu_small"]) == 0
    assert capsys.readouterr().out == shipped_recipe("cpu_small").read_text(encoding="utf-8")


def test_an_unknown_name_lists_the_valid_ones(empty_cwd, capsys):
    assert main(["recipes", "show", "cpu_smal"]) == 2
    err = capsys.readouterr().err
    assert "cpu_smal: no such recipe file, nor a shipped recipe of that name" in err
    assert f"shipped recipes (run by name): {', '.join(recipe_names())}; did you mean 'cpu_small'?" in err
    with pytest.raises(
        FileNotFoundError, match=r"bert_lrage: .*bert_large, cpu_budget, cpu_small.*did you mean 'bert_large'"
    ):
        load_recipe("bert_lrage")
    # A path (it has a folder part) is never looked up by name; the message still says what can be run by name.
    with pytest.raises(FileNotFoundError, match=r"^nowhere/cpu_small\.yaml: no such file; shipped recipes"):
        load_recipe("nowhere/cpu_small.yaml")


def test_a_path_is_used_as_given_and_wins_over_a_shipped_name(empty_cwd):
    own = empty_cwd / "cpu_small.yaml"
    own.write_text(shipped_recipe("cpu_small").read_text().replace("name: cpu_small", "name: mine"))
    assert resolve_recipe("cpu_small.yaml") == Path("cpu_small.yaml")
    assert load_recipe("cpu_small.yaml").name == "mine"
    assert load_recipe(own).name == "mine"
    # The bare name is the shipped recipe; so is the name with its suffix once no such file is here.
    assert resolve_recipe("cpu_small") == shipped_recipe("cpu_small")
    own.unlink()
    assert load_recipe("cpu_small.yaml").name == "cpu_small"


def test_a_folder_is_not_a_recipe(empty_cwd):
    (empty_cwd / "cpu_small").mkdir()
    with pytest.raises(ValueError, match="cpu_small: is a folder, not a recipe file"):
        load_recipe("cpu_small")


def test_sweep_dry_run_by_name_equals_the_checkout_path(empty_cwd, monkeypatch, capsys):
    assert main(["sweep", "cpu_small", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"recipe cpu_small: {len(load_recipe('cpu_small').trials)} trials")
    assert not (empty_cwd / "runs").exists()
    monkeypatch.chdir(REPO)
    assert main(["sweep", "recipes/cpu_small.yaml", "--dry-run"]) == 0
    assert capsys.readouterr().out == out
    monkeypatch.chdir(empty_cwd)
    assert main(["sweep", "cpu_smal", "--dry-run"]) == 2
    assert "did you mean 'cpu_small'?" in capsys.readouterr().err


@pytest.mark.slow
def test_accelerate_launch_sweep_by_name(tmp_path):
    """The mission's command from a folder without recipes: `accelerate launch -m hfscale.sweep bert_large`."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1"]
    command += ["-m", "hfscale.sweep", "bert_large", "--dry-run"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"recipe bert_large: {len(load_recipe('bert_large').trials)} trials")
