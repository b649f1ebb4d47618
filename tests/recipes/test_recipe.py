"""Recipe loading: what a user gets back for a good recipe, and the message for each kind of mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hfscale.core.validation import Invalid
from hfscale.recipes.checks import check_measure
from hfscale.recipes.recipe import load_recipe, parse_recipe
from hfscale.recipes.schema import Recipe, RecipeError
from hfscale.workload.spec import MeasureSpec

BASE = {
    "device": "cpu",
    "model": {"type": "bert", "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}},
    "data": {"num_samples": 16, "seq_len": 32},
    "training_args": {"learning_rate": "5e-5", "logging_steps": 1},
    "measure": {"max_steps": 3, "warmup_steps": 1, "timeout_s": 60},
    "defaults": {"per_device_batch_size": 4},
    "trials": [{"name": "fp32"}, {"name": "bf16", "precision": "bf16"}],
}


def write(tmp_path: Path, data: dict, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def with_(**changes) -> dict:
    return {**BASE, **changes}


def test_load_builds_trials_with_defaults_and_recipe_sections(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE))
    assert isinstance(recipe, Recipe)
    assert recipe.name == "x"  # the file's stem
    assert recipe.trial_names == ["fp32", "bf16"]
    assert recipe.baseline == "fp32"  # the first trial unless named
    fp32, bf16 = (t.spec for t in recipe.trials)
    assert fp32.strategy.per_device_batch_size == bf16.strategy.per_device_batch_size == 4
    assert (fp32.strategy.precision, bf16.strategy.precision) == ("fp32", "bf16")
    assert fp32.strategy.device == "cpu" and fp32.strategy.name == "fp32"
    assert fp32.model.config == {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    assert (fp32.data.num_samples, fp32.data.seq_len) == (16, 32)
    assert fp32.measure.max_steps == 3
    # "5e-5" is a string to PyYAML; a float field of TrainingArguments takes it as the number.
    assert fp32.training_args["learning_rate"] == pytest.approx(5e-5)
    assert isinstance(fp32.training_args["learning_rate"], float)


def test_matrix_expands_the_product_with_automatic_names(tmp_path):
    data = with_(
        trials=[{"name": "baseline"}],
        matrix={"deepspeed.zero_stage": [1, 2, 3], "precision": ["fp32", "bf16"]},
        defaults={"num_processes": 2},
    )
    recipe = load_recipe(write(tmp_path, data))
    names = recipe.trial_names
    assert names[0] == "baseline"
    assert sorted(names[1:]) == sorted(f"zero{s}-{p}" for s in (1, 2, 3) for p in ("fp32", "bf16"))
    by_name = {t.name: t.spec.strategy for t in recipe.trials}
    assert by_name["zero3-bf16"].deepspeed.zero_stage == 3
    assert by_name["zero3-bf16"].precision == "bf16"
    assert by_name["zero1-fp32"].num_processes == 2
    assert by_name["baseline"].deepspeed is None


def test_matrix_merges_with_nested_defaults_and_names_booleans(tmp_path):
    data = with_(
        trials=[],
        defaults={"deepspeed": {"zero_stage": 3}, "num_processes": 2},
        matrix={"gradient_checkpointing": [False, True], "deepspeed.offload_param": ["none", "cpu"]},
    )
    recipe = load_recipe(write(tmp_path, data))
    assert recipe.trial_names == ["default", "param-cpu", "ckpt", "ckpt-param-cpu"]
    strategy = {t.name: t.spec.strategy for t in recipe.trials}["ckpt-param-cpu"]
    assert strategy.gradient_checkpointing is True
    assert (strategy.deepspeed.zero_stage, strategy.deepspeed.offload_param) == (3, "cpu")


def test_per_trial_measure_and_run_overrides(tmp_path):
    data = with_(
        run={"memory_limit_gib": 8, "env": {"A": "1"}},
        trials=[
            {"name": "fp32"},
            {"name": "short", "measure": {"timeout_s": 5}, "run": {"memory_limit_gib": 2, "env": {"B": "2"}}},
        ],
    )
    recipe = load_recipe(write(tmp_path, data))
    fp32, short = recipe.trials
    assert (fp32.spec.measure.timeout_s, short.spec.measure.timeout_s) == (60, 5)
    assert short.spec.measure.max_steps == 3  # the rest of the recipe's measure stays
    assert (fp32.run.memory_limit_gib, short.run.memory_limit_gib) == (8, 2)
    assert short.run.env == {"A": "1", "B": "2"}


def test_unpinned_trials_follow_the_launch_pinned_ones_do_not(tmp_path):
    data = with_(trials=[{"name": "free"}, {"name": "one", "num_processes": 1}])
    recipe = load_recipe(write(tmp_path, data))
    free, one = recipe.trial_specs(num_processes=4)
    assert (free.strategy.num_processes, one.strategy.num_processes) == (4, 1)
    assert [s.strategy.num_processes for s in recipe.trial_specs()] == [1, 1]


def test_launch_counts_that_break_a_strategy_name_the_trial(tmp_path):
    recipe = load_recipe(write(tmp_path, with_(trials=[{"name": "t"}])))
    with pytest.raises(
        RecipeError, match=r"x\.yaml: trials\[0\] \(with the launch's num_processes=3, num_machines=2\)"
    ):
        recipe.resolve(num_processes=3, num_machines=2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"trials": [{"name": "a"}, {"name": "b"}, {"name": "c", "deepspeed": {"zero_stage": 4}}]},
            r"x\.yaml: trials\[2\]\.deepspeed\.zero_stage: expected one of 0, 1, 2, 3, got 4$",
        ),
        (
            {"trials": [{"name": "a", "deepspeed": {"zero_stag": 2}}]},
            r"x\.yaml: trials\[0\]\.deepspeed\.zero_stag: unknown key \(did you mean 'zero_stage'\?\)",
        ),
        (
            {"trials": [{"name": "a", "precison": "bf16"}]},
            r"x\.yaml: trials\[0\]\.precison: unknown key \(did you mean 'precision'\?\); valid keys here are",
        ),
        ({"modle": {}}, r"x\.yaml: modle: unknown key \(did you mean 'model'\?\)"),
        ({"data": {"seq_len": "long"}}, r"x\.yaml: data\.seq_len: expected an integer, got 'long'"),
        ({"model": {"type": "bert", "task": "qa"}}, r"x\.yaml: model\.task: expected one of 'classification'"),
        ({"device": "tpu"}, r"x\.yaml: device: expected one of 'cuda', 'cpu', got 'tpu'"),
        (
            {"trials": [{"name": "a", "gradient_checkpointing": "yes"}]},
            r"trials\[0\]\.gradient_checkpointing: expected true or false, got 'yes'",
        ),
        (
            {"trials": [{"name": "a", "per_device_batch_size": True}]},
            r"trials\[0\]\.per_device_batch_size: expected an integer, got true",
        ),
        ({"measure": {"repeats": 0}}, r"x\.yaml: measure\.repeats: expected a positive integer, got 0"),
        (
            {"measure": {"warmup_steps": -1}},
            r"x\.yaml: measure\.warmup_steps: expected an integer 0 or more, or 'auto' to detect the warm-up from "
            r"each run's step times, got -1$",
        ),
        (
            {"trials": [{"name": "a", "measure": {"warmup_steps": "detect"}}]},
            r"x\.yaml: trials\[0\]\.measure\.warmup_steps: expected an integer or one of 'auto', got 'detect'$",
        ),
        ({"measure": {"timeot_s": 1}}, r"measure\.timeot_s: unknown key \(did you mean 'timeout_s'\?\)"),
        (
            {"trials": [{"name": "a", "measure": {"timeout_s": -1}}]},
            r"trials\[0\]\.measure\.timeout_s: expected a positive number of seconds",
        ),
        ({"run": {"memory_limit_gib": 0}}, r"x\.yaml: run: memory_limit_gib: expected a positive number"),
        (
            {"training_args": {"per_device_train_batch_size": 8}},
            r"training_args\.per_device_train_batch_size: set by the strategy's per_device_batch_size",
        ),
        ({"training_args": {"bf16": True}}, r"training_args\.bf16: set by the strategy's precision"),
        ({"training_args": {"optim": "adamw_torch"}}, r"training_args\.optim: set by the strategy's optimizer"),
        ({"training_args": {"max_steps": 5}}, r"training_args\.max_steps: set by the recipe's measure\.max_steps"),
        (
            {"training_args": {"learnig_rate": 1.0}},
            r"training_args\.learnig_rate: not a transformers\.TrainingArguments field \(did you mean 'learning_rate'",
        ),
        ({"defaults": {"device": "cuda"}}, r"defaults\.device: the device is set once, at the top of the recipe"),
        # A StrategyError keeps its own words, behind the file and the trial's path.
        (
            {"trials": [{"name": "a", "precision": "fp16"}]},
            r"x\.yaml: trials\[0\]: strategy\.precision='fp16' with strategy\.device='cpu'",
        ),
        (
            {"trials": [{"name": "a", "deepspeed": {"zero_stage": 2, "offload_param": "cpu"}}]},
            r"x\.yaml: trials\[0\]\.deepspeed: deepspeed\.offload_param='cpu' needs deepspeed\.zero_stage=3",
        ),
        (
            {"trials": [{"name": "a", "deepspeed": {"zero_stage": 2}, "fsdp": {"version": 2}}]},
            r"x\.yaml: trials\[0\]: strategy\.deepspeed and strategy\.fsdp are both set",
        ),
        ({"trials": [{"name": "a b"}]}, r"x\.yaml: trials\[0\]: strategy\.name: 'a b' must be non-empty letters"),
        # Issue 11, items 5, 11 and 12: refused when the recipe loads, not when a trial runs (or writes elsewhere).
        ({"name": "../../x"}, r"/x\.yaml: name: '\.\./\.\./x' is not a plain folder name \(it names the run folder"),
        ({"name": "/x"}, r"/x\.yaml: name: '/x' is not a plain folder name"),
        ({"name": ".."}, r"/x\.yaml: name: '\.\.' is not a plain folder name"),
        ({"trials": [{"name": ".."}]}, r"/x\.yaml: trials\[0\]: strategy\.name: '\.\.' must be .* not only dots"),
        ({"trials": [{"name": "."}]}, r"/x\.yaml: trials\[0\]: strategy\.name: '\.' must be"),
        (
            {"model": {"type": "bertt"}},
            r"/x\.yaml: model\.type: unknown model type 'bertt' \(did you mean 'bert'.*expected a transformers model",
        ),
        (
            {"data": {"token_high": 40000}},
            r"/x\.yaml: data\.token_high: data\.token_high=40000 exceeds the model's vocab_size=30522",
        ),
        (
            {"model": {"type": "gpt2", "config": {"vocab_size": 1000}}},
            r"/x\.yaml: data\.token_high: data\.token_high=30000 exceeds the model's vocab_size=1000",
        ),
        (
            {"training_args": {"auto_find_batch_size": True}},
            r"/x\.yaml: training_args\.auto_find_batch_size: refused: after an out-of-memory error the Trainer halves",
        ),
        (
            {"trials": [{"name": "a", "training_args": {"auto_find_batch_size": True}}]},
            r"/x\.yaml: trials\[0\]\.training_args\.auto_find_batch_size: refused: .*--find-max-batch",
        ),
        ({"trials": [], "matrix": None}, r"x\.yaml: no trials: give a `trials:` list and/or a `matrix:`"),
        ({"baseline": "nope"}, r"x\.yaml: baseline: 'nope' is not a trial; trials are fp32, bf16"),
        (
            {"matrix": {"deepspeed.zero_stage": [1, 7]}},
            r"x\.yaml: matrix\.deepspeed\.zero_stage\[1\]: expected one of 0, 1, 2, 3, got 7",
        ),
        ({"matrix": {"precission": ["fp32"]}}, r"x\.yaml: matrix\.precission: unknown key \(did you mean 'precision'"),
        ({"matrix": {"precision": []}}, r"x\.yaml: matrix\.precision: expected a non-empty list of values"),
        (
            {"trials": [], "matrix": {"deepspeed.offload_param": ["cpu"], "deepspeed.zero_stage": [1]}},
            r"x\.yaml: matrix\[param-cpu-zero1\]\.deepspeed: deepspeed\.offload_param='cpu' needs",
        ),
        # Issue 12: the batch axis, the new strategy sections, and config keys transformers would silently keep.
        (
            {"sweep": {"batch": "largest"}},
            r"x\.yaml: sweep\.batch: expected one of 'fixed', 'max', 'both', got 'largest'$",
        ),
        ({"sweep": {"bach": "max"}}, r"x\.yaml: sweep\.bach: unknown key \(did you mean 'batch'\?\)"),
        (
            {"trials": [{"name": "a", "batch": "biggest"}]},
            r"x\.yaml: trials\[0\]\.batch: expected one of 'fixed', 'max', 'both', got 'biggest'$",
        ),
        ({"sweep": {"max_batch_limit": 0}}, r"x\.yaml: sweep: max_batch_limit: expected a positive integer, got 0"),
        (
            {"sweep": {"batch": "both"}, "trials": [{"name": "a"}, {"name": "a-maxbatch"}]},
            r"x\.yaml: trials\[1\]: trial name 'a-maxbatch' is the name of 'a''s max-batch row \(batch: both\); rename",
        ),
        (
            {"matrix": {"lora.rnk": [4]}},
            r"x\.yaml: matrix\.lora\.rnk: unknown key \(did you mean lora\.rank\?\)",
        ),
        (
            {"trials": [{"name": "a", "torch_compile": {"mode": "fast"}}]},
            r"x\.yaml: trials\[0\]\.torch_compile\.mode: expected one of 'default', 'reduce-overhead'",
        ),
        (
            {"model": {"type": "llama", "task": "causal_lm", "config": {"num_key_value_head": 2}}},
            r"x\.yaml: model\.config\.num_key_value_head: LlamaConfig has no key 'num_key_value_head' \(did you "
            r"mean 'num_key_value_heads'\?\)",
        ),
        (
            {"training_args": {"torch_compile": True}},
            r"x\.yaml: training_args\.torch_compile: set by the strategy's torch_compile section",
        ),
    ],
)
def test_errors_name_the_file_and_the_key_path(tmp_path, changes, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(write(tmp_path, with_(**changes)))


def test_plain_names_and_an_explicit_false_auto_find_batch_size_load(tmp_path):
    recipe = load_recipe(write(tmp_path, with_(name="my-run_2.x", training_args={"auto_find_batch_size": False})))
    assert recipe.name == "my-run_2.x"
    assert recipe.trials[0].spec.training_args == {"auto_find_batch_size": False}


def test_duplicate_names_are_rejected_explicit_and_from_the_matrix(tmp_path):
    twice = with_(trials=[{"name": "a"}, {"name": "a", "precision": "bf16"}])
    with pytest.raises(RecipeError, match=r"trials\[1\]: duplicate trial name 'a' \(also trials\[0\]\)"):
        load_recipe(write(tmp_path, twice))
    clash = with_(trials=[{"name": "zero2"}], defaults={"num_processes": 2}, matrix={"deepspeed.zero_stage": [2]})
    with pytest.raises(RecipeError, match=re.escape("matrix[zero2]: duplicate trial name 'zero2' (also trials[0])")):
        load_recipe(write(tmp_path, clash))
    # Two combinations named alike cannot be renamed in the matrix: the message says what can be done instead.
    alike = with_(trials=[], matrix={"lora": [{"rank": 4, "target_modules": ["query"]},
                                              {"rank": 4, "target_modules": ["value"]}]})  # fmt: skip
    said = r"duplicate trial name 'lora-r4' \(also matrix\[lora-r4\]\); a matrix names its trials from their values"
    with pytest.raises(RecipeError, match=said + r".*list them under trials: with names"):
        load_recipe(write(tmp_path, alike))
    # An axis that sets what another varies made a trial named for both (zero2-zero3) that ran one of them.
    overlap = with_(trials=[], defaults={"num_processes": 2},
                    matrix={"deepspeed": [{"zero_stage": 2}], "deepspeed.zero_stage": [3]})  # fmt: skip
    with pytest.raises(RecipeError, match=r"matrix\.deepspeed\.zero_stage: overlaps the axis 'deepspeed'"):
        load_recipe(write(tmp_path, overlap))
    with pytest.raises(RecipeError, match=r"matrix: expected a mapping of strategy field -> list of values, got an "
                                          r"empty one"):  # fmt: skip
        load_recipe(write(tmp_path, with_(matrix={})))


def test_a_yaml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("trials: [\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=r"broken\.yaml: not valid YAML"):
        load_recipe(path)


def test_parse_recipe_from_data_uses_the_given_source():
    with pytest.raises(RecipeError, match=r"^inline: trials\[0\]\.optimizer: expected one of"):
        parse_recipe(with_(trials=[{"name": "a", "optimizer": "lion"}]), source="inline")
    recipe = parse_recipe(BASE, source="inline", default_name="mine")
    assert recipe.name == "mine" and recipe.path == "inline"


def test_recipe_files_are_read_with_safe_load_only(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['true']\ntrials: [{name: a}]\n", encoding="utf-8")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(path)


def test_trials_and_defaults_take_dotted_keys_too(tmp_path):
    data = with_(
        defaults={"deepspeed.zero_stage": 3, "num_processes": 2},
        trials=[{"name": "z3"}, {"name": "z3-offload", "deepspeed.offload_optimizer": "cpu"}],
    )
    z3, offload = (t.spec.strategy for t in load_recipe(write(tmp_path, data)).trials)
    assert (z3.deepspeed.zero_stage, z3.deepspeed.offload_optimizer) == (3, "none")
    assert (offload.deepspeed.zero_stage, offload.deepspeed.offload_optimizer) == (3, "cpu")


def test_unreadable_recipe_paths_are_recipe_errors(tmp_path: Path) -> None:
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    with pytest.raises(RecipeError, match=r"folder\.yaml: is a folder"):
        load_recipe(folder)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\x00")
    with pytest.raises(RecipeError, match=r"binary\.yaml: not a UTF-8 text file"):
        load_recipe(binary)


@pytest.mark.parametrize("seed", [None, "abc", 1.5, True])
def test_a_seed_that_is_not_an_integer_is_refused_at_load(tmp_path, seed):
    with pytest.raises(RecipeError, match=r"x\.yaml: training_args\.seed: expected an integer"):
        load_recipe(write(tmp_path, with_(training_args={"seed": seed})))


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    """PyYAML keeps the last of two equal keys without a word: a second trials: block replaced the first and the
    sweep ran only its trials. A merge (<<) is still overridden by the mapping's own keys, as YAML means it."""
    text = yaml.safe_dump(BASE, sort_keys=False) + "trials:\n  - {name: ckpt, gradient_checkpointing: true}\n"
    (tmp_path / "x.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(RecipeError, match=r"(?s)x\.yaml: not valid YAML: .*found the key 'trials' twice") as raised:
        load_recipe(tmp_path / "x.yaml")
    second = max(k for k, line in enumerate(text.splitlines(), 1) if line == "trials:")
    assert f"line {second}," in str(raised.value)  # the second one's line
    merged = yaml.safe_dump({k: v for k, v in BASE.items() if k != "trials"}, sort_keys=False) + (
        "trials:\n  - &base {name: fp32, per_device_batch_size: 4}\n"
        "  - {<<: *base, name: bs2, per_device_batch_size: 2}\n"
    )
    (tmp_path / "m.yaml").write_text(merged, encoding="utf-8")
    recipe = load_recipe(tmp_path / "m.yaml")
    assert [(t.name, t.spec.strategy.per_device_batch_size) for t in recipe.trials] == [("fp32", 4), ("bs2", 2)]


def test_a_merge_into_a_mapping_that_itself_merges_is_not_a_repeat(tmp_path):
    """PyYAML folds a deeper mapping's merge in place before the mapping that merges it: its merged keys then read
    as given twice to a check made after the fold (a valid recipe refused)."""
    rest = yaml.safe_dump({k: v for k, v in BASE.items() if k not in ("trials", "measure")}, sort_keys=False)
    text = rest + (
        "trials:\n  - name: a\n    measure: &long {<<: {warmup_steps: 2, max_steps: 20}, max_steps: 6}\n"
        "measure: {<<: *long, repeats: 3}\n"
    )
    (tmp_path / "x.yaml").write_text(text, encoding="utf-8")
    (trial,) = load_recipe(tmp_path / "x.yaml").trials
    assert (trial.spec.measure.warmup_steps, trial.spec.measure.max_steps, trial.spec.measure.repeats) == (2, 6, 3)


def test_training_args_of_the_right_type_load_as_written(tmp_path):
    """The type check of training_args takes what TrainingArguments takes: YAML's 5e-5 (a string) as a number, an
    integer where a number goes, a scheduler by name, null for clipping off (the Trainer reads it so), a list."""
    given = {"learning_rate": "5e-5", "logging_steps": 10, "lr_scheduler_type": "cosine", "max_grad_norm": None,
             "report_to": ["none"], "disable_tqdm": True, "run_name": "x"}  # fmt: skip
    recipe = load_recipe(write(tmp_path, with_(training_args=given)))
    assert recipe.training_args == given | {"learning_rate": 5e-5}
    # YAML 1.1 reads an unquoted `no` as false: where an enum's names hold "no", it is that name.
    rest = yaml.safe_dump({k: v for k, v in BASE.items() if k != "training_args"})
    (tmp_path / "no.yaml").write_text(rest + "training_args: {logging_strategy: no}\n", encoding="utf-8")
    assert load_recipe(tmp_path / "no.yaml").training_args == {"logging_strategy": "no"}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"training_args": {"logging_steps": 0}}, r"x\.yaml: training_args: .*requires non-zero --logging_steps"),
        (
            {"training_args": {"dataloader_prefetch_factor": 2}},
            r"x\.yaml: training_args: .*--dataloader_prefetch_factor can only be set when .*dataloader_num_workers > 0",
        ),
        (
            {"trials": [{"name": "a", "training_args": {"logging_steps": 1.5}}]},
            r"x\.yaml: trials\[0\]\.training_args: transformers\.TrainingArguments refuses the trial's arguments: "
            r"--logging_steps must be an integer",
        ),
    ],
)
def test_training_args_that_transformers_refuses_are_refused_before_anything_runs(
    tmp_path, monkeypatch, section, message
):
    """Values of the right type that TrainingArguments refuses when it is built: refused at load, not a crashed row
    per trial; the check builds them without setting up a device (a device set up here fails the test)."""
    from transformers import TrainingArguments

    def no_device(self):
        raise AssertionError("the recipe check set up a device")

    monkeypatch.setattr(TrainingArguments, "_setup_devices", property(no_device))
    with pytest.raises(RecipeError, match=message):
        load_recipe(write(tmp_path, with_(**section)))
    # The runner's own keywords sit over the recipe's: a best model the runner's "no" strategies make consistent.
    load_recipe(write(tmp_path, with_(training_args={"load_best_model_at_end": True, "bf16_full_eval": True})))


def test_a_refused_training_arg_is_named_where_it_is_written(tmp_path):
    """The recipe's section when it fails without the trial's own; a value a library raises other than ValueError
    (a missing file) is a message too, not a traceback; a scheduler that needs evaluations says why it cannot be."""
    trials = [{"name": "a", "training_args": {"learning_rate": 1e-3}}]
    with pytest.raises(RecipeError, match=r"x\.yaml: training_args: .*requires non-zero --logging_steps"):
        load_recipe(write(tmp_path, with_(training_args={"logging_steps": 0}, trials=trials)))
    missing = str(tmp_path / "nope.json")
    with pytest.raises(
        RecipeError, match=r"x\.yaml: training_args: .*refuses the trial's arguments: FileNotFoundError"
    ):
        load_recipe(write(tmp_path, with_(training_args={"accelerator_config": missing})))
    # A null the Trainer cannot take is named at its key, not as Python's comparison error under the section.
    with pytest.raises(
        RecipeError, match=r"x\.yaml: training_args\.logging_steps: null, where .*needs a value .*leave the key out"
    ):
        load_recipe(write(tmp_path, with_(training_args={"logging_steps": None})))
    # Beside a null the Trainer takes (max_grad_norm: no clipping), and in a trial's own section over it.
    with pytest.raises(RecipeError, match=r"x\.yaml: training_args\.logging_steps: null, where"):
        load_recipe(write(tmp_path, with_(training_args={"max_grad_norm": None, "logging_steps": None})))
    # A null no trial runs with (each writes its own value) is no refusal; one the trial does not write is named
    # in the recipe's section, where it is written.
    overridden = with_(
        training_args={"logging_steps": None}, trials=[{"name": "a", "training_args": {"logging_steps": 5}}]
    )
    assert load_recipe(write(tmp_path, overridden)).trials[0].spec.training_args["logging_steps"] == 5
    steps = [{"name": "a", "training_args": {"logging_strategy": "steps"}}]
    with pytest.raises(RecipeError, match=r"x\.yaml: training_args\.logging_steps: null, where"):
        load_recipe(
            write(tmp_path, with_(training_args={"logging_steps": None, "logging_strategy": "no"}, trials=steps))
        )
    # Two nulls that fail, and a null beside another refusal: the first null that fails is named.
    for section in (
        {"logging_steps": None, "warmup_steps": None},
        {"logging_steps": None, "dataloader_prefetch_factor": 2},
    ):
        with pytest.raises(RecipeError, match=r"x\.yaml: training_args\.logging_steps: null, where"):
            load_recipe(write(tmp_path, with_(training_args=section)))
    nulls = with_(
        training_args={"max_grad_norm": None}, trials=[{"name": "a", "training_args": {"logging_steps": None}}]
    )
    with pytest.raises(RecipeError, match=r"x\.yaml: trials\[0\]\.training_args\.logging_steps: null, where"):
        load_recipe(write(tmp_path, nulls))
    with pytest.raises(
        RecipeError, match=r"trials\[0\]\.training_args\.lr_scheduler_type: refused: reduce_lr_on_plateau .*never"
    ):
        load_recipe(
            write(
                tmp_path, with_(trials=[{"name": "a", "training_args": {"lr_scheduler_type": "reduce_lr_on_plateau"}}])
            )
        )


def test_batch_axis_and_technique_sections_load_with_dotted_keys_and_names(tmp_path):
    data = with_(
        sweep={"batch": "both", "max_batch_limit": 16},
        trials=[{"name": "fp32"}],
        matrix={"attn_implementation": ["eager", "sdpa"], "lora.rank": [4]},
    )
    recipe = load_recipe(write(tmp_path, data))
    assert recipe.sweep.batch == "both" and recipe.sweep.max_batch_limit == 16
    assert recipe.trial_names == ["fp32", "attn-eager-lora-r4", "attn-sdpa-lora-r4"]
    lora = recipe.trials[1].spec.strategy.lora
    assert lora is not None and lora.rank == 4 and lora.alpha == 16  # the rest of the section is its defaults
    assert load_recipe(write(tmp_path, BASE)).sweep.batch == "fixed"


def test_a_batch_larger_than_the_data_set_is_refused_at_load(tmp_path):
    # Issue 28: 16 samples and a per-device batch of 64 loaded, launched, and ran one step of 16 (not_applied).
    big = with_(trials=[{"name": "a"}, {"name": "b"}, {"name": "c", "per_device_batch_size": 64}])
    with pytest.raises(
        RecipeError,
        match=re.escape(
            "x.yaml: trials[2].per_device_batch_size: one optimizer step takes 64 samples (batch 64 x accumulation 1 "
            "x 1 data-parallel replica(s)), more than data.num_samples 16"
        ),
    ):
        load_recipe(write(tmp_path, big))
    # Processes and accumulation count too; the matrix names its trial.
    pair = with_(trials=[{"name": "ddp", "num_processes": 2, "gradient_accumulation_steps": 4}])
    with pytest.raises(RecipeError, match=r"trials\[0\]\.per_device_batch_size: one optimizer step takes 32 samples"):
        load_recipe(write(tmp_path, pair))
    matrix = with_(trials=[], matrix={"per_device_batch_size": [8, 32]})
    with pytest.raises(RecipeError, match=r"x\.yaml: matrix\[bs32\]\.per_device_batch_size: .* data\.num_samples 16"):
        load_recipe(write(tmp_path, matrix))
    # A trial that follows the launch's process count is checked against it when the sweep resolves it.
    recipe = load_recipe(write(tmp_path, BASE))
    assert [t.spec.strategy.num_processes for t in recipe.resolve(num_processes=4)] == [4, 4]  # 16 samples: fits
    with pytest.raises(
        RecipeError,
        match=re.escape("x.yaml: trials[0] (with the launch's num_processes=8): per_device_batch_size: one optimizer"),
    ):
        recipe.resolve(num_processes=8)


def test_trial_names_are_read_without_building_a_model(tmp_path, monkeypatch):
    """What a finished run's reader needs (the report's coverage line): the names, as the full load gives them."""
    import hfscale.recipes.checks
    from hfscale.recipes.catalog import RECIPES_DIR
    from hfscale.recipes.recipe import read_trial_names

    matrix = {"deepspeed.zero_stage": [1, 2], "precision": ["fp32", "bf16"]}
    unnamed = [{"precision": "bf16"}, {"deepspeed.zero_stage": 2, "num_processes": 2}]
    recipes = [
        *sorted(RECIPES_DIR.glob("*.yaml")),
        write(tmp_path, with_(trials=[{"name": "baseline"}], matrix=matrix, defaults={"num_processes": 2}), "m.yaml"),
        write(tmp_path, with_(trials=unnamed), "a.yaml"),
    ]
    expected = {path: load_recipe(path).trial_names for path in recipes}

    def no_model(*args, **kwargs):
        raise AssertionError("read_trial_names validated a model")

    monkeypatch.setattr(hfscale.recipes.checks, "check_model", no_model)
    for path in recipes:
        assert read_trial_names(path) == expected[path], path.name
    with pytest.raises(RecipeError, match=r"x\.yaml: trials\[0\]: expected a mapping"):
        read_trial_names(write(tmp_path, with_(trials=["fp32"])))


def test_a_detected_warmup_loads_for_the_recipe_or_one_trial(tmp_path):
    trials = [{"name": "fixed", "measure": {"warmup_steps": 0}}, {"name": "auto"}]
    recipe = load_recipe(write(tmp_path, with_(measure={**BASE["measure"], "warmup_steps": "auto"}, trials=trials)))
    fixed, auto = (t.spec.measure for t in recipe.trials)
    assert (fixed.warmup_steps, auto.warmup_steps) == (0, "auto")
    # Where a run's length is planned beforehand (a batch-search probe), "auto" plans the default warm-up.
    assert (fixed.planned_warmup_steps, auto.planned_warmup_steps) == (0, 5)


def test_check_measure_refuses_what_the_loader_would_not_build():
    # A MeasureSpec made in Python skips the loader's type walk: the range check still names the key.
    with pytest.raises(Invalid, match=r"expected an integer 0 or more, or 'auto'.*, got 'Auto'$") as caught:
        check_measure(MeasureSpec(warmup_steps="Auto"), "measure")  # type: ignore[arg-type]
    assert caught.value.path == "measure.warmup_steps"


def test_repeats_from_the_command_line_replace_each_trials_and_bound_a_target_precision(tmp_path):
    measure = {**BASE["measure"], "repeats": 2}
    trials = [{"name": "fp32"}, {"name": "seq", "measure": {"target_precision": 0.05, "max_repeats": 3}}]
    recipe = load_recipe(write(tmp_path, with_(measure=measure, trials=trials)))
    assert [t.spec.measure.repeats for t in recipe.resolve()] == [2, 2]
    fixed, sequential = (t.spec.measure for t in recipe.resolve(repeats=4))
    assert (fixed.repeats, fixed.most_runs) == (4, 4)
    # With a target precision --repeats is the fewest runs; the most is raised to it rather than refused.
    assert (sequential.repeats, sequential.max_repeats, sequential.most_runs) == (4, 4, 4)
    assert recipe.resolve(repeats=1)[1].spec.measure.most_runs == 3
