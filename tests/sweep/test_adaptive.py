"""The adaptive search driven through the real sweep loop with scripted launches: rows, decisions, search.json,
resuming in the middle, the contenders' batch search, and what it refuses before running."""

from __future__ import annotations

import json

import pytest
from helpers.runs import scripted_launches, write_recipe

import hfscale.sweep.loop
from hfscale.launch.plan import SweepError, SweepSettings
from hfscale.recipes.recipe import load_recipe
from hfscale.recipes.schema import RecipeError
from hfscale.records.batch import BatchSearchRecord, BatchSearchResult
from hfscale.results.run_folder import RunFolder
from hfscale.sweep.loop import run_sweep

SPEEDS = {"a": 100.0, "b": 99.0, "c": 30.0, "d": 25.0}


def speed(name: str, repeat: int) -> float:
    """Each trial's speed, 1% apart from run to run."""
    return SPEEDS[name.removesuffix("-maxbatch")] * (1 + 0.01 * (-1) ** repeat) * (1.2 if "maxbatch" in name else 1)


RECIPE = {
    "device": "cpu",
    "model": {"config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}},
    "data": {"num_samples": 64, "seq_len": 16},
    "measure": {"warmup_steps": 1, "max_steps": 4, "repeats": 3},
    "sweep": {"search": "adaptive"},
    "baseline": "a",
    "trials": [{"name": n} for n in SPEEDS],
}


def sweep(tmp_path, name: str, **settings):
    return run_sweep(
        write_recipe(tmp_path, RECIPE),
        run_dir=tmp_path / name,
        settings=SweepSettings(**settings),
        report=False,
        progress=lambda line: None,
    )


def test_the_search_prunes_the_slow_trials_and_records_why(tmp_path, monkeypatch):
    launched = scripted_launches(monkeypatch, speed)
    sweep(tmp_path, "run")
    folder = RunFolder(tmp_path / "run")
    rows = folder.rows()
    pruned = {r.trial: r for r in rows if r.status == "pruned"}
    assert set(pruned) == {"c", "d"}
    assert all(r.search.kind == "pruned" and r.search.ratio_high < 1 for r in pruned.values())
    assert launched[:4] == [("a", 0), ("b", 0), ("c", 0), ("d", 0)]  # every trial once, first
    assert len(launched) < 3 * len(SPEEDS)  # the grid's 12
    summary = folder.search()
    assert summary.runs == len(launched) and summary.grid_runs == 12
    assert summary.answer == "a" and summary.stop in ("decided", "runs_spent")
    assert [d.trial for d in summary.trace] == ["c", "d"]
    ok_rows = [r for r in rows if r.status == "ok"]
    assert all(r.stopping.startswith("adaptive search") for r in ok_rows)


def test_a_search_resumed_in_the_middle_launches_what_an_uninterrupted_one_would(tmp_path, monkeypatch):
    launched = scripted_launches(monkeypatch, speed)
    sweep(tmp_path, "whole")
    whole = list(launched)
    launched.clear()
    sweep(tmp_path, "parts", max_runs=4)  # stopped between rounds: after every trial's first run
    first = (tmp_path / "parts" / "results.jsonl").read_text()
    stopped = RunFolder(tmp_path / "parts").search()
    assert stopped.stop == "run_budget_spent" and len(launched) == 4 and stopped.answer == "a"
    run_sweep(
        None, resume=tmp_path / "parts", settings=SweepSettings(max_runs=100), report=False, progress=lambda _: None
    )
    assert launched == whole  # the same runs in the same order, none twice
    assert (tmp_path / "parts" / "results.jsonl").read_text().startswith(first)  # earlier rows untouched
    parts, uninterrupted = RunFolder(tmp_path / "parts").search(), RunFolder(tmp_path / "whole").search()
    assert [(d.trial, d.kind) for d in parts.trace] == [(d.trial, d.kind) for d in uninterrupted.trace]
    assert (parts.stop, parts.answer) == (uninterrupted.stop, uninterrupted.answer)


def test_a_trial_the_estimate_says_cannot_fit_is_a_skipped_row_and_never_runs(tmp_path, monkeypatch):
    launched = scripted_launches(monkeypatch, speed)
    data = {**RECIPE, "data": {"num_samples": 4096, "seq_len": 128}, "sweep": {"search": "adaptive"}}
    data["trials"] = [{"name": "a"}, {"name": "b"}, {"name": "c", "per_device_batch_size": 4096}]
    run_sweep(
        write_recipe(tmp_path, data), run_dir=tmp_path / "run", settings=SweepSettings(memory_budget_bytes=2**30),
        report=False, progress=lambda line: None,
    )  # fmt: skip
    (skipped,) = [r for r in RunFolder(tmp_path / "run").rows() if r.trial == "c"]
    assert skipped.status == "skipped" and skipped.search.kind == "skipped" and skipped.search.margin == 0.25
    assert skipped.search.predicted_gib / 1.25 > 1.0 and "does not fit the budget of 1.00 GiB" in skipped.reason
    assert all(name != "c" for name, _ in launched)
    assert RunFolder(tmp_path / "run").search().grid_runs == 3 + 3 + 1  # the grid would run c once: it fails


def test_only_contenders_get_their_largest_batch_searched_and_it_joins_the_search(tmp_path, monkeypatch):
    launched = scripted_launches(monkeypatch, speed)
    searched = []

    def search_trial(spec, row, probe, **_):
        searched.append(row.trial)
        result = BatchSearchResult(max_batch_size=16, first_oom_batch_size=32)
        return BatchSearchRecord(searched=True, result=result, start_from="the trial's batch size")

    monkeypatch.setattr(hfscale.sweep.loop, "search_trial", search_trial)
    data = {**RECIPE, "trials": [{"name": "a", "batch": "both"}, {"name": "b"}, {"name": "c", "batch": "both"}]}
    run_sweep(write_recipe(tmp_path, data), run_dir=tmp_path / "run", report=False, progress=lambda line: None)
    assert searched == ["a"]  # c was pruned before anything was searched
    assert ("a-maxbatch", 0) in launched
    rows = RunFolder(tmp_path / "run").rows()
    assert any(r.trial == "a-maxbatch" and r.batch_search.max_batch_of == "a" for r in rows)


def test_what_an_adaptive_search_cannot_do_is_refused_at_its_key(tmp_path):
    with pytest.raises(RecipeError, match=r"trials\[0\]\.measure\.target_precision: an adaptive search"):
        trials = [{"name": "a", "measure": {"target_precision": 0.05}}]
        load_recipe(write_recipe(tmp_path, {**RECIPE, "trials": trials}))
    with pytest.raises(RecipeError, match=r"trials\[0\]\.batch: .*batch: max is not supported"):
        load_recipe(write_recipe(tmp_path, {**RECIPE, "trials": [{"name": "a", "batch": "max"}]}))
    with pytest.raises(RecipeError, match=r"sweep\.search: .*expected one of 'grid', 'adaptive'"):
        load_recipe(write_recipe(tmp_path, {**RECIPE, "sweep": {"search": "smart"}}))
    grid = {**RECIPE, "sweep": {"search": "grid"}, "trials": [{"name": "a", "batch": "max"}]}
    with pytest.raises(SweepError, match=r"--search adaptive: trials\[0\]\.batch"):
        run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "run", settings=SweepSettings(search="adaptive"))
    assert not (tmp_path / "run").exists()  # refused before the run folder exists


def test_a_run_budget_is_never_overspent_and_a_grid_refuses_the_search_options(tmp_path, monkeypatch):
    launched = scripted_launches(monkeypatch, speed)
    sweep(tmp_path, "run", max_runs=3)  # inside the first round
    assert len(launched) == 3 and RunFolder(tmp_path / "run").search().stop == "run_budget_spent"
    grid = {**RECIPE, "sweep": {"search": "grid"}}
    with pytest.raises(SweepError, match=r"--max-runs .*only apply to an adaptive search"):
        run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "grid", settings=SweepSettings(max_runs=3))


def test_the_command_line_reads_the_search_options(tmp_path):
    from hfscale.commands.sweep import build_parser, settings_from_args

    args = build_parser().parse_args(["r.yaml", "--search", "adaptive", "--max-time", "20m", "--max-runs", "30"])
    settings = settings_from_args(args)
    assert (settings.search, settings.max_time_s, settings.max_runs) == ("adaptive", 1200.0, 30)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["r.yaml", "--search", "smart"])
    recorded = json.loads(json.dumps(settings.to_dict()))
    assert SweepSettings.from_dict(recorded) == settings


def test_a_noise_floor_from_an_earlier_grid_is_recorded_and_stated(tmp_path, monkeypatch):
    """The recipe names a grid's run folder (relative to the recipe): its pooled run noise is the floor, search.json
    keeps it with its source, every decision names it, and the report's verdicts and search section use it."""
    from hfscale.report.analysis import summarize_run
    from hfscale.report.trace import search_paragraphs

    scripted_launches(monkeypatch, speed)
    grid = {**RECIPE, "sweep": {"search": "grid"}}
    run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "grid", report=False, progress=lambda _: None)
    floored = {**RECIPE, "sweep": {"search": "adaptive", "noise_floor": "grid"}}
    run_sweep(write_recipe(tmp_path, floored), run_dir=tmp_path / "run", report=False, progress=lambda _: None)
    floor = RunFolder(tmp_path / "run").search().noise_floor
    assert floor is not None and floor.df == 8 and floor.sd == pytest.approx(0.0115, abs=0.001)  # 4 trials x 3 runs
    assert str((tmp_path / "grid").resolve()) in floor.source
    trace = RunFolder(tmp_path / "run").search().trace
    assert trace and all("noise floor" in d.reason for d in trace)
    summary = summarize_run(tmp_path / "run")
    assert summary.speed.floor == floor
    assert any("Noise floor: 1.2% of one run" in str(p) for p in search_paragraphs(summary.search))


def test_a_noise_floor_is_refused_by_a_grid_and_checked_before_anything_runs(tmp_path, monkeypatch):
    scripted_launches(monkeypatch, speed)
    grid = {**RECIPE, "sweep": {"search": "grid"}}
    with pytest.raises(SweepError, match=r"--noise-floor .*only apply to an adaptive search"):
        run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "g", settings=SweepSettings(noise_floor="0.1"))
    with pytest.raises(RecipeError, match=r"sweep\.noise_floor: expected a run-to-run noise between 0 and 1"):
        load_recipe(write_recipe(tmp_path, {**RECIPE, "sweep": {"search": "adaptive", "noise_floor": 1.5}}))
    nowhere = {**RECIPE, "sweep": {"search": "adaptive", "noise_floor": "nowhere"}}
    with pytest.raises(SweepError, match=r"sweep\.noise_floor\) .*nowhere: not a run folder"):
        run_sweep(write_recipe(tmp_path, nowhere), run_dir=tmp_path / "n", report=False, progress=lambda _: None)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "results.jsonl").write_text("")
    with pytest.raises(SweepError, match=r"--noise-floor .*empty: no trial there has two ok runs"):
        sweep(tmp_path, "run", noise_floor=str(tmp_path / "empty"))
    sweep(tmp_path, "searched")
    with pytest.raises(SweepError, match=r"an adaptive search's run folder"):
        sweep(tmp_path, "run", noise_floor=str(tmp_path / "searched"))
    assert not (tmp_path / "run").exists() and not (tmp_path / "n").exists()


def test_a_search_with_a_recipe_floor_relative_to_the_recipe_resumes(tmp_path, monkeypatch):
    """The recipe's copy in the run folder no longer sits beside the grid it names: the resumed search keeps the
    floor the sweep recorded (its absolute path) and decides as the uninterrupted one did."""
    scripted_launches(monkeypatch, speed)
    grid = {**RECIPE, "sweep": {"search": "grid"}}
    run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "grid", report=False, progress=lambda _: None)
    floored = {**RECIPE, "sweep": {"search": "adaptive", "noise_floor": "grid"}}
    recipe = write_recipe(tmp_path, floored)
    run_sweep(recipe, run_dir=tmp_path / "run", settings=SweepSettings(max_runs=4), report=False, progress=print)
    run_sweep(None, resume=tmp_path / "run", settings=SweepSettings(max_runs=100), report=False, progress=print)
    floor = RunFolder(tmp_path / "run").search().noise_floor
    assert floor is not None and str((tmp_path / "grid").resolve()) in floor.source
