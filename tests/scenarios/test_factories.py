"""A recipe whose model and data come from the user's own factories (issue 23): ``model.factory`` and
``data.factory`` from a module outside hfscale, swept for real and estimated on the meta device."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.paths import SCRIPTS
from helpers.runs import write_recipe

from hfscale import report
from hfscale.estimate import estimate_memory
from hfscale.recipes.recipe import load_recipe
from hfscale.recipes.schema import RecipeError

FACTORIES = SCRIPTS / "user_factories.py"


def _recipe(folder: Path) -> dict:
    where = os.path.relpath(FACTORIES, folder)  # relative to the recipe's folder
    return {
        "name": "factories",
        "device": "cpu",
        "model": {"factory": f"{where}:build_model", "config": {"hidden_size": 32, "num_layers": 2}},
        "data": {"factory": f"{where}:build_data", "factory_kwargs": {"num_samples": 96}, "seq_len": 48},
        "measure": {"warmup_steps": 2, "max_steps": 6, "repeats": 1, "timeout_s": 300},
        "defaults": {"per_device_batch_size": 8},
        "trials": [{"name": "fp32"}, {"name": "bf16", "precision": "bf16"}],
    }


def test_factories_resolve_against_the_recipe_and_are_estimated_on_the_meta_device(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, _recipe(tmp_path)))
    spec = recipe.trials[0].spec
    assert spec.model.factory == f"{FACTORIES.resolve()}:build_model"
    estimate = estimate_memory(spec)
    # The embedding 512 x 32, 2 blocks of 4 x (32 x 32 + 32) + an MLP 32 x 128 x 2 + biases + 2 norms, the head.
    block = 4 * (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32) + 2 * 2 * 32
    assert estimate.num_params == 512 * 32 + 2 * block + (32 * 2 + 2)
    assert estimate.total_gib > estimate.weights_gib > 0


def test_a_factory_that_does_not_import_is_refused_with_its_key(tmp_path: Path) -> None:
    data = _recipe(tmp_path)
    data["model"] = {"factory": "no_such_package.models:build"}
    with pytest.raises(RecipeError, match=r"model\.factory: 'no_such_package\.models:build': cannot import"):
        load_recipe(write_recipe(tmp_path, data))
    data["model"] = {"factory": f"{FACTORIES}:no_such_function"}
    with pytest.raises(RecipeError, match=r"model\.factory: .* has no function 'no_such_function'"):
        load_recipe(write_recipe(tmp_path, data))
    data["model"] = {"factory": "not a reference"}
    with pytest.raises(RecipeError, match=r"model\.factory: 'not a reference': expected 'package\.module:function'"):
        load_recipe(write_recipe(tmp_path, data))
    # A module that raises as it is imported (a traceback before), and twice: no half-run module is kept.
    broken = tmp_path / "broken_factories.py"
    broken.write_text("def build():\n    return None\n\nundefined_name  # NameError at import\n", encoding="utf-8")
    data["model"] = {"factory": "broken_factories.py:build"}
    for _ in range(2):
        with pytest.raises(RecipeError, match=r"model\.factory: .*cannot import .*broken_factories\.py \(NameError"):
            load_recipe(write_recipe(tmp_path, data))


def test_keyword_arguments_a_factory_does_not_take_are_refused_with_their_key(tmp_path: Path) -> None:
    """They raised a TypeError inside every trial."""
    data = _recipe(tmp_path)
    data["model"]["config"] = {"hidden_size": 32, "bogus": 1}
    with pytest.raises(RecipeError, match=r"model\.config: .*build_model does not take these keyword arguments: .*"
                                          r"'bogus'"):  # fmt: skip
        load_recipe(write_recipe(tmp_path, data))
    data = _recipe(tmp_path)
    data["data"]["factory_kwargs"] = {"m": 1}
    with pytest.raises(RecipeError, match=r"data\.factory_kwargs: .*build_data does not take .*'m'"):
        load_recipe(write_recipe(tmp_path, data))


@pytest.mark.slow
def test_a_recipe_of_factories_sweeps_the_users_model_and_data(tmp_path: Path) -> None:
    from hfscale.sweep.loop import run_sweep

    recipe = write_recipe(tmp_path, _recipe(tmp_path))
    run_sweep(recipe, run_dir=tmp_path / "run", report=False, progress=lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [(r["trial"], r["status"]) for r in rows] == [("fp32", "ok"), ("bf16", "ok")], [r["reason"] for r in rows]
    for row in rows:
        assert "TinyClassifier" in row["measured"]["verification"]["wrapper_class"]
        assert row["estimate"]["total_gib"] > 0  # estimated before it ran
    assert rows[1]["measured"]["verification"]["linear_output_dtype"] == "bfloat16"
    workload = report.summarize_run(tmp_path / "run").coverage.workload
    assert workload == "model factory user_factories.py:build_model, data factory user_factories.py:build_data"
