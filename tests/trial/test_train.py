"""The trial runner: model and TrainingArguments building, the result file, and a whole trial run in this process
(one rank; launched runs of every strategy are in tests/scenarios/test_strategies_cpu.py)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from helpers.models import TINY_BERT, TINY_GPT2

from hfscale.configs import write_configs
from hfscale.records.row import SCHEMA_VERSION, TrialOutcome
from hfscale.strategy import Strategy
from hfscale.trial.entry import main
from hfscale.trial.train import (
    LossRecorder,
    fsdp_block_classes,
    merge_training_args,
    read_outcome,
    run_trial,
    write_outcome,
)
from hfscale.workload.arguments import DEFAULT_SEED
from hfscale.workload.model import build_model
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

CPU = Strategy(name="fp32", device="cpu", per_device_batch_size=4)


def tiny_spec(strategy: Strategy = CPU, **changes) -> TrialSpec:
    fields = dict(
        name=strategy.name,
        strategy=strategy,
        model=ModelSpec(type="bert", config=TINY_BERT),
        data=DataSpec(num_samples=32, seq_len=32),
        measure=MeasureSpec(max_steps=3, warmup_steps=1),
    )
    return TrialSpec(**(fields | changes))


# -- building ------------------------------------------------------------------------------------------------------


def test_build_model_classification_takes_labels_from_the_data():
    model = build_model(ModelSpec(type="bert", config=TINY_BERT | {"num_labels": 2}), DataSpec(num_labels=2))
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.hidden_size == 64
    config = {k: v for k, v in TINY_BERT.items() if k != "num_labels"}
    assert build_model(ModelSpec(type="bert", config=config), DataSpec(num_labels=5)).config.num_labels == 5


def test_build_model_gpt2_causal_and_classifier():
    lm = build_model(ModelSpec(type="gpt2", task="causal_lm", config=TINY_GPT2), DataSpec())
    assert type(lm).__name__ == "GPT2LMHeadModel"
    clf = build_model(ModelSpec(type="gpt2", config=TINY_GPT2), DataSpec())
    # Decoder classifiers refuse batches without a pad id; dummy data is never padded.
    assert clf.config.pad_token_id is not None
    assert not DataSpec().token_low <= clf.config.pad_token_id < DataSpec().token_high


def test_build_model_rejects_token_ids_beyond_the_vocabulary():
    with pytest.raises(ValueError, match=r"data.token_high=30000 exceeds the model's vocab_size=1000"):
        build_model(ModelSpec(type="bert", config=TINY_BERT | {"vocab_size": 1000}), DataSpec())


def test_build_model_loads_pretrained_weights_from_a_folder(tmp_path, tiny_bert):
    tiny_bert.save_pretrained(tmp_path)
    model = build_model(ModelSpec(type="bert", pretrained=str(tmp_path)), DataSpec())
    assert model.config.hidden_size == 64
    weight = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(weight, tiny_bert.bert.embeddings.word_embeddings.weight)


def test_fsdp_block_classes_leave_out_the_embedding_holder(tiny_bert, tiny_gpt2):
    assert set(tiny_bert._no_split_modules) == {"BertEmbeddings", "BertLayer"}
    assert fsdp_block_classes(tiny_bert) == ["BertLayer"]
    assert fsdp_block_classes(tiny_gpt2) == ["GPT2Block"]


def test_training_args_precedence_recipe_then_strategy_then_runner(caplog):
    spec = tiny_spec(
        training_args={
            "learning_rate": 1e-4,
            "per_device_train_batch_size": 99,
            "logging_steps": 10,
            "save_strategy": "steps",
            "report_to": "tensorboard",
            "output_dir": "/somewhere",
        }
    )
    with caplog.at_level(logging.WARNING, logger="hfscale.trial.train"):
        merged = merge_training_args(spec, {"per_device_train_batch_size": 4, "bf16": False})
    assert merged["learning_rate"] == 1e-4  # the recipe's own
    assert merged["per_device_train_batch_size"] == 4  # the strategy wins over the recipe
    assert merged["save_strategy"] == "no"  # the runner wins over both, and says so
    assert "training_args.save_strategy='steps' is overridden" in caplog.text
    assert merged["logging_steps"] == 10  # logging is the recipe's: the loss curve does not need it
    assert merged["report_to"] == "tensorboard"  # asked for, so kept
    assert merged["average_tokens_across_devices"] is False
    assert merged["save_strategy"] == "no"
    assert merged["max_steps"] == 3
    assert merged["seed"] == DEFAULT_SEED
    assert "output_dir" not in merged


def test_tokens_are_averaged_across_devices_only_for_a_causal_lm_under_tp():
    """The Trainer divides its token count by tp (ranks sharing a batch): right only for the gathered count, which a
    causal LM's loss divides by (off, tp 2 doubled it); a classifier's loss ignores the count, and with it on the
    Trainer multiplies that loss by the data-parallel size (dp_shard 2 x tp 2 doubled it)."""
    from hfscale.strategy import FsdpSpec, ParallelismSpec

    tp2 = CPU.replace(num_processes=2, parallelism=ParallelismSpec(tp=2))
    fsdp_tp = CPU.replace(num_processes=4, fsdp=FsdpSpec(), parallelism=ParallelismSpec(dp_shard=2, tp=2))
    ddp = CPU.replace(num_processes=2)
    causal = ModelSpec(type="llama", task="causal_lm", config={})
    for strategy, expected in ((tp2, True), (fsdp_tp, True), (ddp, False)):
        spec = tiny_spec(strategy, model=causal)
        assert merge_training_args(spec, {})["average_tokens_across_devices"] is expected, strategy
    classifier = ModelSpec(type="llama", task="classification", config={})
    assert merge_training_args(tiny_spec(fsdp_tp, model=classifier), {})["average_tokens_across_devices"] is False


def test_training_args_epochs_and_seed():
    spec = tiny_spec(measure=MeasureSpec(max_steps=None, num_epochs=2.0), training_args={"seed": 7})
    merged = merge_training_args(spec, {})
    assert merged["num_train_epochs"] == 2.0
    assert merged["max_steps"] == -1
    assert merged["seed"] == 7
    assert merged["report_to"] == "none"


def test_outcome_round_trips_and_rejects_unknown_status(tmp_path):
    outcome = TrialOutcome(trial="t", status="not_applied", reason="r", mismatches=["r"], loss_curve=[1.0, 0.5])
    write_outcome(outcome, tmp_path / "result.json")
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert TrialOutcome.from_json(data | {"added_later": 1}) == outcome
    with pytest.raises(ValueError, match=r"TrialOutcome.status: expected 'ok' or 'not_applied', got 'oom'"):
        TrialOutcome(trial="t", status="oom")


# -- the loss curve without a per-step sync ------------------------------------------------------------------------


def _tiny_trainer(tmp_path, tiny_bert, **args):
    from transformers import Trainer, TrainingArguments

    from hfscale.workload.data import make_classification_dataset

    data = make_classification_dataset(num_samples=24, seq_len=16, token_high=1000, seed=0)
    kwargs = dict(per_device_train_batch_size=4, max_steps=5, use_cpu=True, report_to="none", disable_tqdm=True)
    return Trainer(
        model=tiny_bert, args=TrainingArguments(output_dir=str(tmp_path), **kwargs | args), train_dataset=data
    )


@pytest.mark.parametrize("accumulation", [1, 2])
def test_loss_recorder_gives_the_loss_the_trainer_logs(tmp_path, tiny_bert, accumulation):
    """The reference is the Trainer's own per-step log (logging_steps=1): the recorder must give the same curve."""
    trainer = _tiny_trainer(tmp_path, tiny_bert, logging_steps=1, gradient_accumulation_steps=accumulation)
    recorder = LossRecorder()
    recorder.wrap(trainer)
    trainer.train()
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 5
    assert recorder.curve(trainer) == pytest.approx(logged, rel=1e-6)


def test_a_trial_reads_no_tensor_per_step(tmp_path, monkeypatch):
    """Tensor.item() is how the Trainer's per-step logging reads the loss and the grad norm (a host-device sync on
    a GPU); the number of reads in a trial must not grow with its steps."""
    import torch

    calls = {"n": 0}
    item = torch.Tensor.item

    def counting_item(self):
        calls["n"] += 1
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    counts = []
    for steps in (3, 9):
        calls["n"] = 0
        spec = tiny_spec(
            measure=MeasureSpec(max_steps=steps, warmup_steps=1), data=DataSpec(num_samples=40, seq_len=16)
        )
        outcome = run_trial(spec)
        assert len(outcome.loss_curve) == steps
        counts.append(calls["n"])
    assert counts[1] == counts[0], f"Tensor.item() calls: {counts[0]} for 3 steps, {counts[1]} for 9"


# -- one whole trial in this process -------------------------------------------------------------------------------


def test_main_trains_verifies_and_writes_the_result(tmp_path):
    spec = tiny_spec()
    write_configs(spec.strategy, tmp_path)  # training_args.json next to the spec, as the sweep lays it out
    spec.write(tmp_path / "spec.json")
    assert main([str(tmp_path / "spec.json"), "--result", str(tmp_path / "result.json")]) == 0

    outcome = read_outcome(tmp_path / "result.json")
    assert outcome.status == "ok", outcome.mismatches
    assert outcome.trial == "fp32"
    assert len(outcome.loss_curve) == 3  # one loss per optimizer step
    assert all(math.isfinite(x) and x > 0 for x in outcome.loss_curve)
    assert outcome.final_loss == outcome.loss_curve[-1]
    assert outcome.train_runtime_s > 0 and outcome.train_samples_per_second > 0
    assert outcome.memory.peak_gib > 0
    assert outcome.throughput.measured_steps == 2  # 3 steps, 1 of warm-up
    verification = outcome.verification
    assert verification.distributed_type == "NO" and verification.wrapper == "none"
    assert verification.linear_output_dtype == "float32"
    assert outcome.world_size == 1
    assert outcome.training_args["per_device_train_batch_size"] == 4
    for phase in ("startup", "imports", "model_build", "trainer_init", "train_setup", "train_loop", "total"):
        assert outcome.timings_s[phase] >= 0, phase
    assert outcome.timings_s["total"] >= outcome.timings_s["train_call"]


@pytest.mark.parametrize("process_ends", [True, False], ids=["process-ends", "in-process"])
@pytest.mark.parametrize("code", ["recipe", "script", "model-factory", "data-factory"])
def test_only_a_trials_own_process_imports_the_training_stack_frozen(tmp_path, monkeypatch, process_ends, code):
    """``python -m hfscale.trial`` freezes what the imports leave alive (hfscale.core.collector), user code or not
    (none has run then); a call in a process that goes on (this one) must not. Only hfscale's own model and data
    then end without the interpreter's teardown: a script's or a factory's objects may have finalisers to run."""
    import hfscale.trial.entry as entry
    from hfscale.workload.spec import ScriptSpec

    calls = []
    monkeypatch.setattr(entry, "run_trial", lambda *args, own_process, **kwargs: calls.append(("trial", own_process)))
    monkeypatch.setattr(entry, "run_script", lambda *args, own_process, **kwargs: calls.append(("script", own_process)))
    monkeypatch.setattr(entry, "exit_without_teardown", lambda code: calls.append(("exit", code)))  # not this pytest
    spec = tiny_spec(
        model=ModelSpec(type="bert", config=TINY_BERT, factory="my_models:build" if code == "model-factory" else None),
        data=DataSpec(num_samples=32, seq_len=32, factory="my_data:build" if code == "data-factory" else None),
        script=ScriptSpec(path=str(tmp_path / "train.py")) if code == "script" else None,
    )
    spec.write(tmp_path / "spec.json")
    assert entry.main([str(tmp_path / "spec.json")], process_ends=process_ends) == 0
    ran = [("script" if code == "script" else "trial", process_ends)]
    assert calls == ran + ([("exit", 0)] if process_ends and code == "recipe" else [])


@pytest.mark.parametrize("own_process", [True, False], ids=["own-process", "in-process"])
def test_the_training_stack_is_imported_frozen_only_in_the_trials_own_process(monkeypatch, own_process):
    """run_trial and run_script hand ``own_process`` to the imports, which freeze only then (the imports are cached
    here: nothing is frozen in this process either way, the stand-in only records)."""
    import contextlib

    import hfscale.trial.script
    import hfscale.trial.train
    from hfscale.workload.spec import ScriptSpec

    entered = []

    @contextlib.contextmanager
    def recording():
        entered.append("frozen")
        yield

    monkeypatch.setattr(hfscale.trial.train, "frozen_after_imports", recording)
    hfscale.trial.train.import_training_stack(own_process=own_process)
    assert entered == (["frozen"] if own_process else [])

    class Imported(Exception):
        pass

    def stand_in(*, own_process):
        entered.append(own_process)
        raise Imported

    monkeypatch.setattr(hfscale.trial.train, "import_training_stack", stand_in)
    monkeypatch.setattr(hfscale.trial.script, "import_training_stack", stand_in)
    entered.clear()
    with pytest.raises(Imported):
        hfscale.trial.train.run_trial(tiny_spec(), own_process=own_process)
    with pytest.raises(Imported):
        hfscale.trial.script.run_script(tiny_spec(script=ScriptSpec(path="train.py")), own_process=own_process)
    assert entered == [own_process, own_process]


def test_a_registered_technique_takes_part_in_every_phase_of_a_trial(monkeypatch):
    """Adding a technique is registering it: the trial loads and adapts the model, prepares TrainingArguments and
    applies it to the Trainer through the registry, and the verification reads it back and checks it there."""
    import hfscale.measure.verify
    import hfscale.trial.train
    from hfscale.techniques import TECHNIQUES
    from hfscale.techniques.base import Technique

    calls: list[str] = []

    class Recording(Technique):
        name = "recording"

        def load_model(self, model, spec, scratch_dir):
            calls.append("load_model")
            return model

        def adapt_model(self, model, spec, scratch_dir):
            calls.append("adapt_model")
            return model

        def prepare_arguments(self, strategy):
            calls.append("prepare_arguments")
            return {}

        def apply(self, trainer, strategy):
            calls.append("apply")

        def collect(self, run):
            calls.append("collect")
            assert run.model is run.trainer.model and run.world_size == 1
            return {}

        def check(self, strategy, record):
            calls.append("check")
            return ["the recording technique did not take effect"]

    registry = (*TECHNIQUES, Recording())
    monkeypatch.setattr(hfscale.trial.train, "TECHNIQUES", registry)
    monkeypatch.setattr(hfscale.measure.verify, "TECHNIQUES", registry)
    outcome = run_trial(tiny_spec())
    assert calls == ["load_model", "adapt_model", "prepare_arguments", "apply", "collect", "check"]
    assert outcome.status == "not_applied"
    assert outcome.mismatches == ["the recording technique did not take effect"]


def test_a_strategy_that_did_not_take_effect_is_not_applied(tmp_path):
    """A stale training_args.json (fp32) under a bf16 strategy: the run trains in fp32 and must say so."""
    spec = tiny_spec(Strategy(name="bf16", device="cpu", precision="bf16", per_device_batch_size=4))
    write_configs(CPU, tmp_path)
    spec.write(tmp_path / "spec.json")
    assert main([str(tmp_path / "spec.json"), "--result", str(tmp_path / "result.json")]) == 0

    outcome = read_outcome(tmp_path / "result.json")
    assert outcome.status == "not_applied"
    assert outcome.verification.linear_output_dtype == "float32"
    assert any("produced float32, expected bfloat16" in m for m in outcome.mismatches)
    assert "expected bfloat16" in outcome.reason
    assert outcome.loss_curve  # the figures are kept, under a status that says they are not bf16's


@pytest.mark.parametrize(
    "argv", [["spec.json", "--log-level", "bogus"], ["missing-spec.json"]], ids=["log-level", "spec"]
)
def test_bad_arguments_are_usage_errors(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: python -m hfscale.trial" in capsys.readouterr().err


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--no-such-option"])
    assert exc.value.code == 2
    assert "usage: python -m hfscale.trial" in capsys.readouterr().err


def test_a_trial_without_lora_does_not_import_peft(tmp_path):
    """peft (and bitsandbytes and torch's compiler stack through it) costs every trial process about 1.7 s of
    its start when transformers imports it; only a LoRA trial needs it."""
    import subprocess
    import sys

    from hfscale.strategy import LoraSpec
    from hfscale.trial.train import leave_out_peft_unless_used

    lora = TrialSpec(
        name="l",
        strategy=Strategy(device="cpu", lora=LoraSpec()),
    )
    assert leave_out_peft_unless_used(lora) is False
    plain = TrialSpec(
        name="p",
        strategy=Strategy(device="cpu"),
    )
    plain.write(tmp_path / "trial.json")
    script = (
        "import sys\n"
        "from hfscale.workload.spec import TrialSpec\n"
        "from hfscale.trial.train import leave_out_peft_unless_used\n"
        f"assert leave_out_peft_unless_used(TrialSpec.read({str(tmp_path / 'trial.json')!r}))\n"
        "from transformers import Trainer\n"
        "print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
