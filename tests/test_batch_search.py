"""The batch search: its walk against scripted probes, and against real training steps under a memory cap."""

from __future__ import annotations

import pytest

from hfscale.batch_search import (
    BatchSearchResult,
    ProbeOutcome,
    find_max_batch,
    probe_spec,
    search_key,
    search_trial,
    suggest_start_batch,
    why_not_searched,
)
from hfscale.estimate import estimate_memory
from hfscale.spec import DataSpec, ModelSpec, TrialSpec
from hfscale.strategy import Strategy


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
    from hfscale.results import TrialResult

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
    assert record.result.max_batch_size is None or record.result.max_batch_size <= 12
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
    from hfscale.recipe import RecipeTrial, RunSpec

    def trial(spec: TrialSpec) -> RecipeTrial:
        return RecipeTrial(spec=spec, run=RunSpec())

    base = _spec(4)
    assert search_key(trial(base)) == search_key(trial(probe_spec(base, 32, probe_steps=5)))
    other = base.__class__(**{**base.__dict__, "strategy": base.strategy.replace(gradient_checkpointing=True)})
    assert search_key(trial(base)) != search_key(trial(other))
