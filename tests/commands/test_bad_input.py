"""Bad input to the commands is refused before anything runs, naming the argument, the key or the variable and
what is valid: never a traceback, never accepted and then misbehaving."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from helpers.paths import REPO

from hfscale.commands.sweep import main as sweep
from hfscale.core.validation import Invalid, convert
from hfscale.launch.plan import SettingError, SweepSettings


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--memory-limit-gib", "nan"), ("--memory-limit-gib", "inf"), ("--timeout-s", "nan"), ("--price-per-hour", "nan"),
     ("--price-per-hour", "inf"), ("--max-time", "nan")],
)  # fmt: skip
def test_a_number_that_is_not_finite_is_refused_on_the_command_line(flag, value, capsys):
    assert sweep(["cpu_small", "--dry-run", "--search", "adaptive", flag, value]) == 2
    assert f"must be a finite number, got {float(value)}" in capsys.readouterr().err


def test_infinity_is_taken_where_it_means_no_limit(monkeypatch):
    assert SweepSettings(timeout_s=math.inf, max_time_s=math.inf).timeout_s == math.inf  # no time limit
    monkeypatch.setenv("HFSCALE_DEVICE_WAIT_S", "inf")
    from hfscale.launch.device_lock import check_lock_environment

    check_lock_environment()  # waits as long as it takes


def test_nan_is_refused_in_a_recipe():
    with pytest.raises(Invalid, match=r"expected a number, got") as raised:
        convert(float, math.nan, "run.memory_limit_gib")
    assert raised.value.path == "run.memory_limit_gib"
    with pytest.raises(SettingError, match="timeout_s must be a finite number, got nan"):
        SweepSettings(timeout_s=math.nan)


def test_integer_keys_must_be_written_as_integers():
    assert convert(dict[int, float], {64: 1.0}, "data.lengths.histogram") == {64: 1.0}
    with pytest.raises(Invalid, match=r"keys must be integers \(unquoted\), got '64'") as raised:
        convert(dict[int, float], {"64": 1.0}, "data.lengths.histogram")
    assert raised.value.path == "data.lengths.histogram.64"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("HFSCALE_DEVICE_LOCK", "bogus", "HFSCALE_DEVICE_LOCK='bogus': expected 'wait' or 'share'"),
        ("HFSCALE_DEVICE_WAIT_S", "abc", "HFSCALE_DEVICE_WAIT_S='abc': expected a number of seconds"),
        ("HFSCALE_DEVICE_WAIT_S", "nan", "HFSCALE_DEVICE_WAIT_S='nan': expected a number of seconds"),
    ],
)
def test_a_bad_device_lock_variable_is_refused_before_the_sweep_starts(variable, value, message, tmp_path,
                                                                        monkeypatch, capsys):  # fmt: skip
    monkeypatch.setenv(variable, value)
    assert sweep(["cpu_small", "--run-dir", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing ran, nothing was written


def test_an_unknown_log_level_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as raised:
        sweep(["cpu_small", "--dry-run", "--log-level", "bogus"])
    assert raised.value.code == 2
    assert (
        "argument --log-level: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got 'bogus'" in capsys.readouterr().err
    )
    assert sweep(["cpu_small", "--dry-run", "--log-level", "warn"]) == 0  # logging's own alias


# -- where the output goes --------------------------------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a folder\n", encoding="utf-8")
    return path


@pytest.fixture
def a_run(tmp_path):
    from helpers.report import ENV, constructed_rows, write_run

    return write_run(tmp_path / "run", constructed_rows(), ENV)


def test_an_output_path_that_is_a_file_is_refused_with_its_argument(a_file, a_run, capsys):
    from hfscale.commands.config import main as config
    from hfscale.commands.report import compare_main
    from hfscale.commands.report import main as report
    from hfscale.commands.slurm import main as slurm

    assert config(["--device", "cpu", "--out", str(a_file)]) == 2
    assert "argument --out: cannot write the configs: " in capsys.readouterr().err
    assert report([str(a_run), "--out", str(a_file)]) == 2
    assert f"cannot write the report: {a_file}" in capsys.readouterr().err
    assert compare_main([str(a_run), str(a_run), "--out", str(a_file / "x")]) == 2
    assert f"cannot write the comparison: {a_file}" in capsys.readouterr().err
    assert slurm(["bert_large", "--nodes", "2", "--gpus-per-node", "1", "--out", str(a_file / "x.sbatch")]) == 2
    assert f"argument --out: {a_file / 'x.sbatch'}: Not a directory" in capsys.readouterr().err
    for flag, value in (("--out-dir", a_file), ("--run-dir", a_file / "x")):
        assert sweep(["cpu_small", "--only", "fp32", flag, str(value)]) == 2
        assert (
            f"{a_file} is not a folder (a file, or a broken link): no run folder can be made there"
            in capsys.readouterr().err
        )
    assert sweep(["cpu_small", "--only", "fp32", "--run-dir", str(a_file)]) == 2
    assert f"{a_file} is not a folder (a file, or a broken link)" in capsys.readouterr().err
    # The dry run refuses what the sweep would: a file in the way, and a folder that exists.
    assert sweep(["cpu_small", "--dry-run", "--run-dir", str(a_file)]) == 2
    assert f"{a_file} is not a folder (a file, or a broken link)" in capsys.readouterr().err
    assert sweep(["cpu_small", "--dry-run", "--run-dir", str(a_run)]) == 2
    assert f"{a_run} exists; continue it with --resume {a_run}, or choose another" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "says"), [("[1]", "expected a JSON object, got list"), ("{bad", "cannot be read")])
def test_an_environment_record_that_is_not_an_object_is_named(text, says, a_run, capsys):
    from hfscale.commands.report import main as report

    (a_run / "environment.json").write_text(text, encoding="utf-8")
    assert report([str(a_run)]) == 2
    assert f"{a_run / 'environment.json'}: {says}" in capsys.readouterr().err


def test_a_resumed_run_whose_environment_is_not_an_object_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text((REPO / "recipes" / "cpu_small.yaml").read_text(), encoding="utf-8")
    (run / "results.jsonl").write_text("", encoding="utf-8")
    (run / "environment.json").write_text("[1]", encoding="utf-8")
    assert sweep(["--resume", str(run), "--dry-run"]) == 2
    assert "environment.json is not a JSON object (a list)" in capsys.readouterr().err


# -- the other commands' arguments ------------------------------------------------------------------------------


def test_estimate_names_a_config_key_the_model_lacks_and_a_value_it_cannot_build(capsys):
    from hfscale.commands.estimate import main as estimate

    assert estimate(["bert", "--config", "num_hidden_layer=48"]) == 2
    assert (
        "--config num_hidden_layer: BertConfig has no key 'num_hidden_layer' (did you mean 'num_hidden_layers'?)"
        in (capsys.readouterr().err)
    )
    assert estimate(["bert", "--config", "hidden_size=0"]) == 2
    assert "--config hidden_size: expected a positive integer, got 0" in capsys.readouterr().err
    assert estimate(["gpt2", "--config", "resid_pdrop=x"]) == 2  # a value of the wrong type, refused by transformers
    assert "--config: Validation error for field 'resid_pdrop'" in capsys.readouterr().err
    # A mistyped recipe name was taken for a model type: transformers' 12 kB list of types, no word of recipes.
    assert estimate(["cpu_smal"]) == 2
    err = capsys.readouterr().err
    assert "'cpu_smal' is neither a recipe" in err and "did you mean 'cpu_small'" in err and len(err) < 400
    # A length the model has no positions for: estimated before, as if it could run.
    assert estimate(["bert", "--seq-len", "100000"]) == 2
    assert "--seq-len: expected at most 512, the model's positions (model.config.max_position_embeddings)" in (
        capsys.readouterr().err
    )
    assert estimate(["cpu_small", "--seq-len", "4096"]) == 2
    assert "--seq-len: expected at most 512" in capsys.readouterr().err


def test_lora_options_without_a_rank_and_ports_out_of_range_are_refused(tmp_path, capsys):
    from hfscale.commands.config import main as config
    from hfscale.commands.slurm import main as slurm

    for flag, value in (("--lora-alpha", "32"), ("--lora-dropout", "0.1")):
        assert config(["--device", "cpu", flag, value, "--out", str(tmp_path / "c")]) == 2
        assert "configure LoRA: add --lora-rank" in capsys.readouterr().err
    assert config(["--device", "cpu", "--lora-rank", "8", "--out", str(tmp_path / "c")]) == 0  # the defaults stay
    assert config(["--device", "cpu", "--main-process-port", "0", "--out", str(tmp_path / "c")]) == 2
    assert "expected a port between 1 and 65535, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        slurm(["cpu_small", "--nodes", "2", "--gpus-per-node", "1", "--port", "70000"])
    assert "--port: must be between 1024 and 64511" in capsys.readouterr().err


def test_a_dry_run_refuses_what_the_sweep_refuses(tmp_path, capsys):
    from helpers.runs import write_recipe

    assert sweep(["cpu_small", "--dry-run", "--max-runs", "3"]) == 2
    assert "only apply to an adaptive search" in capsys.readouterr().err
    recipe = yaml.safe_load((REPO / "recipes" / "cpu_small.yaml").read_text())
    recipe["sweep"] = {"max_runs": 1}  # a grid recipe with a search's key: refused, not dropped
    assert sweep([str(write_recipe(tmp_path, recipe)), "--dry-run"]) == 2
    assert "sweep.max_runs: only an adaptive search reads it" in capsys.readouterr().err


# -- recipe values that would fail only inside the trial ----------------------------------------------------------

TINY = {"device": "cpu", "model": {"config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}}}


@pytest.mark.parametrize(
    ("changes", "key", "says"),
    [
        ({"model": []}, "model", "expected a mapping, got a list"),
        ({"data": False}, "data", "expected a mapping, got false"),
        ({"run": 0}, "run", "expected a mapping, got 0"),
        ({"trials": [{"name": "a", "measure": False}]}, r"trials\[0\]\.measure", "expected a mapping, got false"),
        ({"trials": [{"name": ""}]}, r"trials\[0\]\.name", "expected a name, got an empty one"),
        ({"data": {"seq_len": 4096}}, "data.seq_len", r"expected at most 512, the model's positions"),
        ({"data": {"seq_len": 0}}, "data.seq_len", "expected a positive integer, got 0"),
        ({"model": {"config": {"hidden_size": 0, "num_hidden_layers": 1, "num_attention_heads": 2}}},
         r"model\.config\.hidden_size", "expected a positive integer, got 0"),
        ({"model": {"type": "gpt2", "config": {"n_embd": 32, "n_layer": 1.5, "n_head": 2}}},
         r"model\.config\.n_layer", "expected a positive integer, got 1.5"),
        # A value of the wrong type that transformers' typed config refuses: named, not a traceback.
        ({"model": {"type": "gpt2", "config": {"n_embd": 32, "n_layer": 1, "n_head": 2, "resid_pdrop": "x"}}},
         r"model\.config", "Validation error for field 'resid_pdrop'"),
        ({"data": {"token_low": 500, "token_high": 100}}, "data.token_low", r"expected 0 <= data.token_low <"),
        ({"measure": {"warmup_steps": 8, "max_steps": 8}}, r"measure\.warmup_steps",
         r"expected at most max_steps - 2 \(6\)"),
        ({"measure": {"warmup_steps": 2, "max_steps": 3}}, r"measure\.warmup_steps",
         r"expected at most max_steps - 2 \(1\).* a figure needs two, got 2"),  # one measured step: no figure
        # An epoch of 32 samples at 8 a step is 4 steps: a warm-up of 5 (the default) leaves none.
        ({"data": {"num_samples": 32}, "defaults": {"per_device_batch_size": 8}, "measure": {"num_epochs": 1}},
         r"measure\.warmup_steps", r"1 epoch\(s\) of 32 samples at 8 a step run at most 4 optimizer step\(s\): a "
         r"warm-up of 5 leaves fewer than the two"),
        ({"data": {"num_samples": 64}, "measure": {"warmup_steps": 2},
          "trials": [{"name": "a", "per_device_batch_size": 4, "gradient_accumulation_steps": 16}]},
         r"measure\.warmup_steps", r"1 epoch\(s\) of 64 samples at 64 a step run at most 1 optimizer step"),
        ({"trials": [{"name": "a", "measure": {"max_steps": 2}}], "measure": {"warmup_steps": 2}},
         r"trials\[0\]\.measure\.warmup_steps", r"expected at most max_steps - 2 \(0\)"),
        ({"data": {"lengths": {"distribution": "histogram", "histogram": {"64": 1.0}}}},
         r"data\.lengths\.histogram\.64", r"keys must be integers \(unquoted\)"),
        ({"run": {"memory_limit_gib": math.nan}}, r"run\.memory_limit_gib", "expected a number, got"),
        ({"run": {"memory_limit_gib": math.inf}}, "run", "memory_limit_gib: expected a positive number, got inf"),
        ({"data": {"lengths": {"distribution": "histogram", "histogram": {16: math.inf}}}},
         r"data\.lengths\.histogram", "expected lengths 1 to data.seq_len"),
        # A config transformers takes for a model it cannot build: every trial crashed on it.
        ({"model": {"config": {"hidden_size": 30, "num_hidden_layers": 1, "num_attention_heads": 4}}}, "model.config",
         r"transformers cannot build the model from it: The hidden size \(30\) is not a multiple of the number of "
         r"attention heads \(4\)"),
        ({"model": {"config": {**TINY["model"]["config"], "hidden_act": "bogus"}}}, "model.config",
         r"transformers cannot build the model from it: it has no 'bogus' \(an activation or other name"),
        ({"model": {"config": {**TINY["model"]["config"], "num_labels": 2}}, "data": {"num_labels": 5}},
         "data.num_labels", r"expected at most 2, the model's classes \(model.config.num_labels\)"),
        ({"data": {"num_labels": 0}}, "data.num_labels", "expected a positive integer, got 0"),
        ({"run": {"env": {"A=B": "1"}}}, "run", r"env: 'A=B' is not an environment variable's name"),
        ({"run": {"env": {"A": "x\0y"}}}, "run", r"env\.A: a value cannot hold a NUL character"),
        ({"model": {"type": "t5", "task": "causal_lm",
                    "config": {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_kv": 16, "d_ff": 64}}},
         "model.task", "causal_lm is not a task transformers has for t5"),
        # TrainingArguments takes these as written; the optimizer or the scheduler failed on them inside the trial.
        ({"training_args": {"learning_rate": "abc"}}, r"training_args\.learning_rate", "expected a number, got 'abc'"),
        ({"trials": [{"name": "a", "training_args": {"dataloader_num_workers": 1.5}}]},
         r"trials\[0\]\.training_args\.dataloader_num_workers", "expected an integer, got 1.5"),
        ({"training_args": {"lr_scheduler_type": "cosinee"}}, r"training_args\.lr_scheduler_type",
         "expected one of 'linear', 'cosine', .*, got 'cosinee'"),
        ({"training_args": {"disable_tqdm": "yes"}}, r"training_args\.disable_tqdm",
         "expected true or false, got 'yes'"),
        ({"model": {"type": "roberta", "config": {"hidden_size": 32, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2}}, "data": {"seq_len": 513}},
         "data.seq_len", r"expected at most 510, the model's positions \(model.config.max_position_embeddings less"),
    ],
)  # fmt: skip
def test_a_recipe_value_the_trial_would_fail_on_is_refused_at_its_key(changes, key, says, tmp_path):
    from helpers.runs import write_recipe

    from hfscale.recipes.recipe import load_recipe
    from hfscale.recipes.schema import RecipeError

    recipe = {**TINY, "trials": [{"name": "a"}], **changes}
    with pytest.raises(RecipeError, match=f"{key}: {says}"):
        load_recipe(write_recipe(tmp_path, recipe))


@pytest.mark.parametrize(
    "model",
    [
        {"type": "llama", "config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "intermediate_size": 64, "max_position_embeddings": 16}},
        {"type": "deberta-v2", "config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                          "intermediate_size": 64, "max_position_embeddings": 16,
                                          "relative_attention": True, "position_biased_input": False}},
        {"type": "xlnet", "config": {"d_model": 32, "n_layer": 1, "n_head": 2, "d_inner": 64}},
    ],
)  # fmt: skip
def test_models_without_a_table_of_learned_positions_take_any_length(model, tmp_path):
    from helpers.runs import write_recipe

    from hfscale.recipes.recipe import load_recipe

    recipe = {"device": "cpu", "model": model, "data": {"seq_len": 64, "token_high": 500}, "trials": [{"name": "a"}]}
    assert load_recipe(write_recipe(tmp_path, recipe)).trials[0].spec.data.seq_len == 64


def test_a_largest_batch_search_it_cannot_run_is_refused_before_the_sweep(tmp_path, capsys):
    """A limit below a trial's own batch started the search below it (the -maxbatch row ran a smaller batch than
    the trial); --find-max-batch on a script's recipe was taken, although the recipe key batch is refused there."""
    from helpers.paths import SCRIPTS
    from helpers.runs import write_recipe

    small = {**TINY, "defaults": {"per_device_batch_size": 8}, "sweep": {"batch": "both", "max_batch_limit": 4},
             "trials": [{"name": "a"}]}  # fmt: skip
    for argv in (["--dry-run"], ["--run-dir", str(tmp_path / "run")]):
        assert sweep([str(write_recipe(tmp_path, small)), *argv]) == 2
        assert "limit 4 (sweep.max_batch_limit or --max-batch-limit) is below a's own per-device batch 8" in (
            capsys.readouterr().err
        )
    assert not (tmp_path / "run").exists()
    script = {"name": "s", "device": "cpu", "workload": {"script": str(SCRIPTS / "hf_example.py")},
              "trials": [{"name": "a"}]}  # fmt: skip
    assert sweep([str(write_recipe(tmp_path, script)), "--dry-run", "--find-max-batch"]) == 2
    assert "--find-max-batch: the largest-batch search trains data hfscale builds" in capsys.readouterr().err


def test_estimate_leaves_a_pretrained_or_factory_models_config_keys_alone():
    """As the recipe loader (the same check): a hub model's or a factory's config is its own, not the model type's;
    a factory's keys are its function's keyword arguments."""
    from helpers.paths import SCRIPTS

    from hfscale.commands.estimate import _check_as_a_recipe
    from hfscale.workload.spec import DataSpec, ModelSpec

    def check(model: ModelSpec) -> None:
        _check_as_a_recipe(model, DataSpec(), model.type)

    check(ModelSpec(type="llama", pretrained="org/model", config={"num_key_value_heads": 2}))  # offline: unread
    check(ModelSpec(type="bert", factory=f"{SCRIPTS / 'user_factories.py'}:build_model", config={"num_layers": 4}))
    with pytest.raises(ValueError, match="--config num_layers: BertConfig has no key"):
        check(ModelSpec(type="bert", config={"num_layers": 4}))


def test_a_dry_run_checks_the_device_lock_variables_and_a_resume_keeps_its_recipes_keys(tmp_path, monkeypatch,
                                                                                         capsys):  # fmt: skip
    monkeypatch.setenv("HFSCALE_DEVICE_LOCK", "bogus")
    assert sweep(["cpu_small", "--dry-run"]) == 2
    assert "HFSCALE_DEVICE_LOCK='bogus'" in capsys.readouterr().err
    monkeypatch.delenv("HFSCALE_DEVICE_LOCK")
    # A run folder started before grid recipes' search keys were refused resumes as it started.
    run = tmp_path / "run"
    run.mkdir()
    recipe = yaml.safe_load((REPO / "recipes" / "cpu_small.yaml").read_text())
    (run / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "sweep": {"max_runs": 5}}), encoding="utf-8")
    (run / "results.jsonl").write_text("", encoding="utf-8")
    (run / "environment.json").write_text(json.dumps({"sweep": {"timeout_s": math.inf}}), encoding="utf-8")
    assert sweep(["--resume", str(run), "--dry-run"]) == 0, capsys.readouterr().err
    (run / "environment.json").write_text('{"sweep": {"timeout_s": NaN}}', encoding="utf-8")
    assert sweep(["--resume", str(run), "--dry-run"]) == 2
    assert "environment.json records timeout_s must be a finite number, got nan" in capsys.readouterr().err


def test_a_broken_link_in_the_way_of_a_run_folder_is_named(tmp_path, capsys):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert sweep(["cpu_small", "--only", "fp32", "--run-dir", str(tmp_path / "dangling" / "run")]) == 2
    assert f"{tmp_path / 'dangling'} is not a folder (a file, or a broken link)" in capsys.readouterr().err
