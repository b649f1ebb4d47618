"""The report as a model: sections with a title, text, a table of declared columns and figures, built once from
the analysis; ``hfscale.report.render`` turns the same model into Markdown and into HTML."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hfscale.report.answer import answer
from hfscale.report.budget import BUDGET_COLUMNS, BUDGET_NOTE, budget_rows
from hfscale.report.columns import MEMORY_COLUMNS, SLIM_COLUMNS, Align, Column, flags, fmt, short, trial_columns
from hfscale.report.definitions import DEFINITIONS, estimate_parity_definitions, floor_definition
from hfscale.report.machine import env_header, env_items
from hfscale.report.ranks import MACHINE_HEADERS, MACHINES_NOTE, RANK_COLUMNS, RANK_NOTE, machine_rows
from hfscale.report.text import Text, plain, rich
from hfscale.report.trace import search_items, search_paragraphs

if TYPE_CHECKING:
    import pandas as pd

    from hfscale.records.batch import BatchSearchRecord
    from hfscale.report.analysis import Summary


@dataclass(frozen=True, kw_only=True)
class Table:
    """Cells already written; each column keeps its declared alignment."""

    headers: tuple[str, ...]
    aligns: tuple[Align, ...]
    rows: tuple[tuple[str, ...], ...]
    row_classes: tuple[str, ...] = ()
    """Per row, how HTML colours it: ``fail``, ``warn``, ``skip``, ``rec`` or empty."""
    css: str = ""
    titles: tuple[str, ...] = ()
    """Per column, its definition: HTML shows it when the pointer rests on the header."""
    badges: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Per row, flags (badge, reason) shown after the last cell: HTML folds each reason under its badge."""

    @property
    def show_header(self) -> bool:
        return any(self.headers)

    @classmethod
    def of(
        cls,
        columns: Sequence[Column],
        records: Sequence[Mapping[str, Any]],
        *,
        row_class: Callable[[Mapping[str, Any]], str] | None = None,
        css: str = "",
        badges: Callable[[Mapping[str, Any]], tuple[tuple[str, str], ...]] | None = None,
    ) -> Table:
        return cls(
            headers=tuple(c.header for c in columns),
            aligns=tuple(c.align for c in columns),
            rows=tuple(tuple(c.text(r) for c in columns) for r in records),
            row_classes=tuple(row_class(r) if row_class else "" for r in records),
            css=css,
            titles=tuple(c.definition for c in columns),
            badges=tuple(badges(r) for r in records) if badges else (),
        )

    @classmethod
    def text(
        cls, headers: Sequence[str], rows: Iterable[Sequence[str]], *, row_classes: Sequence[str] = (), css: str = ""
    ) -> Table:
        """A table of text, left-aligned (the environment)."""
        rows = tuple(tuple(r) for r in rows)
        return cls(
            headers=tuple(headers), aligns=("left",) * len(headers), rows=rows, row_classes=tuple(row_classes), css=css
        )


@dataclass(frozen=True, kw_only=True)
class Figure:
    """A plot: written beside the Markdown as ``name``, embedded in the HTML."""

    name: str
    title: str
    caption: str
    png: bytes


RANKING_FIGURE = "report_ranking.png"
"""The first screen's chart: speed-up against the baseline beside peak memory."""


@dataclass(frozen=True, kw_only=True)
class Section:
    title: str
    anchor: str = ""
    """The HTML section's id (``answer``, ``ranking``, ``trials``): what a link or a test finds it by."""
    level: int = 2
    paragraphs: tuple[Text, ...] = ()
    items: tuple[Text, ...] = ()
    """A list."""
    boxed: bool = False
    """HTML shows the paragraphs and items in a box (the answer)."""
    table: Table | None = None
    notes: tuple[Text, ...] = ()
    """Definitions under the table."""
    figure: Figure | None = None
    code: str | None = None
    collapsed: str | None = None
    """HTML folds the section's body under this label (the full environment record, the definitions)."""


@dataclass(frozen=True, kw_only=True)
class Report:
    title: str
    intro: tuple[Text, ...]
    sections: tuple[Section, ...] = field(default_factory=tuple)
    figures: tuple[Figure, ...] = ()


def records(frame: pd.DataFrame, **extra: Any) -> list[dict[str, Any]]:
    """The table's rows as plain dicts, missing values as None."""
    plain_frame = frame.astype(object).where(frame.notna(), None)
    return [{**r, **extra} for r in plain_frame.to_dict("records")]


def row_class(row: Mapping[str, Any]) -> str:
    if row["status"] in ("oom", "crashed", "timeout"):
        return "fail"
    if row["status"] == "not_applied" or row.get("parity_status") == "flagged":
        return "warn"
    if row["status"] == "skipped" or row.get("pruned"):
        return "skip"
    return "rec" if row.get("recommended") else ""


NO_ENVIRONMENT = "No environment.json in this run folder: the machine and library versions are unknown."

BREAKDOWN_NOTE = (
    "Memory breakdown, from the memory held at the end of each phase of the first step (max over ranks): "
    "weights = after model load; activations = end of forward − model load; gradients = end of backward − model "
    "load; optimizer = end of optimizer step − end of backward (the states appear at the first step, the "
    "gradients are still held); other = peak − the four, at least 0 (temporaries, workspace, fragmentation). "
    "Negative differences show as 0. The four need not be held at once, so their sum can exceed the peak "
    "(black marker); the open diamond is the estimate where one was made. Under DeepSpeed, engine.step() runs "
    'inside backward, so the optimizer states created at the first step are in gradients ("in gradients"; '
    "hatched in the plot) and weights is what the engine held after initialisation. Under fp16, when the loss "
    "scaler skipped the first optimizer step (it allocated nothing, yet the optimizer holds states at the end), "
    'the states are in other ("in other (1st step skipped)"). On CPU the figures are process RSS, so the weights '
    "include the interpreter and its libraries."
)

BATCH_NOTE = (
    "Each probe trains the trial's warm-up steps plus a few more at one per-device batch size, in a fresh process "
    "group with the trial's memory limit (configs and logs in trials/NAME/probes/bsN/). From the first size (the "
    "estimate's largest that fits the budget, else the trial's own) it doubles until out of memory, halves "
    "until one fits, then bisects. Out of memory bounds the search; any other failure stops it. The samples/s are "
    "the probe's steady-state figure over its few steps; + marks a search that reached its upper limit."
)


def _counts(statuses: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in counts.items()) or "none"


def _batch_record(name: str, record: BatchSearchRecord) -> dict[str, Any]:
    if not record.searched or record.result is None:
        return {"trial": name, "notes": f"not searched: {record.reason or '?'}"}
    result = record.result
    notes = []
    if record.same_as:
        notes.append(f"the search of {record.same_as}, which differs only in its batch size")
    if record.start_from:
        notes.append(f"started from {record.start_from}")
    if record.trial_run_batch_size:
        notes.append(f"batch {record.trial_run_batch_size} is the trial's own run")
    if result.reached_upper_limit:
        notes.append(f"the upper limit ({record.upper_limit or '?'}) fitted: the real limit may be higher")
    if result.stopped_reason:
        notes.append(f"stopped: {short(result.stopped_reason, 120)}")
    if record.probe_steps:
        notes.append(f"probes: warm-up + {record.probe_steps} steps")
    probes = []
    for p in result.probes:
        extras = [f"{p.outcome.samples_per_s:.2f}/s"] if p.outcome.samples_per_s is not None else []
        extras += [f"{p.outcome.peak_memory_gib:.3f} GiB"] if p.outcome.peak_memory_gib is not None else []
        probes.append(f"{p.batch_size}: {p.outcome.status}" + (f" ({', '.join(extras)})" if extras else ""))
    limit = "none fits" if result.max_batch_size is None else f"{result.max_batch_size}"
    return {
        "trial": name,
        "start": result.start,
        "max_batch": limit + ("+" if result.reached_upper_limit and result.max_batch_size is not None else ""),
        "samples_per_s": result.samples_per_s,
        "first_oom": result.first_oom_batch_size,
        "probes": "; ".join(probes),
        "notes": "; ".join(notes),
    }


BATCH_COLUMNS = [
    Column(key="trial", header="trial", align="left"),
    Column(key="start", header="start"),
    Column(key="max_batch", header="max batch", cell=lambda r: r.get("max_batch") or "—"),
    Column(key="samples_per_s", header="samples/s at max batch", unit="samples/s", digits=2),
    Column(key="first_oom", header="first out of memory"),
    Column(key="probes", header="probes", align="left", cell=lambda r: r.get("probes") or ""),
    Column(key="notes", header="notes", align="left", cell=lambda r: r.get("notes") or ""),
]


def environment_sections(environment: Mapping[str, Any]) -> tuple[Section, Section | None]:
    """The short environment section, and the full record at the end (None when the short one is the record)."""
    header = env_header(environment)
    items = header or env_items(environment)
    if not items:
        return Section(title="Environment", paragraphs=(plain(NO_ENVIRONMENT),)), None
    short_section = Section(
        title="Environment",
        table=Table.text(["", ""], items, css="env"),
        notes=(plain("The full record is at the end of this report and in environment.json."),) if header else (),
    )
    if not header:
        return short_section, None
    full = Section(
        title="Environment (full record)",
        table=Table.text(["", "value"], env_items(environment), css="env"),
        collapsed="environment.json",
    )
    return short_section, full


def _joint(summary: Summary, family: str) -> str:
    """The noise sentence's end: what keeps the baseline's verdicts at 95% jointly (Šidák's under a noise floor);
    nothing where there are none (no baseline, or one without a speed)."""
    if not summary.baseline or not summary.trials.loc[summary.baseline, "samples_per_s"] > 0:
        return "."
    return f"; verdicts against the baseline hold jointly at 95% ({'Šidák' if summary.speed.floor else family})."


def noise_sentence(summary: Summary) -> str:
    """What the speed figures' uncertainty rests on, in one or two sentences."""
    frame, noise = summary.trials, summary.speed.noise
    ok = frame[frame["status"] == "ok"] if len(frame) else frame
    if not len(ok):
        text = "No trial finished ok: no speed figure to qualify."
    elif noise.df < 1:
        text = (
            "No trial ran twice, so the run-to-run noise is unknown and no speed figure has an interval. Differences "
            "within 2% are shown as ties (≈); any larger ranking is untested: run each trial at least twice "
            "(measure.repeats: 3, or measure.target_precision)."
        )
    elif not summary.speed.shared:
        text = (
            f"Intervals come from runs. The trials' run-to-run noise differs beyond chance (Bartlett's test, p = "
            f"{summary.speed.shared_p:.1g}; {_noise_range(summary)}), so each trial's interval rests on its own runs "
            "(a trial of one run has none) and each comparison on its two trials' own noise (Welch)"
            + _joint(summary, "Dunnett's T3")
        )
    else:
        text = (
            f"Intervals come from runs: the run-to-run noise pooled over {len(noise.trials)} trials "
            f"({noise.df} degrees of freedom) is {noise.sd:.1%} of a run's samples/s" + _joint(summary, "Dunnett")
        )
    if (floor := summary.speed.floor) is not None and len(ok):
        text += (
            f" The search's noise floor holds here too: no trial's mean is taken as known better than one run of "
            f"{floor.sd:.1%} ({floor.source}); the run noise column shows the runs' own."
        )
    unstable = list(ok.index[ok["unstable"].fillna(False).astype(bool)]) if len(ok) else []
    if unstable:
        text += f" May be unstable (no verdict, not recommended on speed; reasons in the notes): {', '.join(unstable)}."
    if summary.price_per_hour is not None:
        text += f" Costs assume {summary.price_per_hour:g} per device-hour (--price-per-hour)."
    return text


def _noise_range(summary: Summary) -> str:
    """The quietest and noisiest trials' own run-to-run noise, in words."""
    own = sorted((summary.speed.run_sd(name), name) for name in summary.speed.noise.trials)
    (low, quiet), (high, noisy) = own[0], own[-1]
    return f"from {low:.1%} ({quiet}) to {high:.1%} ({noisy}) of a run's samples/s"


def build_report(summary: Summary, figures: Sequence[Figure]) -> Report:
    """The report of one run. First screen: the answer, the ranked chart and the slim table; then the details."""
    rows = records(summary.trials, budget_known=summary.recommendation.budget_bytes is not None)
    ranking = [f for f in figures if f.name == RANKING_FIGURE]
    env, full_env = environment_sections(summary.environment)
    sections = [
        *_first_screen(summary, rows, ranking),
        Section(title="Recommendation", items=summary.recommendation.lines),
        *_search_sections(summary),
        Section(title="This run", paragraphs=_intro(summary)),
        env,
        *_machine_sections(summary),
        Section(
            title="All measurements",
            anchor="measurements",
            table=Table.of(_trial_columns(summary), rows, row_class=row_class, css="trials"),
            notes=(rich(estimate_parity_definitions()),),
        ),
        *_budget_sections(summary),
        *(Section(title=f.title, figure=f) for f in figures if f.name != RANKING_FIGURE),
        Section(
            title="Memory", table=Table.of(MEMORY_COLUMNS, rows, row_class=row_class), notes=(rich(BREAKDOWN_NOTE),)
        ),
        *_rank_and_batch_sections(summary),
        *_failure_sections(rows, summary),
        *([full_env] if full_env is not None else []),
        Section(
            title="Definitions",
            anchor="definitions",
            items=tuple(rich(d) for d in (*DEFINITIONS, *floor_definition(summary))),
            collapsed="what each column of the trials tables means",
        ),
    ]
    return Report(title=f"hfscale report: {summary.run_dir.resolve().name}", intro=(), sections=tuple(sections),
                  figures=tuple(figures))  # fmt: skip


def _first_screen(summary: Summary, rows: Sequence[Mapping[str, Any]], ranking: Sequence[Figure]) -> list[Section]:
    """The answer in a sentence, the ranked chart, and the slim table (its definitions on its headers)."""
    slim = Table.of(SLIM_COLUMNS, rows, row_class=row_class, css="slim", badges=flags)
    return [
        Section(title="Answer", anchor="answer", paragraphs=(answer(summary),), boxed=True),
        *(Section(title=f.title, anchor="ranking", figure=f) for f in ranking),
        Section(
            title="Trials",
            anchor="trials",
            table=slim,
            notes=(plain("Every figure of each trial is under All measurements; what each means, under Definitions."),),
        ),
    ]


def _trial_columns(summary: Summary) -> list[Column]:
    """The trials table's columns: the optional ones only where some trial has a figure for them."""
    frame = summary.trials
    return trial_columns(
        repeats=bool(len(frame)) and bool((frame["runs"] > 1).any()),
        batch_search=bool(summary.batch_searches),
        step_times=bool(frame["step_time_cv_pct"].notna().any()) if len(frame) else False,
        energy=bool(frame["energy_j"].notna().any()) if len(frame) else False,
        cost=summary.price_per_hour is not None,
        compiled=bool(frame["compiled"].any()) if len(frame) else False,
        real_tokens=_pads(frame),
    )


def _pads(frame: pd.DataFrame) -> bool:
    """Whether some trial's batches held padding: real tokens/s below tokens/s."""
    if not len(frame) or "real_tokens_per_s" not in frame:
        return False
    return bool((frame["real_tokens_per_s"].astype(float) < frame["tokens_per_s"].astype(float)).any())


def _machine_sections(summary: Summary) -> list[Section]:
    """Each machine's environment, for a run over several machines (none for one)."""
    if len(summary.machines) <= 1:
        return []
    table = Table.text(MACHINE_HEADERS, machine_rows(summary.machines), css="env")
    return [Section(title="Machines", table=table, notes=(plain(MACHINES_NOTE),))]


def _budget_sections(summary: Summary) -> list[Section]:
    """The fastest trial for each memory budget (none when no trial has the figures)."""
    budget = budget_rows(summary.trials, summary.speed) if len(summary.trials) else []
    if not budget:
        return []
    table = Table.of(BUDGET_COLUMNS, budget)
    return [Section(title="Fastest trial for each memory budget", table=table, notes=(plain(BUDGET_NOTE),))]


def _rank_and_batch_sections(summary: Summary) -> list[Section]:
    """Memory per rank (ranks on several machines) and the largest batch each searched trial fits, where there are."""
    sections = []
    if summary.rank_memory:
        table = Table.of(RANK_COLUMNS, summary.rank_memory)
        sections.append(Section(title="Memory per rank", table=table, notes=(plain(RANK_NOTE),)))
    if summary.batch_searches:
        batch = [_batch_record(name, record) for name, record in summary.batch_searches.items()]
        table = Table.of(BATCH_COLUMNS, batch)
        sections.append(Section(title="Largest batch that fits", table=table, notes=(plain(BATCH_NOTE),)))
    return sections


def _search_sections(summary: Summary) -> list[Section]:
    """How an adaptive search decided (none for a grid sweep)."""
    if summary.search is None:
        return []
    return [
        Section(
            title="How the search decided",
            anchor="search",
            paragraphs=search_paragraphs(summary.search),
            items=search_items(summary.search),
        )
    ]


def _failure_sections(rows: Sequence[Mapping[str, Any]], summary: Summary) -> list[Section]:
    """A heading, then each trial that did not finish ok: why, and the end of its stderr (a trial an adaptive
    search skipped or pruned is in the search's own section)."""
    decided = {d.trial for d in summary.search.trace} if summary.search is not None else set()
    failures = [r for r in rows if r["status"] != "ok" and r["trial"] not in decided]
    if not failures:
        return []
    sections = [Section(title="Trials that did not finish ok")]
    for r in failures:
        tail = r.get("stderr_tail")
        sections.append(
            Section(
                title=f"{r['trial']}: {r['status']}",
                level=3,
                paragraphs=(plain(r["description"]), plain(f"Reason: {r.get('reason') or 'not recorded'}")),
                code=tail.rstrip()[-3000:] if tail else None,
            )
        )
    return sections


def _intro(summary: Summary) -> tuple[Text, ...]:
    """The counts by status with the baseline, what the recipe ran, and what the speed figures rest on."""
    frame = summary.trials
    counts = _counts(frame["status"]) if len(frame) else "none"
    intro = [plain(f"{len(frame)} trials: {counts}. {summary.baseline_note}")]
    if summary.coverage is not None:
        intro.append(plain(summary.coverage.sentence()))
        if summary.coverage.workload:
            intro.append(plain(f"Workload: {summary.coverage.workload}, under each trial's strategy."))
    intro.append(plain(noise_sentence(summary)))
    return tuple(intro)


__all__ = ["Figure", "Report", "Section", "Table", "build_report", "environment_sections", "fmt", "records"]
