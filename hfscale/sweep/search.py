"""The adaptive search: what to run next, decided on the evidence so far, instead of every trial to the end.

A grid sweep runs every trial ``measure.repeats`` times. Most of those runs decide nothing: a trial at a third of
the leader's speed is as clearly out after one run as after five. The search asks one question of the rows and
spends runs only where the answer is still open. It is a pure function of the evidence (:func:`next_step`), so
the same function drives a real sweep (:mod:`hfscale.sweep.loop`) and the simulation that checks its error rate
(``tests/sweep/test_search.py``), and a resumed sweep re-derives where it stood from its rows.

In order (``docs/search.md`` explains each choice):

1. **Skip** (before anything runs, :mod:`hfscale.sweep.skip`): a trial whose predicted peak does not fit the budget
   even if the estimate over-predicts by its measured error.
2. **First runs**: one short run of every surviving trial (its warm-up detected from its step times).
3. **Over budget**: a trial whose measured peak does not fit is out (its rows stay).
4. **Prune**: a trial slower than the leader beyond the noise: the ratio of geometric means over runs with the
   sweep's pooled run-to-run noise (:mod:`hfscale.results.stats`, the verdicts' own statistics), its Dunnett
   many-to-one interval (every contender against the leader) wholly below 1 and beyond the 2% noise threshold.
   A decision on runs that never reached a steady state (MSER's truncation late in the run) says so. With a noise
   floor (``--noise-floor``: a drifting machine), no trial's mean is taken as known better than one run of it.
5. **Repeats for the contenders**: each round runs the leader and its strongest challenger once more (the leader
   against the runner-up: the LUCB rule of Kalyanakrishnan et al. 2012, with the point estimate choosing the
   challenger), up to ``measure.repeats`` runs each, until every other contender is pruned or equal to the leader
   within the noise threshold (*decided*), the contenders have had their runs (*runs spent*: they tie within the
   noise), or ``--max-time`` / ``--max-runs`` runs out. With a noise floor a trial runs again only while another
   run can narrow its mean (:func:`_may_run`).

The least-memory question ("least memory at a throughput of at least X") walks the trials by measured memory
instead: a trial whose speed interval lies below X is out (``too_slow``), the first whose interval lies at or above
it is the answer, and runs go to the least-memory trial still undecided.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hfscale.core.text import listed
from hfscale.records.search import SearchDecision, StopReason
from hfscale.results.stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_NOISE_THRESHOLD,
    MIN_RUNS,
    Interval,
    NoiseFloor,
    RunNoise,
    floored_level,
    many_to_one,
    pooled_noise,
    shared_noise_p,
    shares_noise,
    sidak_critical,
    within_threshold,
)

UNSTEADY_NOTE = "; its runs did not reach a steady state by MSER's rule (the figure is after the detected warm-up)"


@dataclass(frozen=True, kw_only=True)
class Question:
    """What the search is to answer."""

    budget_gib: float | None = None
    """Memory per device a trial must fit (the figure the report checks: NVML process memory, else the allocator's
    reserved peak, else the peak); None: no budget."""
    min_samples_per_s: float | None = None
    """None: the fastest trial that fits. A figure: the trial with the least memory whose samples/s is at least
    this."""
    confidence: float = DEFAULT_CONFIDENCE
    noise_threshold: float = DEFAULT_NOISE_THRESHOLD
    noise_floor: NoiseFloor | None = None
    """``--noise-floor``: no trial's mean is taken as known better than one run of it. The search's repeats run
    minutes apart and, where the machine drifts, see only those minutes' noise."""

    def words(self) -> str:
        """The question in words, for the report and ``search.json``."""
        budget = self.budget_gib
        within = f"within {budget:.2f} GiB per device" if budget is not None else "(no memory budget given)"
        if self.min_samples_per_s is None:
            return f"the fastest trial {within}"
        return f"the trial with the least memory at >= {self.min_samples_per_s:g} samples/s {within}"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What the search may spend."""

    max_time_s: float | None = None
    """Sum of the runs' wall times after which no run is started."""
    max_runs: int | None = None
    """Runs after which no run is started."""


@dataclass(frozen=True, kw_only=True)
class TrialState:
    """One trial as the search sees it, read from its rows."""

    name: str
    rates: tuple[float, ...] = ()
    """Each ok run's steady samples/s (the runs the statistics use)."""
    runs: int = 0
    """Runs launched."""
    cap: int = 1
    """The most runs it may have (the recipe's ``measure.repeats``)."""
    fit_gib: float | None = None
    """Its largest measured memory, the figure a budget is checked against."""
    out: str | None = None
    """Why it takes no further part: a failed run (status and reason), or a decision already recorded."""
    unsteady: bool = False
    """None of its runs reached a steady state by MSER's rule (the truncation point fell late in the run): a
    decision on them says so. Not a gate: on runs of 10-20 steps the rule calls a third to a half of steady runs
    unsteady (``docs/callbacks.md``), and the figure after the detected warm-up is the steady part either way."""

    @property
    def log_mean(self) -> float:
        return sum(math.log(r) for r in self.rates) / len(self.rates) if self.rates else -math.inf


@dataclass(frozen=True, kw_only=True)
class Next:
    """What :func:`next_step` decided: trials to run once more (in order), decisions to record, or the end."""

    run: tuple[str, ...] = ()
    decisions: tuple[SearchDecision, ...] = ()
    stop: StopReason | None = None
    stop_reason: str = ""
    answer: str | None = None
    """The leader (fastest question) or the qualifying trial (least-memory question); None when none is known."""
    contenders: tuple[str, ...] = ()
    """Trials still in the contest beside the answer: undecided against it, or equal to it within the noise
    threshold (a decided fastest question)."""


@dataclass(frozen=True, kw_only=True)
class Progress:
    """How far the sweep is: what :class:`Limits` are checked against."""

    runs: int = 0
    elapsed_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class _Look:
    """One look at the evidence: the contenders ranked, the pooled noise, and the decisions taken so far."""

    alive: list[TrialState]
    noise: RunNoise
    question: Question
    progress: Progress
    shared_p: float | None = None
    """Bartlett's p for one run-to-run noise shared by the trials run twice or more (as the report's verdicts)."""
    decisions: list[SearchDecision] = field(default_factory=list)

    @property
    def shared(self) -> bool:
        return shares_noise(self.shared_p)

    def decide(self, state: TrialState, **fields: Any) -> None:
        runs, elapsed = self.progress.runs, self.progress.elapsed_s
        decision = SearchDecision(trial=state.name, runs=len(state.rates), sweep_runs=runs, elapsed_s=elapsed, **fields)
        self.decisions.append(decision)


def next_step(states: Sequence[TrialState], question: Question, limits: Limits, progress: Progress) -> Next:
    """The search's next move from the evidence in ``states`` (every trial of the sweep, decided ones included: their
    runs count in the pooled noise)."""
    alive = [s for s in states if s.out is None]
    if not alive:
        return Next(stop="no_trials", stop_reason="no trial is left to run (every one failed, was skipped or pruned)")
    first = tuple(s.name for s in alive if s.runs == 0)
    if first and (step := _limited(Next(run=first), limits, progress)).stop is None:
        return step
    runs = {s.name: s.rates for s in states}
    look = _Look(
        alive=[s for s in alive if s.runs > 0], noise=pooled_noise(runs), question=question, progress=progress,
        shared_p=shared_noise_p(runs),
    )  # fmt: skip
    _drop_unmeasured(look)
    _drop_over_budget(look)
    floor = question.min_samples_per_s
    step = _fastest(look) if floor is None else _frugal(look, floor)
    step = Next(
        run=step.run, decisions=tuple(look.decisions), stop=step.stop, stop_reason=step.stop_reason,
        answer=step.answer, contenders=step.contenders,
    )  # fmt: skip
    if first:  # a budget ran out before every trial ran once: the answer so far, every other trial still in it
        spent = _limited(Next(run=first), limits, progress)
        # Nothing is decided on this partial look: its intervals are over fewer trials than the full look's, so
        # a prune here could be one the whole search would not make (and a resumed search would keep).
        others = tuple(s.name for s in alive if s.name != step.answer)
        return dataclasses.replace(spent, answer=step.answer, contenders=others)
    return _limited(_said_unranked(step, look), limits, progress)


def _said_unranked(step: Next, look: _Look) -> Next:
    """``step``, its stop reason naming the trials left unranked for want of a speed (an answer "of the trials at
    X samples/s" or "the fastest" says nothing of them otherwise)."""
    unranked = [d.trial for d in look.decisions if d.kind == "unmeasured"]
    if step.stop in (None, "nothing_fits") or not unranked:  # nothing_fits says so itself
        return step
    why = f"{step.stop_reason}; not ranked, no speed measured: {', '.join(unranked)}"
    return dataclasses.replace(step, stop_reason=why)


def budget_spent(limits: Limits, progress: Progress) -> tuple[StopReason, str] | None:
    """Which budget ``progress`` has spent, and that in words; None while both last. A spent budget stops the search
    and runs nothing more, a largest-batch search's probes included."""
    if limits.max_runs is not None and progress.runs >= limits.max_runs:
        return "run_budget_spent", f"the run budget is spent ({progress.runs} of --max-runs {limits.max_runs})"
    if limits.max_time_s is not None and progress.elapsed_s >= limits.max_time_s:
        return (
            "time_spent",
            (
                f"the time budget is spent ({progress.elapsed_s:.0f} s of summed run time, --max-time "
                f"{limits.max_time_s:.0f} s)"
            ),
        )
    return None


def _limited(step: Next, limits: Limits, progress: Progress) -> Next:
    """``step`` with no more runs than ``--max-runs`` leaves, or the end (with the answer so far) once a budget is
    spent. Time is checked here, before each round, and by the runner before each run."""
    if not step.run:
        return step
    spent = budget_spent(limits, progress)
    if spent is None:
        left = None if limits.max_runs is None else limits.max_runs - progress.runs
        return step if left is None else dataclasses.replace(step, run=step.run[:left])
    stop, why = spent
    return Next(
        decisions=step.decisions, stop=stop, stop_reason=f"{why}; undecided", answer=step.answer,
        contenders=step.contenders or step.run,
    )  # fmt: skip


def _drop_unmeasured(look: _Look) -> None:
    """Trials whose ok runs gave no usable speed (no steady samples/s) leave the contest, said as a decision: the
    search cannot rank them, and must not leave them out without a word."""
    for state in list(look.alive):
        if not state.rates:
            look.decide(
                state,
                kind="unmeasured",
                reason=f"no speed measured: {_runs_of(state.runs, 'ok run')} gave no steady samples/s, so it cannot "
                "be ranked",
            )
            look.alive.remove(state)


def _drop_over_budget(look: _Look) -> None:
    """Trials whose measured figure does not fit the budget leave the contest (their rows stay)."""
    budget = look.question.budget_gib
    if budget is None:
        return
    for state in list(look.alive):
        if state.fit_gib is not None and state.fit_gib > budget:
            look.decide(
                state,
                kind="over_budget",
                reason=f"measured {state.fit_gib:.3f} GiB (its largest run), over the budget of {budget:.3f} GiB",
                measured_gib=state.fit_gib,
                budget_gib=budget,
            )
            look.alive.remove(state)


def _fastest(look: _Look) -> Next:
    """The fastest-that-fits question: prune what is slower than the leader beyond the noise, then run the leader
    and its strongest undecided challenger."""
    ranked = sorted(look.alive, key=lambda s: -s.log_mean)
    if not ranked:
        return Next(stop="nothing_fits", stop_reason=_nothing_left_words(look))
    leader, others = ranked[0], ranked[1:]
    settled = {s.name: _settled(look, leader, others, s) for s in others}
    undecided = [s for s in others if settled[s.name] is None]
    if not undecided:
        equal = tuple(name for name, said in settled.items() if said == "equal")
        why = (
            f"{leader.name} is the fastest: every other trial is pruned or within "
            f"{look.question.noise_threshold:.0%} of it"
            if others
            else f"{leader.name} is the only trial left"
        )
        return Next(stop="decided", stop_reason=why, answer=leader.name, contenders=equal)
    challenger = next((s for s in undecided if _may_run(look, s)), None)
    run = [s.name for s in (leader, challenger) if s is not None and _may_run(look, s)]
    if not run:
        names = ", ".join(s.name for s in undecided)
        why = f"{leader.name} and {names} cannot be told apart within the noise " + _spent_words(
            look, [leader, *undecided]
        )
        return Next(stop="runs_spent", stop_reason=why, answer=leader.name, contenders=tuple(s.name for s in undecided))
    return Next(run=tuple(run), answer=leader.name, contenders=tuple(s.name for s in undecided))


def _nothing_left_words(look: _Look) -> str:
    """Why no trial is left to rank, from this look's decisions: none fits the budget, none has a speed, or both."""
    kinds = {d.kind for d in look.decisions}
    over, unmeasured = "over_budget" in kinds, "unmeasured" in kinds
    if over and unmeasured:
        return "no trial left both fits the budget and has a speed measured"
    return "no trial left fits the budget" if over else "no trial left has a speed measured"


def _runs_of(n: int, what: str = "run") -> str:
    """``1 run``, ``2 runs``."""
    return f"{n} {what}{'s' if n != 1 else ''}"


def _may_run(look: _Look, state: TrialState) -> bool:
    """Whether another run of ``state`` may narrow its mean: it has runs left, and with a noise floor it has fewer
    than the two runs a verdict needs (a single run could be a disturbed one; the report tests every trial on two)
    or its runs' noise over their count is still above the floor's (below it, the floor is the mean's uncertainty
    however many runs follow)."""
    if state.runs >= state.cap:
        return False
    floor = look.question.noise_floor
    if floor is None or len(state.rates) < MIN_RUNS:
        return True
    if look.shared:
        noise = look.noise
        return noise.df >= 1 and noise.sd**2 / len(state.rates) > floor.sd**2
    own = pooled_noise({state.name: state.rates})
    return own.df < 1 or own.sd**2 / len(state.rates) > floor.sd**2


def _spent_words(look: _Look, states: Sequence[TrialState]) -> str:
    """Why no further run of ``states`` (the leader first) can decide, as the end of a sentence."""
    counts = {s.runs for s in states}
    if len(counts) == 1:
        ran = f"{_runs_of(states[0].runs)} each"
    else:
        first, *rest = states
        ran = listed([f"{_runs_of(first.runs)} of {first.name}", *(f"{s.runs} of {s.name}" for s in rest)])
    floor = look.question.noise_floor
    if floor is None:
        return f"after {ran} (measure.repeats): they tie"
    return (
        f"after their runs: each mean is known as well as the noise floor allows ({floor.sd:.1%} of one run, "
        f"{floor.source}) or has had its measure.repeats runs ({ran}): they tie"
    )


def _settled(look: _Look, leader: TrialState, others: Sequence[TrialState], state: TrialState) -> str | None:
    """How ``state`` stands against ``leader``: ``pruned`` (the decision recorded), ``equal`` within the noise
    threshold, or None (undecided)."""
    question = look.question
    measured = _against_leader(look, leader, others, state)
    if measured is None:
        return None
    ratio, noise_words = measured
    if ratio.high < 1 and not within_threshold(ratio.value, question.noise_threshold):
        look.decide(
            state,
            kind="pruned",
            reason=(
                f"slower than {leader.name} beyond the noise: {ratio.value:.2f}x its speed (ratio of geometric means "
                f"over runs, {question.confidence:.0%} interval {ratio.low:.2f}-{ratio.high:.2f}, {len(state.rates)} "
                f"against {len(leader.rates)} runs; {noise_words})" + (UNSTEADY_NOTE if state.unsteady else "")
            ),
            leader=leader.name,
            ratio=ratio.value,
            ratio_low=ratio.low,
            ratio_high=ratio.high,
        )
        return "pruned"
    threshold = question.noise_threshold
    return "equal" if within_threshold(ratio.low, threshold) and within_threshold(ratio.high, threshold) else None


def _against_leader(
    look: _Look, leader: TrialState, others: Sequence[TrialState], state: TrialState
) -> tuple[Interval, str] | None:
    """``state`` over ``leader`` with its interval and the noise it rests on, in words; None while the noise is not
    known: no trial ran twice, or the trials do not share one noise and a side has a single run (its own noise is
    unknown until it runs again), and no noise floor was given."""
    noise, floor = look.noise, look.question.noise_floor
    ratio = many_to_one(
        state.rates, leader.rates, others=tuple(len(s.rates) for s in others), noise=noise, shared=look.shared,
        confidence=look.question.confidence, floor=floor,
    )  # fmt: skip
    if ratio is None:
        return None
    if look.shared:
        words = noise.words() if noise.df >= 1 else "no trial has run twice"
    else:
        words = (
            f"each side's own run-to-run noise (Welch, Šidák over {len(others)}): the trials do not share one "
            f"(Bartlett's p = {look.shared_p:.1g})"
        )
    if floor is not None:
        words += f"; neither mean taken as known better than one run of the noise floor, {floor.source}"
    return ratio, words


def _frugal(look: _Look, floor: float) -> Next:
    """The least-memory question: walk the trials by measured memory; the first whose speed is at least ``floor``
    beyond the noise is the answer; one below it beyond the noise is out; runs go to the first undecided one."""
    by_memory = sorted(look.alive, key=lambda s: (s.fit_gib if s.fit_gib is not None else math.inf, s.name))
    noise, question = look.noise, look.question
    undecided: list[TrialState] = []
    for state in by_memory:  # every one has a speed (_drop_unmeasured)
        own = noise if look.shared else pooled_noise({state.name: state.rates})
        level = _level(own, state, len(by_memory), question)
        if level is not None and level.high < floor:
            look.decide(
                state,
                kind="too_slow",
                reason=(
                    f"below {floor:g} samples/s beyond the noise: {level.value:.2f} samples/s (geometric mean over "
                    f"runs, {question.confidence:.0%} Šidák interval {level.low:.2f}-{level.high:.2f}"
                    f"{_floor_clause(question)})" + (UNSTEADY_NOTE if state.unsteady else "")
                ),
                ratio=level.value / floor,
                ratio_low=level.low / floor,
                ratio_high=level.high / floor,
            )
            continue
        if level is not None and level.low >= floor:
            contenders = tuple(s.name for s in undecided)
            if not contenders:
                why = f"{state.name} needs the least memory of the trials at >= {floor:g} samples/s"
                return Next(stop="decided", stop_reason=why, answer=state.name)
            why = (
                f"{state.name} qualifies; {', '.join(contenders)} need less memory but cannot be placed against "
                f"{floor:g} samples/s within the noise after their runs{_floor_clause(question)}"
            )
            return Next(stop="runs_spent", stop_reason=why, answer=state.name, contenders=contenders)
        if _may_run(look, state):
            return Next(run=(state.name,), contenders=(state.name,))
        undecided.append(state)
    if undecided:
        names = ", ".join(s.name for s in undecided)
        why = (
            f"{names} cannot be placed against {floor:g} samples/s within the noise after their runs"
            f"{_floor_clause(question)}; none qualifies"
        )
        return Next(stop="runs_spent", stop_reason=why, contenders=tuple(s.name for s in undecided))
    return Next(stop="nothing_fits", stop_reason=f"no trial that fits reaches {floor:g} samples/s")


def _floor_clause(question: Question) -> str:
    """The noise floor's part in a least-memory decision, as a clause ("" without one)."""
    floor = question.noise_floor
    if floor is None:
        return ""
    return f", no mean taken as known better than one run of the noise floor ({floor.sd:.1%}, {floor.source})"


def _level(noise: RunNoise, state: TrialState, trials: int, question: Question) -> Interval | None:
    """``state``'s geometric mean samples/s over runs with its Šidák interval over ``trials`` from ``noise`` (the
    pool, or the trial's own runs where the trials do not share one noise), no narrower than one run of the noise
    floor; None without degrees of freedom."""
    critical = functools.partial(sidak_critical, trials, confidence=question.confidence)
    floor = question.noise_floor
    if floor is not None:
        return floored_level(state.rates, noise=noise, floor=floor, critical=critical, confidence=question.confidence)
    if noise.df < 1:
        return None
    half = critical(noise.df) * noise.sd / math.sqrt(len(state.rates))
    mean = state.log_mean
    return Interval(
        value=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), confidence=question.confidence,
        samples=len(state.rates), repeats=len(state.rates),
    )  # fmt: skip


__all__ = [
    "Limits",
    "Next",
    "Progress",
    "Question",
    "TrialState",
    "budget_spent",
    "next_step",
]
