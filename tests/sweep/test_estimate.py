"""The sweep with the memory estimate, predicted-OOM skipping and the largest-batch search wired in.

Fast tests run no trial process (every trial is skipped, or only the plan is built) or read the session's shared
tiny sweep (``tiny_sweep_run``: its rows carry the estimate made before each trial ran); the ``slow`` one runs a
largest-batch search under an address-space limit (``run.memory_limit_gib``, RLIMIT_AS). How the report renders
estimates, parity and searches is tested with the report (tests/test_report.py), from the same shared sweep.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from helpers.runs import write_recipe

from hfscale.commands.sweep import main
from hfscale.estimate import estimate_memory
from hfscale.launch.plan import SweepError, SweepSettings, estimate_runs, plan_runs
from hfscale.recipes.recipe import load_recipe, parse_recipe
from hfscale.recipes.schema import RecipeError
from hfscale.results.run_folder import RunFolder, read_results
from hfscale.sweep.batch import probe_spec
from hfscale.sweep.loop import run_sweep

GIB = 2**30
MIB = 2**20

TINY_MODEL = {
    "type": "bert",
    "task": "classification",
    "config": {
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
    },
}


def tiny_recipe(**over: Any) -> dict[str, Any]:
    return {
        "name": "tiny",
        "device": "cpu",
        "model": TINY_MODEL,
        "data": {"num_samples": 64, "seq_len": 32, "token_high": 1000},
        "training_args": {"report_to": "none", "seed": 0},
        "measure": {"warmup_steps": 1, "max_steps": 8, "timeout_s": 300, "repeats": 1},
        "run": {"env": {"OMP_NUM_THREADS": "1"}},
        "baseline": "fp32",
        "defaults": {"per_device_batch_size": 4, "num_processes": 1, "optimizer": "adamw_torch"},
        # big: a batch of the whole data set (a larger one is refused at load: the steps could not fill it).
        "trials": [{"name": "fp32"}, {"name": "big", "per_device_batch_size": 64}],
        **over,
    }


# -- recipe: per-trial training arguments --------------------------------------------------------------------------


def test_a_trial_overrides_training_args_key_by_key():
    recipe = parse_recipe(
        tiny_recipe(
            training_args={"learning_rate": "5e-5", "seed": 3},
            trials=[{"name": "fp32"}, {"name": "lr10", "training_args": {"learning_rate": 10}}],
        )
    )
    fp32, lr10 = (t.spec for t in recipe.trials)
    assert fp32.training_args == {"learning_rate": 5e-5, "seed": 3}
    assert lr10.training_args == {"learning_rate": 10, "seed": 3}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"learnig_rate": 1.0}, r"trials\[1\]\.training_args\.learnig_rate: not a transformers\.TrainingArguments"),
        ({"bf16": True}, r"trials\[1\]\.training_args\.bf16: set by the strategy's precision"),
        (["lr"], r"trials\[1\]\.training_args: expected a mapping, got a list"),
    ],
)
def test_a_trial_training_args_error_names_the_trial(override, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(tiny_recipe(trials=[{"name": "fp32"}, {"name": "x", "training_args": override}]))


# -- estimates and predicted out of memory, without launching -------------------------------------------------------


def test_every_run_carries_its_estimate_and_only_those_over_the_budget_are_skipped():
    recipe = parse_recipe(tiny_recipe())
    small, big = (estimate_memory(t.spec) for t in recipe.trials)
    assert big.total_gib > small.total_gib  # the estimate grows with the batch
    runs = plan_runs(recipe.trials, gpu_count=0, num_machines=1)

    plain = estimate_runs(runs)
    assert [r.estimate for r in plain] == [small, big]
    assert all(r.skip_reason is None and not r.predicted_oom for r in plain)

    budget = int((small.total_gib + big.total_gib) / 2 * GIB)  # CPU: no reserve on top of the estimate
    fp32, big_run = estimate_runs(runs, budget_bytes=budget, skip_predicted_oom=True)
    assert fp32.skip_reason is None and not fp32.predicted_oom
    assert big_run.predicted_oom
    assert f"{big.total_gib:.2f} GiB peak per device" in big_run.skip_reason
    assert f"budget {budget / GIB:.2f} GiB" in big_run.skip_reason

    with pytest.raises(SweepError, match=r"--skip-predicted-oom needs a memory budget.*--memory-budget"):
        estimate_runs(runs, skip_predicted_oom=True)


def test_a_trial_the_estimator_cannot_model_is_launched_without_an_estimate(monkeypatch):
    import hfscale.estimate

    def cannot(spec, *args, **kwargs):
        raise ValueError(f"optimizer {spec.strategy.optimizer!r}: no memory model")

    monkeypatch.setattr(hfscale.estimate, "estimate_memory", cannot)
    monkeypatch.setattr(hfscale.estimate, "predict_fit", cannot)
    recipe = parse_recipe(tiny_recipe())
    runs = estimate_runs(
        plan_runs(recipe.trials, gpu_count=0, num_machines=1), budget_bytes=MIB, skip_predicted_oom=True
    )
    assert all(r.estimate is None and r.skip_reason is None for r in runs)
    assert runs[0].estimate_error == "ValueError: optimizer 'adamw_torch': no memory model"


def test_skip_predicted_oom_launches_nothing_and_records_the_prediction(tmp_path):
    recipe = write_recipe(tmp_path, tiny_recipe())
    run = tmp_path / "run"
    settings = SweepSettings(memory_budget_bytes=MIB, skip_predicted_oom=True)
    outcome = run_sweep(recipe, run_dir=run, settings=settings, report=False, progress=lambda line: None)

    specs = {t.name: t.spec for t in load_recipe(recipe).trials}
    rows = read_results(run)
    assert [r.status for r in rows] == ["skipped", "skipped"]
    for row in rows:
        predicted = estimate_memory(specs[row.trial])
        assert row.estimate == predicted
        assert row.reason.startswith("predicted out of memory: ")
        assert f"{predicted.total_gib:.2f} GiB peak per device > budget 0.00 GiB" in row.reason
        assert row.exit_code is None and row.wall_time_s is None and row.launch is None
    # No trial was launched: not even its configs were written (the folder itself is checked writable first).
    assert not (run / "trials").exists() or not any((run / "trials").iterdir())
    assert outcome.rows == rows
    env = json.loads((run / "environment.json").read_text(encoding="utf-8"))
    assert env["sweep"]["memory_budget_bytes"] == MIB and env["sweep"]["skip_predicted_oom"] is True


def test_skip_predicted_oom_on_cpu_without_a_budget_is_refused_before_anything_is_written(tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_recipe())
    assert main([str(recipe), "--skip-predicted-oom", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--skip-predicted-oom needs a memory budget" in err and "--memory-budget" in err
    assert not (tmp_path / "run").exists()


def test_cli_help_and_bad_budget(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--memory-budget", "--skip-predicted-oom", "--find-max-batch", "--max-batch-limit"):
        assert option in out
    with pytest.raises(SystemExit):
        main(["r.yaml", "--memory-budget", "80"])
    assert "cannot read '80' as a memory size" in capsys.readouterr().err
    assert main(["r.yaml", "--find-max-batch", "--probe-steps", "1"]) == 2
    assert "hfscale sweep: error: --probe-steps must be at least 2, got 1" in capsys.readouterr().err


def test_dry_run_shows_each_trials_predicted_peak_and_what_would_be_skipped(tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_recipe())
    specs = {t.name: t.spec for t in load_recipe(recipe).trials}
    fp32 = estimate_memory(specs["fp32"]).total_gib
    big = estimate_memory(specs["big"]).total_gib
    budget_mib = (fp32 + big) / 2 * 1024
    argv = [str(recipe), "--dry-run", "--skip-predicted-oom", "--memory-budget", f"{budget_mib:.3f}MiB"]
    assert main([*argv, "--find-max-batch"]) == 0
    out = capsys.readouterr().out
    blocks = dict(re.findall(r"^- (\w+): .*\n((?:    .*\n)+)", out, re.MULTILINE))
    assert f"predicted peak {fp32:.3f} GiB per device (weights " in blocks["fp32"]
    assert f"predicted peak {big:.3f} GiB per device (weights " in blocks["big"]
    assert "skipped" not in blocks["fp32"]
    assert "skipped: predicted out of memory" in blocks["big"]
    assert "search the largest batch that fits (up to 1024" in out
    assert not (tmp_path / "runs").exists()


def test_a_probe_trains_full_batches_for_its_few_steps():
    spec = parse_recipe(tiny_recipe()).trials[0].spec
    spec = spec.__class__(**{**spec.__dict__, "strategy": spec.strategy.replace(gradient_accumulation_steps=2)})
    probe = probe_spec(spec, 48, probe_steps=2)
    assert probe.strategy.per_device_batch_size == 48 and probe.strategy.gradient_accumulation_steps == 2
    assert probe.measure.max_steps == spec.measure.warmup_steps + 2 == 3
    assert probe.data.num_samples == 48 * 2 * 3  # every step a full global batch (64 samples would cap it)
    assert probe.model == spec.model and probe.training_args == spec.training_args


# -- the shared real sweep's rows carry the estimate made before they ran --------------------------------------------


def test_sweep_rows_carry_the_estimate_made_before_the_trial_ran(tiny_sweep_run):
    specs = {t.name: t.spec for t in load_recipe(tiny_sweep_run / "recipe.yaml").trials}
    rows = RunFolder(tiny_sweep_run).rows()
    for row in rows:
        assert row.estimate == estimate_memory(specs[row.trial]), row.trial
        assert row.estimate_error is None
        assert {"weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "overhead_gib"} <= set(
            row.to_json()["estimate"]
        )
    measured = [r for r in rows if r.status == "ok"]
    assert measured and all(r.peak_gib > 0 and r.predicted_gib > 0 for r in measured)


# A causal LM whose logits (1024 tokens x 32000 classes, fp32, several copies through the loss) take about 0.4 GB
# of address space per sample over a base of about 2.2 GB (torch, transformers, the model): under a 3.4 GiB
# RLIMIT_AS the limit falls at a few samples, wherever that base lands within +-0.8 GB.
SEARCH_RECIPE = {
    "name": "search",
    "device": "cpu",
    "model": {
        "type": "gpt2",
        "task": "causal_lm",
        "config": {
            "vocab_size": 32000,
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 2,
            "n_positions": 1024,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    },
    "data": {"num_samples": 4, "seq_len": 1024, "token_high": 32000},
    "training_args": {"report_to": "none"},
    "measure": {"warmup_steps": 1, "max_steps": 3, "timeout_s": 300, "repeats": 1},
    "run": {"memory_limit_gib": 3.4, "env": {"OMP_NUM_THREADS": "1"}},
    "defaults": {"per_device_batch_size": 2, "num_processes": 1},
    # bs1 differs only in its batch size: it has the same largest batch, and is not searched again.
    "trials": [{"name": "fp32"}, {"name": "bs1", "per_device_batch_size": 1}],
}


@pytest.mark.slow
def test_find_max_batch_finds_the_limit_under_a_memory_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = write_recipe(tmp_path, SEARCH_RECIPE)
    run = tmp_path / "run"
    lines: list[str] = []
    upper = 8
    settings = SweepSettings(find_max_batch=True, max_batch_limit=upper, probe_steps=2)
    run_sweep(recipe, run_dir=run, settings=settings, report=False, progress=lines.append)

    row, bs1 = read_results(run)
    record = row.batch_search
    search = record.result
    assert record.searched and search.stopped_reason is None, (record, row.reason)
    best, first_oom = search.max_batch_size, search.first_oom_batch_size
    # The cap bounded the search: the largest size that trained, and the next one ran out of memory.
    assert best is not None and 1 <= best < upper, search
    assert first_oom == best + 1, search
    probes = {p.batch_size: p.outcome for p in search.probes}
    assert probes[best].status == "fits" and probes[best].samples_per_s > 0
    assert search.samples_per_s == probes[best].samples_per_s
    assert probes[first_oom].status == "oom" and "memory limit 3.4 GiB" in probes[first_oom].reason
    assert all(p.status in ("fits", "oom") for p in probes.values())
    # Everything that fits is below everything that does not: the search's answer is consistent with its probes.
    assert max(b for b, p in probes.items() if p.status == "fits") == best
    assert min(b for b, p in probes.items() if p.status == "oom") == first_oom

    # The trial's own run (batch 2) is the probe at its size; every other probe was its own process group.
    own = record.trial_run_batch_size
    assert own == (2 if row.status in ("ok", "oom") and 2 in probes else None)
    if row.status == "ok":
        assert probes[2].samples_per_s == row.samples_per_s
    launched = {int(p.name[2:]) for p in (run / "trials" / "fp32" / "probes").iterdir()}
    assert launched == set(probes) - {own}
    for batch in launched:
        folder = run / "trials" / "fp32" / "probes" / f"bs{batch}"
        spec = json.loads((folder / "trial.json").read_text(encoding="utf-8"))
        assert spec["strategy"]["per_device_batch_size"] == batch and spec["measure"]["max_steps"] == 1 + 2
        assert (folder / "stderr.log").exists()
        if probes[batch].status == "fits":
            result = json.loads((folder / "result.json").read_text(encoding="utf-8"))
            assert result["throughput"]["samples_per_s"] == probes[batch].samples_per_s
    assert any(f"largest batch that fits: {best}" in line for line in lines)

    assert bs1.status == "ok" and not (run / "trials" / "bs1" / "probes").exists()
    assert bs1.batch_search == dataclasses.replace(record, same_as="fp32", trial_run_batch_size=None)
    # The measured rows were appended before their searches; the searches were appended as the same rows again.
    assert len((run / "results.jsonl").read_text().splitlines()) == 4


# A GPT-2 whose logits (1024 tokens x 50257 classes, fp32 through the loss) take about 1 GB per sample on the
# GPU: the largest batch is in the tens on an 80 GB card, and 100000 samples are predicted far out of memory.
GPU_RECIPE = {
    "name": "gpu",
    "device": "cuda",
    "model": {
        "type": "gpt2",
        "task": "causal_lm",
        "config": {"vocab_size": 50257, "n_embd": 128, "n_layer": 2, "n_head": 2, "n_positions": 1024},
    },
    # Enough samples for huge's one step (a batch the data set cannot fill is refused at load); fp32 runs 3 steps.
    "data": {"num_samples": 2048, "seq_len": 1024, "token_high": 50257},
    "training_args": {"report_to": "none"},
    "measure": {"warmup_steps": 1, "max_steps": 3, "timeout_s": 300, "repeats": 1},
    "baseline": "fp32",
    "defaults": {"per_device_batch_size": 4, "num_processes": 1},
    # 2048 x 1024 tokens of 50257 fp32 logits: over 400 GB, beyond any one GPU.
    "trials": [{"name": "fp32"}, {"name": "huge", "per_device_batch_size": 2048}],
}


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_sweep_skips_what_the_gpu_cannot_hold_and_finds_the_largest_batch(tmp_path):
    recipe = write_recipe(tmp_path, GPU_RECIPE)
    run = tmp_path / "run"
    settings = SweepSettings(skip_predicted_oom=True, find_max_batch=True, max_batch_limit=512, probe_steps=2)
    run_sweep(recipe, run_dir=run, settings=settings, report=False, progress=print)
    rows = {r.trial: r for r in read_results(run)}
    from hfscale.launch.plan import memory_budget

    budget = memory_budget(SweepSettings(), RunFolder(run).environment())
    assert budget is not None  # the default budget: this GPU's memory

    huge = rows["huge"]
    assert huge.status == "skipped" and huge.reason.startswith("predicted out of memory")
    assert f"budget {budget / GIB:.2f} GiB" in huge.reason and huge.exit_code is None
    # Predicted out of memory at its size, but a smaller batch fits: the same as fp32's (only the batch differs).
    assert huge.batch_search.same_as == "fp32"

    fp32 = rows["fp32"]
    assert fp32.status == "ok", fp32.reason
    predicted, measured = fp32.predicted_gib, fp32.peak_gib
    print(f"\nfp32 batch 4: predicted {predicted:.3f} GiB, measured {measured:.3f} GiB")
    record = fp32.batch_search
    search = record.result
    assert record.start_from == "the estimate" and record.budget_bytes == budget
    best, first_oom = search.max_batch_size, search.first_oom_batch_size
    assert best is not None and first_oom == best + 1, search
    probes = {p.batch_size: p.outcome for p in search.probes}
    assert probes[best].status == "fits" and probes[best].peak_memory_gib * GIB < budget
    assert probes[first_oom].status == "oom" and "CUDA out of memory" in probes[first_oom].reason
    print(f"largest batch {best} ({search.samples_per_s:.1f} samples/s), estimate's start {search.start}")
