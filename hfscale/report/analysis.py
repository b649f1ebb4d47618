"""The comparison table of a run, built with pandas from typed rows: one row per trial, units in the column names.

A run's rows (:class:`~hfscale.records.row.TrialResult`, one per trial run) become one table row per trial
(``hfscale.report.trials``): the repeats of a trial (``measure.repeats``) are grouped, their times are the median of
the runs that finished ok (``runs`` counts them all; ``samples_per_s_values`` keeps each run's figure), and their
memory is the run with the largest peak (a budget must hold for every run). Samples/s and tokens/s are the
geometric mean over runs of each run's steady figure, with a 95% interval from the run-to-run noise pooled over the
sweep, and each trial is checked for stability (``hfscale.report.noise``). Then come the comparisons: ratios
against the baseline (:func:`resolve_baseline`) with their intervals and verdicts, the estimate's error, the
loss-parity status, the Pareto front and the recommendation (``hfscale.report.recommend``).
:func:`load_run` returns that table for a notebook; the report renders it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.core.units import GIB
from hfscale.records.batch import BatchSearchRecord
from hfscale.records.row import TrialResult
from hfscale.records.search import NoiseFloor, SearchSummary
from hfscale.report.coverage import Coverage, coverage
from hfscale.report.noise import NOISE_KEYS, against, sweep_columns, trial_noise
from hfscale.report.ranks import rank_memory_records
from hfscale.report.recommend import Recommendation, pareto_front, recommend
from hfscale.report.trials import MEDIANS, describe, group_rows, record_keys, run_record, trial_record
from hfscale.results.environment import MachineEnvironment, gpu_memory_bytes, read_machine_environments
from hfscale.results.run_folder import RESULTS_FILE, SEARCH_FILE, RunFolder, RunFolderError
from hfscale.results.stats import SweepNoise, sweep_noise

if TYPE_CHECKING:
    import pandas as pd


class ReportError(ValueError):
    """A run folder or argument the report cannot use; the message names it and says what is valid."""


def with_parity(rows: Sequence[TrialResult]) -> list[TrialResult]:
    """Copies of the rows, each ``ok`` row without a parity record given the loss check against the baseline
    (:func:`hfscale.results.parity.annotate_rows`, its default tolerance); a row that carries one keeps it.

    Parity is derived from the loss curves the rows hold, so a report of any run folder (a resumed one, an older
    one) shows it while ``results.jsonl`` stays as the sweep appended it.
    """
    from hfscale.results.parity import annotate_rows

    copies = [dataclasses.replace(r) for r in rows]
    if all(r.parity is not None for r in copies if r.status == "ok"):
        return copies
    checked = [dataclasses.replace(r) for r in copies]
    annotate_rows(checked)
    for row, check in zip(copies, checked, strict=True):
        if row.parity is None:
            row.parity = check.parity
    return copies


def resolve_baseline(rows: Sequence[TrialResult]) -> tuple[TrialResult | None, str]:
    """The row every comparison is against, and a sentence saying which and why.

    The rule of the loss check (:func:`hfscale.results.parity.annotate_rows`): the first ``ok`` row marked
    ``is_baseline``; when rows are marked but none finished ok, none; when no row is marked, the first ``ok`` row.
    """
    ok = [r for r in rows if r.status == "ok"]
    marked = [r for r in rows if r.is_baseline]
    chosen = next((r for r in ok if r.is_baseline), None)
    if chosen is not None:
        note = f"Speed-up and memory saved are against the baseline trial {chosen.trial} ({describe(chosen)})."
        if len({r.trial for r in marked}) > 1:
            note += (
                f" {len({r.trial for r in marked})} trials are marked as baseline; the first that finished ok is used."
            )
        return chosen, note
    if marked:
        r = marked[0]
        why = f"{r.status}: {r.reason}" if r.reason else r.status
        return None, (
            f"The baseline trial {r.trial} did not finish every run ok ({why}), so speed-up and memory saved are not "
            "shown."
        )
    if ok:
        return ok[0], (
            f"No trial is marked as the baseline, so, as for the loss check, the first trial that finished ok, "
            f"{ok[0].trial} ({describe(ok[0])}), is the reference for speed-up and memory saved."
        )
    return None, "No trial finished ok, so speed-up and memory saved are not shown."


@dataclass(frozen=True, kw_only=True)
class Summary:
    """Everything a report shows about one run folder."""

    run_dir: Path
    environment: dict[str, Any]
    trials: pd.DataFrame
    """One row per trial, indexed by trial name (:func:`trial_frame`)."""
    baseline: str | None
    """The baseline trial's name when it finished ok, else None (see ``baseline_note``)."""
    baseline_note: str
    pareto: tuple[str, ...]
    """Trials on the Pareto front of (samples/s, peak memory), fastest first."""
    recommendation: Recommendation
    batch_searches: dict[str, BatchSearchRecord]
    """``--find-max-batch``: each searched trial's record."""
    speed: SweepNoise = dataclasses.field(default_factory=lambda: sweep_noise({}))
    """Each trial's per-run samples/s and the sweep's pooled run-to-run noise: the evidence of every verdict."""
    coverage: Coverage | None = None
    """The recipe's trials against the rows (None when summarized from rows without a run folder)."""
    price_per_hour: float | None = None
    """``--price-per-hour``: the price of one device for an hour, for the cost columns."""
    machines: tuple[MachineEnvironment, ...] = ()
    """Each machine's environment record (``machines/``), by machine rank; empty for one-machine runs."""
    search: SearchSummary | None = None
    """How an adaptive search decided (``search.json``); None for a grid sweep."""
    rank_memory: tuple[dict[str, Any], ...] = ()
    """Per trial whose ranks ran on several machines: each rank's peak with its machine
    (:func:`hfscale.report.ranks.rank_memory_records`); empty when none did."""

    def row(self, trial: str) -> pd.Series:
        """One trial's row (attributes are the column names: ``summary.row("bf16").peak_gib``)."""
        return self.trials.loc[trial]


def summarize(
    rows: Sequence[TrialResult],
    *,
    environment: Mapping[str, Any] | None = None,
    memory_budget_bytes: int | None = None,
    run_dir: str | Path = ".",
    price_per_hour: float | None = None,
    coverage: Coverage | None = None,
    machines: Sequence[MachineEnvironment] = (),
    noise_floor: NoiseFloor | None = None,
) -> Summary:
    """The comparison table, baseline, Pareto front and recommendation of a run's rows.

    Without ``memory_budget_bytes`` the budget is the GPU memory ``environment.json`` records
    (:func:`hfscale.results.environment.gpu_memory_bytes`), else there is none and the recommendation says so. With
    ``price_per_hour`` (one device for an hour, any currency) the table has ``cost_per_m_tokens``. With
    ``machines`` (each machine's record of a multi-machine run) the budget is the smallest GPU of any machine. With
    ``noise_floor`` (an adaptive search's) no trial's mean is taken as known better than one run of it, as the
    search took none.

    Raises:
        ReportError: for a price per hour that is not a positive number.
    """
    environment = dict(environment or {})
    rows = with_parity(rows)
    if price_per_hour is not None and not (math.isfinite(price_per_hour) and price_per_hour > 0):
        raise ReportError(
            f"price_per_hour: expected a positive number (price of one device for an hour), got {price_per_hour}"
        )
    groups = group_rows(rows)
    noise = {name: trial_noise(group) for name, group in groups}
    frame = _trial_frame(groups, noise, price_per_hour)
    baseline, baseline_note = _baseline(rows, groups, frame)
    evidence = sweep_noise({name: rates for name, (_, rates) in noise.items()}, floor=noise_floor)
    sweep_columns(frame, evidence)
    against(frame, baseline, evidence)
    if baseline is not None:
        baseline_note += _unmeasured_note(frame.loc[baseline])

    ok = frame[(frame["status"] == "ok") & (frame["samples_per_s"] > 0) & (frame["peak_gib"] > 0)]
    front = pareto_front({name: (r["samples_per_s"], r["peak_gib"]) for name, r in ok.iterrows()})
    budget, source = _budget(memory_budget_bytes, environment, machines)
    frame["on_pareto_front"] = frame.index.isin(front)
    _mark_fits(frame, budget)
    rec = recommend(frame, budget, source, evidence)
    frame["recommended"] = frame.index == rec.fastest
    frame["ties_with_fastest"] = frame.index.isin(rec.fastest_ties)
    frame["chosen_of_tie"] = frame["recommended"] & bool(rec.fastest_ties)  # tied on speed, picked on memory
    frame["least_memory"] = frame.index == rec.most_frugal
    return Summary(
        run_dir=Path(run_dir),
        environment=environment,
        trials=frame,
        baseline=baseline,
        baseline_note=baseline_note,
        pareto=tuple(front),
        recommendation=rec,
        batch_searches=_batch_searches(groups),
        speed=evidence,
        coverage=coverage,
        price_per_hour=price_per_hour,
        machines=tuple(machines),
        rank_memory=tuple(rank_memory_records(groups)),
    )


def _trial_frame(
    groups: Sequence[tuple[str, list[TrialResult]]],
    noise: Mapping[str, tuple[dict[str, Any], list[float]]],
    price_per_hour: float | None,
) -> pd.DataFrame:
    """One row per trial, indexed by name: its record, the medians over its ok runs, the run-level speed and its
    noise columns, the cost, the run-to-run spread and the estimate's error."""
    import pandas as pd

    records = [trial_record(name, group) for name, group in groups]
    runs = pd.DataFrame.from_records(
        [
            {"trial": name, "ok": r.status == "ok", **run_record(r)}
            for name, group in groups
            for r in ([g for g in group if g.status == "ok"] or group)
        ],
        columns=["trial", "ok", *MEDIANS],
    )
    frame = pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=record_keys())
    frame = frame.set_index("trial", drop=False)
    by_trial = runs.groupby("trial", sort=False)
    medians = by_trial[list(MEDIANS)].median()
    frame = frame.join(medians)
    stats_frame = pd.DataFrame.from_records(
        [{"trial": name, **columns} for name, (columns, _) in noise.items()],
        columns=["trial", *NOISE_KEYS, "samples_per_s", "tokens_per_s"],
    ).set_index("trial")
    for key in ("samples_per_s", "tokens_per_s"):  # the geometric mean over runs where runs have a figure
        frame[key] = stats_frame[key].astype(float).combine_first(frame[key].astype(float))
    frame = frame.join(stats_frame[list(NOISE_KEYS)])
    frame["unstable"] = frame["unstable"].fillna(False).astype(bool)
    _cost(frame, price_per_hour)
    frame["samples_per_s_values"] = by_trial["samples_per_s"].agg(lambda s: [float(v) for v in s.dropna()])
    spread = by_trial["samples_per_s"].agg(lambda s: s.max() - s.min() if s.count() > 1 else math.nan)
    frame["samples_per_s_spread_pct"] = 100.0 * spread / frame["samples_per_s"]
    frame["estimate_error_pct"] = 100.0 * (frame["predicted_gib"] - frame["peak_gib"]) / frame["peak_gib"]
    return frame


def _baseline(
    rows: Sequence[TrialResult], groups: Sequence[tuple[str, list[TrialResult]]], frame: pd.DataFrame
) -> tuple[str | None, str]:
    """The baseline trial's name (None when it did not finish ok over its runs) and the sentence that says so."""
    chosen, note = resolve_baseline(rows)
    baseline = next((name for name, group in groups if chosen is not None and chosen in group), None)
    if baseline is None or frame.loc[baseline, "status"] == "ok":
        return baseline, note
    base = frame.loc[baseline]
    return None, (
        f"The baseline trial {baseline} did not finish every run ok ({base['status']}: {base['reason']}), so "
        "speed-up and memory saved are not shown."
    )


def _unmeasured_note(base: pd.Series) -> str:
    """What the baseline did not measure, so that its comparison is not shown ('' when it measured both)."""
    import pandas as pd

    missing = [w for w, v in (("samples/s", base["samples_per_s"]), ("peak memory", base["peak_gib"])) if pd.isna(v)]
    return f" Its {' and '.join(missing)} was not measured, so that comparison is not shown." if missing else ""


def _budget(
    memory_budget_bytes: int | None, environment: Mapping[str, Any], machines: Sequence[MachineEnvironment]
) -> tuple[int | None, str]:
    """The per-device memory budget and where it comes from: ``--memory-budget``, else the budget the sweep
    recorded (its settings in ``environment.json``: the recipe's or its command line's), else the GPU memory the
    environment records (the smallest of any machine's), else none."""
    recorded = (environment.get("sweep") or {}).get("memory_budget_bytes")
    if memory_budget_bytes is not None and memory_budget_bytes != recorded:
        return memory_budget_bytes, "--memory-budget"
    if isinstance(recorded, int) and recorded > 0:
        return recorded, "the sweep's budget: the recipe's sweep.memory_budget_gib or --memory-budget"
    budget = gpu_memory_bytes(environment)
    source = "the GPU memory environment.json records" if budget is not None else "none"
    # every rank must fit: the smallest GPU of any machine (only machine 0's is in environment.json)
    sizes = [m.gpu_memory_bytes for m in machines if m.gpu_memory_bytes is not None]
    if len(machines) > 1 and sizes and (budget is None or min(sizes) < budget):
        return min(sizes), "the smallest GPU memory the machines' records hold"
    return budget, source


def _mark_fits(frame: pd.DataFrame, budget: int | None) -> None:
    """``fits_budget``: whether each trial's ``fit_gib`` is within the budget (NA without a budget or a figure)."""
    import pandas as pd

    frame["fits_budget"] = pd.array(
        [None if budget is None or pd.isna(fit) else bool(fit * GIB <= budget) for fit in frame["fit_gib"]],
        dtype="boolean",
    )


def _batch_searches(groups: Sequence[tuple[str, list[TrialResult]]]) -> dict[str, BatchSearchRecord]:
    """Each searched trial's batch search record (a max-batch row repeats its trial's search, so it is left out)."""
    return {
        name: search
        for name, group in groups
        if (search := next((r.batch_search for r in group if r.batch_search is not None), None)) is not None
        and search.max_batch_of is None
    }


def _cost(frame: pd.DataFrame, price_per_hour: float | None) -> None:
    """``cost_per_m_tokens``: the price of the devices (one per process) for the time a million tokens take at the
    trial's steady tokens/s; absent (NaN) without a price or without tokens/s."""
    frame["cost_per_m_tokens"] = math.nan
    if price_per_hour is None:
        return
    devices = frame["world_size"].astype(float).fillna(1.0)
    frame["cost_per_m_tokens"] = price_per_hour * devices / 3600 * 1e6 / frame["tokens_per_s"].astype(float)


def summarize_run(
    run_dir: str | Path, *, memory_budget_bytes: int | None = None, price_per_hour: float | None = None
) -> Summary:
    """Read a run folder and summarize it.

    Raises:
        ReportError: when the folder does not exist, holds no ``results.jsonl``, or a row cannot be read.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"{path}: no such folder; expected a run folder written by 'hfscale sweep'")
    if not (path / RESULTS_FILE).is_file():
        raise ReportError(f"{path}: has no {RESULTS_FILE}; expected a run folder written by 'hfscale sweep'")
    folder = RunFolder(path)
    try:
        rows = folder.rows()
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ReportError(f"{path / RESULTS_FILE}: cannot be read: {exc}") from exc
    try:
        environment = folder.environment()
    except RunFolderError as exc:  # the message names environment.json
        raise ReportError(str(exc)) from exc
    try:
        machines = read_machine_environments(path)
    except ValueError as exc:  # the message names the machine's file
        raise ReportError(str(exc)) from exc
    try:
        search = folder.search()
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ReportError(f"{path / SEARCH_FILE}: cannot be read: {exc}") from exc
    summary = summarize(
        rows,
        environment=environment,
        memory_budget_bytes=memory_budget_bytes,
        run_dir=path,
        price_per_hour=price_per_hour,
        coverage=coverage(folder, (r.trial for r in rows)),
        machines=machines,
        noise_floor=search.noise_floor if search is not None else None,
    )
    return dataclasses.replace(summary, search=search)


def load_run(
    run_dir: str | Path, *, memory_budget_bytes: int | None = None, price_per_hour: float | None = None
) -> pd.DataFrame:
    """A run folder's comparison table: one row per trial, indexed by trial name, units in the column names.

    The same table the report renders (``hfscale report``): ``samples_per_s`` (steady state: the geometric mean
    over runs of each run's figure, with ``samples_per_s_low``/``_high``, its 95% interval from the sweep's pooled
    run-to-run noise; none when no trial ran twice), ``peak_gib`` (``peak_gib_min``/``_max``
    over repeats), ``speedup_vs_baseline`` with ``speedup_low``/``_high`` and ``verdict`` (faster, slower, tie,
    untested, baseline), ``memory_saved_pct``, ``unstable`` and ``unstable_reason``, ``energy_j``,
    ``cost_per_m_tokens``, ``estimate_error_pct``, ``parity_status``, ``on_pareto_front``, ``recommended``, ...;
    each column is declared, with its unit, in :data:`hfscale.report.columns.COLUMNS`.

    Raises:
        ReportError: when the folder does not exist or holds no readable ``results.jsonl``.
    """
    return summarize_run(run_dir, memory_budget_bytes=memory_budget_bytes, price_per_hour=price_per_hour).trials


__all__ = [
    "ReportError",
    "Summary",
    "load_run",
    "resolve_baseline",
    "summarize",
    "summarize_run",
    "with_parity",
]
