"""The adaptive search run for real: the rows of the run folder read as the search's evidence, its decisions written
as rows, its runs launched through the sweep, and ``search.json`` at the end.

:mod:`hfscale.sweep.search` decides; this module only carries the decisions out. Everything the search knows is
read back from the rows each time (:func:`trial_states`), so ``--resume`` in the middle of a search picks it up
where the rows leave it: the trials already pruned or skipped stay so, and the next step is the one the rows call
for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hfscale.core.units import GIB, parse_share
from hfscale.launch.plan import PlannedRun, SweepError, SweepSettings
from hfscale.launch.rows import planned_row
from hfscale.recipes.recipe import adaptive_refusal
from hfscale.recipes.schema import RecipeTrial, SweepOptions
from hfscale.records.activity import others_busy
from hfscale.records.batch import max_batch_base
from hfscale.records.row import RAN_STATUSES, TrialResult
from hfscale.records.search import NoiseFloor, SearchDecision, SearchSummary
from hfscale.report.noise import run_rates
from hfscale.report.trials import fit_memory
from hfscale.results.run_folder import RESULTS_FILE, SEARCH_FILE, RunFolder, RunFolderError, read_results
from hfscale.results.stats import outliers, pooled_noise
from hfscale.sweep.batch_axis import mark_max_batch, max_batch_trial
from hfscale.sweep.search import (
    Limits,
    Next,
    Progress,
    Question,
    TrialState,
    budget_spent,
    next_step,
)
from hfscale.sweep.skip import skip_by_estimate, skip_margin
from hfscale.workload.steps import optimizer_steps

Key = tuple[str, int]

SHORT_FRACTION = 0.5
"""A first run trains this share of the trial's steps ..."""
MIN_SHORT_STEPS = 20
"""... and never fewer steps than this: MSER reads the warm-up poorly from fewer (a third of steady 20-step runs
are called unsteady, docs/callbacks.md), and the steps after it must hold a figure as steady as a full run's."""


ADAPTIVE_ONLY = ("min_samples_per_s", "max_time_s", "max_runs", "noise_floor")
"""Settings that only an adaptive search reads: a grid refuses them rather than ignore them."""


def search_settings(options: SweepOptions, settings: SweepSettings) -> SweepSettings:
    """The sweep's settings with the recipe's ``sweep:`` search options wherever the command line gave none (its
    adaptive-only keys only when the search is adaptive: ``--search grid`` on an adaptive recipe leaves them)."""
    changes: dict[str, object] = {}
    given = settings.given()
    search = settings.search if "search" in given else options.search
    if search == "adaptive":  # None stays the grid's (the default, recorded as such)
        changes["search"] = search
    if "memory_budget_bytes" not in given and options.memory_budget_gib is not None:
        changes["memory_budget_bytes"] = int(options.memory_budget_gib * GIB)
    for name in ADAPTIVE_ONLY if search == "adaptive" else ():
        if name not in given and getattr(options, name) is not None:
            changes[name] = getattr(options, name)
    return dataclasses.replace(settings, **changes)


def refuse_search_keys(options: SweepOptions, settings: SweepSettings) -> None:
    """Refuse a new sweep's recipe that sets a search's keys (``sweep.max_runs``, ...) but never asks for a search,
    rather than drop them. (A resumed run's recipe is the one it started with: not refused again.)

    Raises:
        SweepError: naming the keys.
    """
    keys = [f"sweep.{name}" for name in ADAPTIVE_ONLY if getattr(options, name) is not None]
    search = settings.search if "search" in settings.given() else options.search
    if keys and "adaptive" not in (search, options.search):
        raise SweepError(
            f"{', '.join(keys)}: only an adaptive search reads {'them' if len(keys) > 1 else 'it'}: add sweep.search: "
            "adaptive (or --search adaptive), or leave it out"
        )


def check_adaptive(trials: Sequence[RecipeTrial], settings: SweepSettings, *, num_machines: int) -> None:
    """Refuse, before anything runs, what an adaptive search cannot do.

    Raises:
        SweepError: naming the trial's key and why.
    """
    if settings.search != "adaptive":
        fields = SweepSettings.__dataclass_fields__
        given = [fields[n].metadata["flag"] for n in ADAPTIVE_ONLY if getattr(settings, n) is not None]
        if given:
            raise SweepError(
                f"{', '.join(given)} (or the recipe's sweep.{', sweep.'.join(ADAPTIVE_ONLY)}) only apply to an "
                "adaptive search: add --search adaptive (sweep.search: adaptive), or leave them out"
            )
        return
    if num_machines > 1:
        raise SweepError(
            "--search adaptive runs on one machine: the other machines' drivers follow a plan made before the "
            "first trial, which a search cannot give; search the grid (sweep.search: grid)"
        )
    if (refusal := adaptive_refusal(trials)) is not None:
        raise SweepError(f"--search adaptive: {refusal[0]}: {refusal[1]}")
    several = [t.name for t in trials if t.spec.strategy.num_machines > 1]
    if several:
        raise SweepError(
            f"--search adaptive: {', '.join(several)} span several machines, which the other machines' drivers could "
            "not follow as the search decides; search the grid (sweep.search: grid)"
        )


def question_of(settings: SweepSettings, budget_bytes: int | None, floor: NoiseFloor | None) -> Question:
    """The question the sweep's settings ask, under the budget the sweep resolved (recipe, command line or GPU) and
    the noise floor it read (:func:`noise_floor_of`, once per run)."""
    return Question(
        budget_gib=budget_bytes / GIB if budget_bytes is not None else None,
        min_samples_per_s=settings.min_samples_per_s,
        noise_floor=floor,
    )


def recorded_floor(environment: Mapping[str, object]) -> NoiseFloor | None:
    """The noise floor a run recorded in its ``environment.json``: when it started, or, for a run folder older than
    that record, when a later ``--resume`` of it read the floor (its latest entry under ``resumed``); None where
    neither recorded one.

    Raises:
        SweepError: for a record that is not a noise floor (keys unknown to this version are ignored).
    """
    resumed = environment.get("resumed")
    entries = [environment, *reversed(resumed if isinstance(resumed, list) else [])]
    data = next((e["noise_floor"] for e in entries if isinstance(e, Mapping) and e.get("noise_floor")), None)
    if data is None:
        return None
    if not isinstance(data, Mapping) or "df" not in data:  # a missing df would read as a figure taken as known
        raise SweepError(f"environment.json: noise_floor is not a noise floor (sd and df are required): {data!r}")
    from pydantic import TypeAdapter, ValidationError

    try:  # strict: a bool or a string is no number; keys unknown to this version are ignored
        return TypeAdapter(NoiseFloor).validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        problems = "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"]))) for e in exc.errors())
        raise SweepError(f"environment.json: noise_floor is not a noise floor ({problems}): {data!r}") from None


def noise_floor_of(spec: str | None) -> NoiseFloor | None:
    """The floor that ``--noise-floor`` / ``sweep.noise_floor`` recorded (:func:`hfscale.core.units.noise_floor_spec`):
    a figure, taken as known, or a run folder, whose trials' ok runs give it (their pooled run-to-run noise).

    A sweep reads it once, when it starts, and records it (:func:`recorded_floor`): its resumed runs keep it.

    Raises:
        SweepError: for a run folder in which no trial has two undisturbed ok runs, an adaptive search's folder, or
            one that cannot be read.
    """
    if spec is None:
        return None
    share = parse_share(spec)
    if share is not None:
        return NoiseFloor(sd=share, source="given as a figure")
    folder = Path(spec)
    if not (folder / RESULTS_FILE).is_file():
        raise SweepError(
            f"--noise-floor (or sweep.noise_floor) {spec}: not a run folder (no {RESULTS_FILE}); give the run folder "
            "of an earlier grid sweep on this machine, or a figure (15%)"
        )
    try:
        rows = read_results(folder)
    except (OSError, ValueError) as exc:
        raise SweepError(f"--noise-floor {spec}: cannot read its rows: {exc}") from exc
    # search.json is written when a search ends; the settings recorded when it started say so from the start.
    if (folder / SEARCH_FILE).is_file() or _recorded_search(folder) == "adaptive":
        raise SweepError(
            f"--noise-floor {spec}: an adaptive search's run folder: its repeats ran close together, which is the "
            "noise a floor must not come from; give a grid sweep's run folder"
        )
    runs, left_out = _undisturbed_runs(rows)
    noise = pooled_noise(runs)
    if noise.df < 1:
        raise SweepError(
            f"--noise-floor {spec}: no trial there has two ok runs"
            + (f" once these are left out: {'; '.join(left_out)}" if left_out else "")
            + ", so it measured no run-to-run noise; give a grid sweep's folder (measure.repeats of 2 or more) or a "
            "figure (15%)"
        )
    source = f"the pooled run-to-run noise of {spec} ({len(noise.trials)} trials, {noise.df} df"
    source += f"; left out: {'; '.join(left_out)})" if left_out else ")"
    return NoiseFloor(sd=noise.sd, df=noise.df, source=source)


def _recorded_search(folder: Path) -> str | None:
    """The search a run folder's sweep was started with (``environment.json``: ``sweep.search``), None unknown."""
    try:
        return RunFolder(folder).environment().get("sweep", {}).get("search")
    except (OSError, RunFolderError, AttributeError):
        return None


def _undisturbed_runs(rows: Sequence[TrialResult]) -> tuple[dict[str, list[float]], list[str]]:
    """Each trial's per-run samples/s for a noise floor, and what was left out, in words: runs during which the
    activity sampler saw other processes busy on the machine (:func:`~hfscale.records.activity.others_busy`; stolen
    CPU time and throttled clocks stay in: they are the machine's own drift, which the floor measures), then trials
    whose runs disagree far beyond the others' (:func:`~hfscale.results.stats.outliers`). A grid's verdicts keep
    such trials in their pool (leaving them out would narrow the pool exactly when the sweep was noisy); a floor is
    the machine's own noise, which one busy run would otherwise raise for every decision of the search (a grid of
    cpu_small run beside other work pooled 38.5%, 17.1% with those runs left out, against 13-18% in undisturbed
    grids: docs/search.md)."""
    by_trial: dict[str, list[TrialResult]] = {}
    busy: list[str] = []
    for row in rows:
        if row.status == "ok" and others_busy(row.activity):
            busy.append(f"{row.trial} run {row.repeat + 1}")
            continue
        by_trial.setdefault(row.trial, []).append(row)
    runs = {name: run_rates(group) for name, group in by_trial.items()}
    flagged = outliers(runs)
    left_out = [f"runs beside other busy processes: {', '.join(busy)}"] if busy else []
    left_out += [f"{name} ({reason})" for name, reason in flagged.items()]
    return {name: rates for name, rates in runs.items() if name not in flagged}, left_out


def first_run(run: PlannedRun) -> PlannedRun:
    """``run`` (a trial's first) with its warm-up detected (``warmup_steps: auto``), made short:
    :data:`SHORT_FRACTION` of its optimizer steps, at least :data:`MIN_SHORT_STEPS`. A trial whose step count is
    not known before it runs (:func:`~hfscale.workload.steps.optimizer_steps`: a script's or a data factory's data
    trained by epochs, sequence parallelism, training_args that batch an epoch their own way), or that is no
    longer than that, runs in full."""
    spec = run.trial.spec
    total = optimizer_steps(run.trial.spec)
    measure = dataclasses.replace(spec.measure, warmup_steps="auto")
    if total is not None and total > MIN_SHORT_STEPS:
        short = max(MIN_SHORT_STEPS, math.ceil(total * SHORT_FRACTION))
        measure = dataclasses.replace(measure, max_steps=short)
    trial = dataclasses.replace(run.trial, spec=dataclasses.replace(spec, measure=measure))
    return dataclasses.replace(run, trial=trial)


def trial_states(firsts: Sequence[PlannedRun], stored: Mapping[Key, TrialResult]) -> list[TrialState]:
    """Each trial of the search as its rows in ``stored`` show it."""
    rows: dict[str, list[TrialResult]] = {}
    for (name, _), row in sorted(stored.items(), key=lambda item: item[0][1]):
        rows.setdefault(name, []).append(row)
    return [_state(run, rows.get(run.name, [])) for run in firsts]


def _state(run: PlannedRun, rows: list[TrialResult]) -> TrialState:
    """One trial's state from its rows: its ok runs' figures, and why it is out (a decision row, a failed run)."""
    launched = [r for r in rows if r.status not in ("skipped", "pruned")]
    ended = next((r for r in rows if r.status in ("skipped", "pruned")), None)
    failed = next((r for r in launched if r.status != "ok"), None)
    out = None
    if ended is not None:
        out = f"{ended.status}: {ended.reason}"
    elif failed is not None:
        out = f"{failed.status}: {failed.reason or 'no reason recorded'}"
    ok = [r for r in launched if r.status == "ok"]
    fits = [f for r in ok if (f := fit_memory(r.memory)[0]) is not None]
    steady = [r.throughput.steady_state for r in ok if r.throughput is not None]
    return TrialState(
        name=run.name, rates=tuple(run_rates(ok)), runs=len(launched), cap=run.repeats,
        fit_gib=max(fits) if fits else None, out=out,
        unsteady=bool(steady) and all(s is False for s in steady),
    )  # fmt: skip


def grid_cost(firsts: Sequence[PlannedRun], stored: Mapping[Key, TrialResult]) -> tuple[int, float | None]:
    """Runs the grid would make and the time they would take: every trial ``measure.repeats`` times, but once for a
    trial whose first run failed or that the search skipped on its estimate (the grid does not repeat a trial whose
    first run fails, and that one is expected to), and never one the sweep does not launch (a missing dependency);
    each run at the trial's median wall time at full length (:func:`_full_run_walls`), the median over all runs
    for a trial that never ran."""
    walls = _full_run_walls(firsts, stored)
    counts = {run.name: _grid_runs(run, stored) for run in firsts}
    everything = [w for values in walls.values() for w in values]
    if not everything:
        return sum(counts.values()), None
    fallback = statistics.median(everything)
    seconds = sum(n * (statistics.median(walls[name]) if name in walls else fallback) for name, n in counts.items())
    return sum(counts.values()), seconds


def _grid_runs(run: PlannedRun, stored: Mapping[Key, TrialResult]) -> int:
    """The runs the grid makes of ``run``'s trial, as far as the search's rows show."""
    if run.skip_reason is not None:
        return 0
    first = stored.get((run.name, 0))
    if first is not None and (first.status not in RAN_STATUSES or first.search is not None):
        return 1  # failed on its first run (the grid repeats only ok and not_applied), or skipped on the estimate
    return run.trial.spec.measure.repeats


def _full_run_walls(firsts: Sequence[PlannedRun], stored: Mapping[Key, TrialResult]) -> dict[str, list[float]]:
    """Each trial's launched runs' wall times at full length: a short first run (:func:`first_run`) plus the steps it
    left out at its own mean step time (unknown: as it ran, so the grid's time is underestimated, never overstated)."""
    by_name = {run.name: run for run in firsts}
    walls: dict[str, list[float]] = {}
    for (name, repeat), row in stored.items():
        if row.wall_time_s is None or row.status in ("skipped", "pruned"):
            continue
        wall = row.wall_time_s
        run = by_name.get(name)
        total = optimizer_steps(run.trial.spec) if run is not None else None
        throughput = row.throughput
        if repeat == 0 and total is not None and throughput is not None and throughput.step_time_mean_s:
            ran = first_run(run).trial.spec.measure.max_steps
            if ran is not None and ran < total:
                wall += (total - ran) * throughput.step_time_mean_s
        walls.setdefault(name, []).append(wall)
    return walls


@dataclass(kw_only=True)
class AdaptiveSearch:
    """One adaptive search over the sweep's planned trials; the sweep gives it its way to launch and append."""

    firsts: list[PlannedRun]
    """Each trial's first planned run (repeat 0), in recipe order."""
    originals: Sequence[RecipeTrial]
    """The recipe's trials, for the measure of a max-batch trial."""
    stored: dict[Key, TrialResult]
    """The run folder's rows (the sweep's own dict: rows appended through ``append`` show up here)."""
    question: Question
    limits: Limits
    baseline: str
    launch: Callable[[PlannedRun, str], TrialResult]
    """Launches one run and appends its row."""
    append: Callable[[TrialResult], None]
    search_batch: Callable[[PlannedRun, TrialResult], None]
    """Runs a trial's largest-batch search and appends its row again with the record."""
    searched: Callable[[RecipeTrial], bool]
    clear_summary: Callable[[], None]
    """Removes ``search.json`` (a resumed search's, from before)."""
    progress: Callable[[str], None]
    trace: list[SearchDecision] = field(default_factory=list)

    def run(self) -> SearchSummary:
        """Search until the question is decided or a budget is spent; returns what ``search.json`` records."""
        self.clear_summary()  # a resumed search's old summary no longer says how it ends
        self._trace_stored()
        self._skip_by_estimate()
        if self.question.noise_floor is None and all(run.repeats < 2 for run in self.firsts):
            self.progress(
                "every trial runs once (measure.repeats or --repeats 1) and no noise floor was given: with no second "
                "run there is no noise to prune on, so a trial leaves the contest only on memory (its estimate, or "
                "a measured peak over the budget) or when a run or time budget ends the search; give 2 runs or "
                "more, or a noise floor (--noise-floor, sweep.noise_floor; docs/search.md)"
            )
        while True:
            firsts = self._all_firsts()
            step = next_step(trial_states(firsts, self.stored), self.question, self.limits, self._progress())
            self._record(step, firsts)
            if step.stop is None:
                self._round(step.run, firsts)
            elif not self._search_contenders(step, firsts):
                return self._summary(step, firsts)

    def _progress(self) -> Progress:
        launched = [r for r in self.stored.values() if r.status not in ("skipped", "pruned")]
        return Progress(runs=len(launched), elapsed_s=sum(r.wall_time_s or 0.0 for r in launched))

    def _all_firsts(self) -> list[PlannedRun]:
        """The planned trials, and the max-batch trial of each contender whose search found a batch."""
        by_name = {t.name: t for t in self.originals}
        extra = []
        for run in self.firsts:
            row = self.stored.get(run.key)
            if run.trial.batch == "fixed" or row is None or row.batch_search is None:
                continue
            trial = max_batch_trial(run.trial, row.batch_search, original=by_name.get(run.name))
            if trial is not None:
                extra.append(dataclasses.replace(run, trial=trial, estimate=None, estimate_error=None))
        return [*self.firsts, *extra]

    def _trace_stored(self) -> None:
        """A resumed search's decisions so far, from its rows."""
        self.trace = sorted(
            (row.search for row in self.stored.values() if row.search is not None), key=lambda d: d.sweep_runs
        )

    def _skip_by_estimate(self) -> None:
        errors = [
            r.estimate.total_gib / fit - 1
            for r in self.stored.values()
            if r.status == "ok" and r.estimate is not None and (fit := fit_memory(r.memory)[0])
        ]
        margin = skip_margin(errors)
        for run in self.firsts:
            if run.key in self.stored or run.skip_reason is not None:
                continue
            predicted = run.estimate.total_gib if run.estimate is not None else None
            why = skip_by_estimate(predicted, self.question.budget_gib, margin)
            if why is None:
                continue
            decision = SearchDecision(
                trial=run.name, kind="skipped", reason=why, predicted_gib=predicted,
                budget_gib=self.question.budget_gib, margin=margin,
            )  # fmt: skip
            self._write_decision(run, decision, status="skipped")

    def _record(self, step: Next, firsts: Sequence[PlannedRun]) -> None:
        by_name = {run.name: run for run in firsts}
        seen = {(d.trial, d.kind) for d in self.trace}
        for decision in step.decisions:
            if (decision.trial, decision.kind) in seen:
                continue  # an over-budget trial is found again at every look
            if decision.kind in ("pruned", "too_slow"):
                self._write_decision(by_name[decision.trial], decision, status="pruned")
            else:
                self.trace.append(decision)
                self.progress(f"{decision.trial}: {decision.kind.replace('_', ' ')}: {decision.reason}")

    def _write_decision(self, run: PlannedRun, decision: SearchDecision, *, status: str) -> None:
        repeat = 1 + max((k[1] for k in self.stored if k[0] == run.name), default=-1)
        run = dataclasses.replace(run, repeat=repeat)
        row = planned_row(run, baseline=self.baseline, status=status, reason=decision.reason, search=decision)
        self.append(row)
        self.trace.append(decision)
        self.progress(f"{run.name}: {status}: {decision.reason}")

    def _round(self, names: Sequence[str], firsts: Sequence[PlannedRun]) -> None:
        """One more run of each trial named, in order; none once ``--max-time`` is spent (checked before each)."""
        by_name = {run.name: run for run in firsts}
        for name in names:
            if self.limits.max_time_s is not None and self._progress().elapsed_s >= self.limits.max_time_s:
                return  # the next look stops the search and says why
            run = by_name[name]
            repeat = 1 + max((k[1] for k in self.stored if k[0] == name), default=-1)
            planned = dataclasses.replace(run, repeat=repeat, index=len(self.stored))
            self.launch(first_run(planned) if repeat == 0 else planned, "[search] ")

    def _search_contenders(self, step: Next, firsts: Sequence[PlannedRun]) -> bool:
        """The largest-batch search of the answer and the contenders left that ask for one (not yet searched);
        True when one found a batch whose trial now joins the search."""
        if budget_spent(self.limits, self._progress()) is not None:
            return False  # no probes once a budget is spent, whatever ended the search
        before = len(firsts)
        in_contest = {step.answer, *step.contenders} - {None}
        for run in self.firsts:
            row = self.stored.get(run.key)
            if run.name not in in_contest or row is None or row.status != "ok" or row.batch_search is not None:
                continue
            if not self.searched(run.trial):
                continue
            self.progress(f"{run.name}: a contender; its largest batch is searched")
            self.search_batch(run, row)
        return len(self._all_firsts()) > before

    def _summary(self, step: Next, firsts: Sequence[PlannedRun]) -> SearchSummary:
        progress = self._progress()
        grid_runs, grid_s = grid_cost(firsts, self.stored)
        return SearchSummary(
            question=self.question.words(), min_samples_per_s=self.question.min_samples_per_s,
            stop=step.stop or "decided", stop_reason=step.stop_reason,
            answer=step.answer, contenders=step.contenders, runs=progress.runs, elapsed_s=progress.elapsed_s,
            grid_runs=grid_runs, grid_estimate_s=grid_s, confidence=self.question.confidence, trace=tuple(self.trace),
            noise_floor=self.question.noise_floor,
        )  # fmt: skip


def adaptive_mark(row: TrialResult, run: PlannedRun, stored: dict[Key, TrialResult]) -> TrialResult:
    """A row of the search saying so (its run count followed the results), its first run's shortening named; a
    max-batch row marked as the grid marks it."""
    if max_batch_base(run.name) is not None:
        row = mark_max_batch(row, run, stored)
    measure = run.trial.spec.measure
    short = ""
    if run.repeat == 0 and measure.warmup_steps == "auto":
        steps = f"{measure.max_steps} optimizer steps, " if measure.max_steps is not None else ""
        short = f" (its first: {steps}the warm-up detected)"
    return dataclasses.replace(
        row, stopping=f"adaptive search: runs until the answer is decided within the noise{short}"
    )


__all__ = [
    "MIN_SHORT_STEPS",
    "SHORT_FRACTION",
    "AdaptiveSearch",
    "adaptive_mark",
    "check_adaptive",
    "first_run",
    "grid_cost",
    "noise_floor_of",
    "question_of",
    "recorded_floor",
    "refuse_search_keys",
    "search_settings",
    "trial_states",
]
