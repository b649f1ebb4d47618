"""The search's skip before anything runs (hfscale.sweep.skip): only what cannot fit even if the estimate
over-predicts by its measured error."""

from __future__ import annotations

import json

import pytest
from helpers.paths import REPO

from hfscale.sweep.skip import DEFAULT_SKIP_MARGIN, skip_by_estimate, skip_margin


def test_the_default_margin_is_the_largest_over_prediction_of_the_committed_h100_rows():
    errors = []
    for line in (REPO / "results" / "bert_large-h100" / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        memory = (row.get("measured") or row).get("memory") or {}
        if row["status"] == "ok" and row.get("estimate") and memory.get("peak_gib"):
            errors.append(row["estimate"]["total_gib"] / memory["peak_gib"] - 1)
    assert max(errors) == pytest.approx(DEFAULT_SKIP_MARGIN, abs=0.005)
    assert skip_margin(errors) == DEFAULT_SKIP_MARGIN
    assert skip_margin([0.4, float("nan")]) == 0.4  # a run's own larger error widens it


def test_skip_only_what_cannot_fit_even_if_the_estimate_over_predicts_by_the_margin():
    assert skip_by_estimate(1.2, 1.0, 0.25) is None  # 1.2 / 1.25 = 0.96 may fit
    why = skip_by_estimate(1.3, 1.0, 0.25)
    assert why is not None and "1.30 GiB" in why and "25%" in why and "1.00 GiB" in why
    assert skip_by_estimate(None, 1.0, 0.25) is None and skip_by_estimate(9.0, None, 0.25) is None
