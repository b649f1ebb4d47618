"""Two runs side by side: the same trials (matched by name) with B/A ratios, from the same analysis, model and
templates as the report of one run (``hfscale compare RUN_A RUN_B``), and for each trial in both a significance
test of the change in speed: the interval of the ratio of time per sample (B over A, from the runs of both sweeps
with their noise pooled, Šidák-adjusted over the trials), read as "B is 7.0% ± 2.1% slower" or "no significant
change" (the interval holds 1 or the change is within the 2% noise threshold). ``--fail-on-regression PCT`` turns
that into an exit code for CI."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.report.analysis import Summary, summarize_run
from hfscale.report.columns import COLUMNS, Column, status_cell
from hfscale.report.machine import env_header, env_items
from hfscale.report.model import Figure, Report, Section, Table, records
from hfscale.report.noise import speed_verdict
from hfscale.report.text import plain
from hfscale.report.write import ReportPaths, write_files
from hfscale.results.stats import Comparison, SweepNoise, sidak_critical, sweep_noise

if TYPE_CHECKING:
    import pandas as pd

COMPARE_MD = "compare.md"
COMPARE_HTML = "compare.html"
COMPARE_CSV = "compare.csv"

RATIO_KEYS = ("samples_per_s", "tokens_per_s", "step_time_median_s", "peak_gib", "wall_time_s")
"""Figures compared as B/A (wall time: in the CSV only, the table is wide enough)."""
_SIDE_KEYS = ("description", "status", "reason", "final_loss", "mfu_pct")


def compare_runs(a: str | Path | pd.DataFrame, b: str | Path | pd.DataFrame) -> pd.DataFrame:
    """Two runs' comparison tables side by side: one row per trial name in either run (A's order, then B's new
    ones), each figure as ``{key}_a`` and ``{key}_b``, and ``{key}_ratio`` = B / A for samples/s, tokens/s, step
    time, peak memory and wall time. A trial in one run only has the other run's columns empty.

    ``a`` and ``b`` are run folders or tables from :func:`hfscale.load_run`.

    Raises:
        ReportError: when a folder is not a readable run folder.
    """
    import pandas as pd

    frames = [summarize_run(x).trials if not isinstance(x, pd.DataFrame) else x for x in (a, b)]
    keys = [k for k in (*_SIDE_KEYS, *RATIO_KEYS) if k in frames[0].columns or k in frames[1].columns]
    sides = [f.reset_index(drop=True).reindex(columns=["trial", *keys]).set_index("trial") for f in frames]
    names = list(sides[0].index) + [n for n in sides[1].index if n not in sides[0].index]
    out = pd.DataFrame(index=pd.Index(names, name="trial"))
    for suffix, side in zip(("_a", "_b"), sides, strict=True):
        out = out.join(side.add_suffix(suffix))
    for key in RATIO_KEYS:
        a_values, b_values = out[f"{key}_a"].astype(float), out[f"{key}_b"].astype(float)
        out[f"{key}_ratio"] = b_values / a_values.where(a_values != 0)
    out.insert(0, "trial", out.index)
    return out


def _float(value: Any) -> float | None:
    return None if value is None or value != value else float(value)


def _cross_evidence(a: Summary, b: Summary) -> SweepNoise:
    """Both runs' per-run figures in one pool (``A:name``, ``B:name``): the two sweeps ran the same kind of
    trials on the same kind of machine, so their run-to-run noise is pooled as one sweep's is."""
    return sweep_noise(
        {**{f"A:{n}": v for n, v in a.speed.runs.items()}, **{f"B:{n}": v for n, v in b.speed.runs.items()}}
    )


FAILED_IN_B = "failed in B"
"""The change of a trial that finished ok in A and failed in B (one of its runs crashed, ran out of memory, timed out
or did not run as asked): what ``--fail-on-regression`` fails on whatever the threshold, since B measured nothing to
compare. A trial B skipped or pruned (a search, ``--skip-predicted-oom``) did not fail: it is not tested."""
FAILURES = frozenset({"oom", "crashed", "timeout", "not_applied"})


def significance(a: Summary, b: Summary) -> pd.DataFrame:
    """For each trial in both runs: ``time_ratio`` (time per sample, B / A; above 1: B is slower) with
    ``time_ratio_low``/``_high`` (a 95% interval from the runs of both sweeps, their noise pooled, Šidák-adjusted
    over the trials tested so that the chance of calling any unchanged trial changed is 5%; None where a side has
    fewer than two runs), ``change`` (``slower``, ``faster``, ``no significant change``, ``not tested``, or
    :data:`FAILED_IN_B`) and ``change_text`` ("B is 7.0% ± 2.1% slower"; for a trial that did not finish ok on a
    side, which side and why)."""
    import pandas as pd

    evidence = _cross_evidence(a, b)
    common = [n for n in a.trials.index if n in b.trials.index]
    tested = [n for n in common if evidence.testable(f"A:{n}") is None and evidence.testable(f"B:{n}") is None]
    comparisons, confidence = len(tested), evidence.confidence
    records = []
    for name in common:
        ra, rb = a.trials.loc[name], b.trials.loc[name]
        speed_a, speed_b = _float(ra["samples_per_s"]), _float(rb["samples_per_s"])
        if ra["status"] != "ok" or rb["status"] != "ok" or not speed_a or not speed_b:
            records.append(_unfinished_record(name, ra, rb, speed_a))
            continue
        said = evidence.compare(f"A:{name}", f"B:{name}", lambda df: sidak_critical(comparisons, df, confidence))
        records.append(_change_record(name, speed_a / speed_b, said))
    columns = ["trial", "time_ratio", "time_ratio_low", "time_ratio_high", "change_pct", "change", "change_text"]
    return pd.DataFrame.from_records(records, columns=columns).set_index("trial", drop=False)


def _unfinished_record(name: str, ra: pd.Series, rb: pd.Series, speed_a: float | None) -> dict[str, Any]:
    """A trial with no speed to compare on one side or both: which, and why (its status and reason)."""

    def why(side: str, row: pd.Series) -> str:
        if row["status"] == "ok":
            return f"{side} has no speed"
        reason = row.get("reason")
        return f"{side} {row['status']}" + ("" if not isinstance(reason, str) or not reason else f" ({reason})")

    a_ok = ra["status"] == "ok" and bool(speed_a)
    if a_ok and rb["status"] in FAILURES:
        change, text = FAILED_IN_B, f"B did not finish ok: {why('B', rb)}"
    elif a_ok:
        change, text = "not tested", f"not tested: {why('B', rb)}"
    else:
        sides = [why("A", ra)] + ([why("B", rb)] if rb["status"] != "ok" else [])
        change, text = "not tested", "not tested: " + "; ".join(sides)
    return {"trial": name, "time_ratio": None, "time_ratio_low": None, "time_ratio_high": None, "change_pct": None,
            "change": change, "change_text": text}  # fmt: skip


def _change_record(name: str, ratio: float, said: Comparison) -> dict[str, Any]:
    """One trial's change from A to B; ``ratio`` is A's speed over B's (B's time per sample over A's)."""
    interval = said.ratio
    ratio = ratio if interval is None else interval.value
    pct = 100 * (ratio - 1)
    verdict = speed_verdict(ratio, said)
    change = {"faster": "slower", "slower": "faster", "tie": "no significant change", "untested": "not tested"}[verdict]
    if interval is None or verdict == "untested":
        why = said.why or "no interval"
        text = (
            f"no significant change ({pct:+.1f}%, within the 2% noise threshold; {why})"
            if verdict == "tie"
            else f"B is {abs(pct):.1f}% {'slower' if pct > 0 else 'faster'}: not tested ({why})"
        )
    else:
        half = 100 * (interval.high - interval.low) / 2
        text = (
            f"no significant change ({pct:+.1f}% ± {half:.1f}%)"
            if verdict == "tie"
            else f"B is {abs(pct):.1f}% ± {half:.1f}% {change}"
        )
    return {
        "trial": name,
        "time_ratio": ratio,
        "time_ratio_low": None if interval is None else interval.low,
        "time_ratio_high": None if interval is None else interval.high,
        "change_pct": pct,
        "change": change,
        "change_text": text,
    }


def regressions(table: pd.DataFrame, threshold_pct: float) -> list[str]:
    """Trials significantly slower in B by more than ``threshold_pct`` percent (the point estimate of the change;
    untested changes never count), and trials that finished ok in A but not in B (:data:`FAILED_IN_B`)."""
    slow = (table["change"] == "slower") & (table["change_pct"].astype(float) > threshold_pct)
    return list(table["trial"][slow | (table["change"] == FAILED_IN_B)])


def _labels(a: Path, b: Path) -> tuple[str, str]:
    label_a, label_b = a.resolve().name, b.resolve().name
    return (f"A ({label_a})", f"B ({label_b})") if label_a == label_b else (label_a, label_b)


def _side(key: str, suffix: str, label: str, header: str | None = None) -> Column:
    column = COLUMNS[key]
    return dataclasses.replace(column, key=f"{key}{suffix}", header=header or f"{column.header} {label}", cell=None)


def _compare_columns(label_a: str, label_b: str) -> list[Column]:
    def status(suffix: str, label: str) -> Column:
        return Column(
            key=f"status{suffix}",
            header=f"status {label}",
            align="left",
            cell=lambda r: status_cell({"status": r[f"status{suffix}"], "reason": r[f"reason{suffix}"]}, 40),
        )

    def strategy(r: Mapping[str, Any]) -> str:
        da, db = r["description_a"], r["description_b"]
        return da if da == db else f"{da} / {db}"

    columns = [COLUMNS["trial"], Column(key="strategy", header="strategy", align="left", cell=strategy)]
    columns += [status("_a", label_a), status("_b", label_b)]
    for key in RATIO_KEYS[:-1]:
        header = COLUMNS[key].header.replace(" (steady)", "")
        columns += [
            _side(key, "_a", label_a, header=f"{header} {label_a}"),
            _side(key, "_b", label_b, header=f"{header} {label_b}"),
            Column(key=f"{key}_ratio", header=f"{header} B/A (x)", unit="x", digits=2),
        ]
    columns += [_side("final_loss", "_a", label_a), _side("final_loss", "_b", label_b)]
    columns += [_side("mfu_pct", "_a", label_a, header=f"MFU {label_a} (%)")]
    columns += [_side("mfu_pct", "_b", label_b, header=f"MFU {label_b} (%)")]
    return columns


_ALWAYS_DIFFERENT = ("time", "command", "launch.", "resumed", "sweep")
# Keys the header lines already show (package versions stay: one row each reads better than the joined line).
_IN_HEADER = (
    "host",
    "platform",
    "python",
    "cpu_model",
    "cpu_count",
    "host_memory_total_gib",
    "gpus",
    "gpu_count",
    "driver_version",
    "cuda_driver_version",
    "cuda_version",
    "cudnn_version",
)


def _environment_table(env_a: Mapping[str, Any], env_b: Mapping[str, Any], label_a: str, label_b: str) -> Table:
    """The header lines of both runs, then every other recorded key whose value differs (left out: keys that
    differ between any two runs, such as the start time and the command line); differing rows are starred."""

    def pairs(a: dict[str, str], b: dict[str, str], keys: Iterable[str]) -> list[tuple[bool, list[str]]]:
        return [(a.get(k) != b.get(k), [k, a.get(k, "—"), b.get(k, "—")]) for k in keys]

    head_a, head_b = dict(env_header(env_a)), dict(env_header(env_b))
    rows = pairs(head_a, head_b, list(head_a) + [k for k in head_b if k not in head_a])
    a, b = dict(env_items(env_a)), dict(env_items(env_b))
    keys = [k for k in list(a) + [k for k in b if k not in a] if not k.startswith(_ALWAYS_DIFFERENT)]
    if head_a or head_b:
        keys = [k for k in keys if a.get(k) != b.get(k) and not (k in _IN_HEADER or k.startswith("git."))]
    rows += pairs(a, b, keys)
    return Table.text(
        ["", label_a, label_b],
        ([("* " if differs else "") + cells[0], *cells[1:]] for differs, cells in rows),
        row_classes=["warn" if differs else "" for differs, _ in rows],
        css="env",
    )


def write_comparison(run_a: str | Path, run_b: str | Path, *, out_dir: str | Path | None = None) -> ReportPaths:
    """Write ``compare.md``, ``compare.html`` and ``compare.csv``: the trials of two runs side by side.

    ``out_dir`` defaults to ``compare-A-vs-B`` in the current folder.

    Raises:
        ReportError: when either folder has no results.
        ImportError: when matplotlib is missing (``pip install 'hfscale[report]'``).
    """
    paths, _ = write_comparison_of(summarize_run(run_a), summarize_run(run_b), out_dir=out_dir)
    return paths


def workload_difference(a: Summary, b: Summary) -> str | None:
    """Why the two runs trained different jobs (their recipe copies' ``workload``, ``model`` or ``data`` differ),
    in one sentence; None when they trained the same one or either recipe copy cannot be read."""
    key_a = a.coverage.workload_key if a.coverage is not None else None
    key_b = b.coverage.workload_key if b.coverage is not None else None
    if key_a is None or key_b is None or key_a == key_b:
        return None
    return (
        f"{a.run_dir} and {b.run_dir} trained different workloads (their recipe copies' workload, model or data "
        f"sections differ: {key_a} against {key_b})"
    )


def write_comparison_of(
    a: Summary, b: Summary, *, out_dir: str | Path | None = None
) -> tuple[ReportPaths, pd.DataFrame]:
    """:func:`write_comparison` of two summaries; also returns the significance table (:func:`significance`)."""
    from hfscale.report.plots import plot_compare

    run_a, run_b = Path(a.run_dir), Path(b.run_dir)
    label_a, label_b = _labels(run_a, run_b)
    table = compare_runs(a.trials, b.trials)
    tests = significance(a, b)
    table = table.join(tests.drop(columns=["trial"]))
    in_a, in_b = table["status_a"].notna(), table["status_b"].notna()
    matched = table[in_a & in_b]
    only_a, only_b = list(table["trial"][in_a & ~in_b]), list(table["trial"][in_b & ~in_a])
    png = plot_compare(matched, label_a, label_b)
    caption = f"Bars: {label_a} and {label_b} for each trial in both runs."
    figures = [Figure(name="compare.png", title="Throughput and peak memory", caption=caption, png=png)] if png else []
    different = workload_difference(a, b)
    intro = (
        f"Run A: {a.run_dir} ({len(a.trials)} trials); run B: {b.run_dir} ({len(b.trials)} trials); "
        f"{len(matched)} in both. B/A above 1 means B is faster (samples/s, tokens/s) or uses more "
        "(step time, peak memory, wall time)." + (f" Compared although {different}." if different else "")
    )
    only = [f"Only in {label}: {', '.join(names)}." for label, names in ((label_a, only_a), (label_b, only_b)) if names]
    sections = [
        Section(title="Runs", items=tuple(plain(line) for line in only)) if only else None,
        Section(
            title="Environments",
            paragraphs=(
                plain(
                    "Rows that differ are starred (*); below the header lines, only the other recorded keys "
                    "that differ."
                ),
            ),
            table=_environment_table(a.environment, b.environment, label_a, label_b),
        ),
        Section(
            title="Change in speed (B against A)",
            table=Table.of(_CHANGE_COLUMNS, records(tests)),
            notes=(plain(CHANGE_NOTE),),
        )
        if len(tests)
        else None,
        Section(title="Trials", table=Table.of(_compare_columns(label_a, label_b), records(matched))),
        *(Section(title=f.title, figure=f) for f in figures),
    ]
    report = Report(
        title=f"hfscale compare: {label_a} vs {label_b}",
        intro=(plain(intro),),
        sections=tuple(s for s in sections if s is not None),
        figures=tuple(figures),
    )
    out = Path(out_dir) if out_dir is not None else Path(f"compare-{run_a.resolve().name}-vs-{run_b.resolve().name}")
    csv = table.drop(columns=[c for c in table.columns if c.startswith(("description", "reason", "mfu_pct"))])
    return write_files(out, report, figures, csv, (COMPARE_MD, COMPARE_HTML, COMPARE_CSV)), tests


_CHANGE_COLUMNS = [
    COLUMNS["trial"],
    Column(key="change_text", header="B against A", align="left"),
    Column(key="time_ratio", header="time per sample B/A (x)", unit="x", digits=3),
    Column(
        key="time_ratio_low",
        header="95% interval",
        unit="x",
        cell=lambda r: (
            "untested" if r.get("time_ratio_low") is None else f"{r['time_ratio_low']:.3f}–{r['time_ratio_high']:.3f}"
        ),
    ),
]
CHANGE_NOTE = (
    "Time per sample is the reciprocal of samples/s (each run's steady figure, geometric mean over runs); its ratio "
    "B/A comes with a 95% interval from the run-to-run noise of both sweeps' trials pooled (each trial's own where "
    "they do not share one noise, Bartlett's test), Šidák-adjusted over the "
    "trials compared (the chance of calling any unchanged trial changed is 5%). It assumes both sweeps ran on "
    "machines of one kind: a machine that is slower as a whole shows as a change of every trial. No significant "
    "change: the interval holds 1 or the change is within 2% (the noise threshold). ± is half the interval's width. "
    "With fewer than two runs a side only a change within 2% can be called; a larger one is not tested. A trial "
    "that finished ok in A and not in B (a run crashed, ran out of memory or timed out) has no change to test and "
    "is named as such; --fail-on-regression fails on it."
)


__all__ = [
    "COMPARE_CSV",
    "COMPARE_HTML",
    "COMPARE_MD",
    "FAILED_IN_B",
    "RATIO_KEYS",
    "compare_runs",
    "regressions",
    "significance",
    "write_comparison",
    "write_comparison_of",
]
