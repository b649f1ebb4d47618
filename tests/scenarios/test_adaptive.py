"""An adaptive search for real (issue 24): tiny BERT trials launched as their own process groups, one skipped by its
estimate, the first runs short with their warm-up detected, stopped by its run budget and resumed, and the report's
decision trace. The search's error rate is tests/sweep/test_search.py's (simulated); its bookkeeping with scripted
launches is tests/sweep/test_adaptive.py's."""

from __future__ import annotations

import pytest
from helpers.models import TINY_BERT
from helpers.runs import write_recipe

from hfscale.launch.plan import SweepSettings
from hfscale.results.run_folder import RunFolder
from hfscale.sweep.adaptive import MIN_SHORT_STEPS
from hfscale.sweep.loop import run_sweep

RECIPE = {
    "name": "adaptive",
    "device": "cpu",
    "model": {"type": "bert", "task": "classification", "config": dict(TINY_BERT)},
    "data": {"num_samples": 4096, "seq_len": 64, "token_high": 1000},
    "training_args": {"report_to": "none", "seed": 0},
    "measure": {"warmup_steps": 1, "max_steps": 40, "repeats": 2, "timeout_s": 300},
    "run": {"env": {"OMP_NUM_THREADS": "1"}},
    "sweep": {"search": "adaptive", "memory_budget_gib": 1.0},
    "baseline": "fp32",
    "defaults": {"per_device_batch_size": 4, "num_processes": 1, "optimizer": "adamw_torch"},
    "trials": [
        {"name": "fp32"},
        {"name": "bf16", "precision": "bf16"},
        # 2.7 GiB predicted for a 1 GiB budget: skipped before anything runs.
        {"name": "huge", "per_device_batch_size": 4096},
    ],
}


@pytest.mark.slow
def test_an_adaptive_search_skips_runs_short_first_stops_on_its_budget_and_resumes(tmp_path):
    recipe = write_recipe(tmp_path, RECIPE)
    quiet = lambda line: None  # noqa: E731
    run_sweep(recipe, run_dir=tmp_path / "run", settings=SweepSettings(max_runs=2), report=False, progress=quiet)
    folder = RunFolder(tmp_path / "run")
    first = folder.search()
    assert first.stop == "run_budget_spent" and first.runs == 2 and "--max-runs 2" in first.stop_reason
    rows = {r.key: r for r in folder.rows()}
    huge = rows[("huge", 0)]
    assert huge.status == "skipped" and huge.launch is None and huge.search.predicted_gib > 1.25

    # The first runs are short (20 of 40 steps), their warm-up read from their own step times.
    for name in ("fp32", "bf16"):
        tp = rows[(name, 0)].throughput
        assert rows[(name, 0)].status == "ok" and tp.total_steps == MIN_SHORT_STEPS
        assert tp.warmup_detected and tp.steady_state is not None
        assert f"its first: {MIN_SHORT_STEPS} optimizer steps" in rows[(name, 0)].stopping

    outcome = run_sweep(None, resume=tmp_path / "run", settings=SweepSettings(max_runs=10), progress=quiet)
    done = folder.search()
    assert done.stop in ("decided", "runs_spent") and done.runs == 4  # the grid's four runs: two trials, two each
    again = {r.key: r for r in folder.rows()}
    assert again[("fp32", 0)] == rows[("fp32", 0)]  # the rows of the first part stand as written
    assert again[("fp32", 1)].throughput.total_steps == 40 and not again[("fp32", 1)].throughput.warmup_detected
    html = next(p for p in outcome.report_paths if p.suffix == ".html").read_text()
    assert 'id="search"' in html and "skipped (estimate)" in html and "An adaptive search asked for" in html
