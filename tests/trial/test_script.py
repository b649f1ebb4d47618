"""The user's-script runner in this process: which of a script's settings contradict a trial, and a script that
never trains (the real launches are in tests/scenarios/test_script.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfscale.configs import training_args_kwargs
from hfscale.strategy import Strategy
from hfscale.trial.script import ScriptDidNotTrainError, run_script, script_conflicts
from hfscale.workload.spec import MeasureSpec, ScriptSpec, TrialSpec

transformers = pytest.importorskip("transformers")


def _args(**kwargs) -> object:
    return transformers.TrainingArguments(output_dir="unused", report_to="none", use_cpu=True, **kwargs)


def _trial(**fields) -> dict:
    return training_args_kwargs(Strategy(name="t", device="cpu", **fields))


def test_a_setting_left_at_the_default_or_equal_to_the_trials_is_no_conflict() -> None:
    assert script_conflicts(_args(), _trial(precision="bf16")) == []
    assert script_conflicts(_args(bf16=True), _trial(precision="bf16")) == []
    assert script_conflicts(_args(per_device_train_batch_size=8), _trial(per_device_batch_size=8)) == []


def test_a_contradicting_setting_names_the_field_and_both_values() -> None:
    assert script_conflicts(_args(bf16=True), _trial()) == ["bf16: the script sets True, the trial asks for False"]
    found = script_conflicts(_args(per_device_train_batch_size=4, gradient_accumulation_steps=2), _trial())
    assert found == [
        "per_device_train_batch_size: the script sets 4, the trial asks for 8",
        "gradient_accumulation_steps: the script sets 2, the trial asks for 1",
    ]
    named = script_conflicts(_args(optim="adafactor"), _trial(optimizer="adamw_torch"))
    assert named == ["optim: the script sets 'adafactor', the trial asks for 'adamw_torch'"]
    # No optimizer in the strategy: the script's own is the trial's (a bare Trainer's choice), not a conflict.
    assert script_conflicts(_args(optim="adafactor"), _trial()) == []


def test_a_scripts_own_engine_is_always_a_conflict(tmp_path: Path) -> None:
    found = script_conflicts(_args(fsdp="full_shard"), _trial())
    assert len(found) == 1 and found[0].startswith("fsdp: the script sets its own") and "remove it" in found[0]


def test_a_script_that_returns_without_a_trainer_says_so(tmp_path: Path) -> None:
    script = tmp_path / "no_trainer.py"
    script.write_text("import sys\nprint('parsed', sys.argv[1:])\n", encoding="utf-8")
    spec = TrialSpec(
        name="t",
        strategy=Strategy(name="t", device="cpu"),
        measure=MeasureSpec(max_steps=2, warmup_steps=1),
        script=ScriptSpec(path=str(script), args=("--x", "1")),
    )
    with pytest.raises(ScriptDidNotTrainError, match=r"no_trainer\.py returned without building a Trainer"):
        run_script(spec, result_path=tmp_path / "result.json")
    assert not (tmp_path / "result.json").exists()
    assert TrialSpec.from_dict(spec.to_dict()) == spec  # the script travels in trial.json
