"""The sweep runner: settings and their command line, the shared tiny sweep's rows, resume
(missing runs, a corrupt line, a batch search that failed), and real faults.

Process groups, their limits and the failure classifier are tested in ``test_process.py``. Most sweep tests launch
nothing (every trial is skipped before launching) or read the session's one real sweep
(``tiny_sweep_run`` in conftest). The end-to-end test launches ``accelerate launch --multi_gpu --num_processes 2
-m hfscale.sweep`` (two outer processes: only one may drive), with trials that succeed with two processes, are
killed by a signal from outside, run past their timeout, and one that is interrupted by SIGINT to the whole outer
launch and then completed with ``hfscale sweep --resume``; a smaller one closes the terminal (SIGHUP) under a
one-process sweep and resumes it with a new ``--timeout-s``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.paths import REPO
from helpers.runs import scripted_launches, write_recipe

from hfscale.commands.sweep import build_parser, main
from hfscale.launch.group import LaunchInfo
from hfscale.launch.plan import SettingError, SweepError, SweepSettings, plan_runs
from hfscale.launch.process import (
    free_port,
    group_members,
)
from hfscale.recipes.recipe import load_recipe
from hfscale.results.run_folder import RunFolder, read_results
from hfscale.sweep.loop import run_sweep
from hfscale.sweep.outcome import NOTHING_RAN_EXIT

PY = sys.executable


# -- launch, plan, settings ----------------------------------------------------------------------------------------


def test_launch_info_from_torchrun_environment():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    info = LaunchInfo.from_env({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (info.launched, info.world_size, info.num_machines, info.machine_rank) == (True, 4, 2, 1)
    assert not info.is_driver and info.master_port == 29500
    assert LaunchInfo.from_env({}) == LaunchInfo()
    assert LaunchInfo().is_driver
    # Counts the command line did not give come from the outer launch.
    assert info.default_counts(SweepSettings()).num_processes == 4
    assert info.default_counts(SweepSettings(num_processes=1)).num_processes == 1


def test_repeats_are_interleaved_so_drift_reaches_every_trial_alike(tmp_path):
    data = {
        "device": "cpu",
        "trials": [{"name": "a", "measure": {"repeats": 3}}, {"name": "b"}, {"name": "c", "measure": {"repeats": 2}}],
    }
    runs = plan_runs(load_recipe(write_recipe(tmp_path, data)).trials, gpu_count=0, num_machines=1)
    # b says nothing: it gets the default, three runs (hfscale.workload.spec.DEFAULT_REPEATS).
    assert [(r.name, r.repeat) for r in runs] == [
        ("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2)
    ]  # fmt: skip
    assert [r.index for r in runs] == list(range(8))


def test_a_target_precision_adds_interleaved_runs_until_it_is_reached(tmp_path, monkeypatch):
    """Each trial is run three times (the fewest a sequential stop takes); the runs of "noisy" are 30-50% apart,
    which the sweep's pooled noise carries into every trial's interval, so both run on to max_repeats."""
    steady = [0.100, 0.101, 0.099, 0.100] * 5
    noisy_runs = [[t * f for t in steady] for f in (1.0, 1.5, 0.7, 1.3)]
    runs = {"steady": [steady] * 5, "noisy": noisy_runs}
    launched = scripted_launches(monkeypatch, step_times=lambda name, k: runs[name][k], samples_per_step=8)
    data = {
        "device": "cpu",
        "measure": {"target_precision": 0.05, "max_repeats": 4},
        "trials": [{"name": "steady"}, {"name": "noisy"}],
    }
    run_sweep(write_recipe(tmp_path, data), run_dir=tmp_path / "run", report=False, progress=lambda line: None)
    assert launched == [(name, k) for k in range(4) for name in ("steady", "noisy")]
    rows = RunFolder(tmp_path / "run").rows()
    assert [r.launch is None for r in rows] == [True] * 8  # scripted rows
    assert {(r.trial, r.repeat) for r in rows} == set(launched)


def test_a_target_precision_is_checked_when_the_recipe_loads(tmp_path):
    from hfscale.recipes.schema import RecipeError

    data = {"device": "cpu", "measure": {"target_precision": 5}, "trials": [{"name": "a"}]}
    with pytest.raises(RecipeError, match=r"measure.target_precision: expected a fraction between 0 and 1"):
        load_recipe(write_recipe(tmp_path, data))
    data["measure"] = {"target_precision": 0.05, "max_repeats": 2}
    with pytest.raises(RecipeError, match=r"measure.max_repeats: expected at least 3"):
        load_recipe(write_recipe(tmp_path, data))


def test_plan_skips_what_cannot_run_here_with_the_reason(tmp_path, monkeypatch):
    import importlib.util

    data = {
        "device": "cuda",
        "trials": [
            {"name": "gpu"},
            {"name": "zero2", "deepspeed": {"zero_stage": 2}},
            {"name": "two-machines", "num_machines": 2, "num_processes": 2},
        ],
        "measure": {"repeats": 2},
    }
    recipe = load_recipe(write_recipe(tmp_path, data))
    runs = plan_runs(recipe.trials, gpu_count=0, num_machines=1)
    assert [(r.name, r.repeat) for r in runs] == [(n, k) for k in (0, 1) for n in ("gpu", "zero2", "two-machines")]
    assert "no CUDA device" in runs[0].skip_reason
    assert "needs 2 machines" in runs[2].skip_reason
    assert plan_runs(recipe.trials, gpu_count=1, num_machines=1)[0].skip_reason is None

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    runs = plan_runs(recipe.trials, gpu_count=1, num_machines=1, only=["zero2"])
    assert [r.name for r in runs] == ["zero2", "zero2"]
    assert runs[0].skip_reason == "deepspeed is not installed (pip install 'hfscale[deepspeed]')"
    with pytest.raises(SweepError, match="--only: no trial named nope"):
        plan_runs(recipe.trials, gpu_count=1, num_machines=1, only=["nope"])


def test_settings_are_bounded_in_one_place_and_the_cli_names_the_flag(capsys):
    with pytest.raises(SettingError, match="probe_steps must be at least 2, got 1"):
        SweepSettings(probe_steps=1)
    with pytest.raises(SettingError, match="timeout_s must be more than 0, got -5"):
        SweepSettings(timeout_s=-5)
    for argv, message in (
        (["--num-processes", "0"], "--num-processes must be at least 1, got 0"),
        (["--timeout-s", "0"], "--timeout-s must be more than 0, got 0"),
        (["--max-batch-limit", "0"], "--max-batch-limit must be at least 1, got 0"),
    ):
        assert main(["r.yaml", *argv]) == 2
        assert f"hfscale sweep: error: {message}" in capsys.readouterr().err


def test_every_setting_has_exactly_one_flag_and_round_trips_through_the_parser():
    import dataclasses

    flags = [f.metadata["flag"] for f in dataclasses.fields(SweepSettings)]
    assert len(set(flags)) == len(flags)
    help_text = build_parser().format_help()
    assert all(flag in help_text for flag in flags)
    from hfscale.commands.sweep import settings_from_args

    args = build_parser().parse_args(
        ["r.yaml", "--timeout-s", "7", "--only", "a", "--only", "b", "--memory-budget", "1GiB", "--find-max-batch"]
    )
    settings = settings_from_args(args)
    assert settings == SweepSettings(timeout_s=7.0, only=("a", "b"), memory_budget_bytes=2**30, find_max_batch=True)
    assert SweepSettings.from_dict(settings.to_dict()) == settings


def test_resume_applies_new_limits_and_refuses_new_process_counts():
    recorded = SweepSettings(num_processes=2, timeout_s=300.0, memory_limit_gib=8.0)
    resumed = recorded.for_resume(SweepSettings(timeout_s=5.0))
    assert resumed == SweepSettings(num_processes=2, timeout_s=5.0, memory_limit_gib=8.0)
    assert recorded.for_resume(SweepSettings()) == recorded
    assert recorded.for_resume(SweepSettings(num_processes=2)) == recorded
    with pytest.raises(SweepError, match="--num-processes 4 differs from the recorded 2: a resumed run keeps"):
        recorded.for_resume(SweepSettings(num_processes=4))


def test_run_dir_that_exists_is_refused(tmp_path, capsys):
    recipe = REPO / "recipes" / "cpu_small.yaml"
    (tmp_path / "taken").mkdir()
    assert main([str(recipe), "--run-dir", str(tmp_path / "taken"), "--no-report"]) == 2
    assert "exists; continue it with --resume" in capsys.readouterr().err


def test_dry_run_prints_each_trial_and_its_launch_command_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["cpu_small", "--dry-run"]) == 0
    out = capsys.readouterr().out
    recipe = load_recipe("cpu_small")
    for name in recipe.trial_names:
        assert f"- {name}: " in out
        assert f"--config_file RUN/trials/{name}/accelerate.yaml -m hfscale.trial RUN/trials/{name}/trial.json" in out
    assert "ZeRO-2" in out and "x 2 proc" in out
    assert not (tmp_path / "runs").exists()


def test_repeats_replaces_every_trials_repeats(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("cpu_small")
    assert {t.spec.measure.repeats for t in recipe.trials} != {2}
    assert main(["cpu_small", "--dry-run", "--repeats", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    n = len(recipe.trial_names)
    assert first.startswith(f"recipe cpu_small: {n} trials, {2 * n} runs ")
    assert main(["cpu_small", "--dry-run", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


# -- the shared real sweep ------------------------------------------------------------------------------------------


def test_the_shared_sweeps_rows_are_typed_and_complete(tiny_sweep_run):
    from helpers.runs import TINY_SWEEP_RECIPE

    folder = RunFolder(tiny_sweep_run)
    rows = {row.key: row for row in folder.rows(on_bad_line="raise")}
    # Interleaved: every trial's first run, then the second run of the one trial with two.
    assert list(rows) == [("fp32", 0), ("bf16", 0), ("ckpt", 0), ("oom", 0), ("two-machines", 0), ("ckpt", 1)]
    for key in (("fp32", 0), ("bf16", 0), ("ckpt", 0), ("ckpt", 1)):
        row = rows[key]
        assert row.status == "ok", (key, row.reason, row.stderr_tail)
        assert row.exit_code == 0 and row.stderr_tail is None and row.launch.after_result is None
        assert len(row.loss_curve) == 4 and math.isfinite(row.final_loss)
        assert row.samples_per_s > 0 and row.peak_gib > 0 and row.predicted_gib > 0
        assert row.wall_time_s > row.train_runtime_s > 0
        assert row.measured.world_size == 1 and row.launch.timeout_s == TINY_SWEEP_RECIPE["measure"]["timeout_s"]
        assert (tiny_sweep_run / row.launch.trial_dir / "result.json").exists()
        assert "samples/s" in row.progress_line() and "(predicted " in row.progress_line()
    assert (rows["ckpt", 0].repeats, rows["ckpt", 1].repeat) == (2, 1)
    assert rows["ckpt", 1].launch.trial_dir == "trials/ckpt/repeat-2"
    assert rows["bf16", 0].strategy.precision == "bf16" and rows["ckpt", 0].strategy.gradient_checkpointing
    # Parity is computed once, as each row is appended after the baseline's.
    assert rows["fp32", 0].is_baseline and rows["fp32", 0].parity.is_baseline
    for key in (("bf16", 0), ("ckpt", 0), ("ckpt", 1)):
        assert rows[key].parity.compared and not rows[key].parity.flagged, rows[key].parity
        assert rows[key].parity.baseline == "fp32"
    oom = rows["oom", 0]
    assert oom.status == "oom" and "memory limit 0.5 GiB" in oom.reason and oom.measured is None
    assert oom.launch.memory_limit_gib == 0.5 and oom.stderr_tail
    skipped = rows["two-machines", 0]
    assert skipped.status == "skipped" and skipped.reason == "needs 2 machines; this sweep was launched on 1"
    assert skipped.launch is None and skipped.exit_code is None

    environment = folder.environment()
    assert environment["sweep"] == SweepSettings().to_dict() and environment["gpu_count"] == 0
    assert (tiny_sweep_run / "recipe.yaml").read_text() == yaml.safe_dump(TINY_SWEEP_RECIPE)
    assert folder.lock_path.read_text() == ""  # released
    with folder.locked():  # and takeable
        pass


# -- resume without launching: every trial is skipped as predicted out of memory ------------------------------------

SKIPPED_RECIPE = {
    "name": "skipped",
    "device": "cpu",
    "model": {"type": "bert", "task": "classification", "config": {"hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 1000}},
    "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
    "measure": {"repeats": 1, "warmup_steps": 1},  # an epoch is 4 steps
    "defaults": {"per_device_batch_size": 4, "num_processes": 1, "optimizer": "adamw_torch"},
    "trials": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
}  # fmt: skip
NOTHING_FITS = ["--skip-predicted-oom", "--memory-budget", "1MiB", "--no-report"]


def test_a_corrupt_middle_line_is_set_aside_and_its_trial_run_again_on_resume(tmp_path, capsys):
    recipe, run = write_recipe(tmp_path, SKIPPED_RECIPE), tmp_path / "run"
    assert main([str(recipe), "--run-dir", str(run), *NOTHING_FITS]) == NOTHING_RAN_EXIT  # every run skipped
    results = run / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    results.write_text(lines[0] + '{"trial": "b", "status"\n' + lines[2])
    assert [r.trial for r in read_results(run)] == ["a", "c"]  # the report reads the rest

    capsys.readouterr()
    assert main(["--resume", str(run), "--no-report"]) == NOTHING_RAN_EXIT
    err = capsys.readouterr().err
    assert "results.jsonl:2: not a valid row" in err and "1 of 3 runs to do (2 already in" in err
    assert [r.trial for r in RunFolder(run).rows(on_bad_line="raise")] == ["a", "c", "b"]
    (aside,) = [json.loads(line) for line in (run / "results.corrupt.jsonl").read_text().splitlines()]
    assert aside["line"] == 2 and aside["text"] == '{"trial": "b", "status"'


def test_a_batch_search_that_raises_keeps_the_measured_row_and_resume_runs_only_the_search(tmp_path, monkeypatch):
    import hfscale.sweep.loop
    from hfscale.records.batch import BatchSearchRecord

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hfscale.sweep.loop, "search_trial", broken)
    recipe, run = write_recipe(tmp_path, {**SKIPPED_RECIPE, "trials": [{"name": "a"}]}), tmp_path / "run"
    # Before: the row was appended after the search, so the OSError lost it and the sweep exited 2 ("bad input").
    assert main([str(recipe), "--run-dir", str(run), "--find-max-batch", *NOTHING_FITS]) == 1
    (row,) = read_results(run)
    assert row.status == "skipped" and row.reason.startswith("predicted out of memory") and row.batch_search is None

    found = BatchSearchRecord(searched=True, start_from="the estimate", upper_limit=8)
    monkeypatch.setattr(hfscale.sweep.loop, "search_trial", lambda *args, **kwargs: found)
    outcome = run_sweep(None, resume=run, report=False, progress=lambda line: None)
    (again,) = read_results(run)
    assert again.batch_search == found and outcome.rows == [again]
    assert again.estimate == row.estimate and again.reason == row.reason  # the same row, now with its search
    assert len((run / "results.jsonl").read_text().splitlines()) == 2


def test_resume_refuses_other_process_counts(tmp_path, capsys):
    recipe, run = write_recipe(tmp_path, SKIPPED_RECIPE), tmp_path / "run"
    assert main([str(recipe), "--run-dir", str(run), *NOTHING_FITS]) == NOTHING_RAN_EXIT
    assert main(["--resume", str(run), "--num-processes", "2"]) == 2
    assert "--num-processes 2 differs from the recorded none (the recipe's own, as it started)" in (
        capsys.readouterr().err
    )


# -- a sweep that ran nothing, and the last line (issue 28) --------------------------------------------------------


def _no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's record says no GPU (also on a machine that has one), without probing torch."""
    import hfscale.results.environment

    monkeypatch.setattr(
        hfscale.results.environment,
        "collect_environment",
        lambda *, python, extra=None: {"gpu_count": 0, **(extra or {})},
    )


def test_a_sweep_that_ran_nothing_exits_non_zero_naming_the_cause_and_what_to_do(tmp_path, capsys, monkeypatch):
    _no_gpu_here(monkeypatch)
    recipe, run = write_recipe(tmp_path, {**SKIPPED_RECIPE, "name": "gpu-only", "device": "cuda"}), tmp_path / "run"
    # Before: three `skipped` rows and exit 0, so a job whose GPUs were not allocated "succeeded".
    assert main([str(recipe), "--run-dir", str(run), "--no-report"]) == NOTHING_RAN_EXIT == 4
    err = capsys.readouterr().err
    said = err.index("device 'cuda', but no CUDA device is visible on this machine")
    assert said < err.index("[1/3] a:"), err  # said before the first trial
    (last,) = [line for line in err.splitlines() if "no trial ran" in line]
    assert "hfscale sweep: error: no trial ran: all 3 runs were skipped before launching: device 'cuda' but no " in last
    assert "a CPU recipe such as cpu_small" in last and "--dry-run" in last and str(run) in last
    assert [r.status for r in read_results(run)] == ["skipped"] * 3  # the rows are kept

    # Another cause, another remedy; nothing was predicted to fit the budget.
    oom = write_recipe(tmp_path, SKIPPED_RECIPE)
    assert main([str(oom), "--run-dir", str(tmp_path / "oom"), *NOTHING_FITS]) == NOTHING_RAN_EXIT
    (last,) = [line for line in capsys.readouterr().err.splitlines() if "no trial ran" in line]
    assert "all 3 runs were skipped before launching: predicted out of memory" in last
    assert "--memory-budget" in last and "without --skip-predicted-oom" in last


def test_the_last_line_counts_the_recipe_trials_with_rows_beside_what_this_sweep_ran(tmp_path, capsys, monkeypatch):
    _no_gpu_here(monkeypatch)
    steps = [[0.1, 0.1, 0.1]]
    scripted_launches(monkeypatch, step_times=lambda name, k: steps[k], samples_per_step=8)
    recipe, run = write_recipe(tmp_path, SKIPPED_RECIPE), tmp_path / "run"
    assert main([str(recipe), "--run-dir", str(run), "--only", "a", "--no-report"]) == 0
    assert f"done: {run}: 1 row added (1 ok, 0 not ok); 1 of the recipe's 3 trials has rows" in capsys.readouterr().err
    # Before: "done: RUN (1 ok, 0 not ok)" for a run folder that now holds two trials' rows.
    assert main(["--resume", str(run), "--only", "b", "--no-report"]) == 0
    assert f"done: {run}: 1 row added (1 ok, 0 not ok); 2 of the recipe's 3 trials have rows" in capsys.readouterr().err


def test_an_interrupted_sweep_names_the_resume_its_run_needs(tmp_path, capsys, monkeypatch):
    import hfscale.commands.sweep
    from hfscale.sweep.outcome import SweepInterrupted, SweepStopped

    hint = "hfscale slurm /runs/r --resume --nodes 2 --gpus-per-node 4"

    def stopped(*args, **kwargs):
        raise SweepInterrupted(tmp_path / "machine-1", resume=hint, rows_in=Path("/runs/r"))

    monkeypatch.setattr(hfscale.commands.sweep, "run_sweep", stopped)
    assert main(["r.yaml"]) == 130
    err = capsys.readouterr().err
    assert f"continue with: {hint}" in err and "/runs/r" in err and "hfscale sweep --resume" not in err

    def full(*args, **kwargs):
        raise SweepStopped(Path("/runs/r"), OSError(28, "No space left on device"), resume=hint)

    monkeypatch.setattr(hfscale.commands.sweep, "run_sweep", full)
    assert main(["r.yaml"]) == 3
    assert f"continue with: {hint}" in capsys.readouterr().err


# -- real faults -----------------------------------------------------------------------------------------------------

LONG_RECIPE = {
    "name": "long",
    "device": "cpu",
    "model": SKIPPED_RECIPE["model"],
    "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
    "measure": {"max_steps": 100000, "warmup_steps": 1, "timeout_s": 300, "repeats": 1},
    "run": {"env": {"OMP_NUM_THREADS": "1"}},
    "defaults": {"per_device_batch_size": 4, "num_processes": 1},
    "trials": [{"name": "long"}],
}


def _wait_for_trial(run_dir: Path, name: str, deadline_s: float) -> int:
    """The process group of a trial once it has been running for 3 s (a one-process trial is started directly,
    without a launcher of its own, so its group is that one process)."""
    deadline = time.monotonic() + deadline_s
    first_seen = None
    while time.monotonic() < deadline:
        try:
            pgid = int((run_dir / "trials" / name / "pid").read_text())
            first_seen = first_seen or time.monotonic()
            if group_members(pgid) and time.monotonic() - first_seen > 3:
                return pgid
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"trial {name} did not start within {deadline_s} s")


FROM_A_TERMINAL = [
    PY,
    "-c",
    "import runpy, signal; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "runpy.run_module('hfscale.sweep', run_name='__main__', alter_sys=True)",
]
"""``python -m hfscale.sweep`` with SIGHUP at its default, as a terminal starts it. The suite may itself run under
``nohup`` (SIGHUP ignored, inherited by every child), and the sweep rightly keeps a signal its caller ignored."""


@pytest.mark.slow
def test_sighup_stops_the_sweep_like_sigterm_and_resume_applies_a_new_timeout(tmp_path):
    recipe, run = write_recipe(tmp_path, LONG_RECIPE), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    sweep = subprocess.Popen(
        [*FROM_A_TERMINAL, str(recipe), "--run-dir", str(run), "--no-report"],
        env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        pgid = _wait_for_trial(run, "long", 600)
        sweep.send_signal(signal.SIGHUP)  # the terminal closed
        _, err = sweep.communicate(timeout=60)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130, err[-3000:]
    assert "interrupted: finished trials are kept" in err
    assert group_members(pgid) == []  # the running trial's group was ended
    assert not (run / "results.jsonl").exists()

    # Before: --resume kept the recorded 300 s and ignored --timeout-s.
    resumed = subprocess.run(
        [PY, "-m", "hfscale.sweep", "--resume", str(run), "--timeout-s", "3", "--no-report"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (row,) = read_results(run)
    assert row.status == "timeout" and "3 s" in row.reason and row.launch.timeout_s == 3
    environment = RunFolder(run).environment()
    assert environment["sweep"]["timeout_s"] is None and environment["resumed"][0]["sweep"]["timeout_s"] == 3


# -- end to end ----------------------------------------------------------------------------------------------------

E2E_RECIPE = {
    "name": "e2e",
    "device": "cpu",
    "model": {
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
    },
    "data": {"num_samples": 64, "seq_len": 32, "token_high": 1000},
    "training_args": {"report_to": "none"},
    "measure": {"max_steps": 3, "warmup_steps": 1, "timeout_s": 300, "repeats": 1},
    "defaults": {"per_device_batch_size": 4},
    # Out of memory, bf16, checkpointing and repeats are the shared tiny sweep's (conftest); here: what needs
    # an outer launch, a signal from outside, a timeout and an interrupt.
    "trials": [
        # Not pinned: takes the outer launch's 2 processes (DDP).
        {"name": "ddp"},
        {"name": "killed", "num_processes": 1, "measure": {"max_steps": 100000}},
        {"name": "slow", "num_processes": 1, "measure": {"max_steps": 100000, "timeout_s": 4}},
        {"name": "last", "num_processes": 1},
    ],
}


def _hfscale_command() -> list[str]:
    script = Path(PY).parent / "hfscale"
    return [str(script)] if script.exists() else [PY, "-m", "hfscale.commands.main"]


@pytest.mark.slow
def test_end_to_end_sweep_with_real_failures_interrupt_and_resume(tmp_path):
    t0 = time.monotonic()
    recipe = write_recipe(tmp_path, E2E_RECIPE)
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    outer_cmd = [
        PY, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        "-m", "hfscale.sweep", str(recipe), "--run-dir", str(run_dir),
    ]  # fmt: skip
    log = open(tmp_path / "outer.log", "w+b")  # noqa: SIM115 (read after the process ends)
    outer = subprocess.Popen(outer_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    groups: dict[str, int] = {}  # trial -> its process group, seen through its pid file
    seen: dict[str, float] = {}  # trial -> when its group was first seen
    killed_at = interrupted_at = None

    def running(trial: str) -> bool:
        """The trial's group has been alive for 2 s (a one-process trial runs without a launcher of its own)."""
        return bool(group_members(groups.get(trial, -1))) and time.monotonic() - seen.get(trial, math.inf) > 2

    try:
        deadline = time.monotonic() + 480
        while outer.poll() is None and time.monotonic() < deadline:
            for pid_file in (run_dir / "trials").glob("*/pid"):
                try:
                    groups.setdefault(pid_file.parent.name, int(pid_file.read_text()))
                    seen.setdefault(pid_file.parent.name, time.monotonic())
                except (OSError, ValueError):
                    continue
            # Act once the trial is running: the whole group must go.
            if killed_at is None and running("killed"):
                os.killpg(groups["killed"], signal.SIGKILL)
                killed_at = time.monotonic()
            if interrupted_at is None and running("last"):
                os.killpg(outer.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole outer launch
                interrupted_at = time.monotonic()
            time.sleep(0.1)
        outer.wait(timeout=60)
    finally:
        if outer.poll() is None:
            os.killpg(outer.pid, signal.SIGKILL)
        log.seek(0)
        outer_log = log.read().decode(errors="replace")
        log.close()
    first_s = time.monotonic() - t0
    assert killed_at is not None and interrupted_at is not None, outer_log[-4000:]

    # One driver: rank 1 stood down, and every trial ran once.
    assert "rank 1 (local rank 1): the driver on local rank 0 runs the sweep; exiting" in outer_log
    assert "interrupted: finished trials are kept" in outer_log
    rows = read_results(run_dir)
    assert [r.trial for r in rows] == ["ddp", "killed", "slow"], outer_log[-4000:]
    # Nothing of any trial is left running: not the killed one, the timed-out one, nor the interrupted one.
    assert {"killed", "slow", "last"} <= set(groups)
    assert all(group_members(pgid) == [] for pgid in groups.values()), groups
    assert not (run_dir / "report.md").exists()  # an interrupted sweep writes nothing partial

    # Resume with the third entry point; only the interrupted trial runs, with the first run's settings.
    t1 = time.monotonic()
    resumed = subprocess.run(
        [*_hfscale_command(), "sweep", "--resume", str(run_dir), "--no-report"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    resume_s = time.monotonic() - t1
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "1 of 4 runs to do (3 already in" in resumed.stderr
    rows = {r.trial: r for r in read_results(run_dir)}
    assert list(rows) == [t["name"] for t in E2E_RECIPE["trials"]]

    for name in ("ddp", "last"):
        row = rows[name]
        assert row.status == "ok", (name, row.reason, row.stderr_tail)
        assert len(row.loss_curve) == 3 and row.samples_per_s > 0 and row.peak_gib > 0
    # The unpinned trial ran with the outer launch's two processes, and both trained.
    assert rows["ddp"].strategy.num_processes == 2 and rows["ddp"].measured.world_size == 2
    assert rows["last"].measured.world_size == 1
    killed = rows["killed"]
    assert killed.status == "crashed" and killed.exit_code == -signal.SIGKILL
    assert "killed by SIGKILL" in killed.reason
    slow = rows["slow"]
    assert slow.status == "timeout" and "4 s" in slow.reason
    assert 4 <= slow.wall_time_s < 4 + 15
    for row in (killed, slow):
        assert row.stderr_tail is not None

    env_record = RunFolder(run_dir).environment()
    assert env_record["packages"]["torch"] and env_record["gpu_count"] == 0
    assert env_record["sweep"]["num_processes"] == 2 and env_record["launch"]["world_size"] == 2
    assert len(env_record["resumed"]) == 1 and env_record["resumed"][0]["sweep"]["num_processes"] == 2
    assert (run_dir / "recipe.yaml").read_text() == recipe.read_text()
    print(f"\nend-to-end: first sweep {first_s:.1f} s, resume {resume_s:.1f} s")


def test_a_failing_report_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys as _sys
    import types

    from hfscale.sweep.session import write_report

    def broken(run_dir: Path, **kwargs: object) -> None:
        raise ZeroDivisionError("report bug")

    monkeypatch.setitem(_sys.modules, "hfscale.report", types.SimpleNamespace(write_report=broken))
    paths, error = write_report(tmp_path, lambda line: None)
    assert paths == [] and error is not None and "ZeroDivisionError: report bug" in error


def _precision_sweep(tmp_path, monkeypatch, speeds):
    """A two-trial sweep with ``target_precision: 0.05`` whose launches are scripted: run k of a trial measures
    ``speeds[k]`` samples/s. Returns the rows by (trial, repeat)."""

    from hfscale.results.run_folder import RunFolder
    from hfscale.sweep.loop import run_sweep

    scripted_launches(monkeypatch, lambda name, repeat: speeds[repeat])
    data = {
        "device": "cpu",
        "model": {"config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}},
        "data": {"num_samples": 32, "seq_len": 16},
        "measure": {"warmup_steps": 1, "target_precision": 0.05, "max_repeats": 5},
        "defaults": {"per_device_batch_size": 4},
        "trials": [{"name": "fp32"}, {"name": "ckpt", "gradient_checkpointing": True}],
    }
    run_sweep(write_recipe(tmp_path, data), run_dir=tmp_path / "run", report=False, progress=lambda line: None)
    return {r.key: r for r in RunFolder(tmp_path / "run").rows()}


def test_target_precision_stops_on_the_run_level_interval_after_three_runs(tmp_path, monkeypatch):
    """Runs 1% apart: the run-level interval is within ± 5% at once, yet the rule takes the three runs the
    calibration asks for (0.3 stopped at two, on an interval over steps), and every row says it stopped
    sequentially."""
    from hfscale.workload.spec import SEQUENTIAL_MIN_RUNS

    rows = _precision_sweep(tmp_path, monkeypatch, [100.0, 101.0, 99.0, 100.0, 100.0])
    assert sorted(rows) == [(t, k) for t in ("ckpt", "fp32") for k in range(SEQUENTIAL_MIN_RUNS)]
    assert all(r.stopping and r.stopping.startswith("sequential") and "± 5.0%" in r.stopping for r in rows.values())


def test_target_precision_runs_on_while_the_runs_disagree(tmp_path, monkeypatch):
    """Steps of each run are identical (0.3's interval over steps was 0 wide and stopped at two runs); the runs
    are 30% apart, so the run-level interval stays wide and the trials take all five runs."""
    rows = _precision_sweep(tmp_path, monkeypatch, [100.0, 130.0, 100.0, 130.0, 100.0])
    assert sorted(rows) == [(t, k) for t in ("ckpt", "fp32") for k in range(5)]
