"""A user's own training script swept under every strategy (issue 23): ``workload: {script: ...}`` in a recipe.

The script (tests/scripts/hf_example.py) is written as the transformers examples are: ``HfArgumentParser``,
``TrainingArguments`` from the command line, its own model class and its own collator over variable-length data.
One real sweep runs it unmodified across fp32, bf16, gradient checkpointing, LoRA, DDP x2, ZeRO-2 x2 and FSDP2 x2
(bf16), plus a trial whose script arguments contradict it (``--bf16`` against fp32) and one whose script returns
before training. Every strategy row must be ``ok`` and verified from inside the run, with intervals and a report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.paths import SCRIPTS
from helpers.runs import one_thread, write_recipe

from hfscale import report
from hfscale.recipes.recipe import load_recipe
from hfscale.recipes.schema import RecipeError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # its module fixture: 11 trial runs, 351 s in CI

SCRIPT = SCRIPTS / "hf_example.py"
STRATEGIES = ["fp32", "bf16", "ckpt", "lora", "ddp-x2", "zero2-x2", "fsdp2-x2", "args-in-code"]


def _recipe(tmp: Path) -> dict:
    return {
        "name": "own_script",
        "device": "cpu",
        "workload": {
            "script": os.path.relpath(SCRIPT, tmp),  # relative to the recipe's folder
            "args": ["--per_device_train_batch_size", "8", "--num_samples", "256", "--report_to", "none"],
        },
        "measure": {"warmup_steps": 2, "max_steps": 10, "repeats": 1, "timeout_s": 300},
        "baseline": "fp32",
        "defaults": {"per_device_batch_size": 8},
        "trials": [
            {"name": "fp32", "measure": {"repeats": 2}},  # two runs: the sweep's run-to-run noise, every interval
            {"name": "bf16", "precision": "bf16"},
            {"name": "ckpt", "gradient_checkpointing": True},
            {"name": "lora", "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}},
            {"name": "ddp-x2", "num_processes": 2},
            {"name": "zero2-x2", "num_processes": 2, "deepspeed": {"zero_stage": 2}},
            # bf16: accelerate's FSDP2 gathers in bf16 (its mixed-precision policy, read back from every unit).
            {
                "name": "fsdp2-x2",
                "num_processes": 2,
                "precision": "bf16",
                "fsdp": {"version": 2, "sharding": "full_shard"},
            },
            {"name": "script-bf16", "script_args": ["--bf16", "--use_cpu"]},
            {"name": "exits-early", "script_args": ["--exit_early"]},
            {"name": "args-in-code", "script_args": ["--args_in_code"]},
        ],
    }


@pytest.fixture(scope="module")
def script_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hfscale.sweep.loop import run_sweep

    root = tmp_path_factory.mktemp("own-script")
    recipe = write_recipe(root, _recipe(root))
    with one_thread():
        run_sweep(recipe, run_dir=root / "run", progress=lambda line: None)
    return root / "run"


def _rows(run: Path) -> dict[str, dict]:
    lines = (run / "results.jsonl").read_text(encoding="utf-8").splitlines()
    return {row["trial"]: row for row in map(json.loads, lines)}


def test_every_strategy_runs_the_users_script_verified_from_inside(script_run: Path) -> None:
    frame = report.summarize_run(script_run).trials
    for name in STRATEGIES:
        row = frame.loc[name]
        assert row["status"] == "ok", (name, row["reason"])
        assert row["samples_per_s"] > 0 and row["peak_gib"] > 0, name
        assert row["samples_per_s_low"] < row["samples_per_s"] < row["samples_per_s_high"], name
    rows = _rows(script_run)
    verified = {name: rows[name]["measured"]["verification"] for name in STRATEGIES}
    assert verified["bf16"]["linear_output_dtype"] == "bfloat16"
    assert verified["ckpt"]["gradient_checkpointing"] is True
    assert verified["zero2-x2"]["zero_stage"] == 2 and verified["zero2-x2"]["world_size"] == 2
    assert verified["fsdp2-x2"]["wrapper"] == "FSDP2" and verified["ddp-x2"]["wrapper"] == "DDP"
    assert verified["fsdp2-x2"]["fsdp_param_dtype"] == "bfloat16"
    assert verified["lora"]["lora_layers"] == 2 * 2 and sorted(verified["lora"]["lora_target_modules"]) == [
        "q_proj",
        "v_proj",
    ]
    # The script's own model: its class is what the Trainer stepped; its steps are capped to the recipe's measure.
    assert "TinyClassifier" in verified["fp32"]["wrapper_class"]
    assert rows["fp32"]["measured"]["throughput"]["measured_steps"] == 10 - 2


def test_a_script_setting_that_contradicts_the_trial_is_named(script_run: Path) -> None:
    row = _rows(script_run)["script-bf16"]
    assert row["status"] == "not_applied"
    assert "bf16: the script sets True, the trial asks for False" in row["reason"]


def test_a_script_that_never_trains_is_a_failed_row_saying_so(script_run: Path) -> None:
    row = _rows(script_run)["exits-early"]
    assert row["status"] == "crashed"
    assert "the script hf_example.py exited (status 0) without building a Trainer" in row["reason"]


def test_the_report_names_the_workload(script_run: Path) -> None:
    text = (script_run / "report.md").read_text(encoding="utf-8")
    assert "hf_example.py --per_device_train_batch_size 8" in text


def test_a_script_recipe_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    data = _recipe(tmp_path)
    with pytest.raises(RecipeError, match=r"workload\.script: .*not_there\.py.* does not exist"):
        load_recipe(write_recipe(tmp_path, data | {"workload": {"script": "not_there.py"}}))
    with pytest.raises(RecipeError, match=r"workload\.script: .* is a folder: expected your training script's file"):
        load_recipe(write_recipe(tmp_path, data | {"workload": {"script": str(tmp_path)}}))
    with pytest.raises(RecipeError, match=r"workload\.script: empty: the path of your training script"):
        load_recipe(write_recipe(tmp_path, data | {"workload": {"script": ""}}))
    # --script's recipe is read as every recipe is (it raised a UnicodeDecodeError out of the command).
    from hfscale.recipes.workload import recipe_with_script

    (tmp_path / "bin.yaml").write_bytes(b"name: x\n\xff\xfe")
    with pytest.raises(RecipeError, match=r"bin\.yaml: not a UTF-8 text file"):
        recipe_with_script(tmp_path / "bin.yaml", str(SCRIPT), [])
    with pytest.raises(RecipeError, match=r"model: the script builds its own model"):
        load_recipe(write_recipe(tmp_path, data | {"model": {"type": "bert"}}))
    bad = data | {"trials": [{"name": "a", "lora": {"rank": 4}}]}
    with pytest.raises(RecipeError, match=r"trials\[0\]\.lora\.target_modules: .*script"):
        load_recipe(write_recipe(tmp_path, bad))
    plain = {k: v for k, v in data.items() if k != "workload"}
    with pytest.raises(RecipeError, match=r"trials\[7\]\.script_args: .*only with workload\.script"):
        load_recipe(write_recipe(tmp_path, plain))


def test_the_command_line_form_puts_the_script_in_place_of_a_recipes_model(capsys: pytest.CaptureFixture) -> None:
    """``hfscale sweep --script train.py RECIPE -- ARGS``: the recipe's trials, the script's model and data."""
    from hfscale.commands.sweep import main
    from hfscale.recipes.workload import recipe_with_script

    derived = load_recipe(recipe_with_script("cpu_small", str(SCRIPT), ["--num_samples", "64"]))
    assert [t.name for t in derived.trials] == [t.name for t in load_recipe("cpu_small").trials]
    assert {t.spec.script.path for t in derived.trials} == {str(SCRIPT.resolve())}
    assert derived.trials[0].spec.script.args == ("--num_samples", "64")
    assert main(["--dry-run", "--script", str(SCRIPT), "cpu_small", "--", "--num_samples", "64"]) == 0
    assert "fsdp2-x2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--dry-run", "cpu_small", "--", "--bf16"])  # arguments after -- without --script
    assert "give --script TRAIN_PY" in capsys.readouterr().err
