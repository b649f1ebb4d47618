"""The result row: one serializer (round trip), schema-1 rows of hfscale 0.1 migrated with the same numbers, a
newer schema refused with a message a user can act on."""

from __future__ import annotations

import json
import math

import pytest
from helpers.paths import DATA, REPO

from hfscale.records.row import SCHEMA_VERSION, TrialResult, migrate_row, row_from_json, row_to_json
from hfscale.results.run_folder import RunFolder

COMMITTED = ["cpu_small-cpu2", "cpu_techniques-cpu2", "bert_large-h100"]
SCHEMA_1 = {
    "bert_large-h100": REPO / "results" / "bert_large-h100" / "results.jsonl",
    # The rows hfscale 0.1 wrote for cpu_small (results/cpu_small-cpu2 before 0.4 ran it again), kept as data.
    "cpu_small-0.1": DATA / "cpu_small_0.1.jsonl",
}


def _raw(run: str) -> list[dict]:
    return [json.loads(line) for line in SCHEMA_1[run].read_text().splitlines()]


def _holds(new: dict, old: dict) -> bool:
    """Whether every key stored in ``old`` is in ``new`` with the same value (nested specs gained fields since)."""
    return all(
        _holds(new[k], v) if isinstance(v, dict) and isinstance(new.get(k), dict) else new.get(k, object()) == v
        for k, v in old.items()
    )


@pytest.mark.parametrize("run", sorted(SCHEMA_1))
def test_schema_1_rows_migrate_with_the_same_numbers(run):
    raw = _raw(run)
    assert all(r.get("schema_version", 1) == 1 for r in raw)  # the committed rows are hfscale 0.1's
    rows = [row_from_json(r) for r in raw]
    for old, row in zip(raw, rows, strict=True):
        extra = old.get("extra", {})
        assert row.schema_version == SCHEMA_VERSION
        assert (row.trial, row.status, row.reason, row.exit_code) == (
            old["trial"], old["status"], old.get("reason"), old.get("exit_code")
        )  # fmt: skip
        assert (row.repeat, row.repeats) == (extra.get("repeat", 0), extra.get("repeats", 1))
        assert _holds(row.strategy.to_dict(), old["strategy"])  # every stored field kept
        if old.get("memory"):
            assert row.peak_gib == old["memory"]["peak_gib"]
            assert row.samples_per_s == old["throughput"]["samples_per_s"]
            assert row.loss_curve == old["loss_curve"]
            assert row.measured.world_size == extra.get("world_size", 1)
            assert row.measured.timings_s == extra.get("timings_s", {})
        else:
            assert row.measured is None
        if old.get("estimate"):
            assert math.isclose(row.predicted_gib, old["estimate"]["total_gib"])
        if "command" in extra:
            assert row.launch.command == extra["command"] and row.launch.timeout_s == extra["timeout_s"]
        if isinstance(extra.get("batch_search"), dict) and extra["batch_search"].get("searched"):
            found = row.batch_search.result
            assert found.max_batch_size == extra["batch_search"]["max_batch_size"]
            assert [p.batch_size for p in found.probes] == [p["batch_size"] for p in extra["batch_search"]["probes"]]


@pytest.mark.parametrize("run", COMMITTED)
def test_round_trip_through_the_one_serializer(run):
    for row in RunFolder(REPO / "results" / run).rows(on_bad_line="raise"):
        data = row_to_json(row)
        assert data["schema_version"] == SCHEMA_VERSION and "extra" not in data
        again = row_from_json(json.loads(json.dumps(data)))
        assert again == row
        assert migrate_row(data) is data  # current rows are not migrated


def test_the_shared_sweeps_rows_round_trip(tiny_sweep_run):
    rows = RunFolder(tiny_sweep_run).rows(on_bad_line="raise")
    assert rows
    for row in rows:
        assert row_from_json(json.loads(json.dumps(row_to_json(row)))) == row


def test_a_newer_schema_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match=rf"schema_version 3: this hfscale reads rows of schema 1 to {SCHEMA_VERSION}"):
        row_from_json({"schema_version": 3, "trial": "x"})


def test_an_invalid_row_names_the_field():
    data = row_to_json(TrialResult(trial="x", strategy=_strategy(), status="ok"))
    data["status"] = "exploded"
    with pytest.raises(ValueError, match=r"not a valid TrialResult: status: "):
        row_from_json(data)


def _strategy():
    from hfscale.strategy import Strategy

    return Strategy(name="x", device="cpu")


def test_a_diverged_loss_is_written_as_standard_json_and_read_back(tmp_path):
    import json
    import math

    from hfscale.records.row import TrialOutcome, TrialResult
    from hfscale.results.run_folder import RunFolder
    from hfscale.strategy import Strategy

    measured = TrialOutcome(trial="lr10", status="ok", loss_curve=[2.0, math.inf, math.nan])
    row = TrialResult(trial="lr10", strategy=Strategy(name="lr10", device="cpu"), status="ok", measured=measured)
    folder = RunFolder(tmp_path)
    folder.append(row)

    def refuse(token):
        raise ValueError(f"bare {token} is not JSON")

    line = folder.results_path.read_text().splitlines()[0]
    json.loads(line, parse_constant=refuse)  # strings, not NaN/Infinity tokens
    (back,) = folder.rows(on_bad_line="raise")
    assert back.loss_curve[0] == 2.0 and math.isinf(back.loss_curve[1]) and math.isnan(back.loss_curve[2])


def test_a_schema_1_row_without_memory_keeps_what_it_measured():
    from hfscale.records.row import row_from_json

    row = row_from_json(
        {
            "trial": "t",
            "strategy": {"name": "t", "device": "cpu"},
            "status": "ok",
            "memory": None,
            "loss_curve": [1.0, 0.5],
            "extra": {"world_size": 1},
        }
    )
    assert row.measured is not None and row.loss_curve == [1.0, 0.5]
