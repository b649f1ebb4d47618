"""The adaptive search driven through the real sweep loop with scripted launches: rows, decisions, search.json,
resuming in the middle, the contenders' batch search, and what it refuses before running."""

from __future__ import annotations

import dataclasses
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


def _probing(monkeypatch) -> list[str]:
    """Every largest-batch search answers 16 (first out of memory at 32); returns the trials searched."""
    searched = []

    def search_trial(spec, row, probe, **_):
        searched.append(row.trial)
        result = BatchSearchResult(max_batch_size=16, first_oom_batch_size=32)
        return BatchSearchRecord(searched=True, result=result, start_from="the trial's batch size")

    monkeypatch.setattr(hfscale.sweep.loop, "search_trial", search_trial)
    return searched


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


def test_a_search_of_single_runs_says_it_has_no_noise_to_prune_on(tmp_path, monkeypatch):
    """cpu_techniques runs each trial once: searched, it ran what the grid runs and said nothing of why."""
    launched = scripted_launches(monkeypatch, speed)
    once = {**RECIPE, "measure": {**RECIPE["measure"], "repeats": 1}}
    lines: list[str] = []
    run_sweep(write_recipe(tmp_path, once), run_dir=tmp_path / "once", report=False, progress=lines.append)
    assert sorted(launched) == [(n, 0) for n in sorted(SPEEDS)]  # each once, as the grid; nothing pruned
    assert any(
        "every trial runs once (measure.repeats or --repeats 1) and no noise floor was given" in line for line in lines
    )
    lines.clear()
    sweep_twice = {**RECIPE, "trials": [{"name": "a"}, {"name": "b"}]}
    run_sweep(write_recipe(tmp_path, sweep_twice, "twice.yaml"), run_dir=tmp_path / "twice", report=False,
              progress=lines.append)  # fmt: skip
    assert not any("every trial runs once" in line for line in lines)


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
    searched = _probing(monkeypatch)
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


def test_the_command_line_reads_a_noise_floor_as_a_figure_or_a_folder_from_where_it_runs(tmp_path, monkeypatch):
    from hfscale.commands.sweep import build_parser, settings_from_args

    def floor(*argv: str) -> str | None:
        return settings_from_args(build_parser().parse_args(["r.yaml", "--search", "adaptive", *argv])).noise_floor

    assert floor("--noise-floor", "15%") == floor("--noise-floor", "0.15") == "0.15"
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "results.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    assert floor("--noise-floor", "grid") == str(tmp_path / "grid")  # recorded absolute: resume runs elsewhere
    assert floor() is None
    for bad in ("150%", "nowhere"):
        with pytest.raises(SystemExit):
            floor("--noise-floor", bad)


def test_a_noise_floor_from_an_earlier_grid_is_recorded_and_stated(tmp_path, monkeypatch):
    """The recipe names a grid's run folder (relative to the recipe): its pooled run noise is the floor, search.json
    keeps it with its source, every decision names it, and the report's verdicts and search section use it."""
    from hfscale.report.analysis import summarize_run
    from hfscale.report.plots import ranking_caption
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
    assert "(Šidák; no mean narrower than one run of the noise floor, 1.2%;" in ranking_caption(summary)


def test_a_noise_floor_leaves_out_disturbed_runs_and_trials_whose_runs_disagree(tmp_path, monkeypatch):
    """A busy run (the activity sampler saw other processes) or a trial whose runs disagree far beyond the others'
    would raise the floor for every decision of the search: both are left out, and the floor's source says so."""
    from hfscale.sweep.adaptive import noise_floor_of

    wild = {0: 1.0, 1: 1.6, 2: 0.6}
    scripted_launches(monkeypatch, lambda name, repeat: speed(name, repeat) * (wild[repeat] if name == "c" else 1))
    grid = {**RECIPE, "sweep": {"search": "grid"}}
    run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "grid", report=False, progress=lambda _: None)
    results = tmp_path / "grid" / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    for row in rows:
        if (row["trial"], row["repeat"]) == ("d", 1):
            row["activity"] = {"samples": 5, "duration_s": 5.0, "cpu_count": 2, "other_cores_mean": 0.9}
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    floor = noise_floor_of(str(tmp_path / "grid"))
    assert floor.df == 2 + 2 + 1  # a and b 3 runs each, d 2 of its 3, c none
    assert floor.sd == pytest.approx(0.0115, abs=0.002)  # the 1% runs', not c's 50%
    assert (
        "left out: runs beside other busy processes: d run 2" in floor.source
        and "c (its 3 runs disagree" in floor.source
    )


def test_a_resumed_search_keeps_the_floor_it_recorded_though_its_grid_is_gone(tmp_path, monkeypatch):
    """The floor is read once, when the search starts, and recorded in environment.json: a resumed search does not
    read the grid again (changed or gone since)."""
    scripted_launches(monkeypatch, speed)
    grid = {**RECIPE, "sweep": {"search": "grid"}}
    run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "grid", report=False, progress=lambda _: None)
    sweep(tmp_path, "run", search="adaptive", noise_floor=str(tmp_path / "grid"), max_runs=4)
    first = RunFolder(tmp_path / "run").search().noise_floor
    recorded = json.loads((tmp_path / "run" / "environment.json").read_text())["noise_floor"]
    assert recorded == {"sd": first.sd, "df": first.df, "source": first.source}
    (tmp_path / "grid").rename(tmp_path / "moved")
    run_sweep(None, resume=tmp_path / "run", settings=SweepSettings(max_runs=100), report=False, progress=print)
    assert RunFolder(tmp_path / "run").search().noise_floor == first


def test_the_least_memory_question_under_a_noise_floor_stops_at_two_runs_and_says_why(tmp_path, monkeypatch):
    """At least 150 samples/s with a 20% floor: c and d are too slow beyond it after one run; a and b (100, 99) can
    be placed neither way, and their 1% runs cannot narrow a mean the floor holds at 20%: two runs each, not the
    three of measure.repeats, and every reason names the floor."""
    launched = scripted_launches(monkeypatch, speed)
    sweep(tmp_path, "run", search="adaptive", min_samples_per_s=150, noise_floor="0.2")
    summary = RunFolder(tmp_path / "run").search()
    assert summary.stop == "runs_spent" and summary.answer is None
    assert "noise floor (20.0%, given as a figure)" in summary.stop_reason and "none qualifies" in summary.stop_reason
    too_slow = {d.trial: d.reason for d in summary.trace if d.kind == "too_slow"}
    assert set(too_slow) == {"c", "d"} and all("noise floor" in why for why in too_slow.values())
    runs = {name: sum(1 for trial, _ in launched if trial == name) for name in SPEEDS}
    assert runs == {"a": 2, "b": 2, "c": 1, "d": 1}


def test_a_search_from_before_the_record_resumes_on_its_search_json_floor_and_records_it(tmp_path, monkeypatch, capsys):
    """A run folder whose environment.json has no floor (written before the record) but whose search.json does: the
    resumed search takes that one, not the grid's figure read again, and records it for the next resume. A record
    that is not a floor is refused, naming the file. The dry run of a resume shows the recorded floor, although the
    recipe's relative path no longer resolves from the run folder's copy."""
    from hfscale.commands.sweep import main

    scripted_launches(monkeypatch, speed)
    grid = {**RECIPE, "sweep": {"search": "grid"}}
    run_sweep(write_recipe(tmp_path, grid), run_dir=tmp_path / "grid", report=False, progress=lambda _: None)
    floored = {**RECIPE, "sweep": {"search": "adaptive", "noise_floor": "grid"}}
    run_sweep(write_recipe(tmp_path, floored), run_dir=tmp_path / "run", settings=SweepSettings(max_runs=4),
              report=False, progress=lambda _: None)  # fmt: skip
    first = RunFolder(tmp_path / "run").search().noise_floor
    assert main(["--dry-run", "--resume", str(tmp_path / "run")]) == 0
    assert f"noise floor {first.sd:.1%} of one run: {first.source}" in capsys.readouterr().out
    environment = tmp_path / "run" / "environment.json"
    recorded = json.loads(environment.read_text())
    environment.write_text(json.dumps({**recorded, "noise_floor": {"sd": "high", "df": 3}}))
    with pytest.raises(SweepError, match=r"environment\.json: noise_floor is not .* \(sd: Input should be a"):
        run_sweep(None, resume=tmp_path / "run", report=False, progress=lambda _: None)
    environment.write_text(json.dumps({k: v for k, v in recorded.items() if k != "noise_floor"}))
    (tmp_path / "grid").rename(tmp_path / "moved")
    run_sweep(None, resume=tmp_path / "run", settings=SweepSettings(max_runs=6), report=False, progress=print)
    assert RunFolder(tmp_path / "run").search().noise_floor == first
    run_sweep(None, resume=tmp_path / "run", settings=SweepSettings(max_runs=100), report=False, progress=print)
    assert RunFolder(tmp_path / "run").search().noise_floor == first  # from the first resume's record


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


def test_no_probe_runs_once_the_run_budget_is_spent_and_the_answer_so_far_stays(tmp_path, monkeypatch):
    """A search that decides on exactly its last allowed run: its contender's largest batch is not searched (that
    costs runs the budget no longer has), and the answer it reached is kept."""
    launched = scripted_launches(monkeypatch, speed)
    searched = _probing(monkeypatch)
    data = {**RECIPE, "trials": [{"name": "a", "batch": "both"}, {"name": "b"}, {"name": "c"}]}
    run_sweep(write_recipe(tmp_path, data), run_dir=tmp_path / "whole", report=False, progress=lambda line: None)
    before_probe = launched.index(("a-maxbatch", 0))
    launched.clear()
    searched.clear()
    run_sweep(
        write_recipe(tmp_path, data), run_dir=tmp_path / "capped", settings=SweepSettings(max_runs=before_probe),
        report=False, progress=lambda line: None,
    )  # fmt: skip
    assert searched == [] and ("a-maxbatch", 0) not in launched and len(launched) == before_probe
    summary = RunFolder(tmp_path / "capped").search()  # it ended on its own (a and b tie) as its budget ran out
    assert summary.answer == "a" and "a-maxbatch" not in summary.contenders, summary


def test_a_time_budget_spent_before_every_trial_ran_keeps_the_answer_of_those_that_did(tmp_path, monkeypatch):
    launched = scripted_launches(monkeypatch, speed)  # every run takes 1 s
    sweep(tmp_path, "run", max_time_s=3.0)
    assert launched == [("a", 0), ("b", 0), ("c", 0)]
    summary = RunFolder(tmp_path / "run").search()
    assert summary.stop == "time_spent" and summary.answer == "a", summary
    assert "d" in summary.contenders  # never ran: still in the contest


def _failing(monkeypatch, names: set[str]) -> None:
    """The first run of each trial in ``names`` ends out of memory (wall time 1 s, as the scripted runs)."""
    from hfscale.launch.rows import planned_row

    inner = hfscale.sweep.loop.launch_trial

    def launch_trial(run, folder, *, baseline, **kw):
        if run.name in names:
            return planned_row(run, baseline=baseline, status="oom", reason="CUDA out of memory", wall_time_s=1.0)
        return inner(run, folder, baseline=baseline, **kw)

    monkeypatch.setattr(hfscale.sweep.loop, "launch_trial", launch_trial)


def test_the_grids_cost_counts_a_failed_trial_once_and_a_planned_skip_never(tmp_path, monkeypatch):
    import hfscale.launch.plan as plan

    scripted_launches(monkeypatch, speed)
    _failing(monkeypatch, {"d"})
    missing = plan.skip_reason
    monkeypatch.setattr(
        plan, "skip_reason", lambda s, **kw: "deepspeed is not installed" if s.name == "c" else missing(s, **kw)
    )
    sweep(tmp_path, "run")
    summary = RunFolder(tmp_path / "run").search()
    assert summary.grid_runs == 3 + 3 + 0 + 1  # a and b three times, c never launched, d once (it fails)


def test_the_grids_time_is_costed_at_full_length_runs(tmp_path, monkeypatch):
    """A trial pruned after its short first run is costed as the grid would run it: at its full length, its
    extra steps at its own measured step time."""
    launched = scripted_launches(monkeypatch, speed)
    inner = hfscale.sweep.loop.launch_trial

    def timed(run, folder, **kw):  # 1 s to start, then the steps at the trial's own step time
        row = inner(run, folder, **kw)
        steps = run.trial.spec.measure.max_steps
        return dataclasses.replace(row, wall_time_s=1.0 + steps * 4 / speed(run.name, run.repeat))

    monkeypatch.setattr(hfscale.sweep.loop, "launch_trial", timed)
    data = {**RECIPE, "measure": {"warmup_steps": 1, "max_steps": 48, "repeats": 3}}
    run_sweep(write_recipe(tmp_path, data), run_dir=tmp_path / "run", report=False, progress=lambda line: None)
    assert launched[:4] == [("a", 0), ("b", 0), ("c", 0), ("d", 0)]
    full = {name: 1.0 + 48 * 4 / SPEEDS[name] for name in SPEEDS}  # about: runs differ 1%
    summary = RunFolder(tmp_path / "run").search()
    assert summary.grid_estimate_s == pytest.approx(3 * sum(full.values()), rel=0.02)


def test_a_trial_whose_runs_gave_no_speed_is_out_and_says_why(tmp_path, monkeypatch):
    def step_times(name: str, repeat: int) -> list[float]:
        times = [4 / speed(name, repeat)] * 4
        if name == "b":
            times[2] = float("nan")  # no usable speed from its run
        return times

    launched = scripted_launches(monkeypatch, step_times=step_times)
    lines: list[str] = []
    run_sweep(write_recipe(tmp_path, RECIPE), run_dir=tmp_path / "run", report=False, progress=lines.append)
    summary = RunFolder(tmp_path / "run").search()
    assert ("b", 1) not in launched and summary.answer == "a"
    assert any(line.startswith("b: unmeasured: no speed measured") for line in lines), lines
    assert [(d.trial, d.kind) for d in summary.trace if d.trial == "b"] == [("b", "unmeasured")]


def test_an_interrupted_search_is_refused_as_a_noise_floor(tmp_path, monkeypatch):
    from hfscale.sweep.adaptive import noise_floor_of

    launched = scripted_launches(monkeypatch, speed)
    inner = hfscale.sweep.loop.launch_trial

    def interrupted(run, folder, **kw):
        if len(launched) == 6:
            raise KeyboardInterrupt
        return inner(run, folder, **kw)

    monkeypatch.setattr(hfscale.sweep.loop, "launch_trial", interrupted)
    with pytest.raises(BaseException):  # noqa: B017 - the sweep's own interrupt, whatever its type
        sweep(tmp_path, "run")
    assert not (tmp_path / "run" / "search.json").exists()
    with pytest.raises(SweepError, match="an adaptive search's run folder"):
        noise_floor_of(str(tmp_path / "run"))


def test_a_trial_that_ran_but_did_not_apply_is_costed_at_every_repeat_as_the_grid_runs_it(tmp_path, monkeypatch):
    launched = scripted_launches(monkeypatch, speed)
    inner = hfscale.sweep.loop.launch_trial

    def not_applied(run, folder, **kw):
        row = inner(run, folder, **kw)
        if run.name != "d":
            return row
        measured = dataclasses.replace(row.measured, status="not_applied", reason="ZeRO stage 0 ran")
        return dataclasses.replace(row, status="not_applied", reason="ZeRO stage 0 ran", measured=measured)

    monkeypatch.setattr(hfscale.sweep.loop, "launch_trial", not_applied)
    run_sweep(
        write_recipe(tmp_path, {**RECIPE, "sweep": {"search": "grid"}}), run_dir=tmp_path / "grid", report=False,
        progress=lambda line: None,
    )  # fmt: skip
    grid_launches = len(launched)
    sweep(tmp_path, "search")
    assert RunFolder(tmp_path / "search").search().grid_runs == grid_launches == 12


def test_a_budget_spent_inside_the_first_round_decides_nothing_a_resume_would_not(tmp_path, monkeypatch):
    """Six trials, a 2% noise floor (one run can prune): stopped after two first runs, a look at those two alone
    would prune b on intervals over two trials rather than six. The resumed search must launch what an
    uninterrupted one does."""
    speeds = {"a": 100.0, "b": 94.0, "c": 90.0, "d": 90.0, "e": 90.0, "f": 90.0}
    launched = scripted_launches(monkeypatch, lambda name, repeat: speeds[name] * (1 + 0.001 * (-1) ** repeat))
    data = {**RECIPE, "trials": [{"name": name} for name in speeds]}
    floor = SweepSettings(noise_floor="2%")
    run_sweep(write_recipe(tmp_path, data), run_dir=tmp_path / "whole", settings=floor, report=False,
              progress=lambda line: None)  # fmt: skip
    whole = list(launched)
    launched.clear()
    capped = SweepSettings(noise_floor="2%", max_runs=2)
    run_sweep(write_recipe(tmp_path, data), run_dir=tmp_path / "parts", settings=capped, report=False,
              progress=lambda line: None)  # fmt: skip
    stopped = RunFolder(tmp_path / "parts").search()
    assert stopped.stop == "run_budget_spent" and stopped.trace == () and stopped.answer == "a"
    assert stopped.contenders == ("b", "c", "d", "e", "f")
    run_sweep(
        None, resume=tmp_path / "parts", settings=SweepSettings(max_runs=100), report=False, progress=lambda _: None
    )
    assert launched == whole
