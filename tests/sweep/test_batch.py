"""The batch search: its walk against scripted probes, and against real training steps under a memory cap."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.runs import write_recipe

from hfscale.estimate import estimate_memory
from hfscale.records.batch import BatchSearchResult, ProbeOutcome
from hfscale.strategy import Strategy
from hfscale.sweep.batch import (
    find_max_batch,
    probe_spec,
    search_key,
    search_trial,
    suggest_start_batch,
    why_not_searched,
)
from hfscale.workload.spec import DataSpec, ModelSpec, TrialSpec


def _scripted(limit: int, *, error_at: int | None = None):
    calls: list[int] = []

    def probe(batch: int) -> ProbeOutcome:
        calls.append(batch)
        if error_at is not None and batch >= error_at:
            return ProbeOutcome(status="error", reason="RuntimeError: NCCL timeout")
        if batch <= limit:
            return ProbeOutcome(status="fits", samples_per_s=10.0 * batch)
        return ProbeOutcome(status="oom", reason="CUDA out of memory")

    return probe, calls


def _assert_bracketed(result: BatchSearchResult, limit: int) -> None:
    outcomes = {p.batch_size: p.outcome.status for p in result.probes}
    assert result.max_batch_size == limit
    assert outcomes[limit] == "fits"
    assert outcomes[limit + 1] == "oom"


@pytest.mark.parametrize("start", [1, 3, 16, 37, 100, 500])
@pytest.mark.parametrize("limit", [1, 5, 37, 64, 300])
def test_finds_the_limit_from_any_start(start, limit):
    probe, calls = _scripted(limit)
    result = find_max_batch(probe, start=start, upper_limit=4096)
    _assert_bracketed(result, limit)
    assert len(calls) == len(set(calls)), "a size is never probed twice"
    assert result.first_oom_batch_size == limit + 1
    assert result.samples_per_s == 10.0 * limit


def test_start_near_the_limit_takes_few_probes():
    probe, calls = _scripted(100)
    find_max_batch(probe, start=90)
    assert len(calls) <= 2 + 7  # 90 fits, 180 oom, then bisect 90..180


def test_nothing_fits():
    probe, calls = _scripted(0)
    result = find_max_batch(probe, start=8)
    assert result.max_batch_size is None
    assert result.first_oom_batch_size == 1
    assert calls == [8, 4, 2, 1]


def test_upper_limit_caps_the_walk():
    probe, calls = _scripted(10_000)
    result = find_max_batch(probe, start=3, upper_limit=20)
    assert result.max_batch_size == 20 and result.reached_upper_limit
    assert max(calls) == 20


def test_an_error_stops_the_search_with_its_reason():
    probe, calls = _scripted(100, error_at=40)
    result = find_max_batch(probe, start=10)
    assert result.max_batch_size == 20
    assert result.stopped_reason == "batch 40: RuntimeError: NCCL timeout"
    assert calls == [10, 20, 40]
    assert [p.outcome.status for p in result.probes] == ["fits", "fits", "error"]


def test_multiple_of_stops_at_the_granularity():
    probe, calls = _scripted(45)
    result = find_max_batch(probe, start=8, multiple_of=8)
    assert result.max_batch_size == 40
    assert all(b % 8 == 0 for b in calls)


def test_suggested_start_is_what_the_estimate_says_fits():
    spec = TrialSpec(
        name="t",
        strategy=Strategy(device="cuda", per_device_batch_size=8),
        model=ModelSpec(type="bert", config={"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}),
        data=DataSpec(seq_len=256),
    )
    budget = 4 * 1024**3
    start = suggest_start_batch(spec, budget, reserve_bytes=0)

    def total(batch: int) -> int:
        return estimate_memory(spec, spec.strategy.replace(per_device_batch_size=batch)).total_bytes

    assert total(start) <= budget < total(start + 1)


# ---------------------------------------------------------------------------------------------------------------
# one trial's search, as the sweep runs it, with a scripted probe launcher
# ---------------------------------------------------------------------------------------------------------------


def _trial_row(status: str = "ok", *, batch: int = 4, samples_per_s: float | None = None):
    from hfscale.records.row import TrialResult

    strategy = Strategy(name="t", device="cpu", per_device_batch_size=batch)
    return TrialResult(trial="t", strategy=strategy, status=status, reason=None if status == "ok" else "why")


def _spec(batch: int = 4) -> TrialSpec:
    return TrialSpec(
        name="t",
        strategy=Strategy(name="t", device="cpu", per_device_batch_size=batch),
        model=ModelSpec(type="bert", task="classification", config={"hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 1000}),
        data=DataSpec(num_samples=64, seq_len=32),
    )  # fmt: skip


def test_search_trial_counts_the_trials_own_run_and_sizes_each_probe():
    launched: list[TrialSpec] = []

    def launch(spec: TrialSpec) -> ProbeOutcome:
        launched.append(spec)
        fits = spec.strategy.per_device_batch_size <= 12
        return ProbeOutcome(status="fits", samples_per_s=1.0) if fits else ProbeOutcome(status="oom", reason="oom")

    record = search_trial(_spec(4), _trial_row("oom"), launch, budget_bytes=None, upper_limit=64, probe_steps=2)
    assert record.searched and record.start_from == "the trial's batch size"
    # Out of memory at 4 (the trial's own run), and every smaller size fits: the answer is 3.
    assert (record.result.max_batch_size, record.result.first_oom_batch_size) == (3, 4)
    # The trial's own run (out of memory at 4) was the first probe: only smaller sizes were launched.
    assert record.trial_run_batch_size == 4 and all(s.strategy.per_device_batch_size < 4 for s in launched)
    for spec in launched:
        assert spec.measure.max_steps == spec.measure.warmup_steps + 2
        assert spec.data.num_samples == spec.strategy.per_device_batch_size * spec.measure.max_steps

    launched.clear()
    record = search_trial(_spec(4), _trial_row("crashed"), launch, budget_bytes=None, upper_limit=64, probe_steps=2)
    assert record.result.max_batch_size == 12 and record.result.first_oom_batch_size == 13
    assert record.trial_run_batch_size is None and launched[0].strategy.per_device_batch_size == 4


def test_why_not_searched():
    assert why_not_searched(_trial_row("ok"), predicted_oom=False) is None
    assert why_not_searched(_trial_row("oom"), predicted_oom=False) is None
    assert why_not_searched(_trial_row("skipped"), predicted_oom=True) is None
    assert why_not_searched(_trial_row("skipped"), predicted_oom=False) == "skipped: why"
    assert why_not_searched(_trial_row("timeout"), predicted_oom=False) == "the trial ended timeout"


def test_trials_that_differ_only_in_their_batch_share_a_search_key():
    from hfscale.recipes.schema import RecipeTrial, RunSpec

    def trial(spec: TrialSpec) -> RecipeTrial:
        return RecipeTrial(spec=spec, run=RunSpec())

    base = _spec(4)
    assert search_key(trial(base)) == search_key(trial(probe_spec(base, 32, probe_steps=5)))
    other = base.__class__(**{**base.__dict__, "strategy": base.strategy.replace(gradient_checkpointing=True)})
    assert search_key(trial(base)) != search_key(trial(other))


# -- batch size as an axis: a recipe's `sweep.batch` -----------------------------------------------------------------


def _scripted_sweep(monkeypatch, limits: dict[str, int]) -> list[tuple[str, int, int]]:
    """Replace the sweep's launches by scripts: a trial's row is ok (10 samples/s per sample of batch) when its
    per-device batch is within ``limits[trial]``, else oom; a probe of the search fits likewise. Returns the
    (trial, repeat, batch) of every trial launch, in order (probes are not trials)."""
    from types import SimpleNamespace

    import hfscale.sweep.loop
    from hfscale.launch.rows import planned_row
    from hfscale.records.measurements import ThroughputSummary
    from hfscale.records.row import TrialOutcome

    launched: list[tuple[str, int, int]] = []

    def limit(name: str) -> int:
        return limits[name.removesuffix("-maxbatch")]

    def launch_trial(run, folder, *, baseline, **_):
        batch = run.trial.spec.strategy.per_device_batch_size
        launched.append((run.name, run.repeat, batch))
        if batch > limit(run.name):
            return planned_row(run, baseline=baseline, status="oom", reason="CUDA out of memory")
        times = [batch / (10.0 * batch)] * 4
        throughput = ThroughputSummary(
            samples_per_s=10.0 * batch, tokens_per_s=None, step_time_median_s=times[0], step_time_p90_s=None,
            step_time_mean_s=times[0], measured_steps=4, warmup_steps=1, samples_per_step=batch,
            tokens_per_sample=None, world_size=1, flops_per_token=None, mfu=None, peak_flops_per_s=None,
            device_name="cpu", step_times_s=times,
        )  # fmt: skip
        measured = TrialOutcome(trial=run.name, status="ok", throughput=throughput)
        return planned_row(run, baseline=baseline, status="ok", measured=measured, wall_time_s=1.0)

    def launch_group(request, **kwargs):
        batch = request.trial.spec.strategy.per_device_batch_size
        fits = batch <= limit(request.trial.name)
        outcome = ProbeOutcome(status="fits", samples_per_s=10.0 * batch) if fits else ProbeOutcome(status="oom")
        return SimpleNamespace(as_probe=lambda: outcome)

    monkeypatch.setattr(hfscale.sweep.loop, "launch_trial", launch_trial)
    monkeypatch.setattr(hfscale.sweep.loop, "launch_group", launch_group)
    return launched


def _axis_data(batch: str, **measure) -> dict:
    return {
        "device": "cpu",
        "model": {"config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}},
        "data": {"num_samples": 32, "seq_len": 16},
        "measure": {"warmup_steps": 1, "repeats": 1, **measure},
        "sweep": {"batch": batch, "max_batch_limit": 64},
        "defaults": {"per_device_batch_size": 4},
        "trials": [{"name": "fp32"}, {"name": "ckpt", "gradient_checkpointing": True}],
    }


def _axis_recipe(tmp_path, batch: str, **measure) -> str:
    return str(write_recipe(tmp_path, _axis_data(batch, **measure), "axis.yaml"))


def test_batch_both_adds_a_row_per_strategy_at_the_largest_batch_it_fits(tmp_path, monkeypatch):
    from hfscale.report.columns import COLUMNS
    from hfscale.report.trials import group_rows, trial_record
    from hfscale.results.run_folder import RunFolder
    from hfscale.sweep.loop import run_sweep

    launched = _scripted_sweep(monkeypatch, {"fp32": 12, "ckpt": 40})
    recipe = _axis_recipe(tmp_path, "both")
    run_sweep(recipe, run_dir=tmp_path / "run", report=False, progress=lambda line: None)
    assert launched == [("fp32", 0, 4), ("ckpt", 0, 4), ("fp32-maxbatch", 0, 12), ("ckpt-maxbatch", 0, 40)]
    rows = {r.trial: r for r in RunFolder(tmp_path / "run").rows()}
    assert set(rows) == {"fp32", "ckpt", "fp32-maxbatch", "ckpt-maxbatch"}
    # Each max-batch row is written once, already marked: an unmarked first copy would read as an ordinary trial
    # to a sweep stopped before the second write and resumed.
    lines = (tmp_path / "run" / "results.jsonl").read_text(encoding="utf-8").splitlines()
    assert sum('"trial":"fp32-maxbatch"' in line for line in lines) == 1, lines
    for name, limit in (("fp32", 12), ("ckpt", 40)):
        fixed, best = rows[name], rows[f"{name}-maxbatch"]
        assert fixed.batch_search.result.max_batch_size == limit and fixed.batch_search.max_batch_of is None
        assert best.status == "ok" and best.strategy.per_device_batch_size == limit
        assert best.batch_search.max_batch_of == name and best.samples_per_s == 10.0 * limit
        assert best.strategy.gradient_checkpointing == fixed.strategy.gradient_checkpointing
    # The baseline stays the fixed-batch trial; the table says which rows ran another batch and how to read them.
    assert [r.trial for r in rows.values() if r.is_baseline] == ["fp32"]
    notes = COLUMNS["notes"].cell
    records = {name: trial_record(name, group) for name, group in group_rows(list(rows.values()))}
    assert "ckpt at its largest batch: compare samples/s, not step time or loss" in notes(records["ckpt-maxbatch"])
    assert "largest batch" not in notes(records["ckpt"])
    from hfscale.report.coverage import coverage

    assert coverage(RunFolder(tmp_path / "run"), rows).sentence() == "2 of 2 recipe trials have a result."

    # A resumed sweep has nothing left to run: the max-batch rows are there.
    launched.clear()
    run_sweep(None, resume=tmp_path / "run", report=False, progress=lambda line: None)
    assert launched == []


def test_batch_max_compares_at_the_largest_batch_only(tmp_path, monkeypatch):
    from hfscale.results.run_folder import RunFolder
    from hfscale.sweep.loop import run_sweep

    launched = _scripted_sweep(monkeypatch, {"fp32": 12, "ckpt": 40})
    run_sweep(_axis_recipe(tmp_path, "max", repeats=2), run_dir=tmp_path / "run", report=False)
    # The fixed batch runs once (the search's first probe); the max-batch rows get the recipe's two runs each.
    assert launched == [
        ("fp32", 0, 4), ("ckpt", 0, 4),
        ("fp32-maxbatch", 0, 12), ("ckpt-maxbatch", 0, 40), ("fp32-maxbatch", 1, 12), ("ckpt-maxbatch", 1, 40),
    ]  # fmt: skip
    rows = RunFolder(tmp_path / "run").rows()
    assert {r.trial for r in rows if r.is_baseline} == {"fp32-maxbatch"}


def test_batch_fixed_adds_no_rows_and_find_max_batch_still_only_records_the_search(tmp_path, monkeypatch):
    from hfscale.launch.plan import SweepSettings
    from hfscale.results.run_folder import RunFolder
    from hfscale.sweep.loop import run_sweep

    launched = _scripted_sweep(monkeypatch, {"fp32": 12, "ckpt": 40})
    settings = SweepSettings(find_max_batch=True)
    run_sweep(_axis_recipe(tmp_path, "fixed"), run_dir=tmp_path / "run", settings=settings, report=False)
    assert [name for name, _, _ in launched] == ["fp32", "ckpt"]
    assert all(r.batch_search.searched for r in RunFolder(tmp_path / "run").rows())


def test_max_batch_trial_keeps_the_steps_per_epoch_and_the_recipes_repeats():
    from hfscale.recipes.schema import RecipeTrial, RunSpec
    from hfscale.records.batch import BatchSearchRecord
    from hfscale.sweep.batch_axis import max_batch_trial

    trial = RecipeTrial(spec=_spec(4), run=RunSpec(), source="trials[0]")  # 64 samples: 16 steps of 4
    found = BatchSearchRecord(
        searched=True, result=BatchSearchResult(max_batch_size=12, first_oom_batch_size=13, probes=())
    )
    best = max_batch_trial(trial, found)
    assert best.name == best.spec.strategy.name == f"{trial.name}-maxbatch"
    assert best.spec.strategy.per_device_batch_size == 12
    assert best.spec.data.num_samples == 16 * 12  # 16 steps per epoch at either batch
    assert best.source == "trials[0] at its largest batch (12)"
    assert max_batch_trial(trial, None) is None
    assert max_batch_trial(trial, BatchSearchRecord(searched=False, reason="crashed")) is None
    # dataloader_drop_last trains the whole batches only: 100 samples at 8 are 12 steps, and 12 steps of 12 at the
    # largest batch (13 of them trained a step more than the trial).
    uneven = dataclasses.replace(
        trial.spec, data=DataSpec(num_samples=100, seq_len=32), training_args={"dataloader_drop_last": True}
    )
    uneven = dataclasses.replace(
        trial, spec=dataclasses.replace(uneven, strategy=uneven.strategy.replace(per_device_batch_size=8))
    )
    assert max_batch_trial(uneven, found).spec.data.num_samples == 12 * 12
    none_fits = BatchSearchResult(max_batch_size=None, first_oom_batch_size=1)
    assert max_batch_trial(trial, BatchSearchRecord(searched=True, result=none_fits)) is None


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_packed_trial_at_its_largest_batch_trains_as_many_full_steps(seed: int):
    """Packed data's rows come from drawn lengths: scaling the sequences in proportion left the larger batch's
    data about a row short now and then, so its last step (or an epoch's only one) trained a smaller batch."""
    import dataclasses

    from hfscale.recipes.schema import RecipeTrial, RunSpec
    from hfscale.records.batch import BatchSearchRecord
    from hfscale.sweep.batch_axis import max_batch_trial
    from hfscale.workload.spec import DataSpec, LengthSpec, ModelSpec
    from hfscale.workload.steps import rows_per_epoch, steps_per_epoch

    packed = DataSpec(
        num_samples=300, seq_len=64, lengths=LengthSpec(min=4), packing="pack", token_high=1000, seed=seed
    )
    spec = dataclasses.replace(_spec(4), model=ModelSpec(type="gpt2", task="causal_lm"), data=packed)
    trial = RecipeTrial(spec=spec, run=RunSpec(), source="trials[0]")
    for batch in (5, 7, 12):
        found = BatchSearchRecord(
            searched=True, result=BatchSearchResult(max_batch_size=batch, first_oom_batch_size=batch + 1)
        )
        best = max_batch_trial(trial, found).spec
        steps = steps_per_epoch(spec.strategy, rows_per_epoch(spec.data))
        assert rows_per_epoch(best.data) >= steps * best.strategy.global_batch_size, (seed, batch)
        assert steps_per_epoch(best.strategy, rows_per_epoch(best.data)) == steps, (seed, batch)


def test_the_recipes_max_batch_limit_applies_unless_the_command_line_gives_one():
    from hfscale.launch.plan import SweepSettings
    from hfscale.recipes.schema import SweepOptions
    from hfscale.sweep.batch_axis import batch_settings

    both = SweepOptions(batch="both", max_batch_limit=32)
    assert batch_settings(both, SweepSettings()) == SweepSettings(max_batch_limit=32)
    assert batch_settings(both, SweepSettings(max_batch_limit=8)) == SweepSettings(max_batch_limit=8)
    assert batch_settings(SweepOptions(), SweepSettings()) == SweepSettings()


def test_a_trial_may_set_its_own_batch_and_only_those_trials_are_searched(tmp_path, monkeypatch):

    from hfscale.results.run_folder import RunFolder
    from hfscale.sweep.loop import run_sweep

    launched = _scripted_sweep(monkeypatch, {"fp32": 12, "ckpt": 40})
    data = _axis_data("fixed")
    data["trials"][1]["batch"] = "max"
    run_sweep(
        write_recipe(tmp_path, data, "own.yaml"), run_dir=tmp_path / "run", report=False, progress=lambda line: None
    )
    assert launched == [("fp32", 0, 4), ("ckpt", 0, 4), ("ckpt-maxbatch", 0, 40)]
    rows = {r.trial: r for r in RunFolder(tmp_path / "run").rows()}
    assert rows["fp32"].batch_search is None and rows["ckpt"].batch_search.result.max_batch_size == 40
    assert rows["fp32"].is_baseline  # the baseline is compared at its own batch


def test_a_max_batch_row_of_a_trial_with_a_target_precision_runs_twice(tmp_path, monkeypatch):
    from hfscale.sweep.loop import run_sweep

    launched = _scripted_sweep(monkeypatch, {"fp32": 12, "ckpt": 40})
    recipe = _axis_recipe(tmp_path, "both", target_precision=0.05, max_repeats=3)
    run_sweep(recipe, run_dir=tmp_path / "run", report=False, progress=lambda line: None)
    maxbatch = [(name, repeat) for name, repeat, _ in launched if name.endswith("-maxbatch")]
    assert maxbatch == [("fp32-maxbatch", 0), ("ckpt-maxbatch", 0), ("fp32-maxbatch", 1), ("ckpt-maxbatch", 1)]
