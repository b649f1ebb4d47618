"""The Pareto front of (samples/s, peak memory) and the recommendation: the fastest trial within the memory budget,
and the one that needs the least memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hfscale.core.text import listed
from hfscale.core.units import GIB
from hfscale.report.columns import is_missing
from hfscale.report.fastest import FastestPick, pick_fastest
from hfscale.report.machine import format_bytes
from hfscale.report.noise import memory_tie, speed_tie
from hfscale.report.text import Text, rich
from hfscale.results.stats import SweepNoise, sweep_noise

if TYPE_CHECKING:
    import pandas as pd


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """Names of the points no other point dominates, fastest first; a point is ``(samples_per_s, memory_gib)``.

    A point dominates another when it is at least as fast and at most as large, and strictly better in one of the
    two. Identical points are all on the front.
    """
    front = []
    for name, (speed, mem) in points.items():
        dominated = any(
            other != name and s >= speed and m <= mem and (s > speed or m < mem) for other, (s, m) in points.items()
        )
        if not dominated:
            front.append(name)
    return sorted(front, key=lambda n: (-points[n][0], points[n][1], n))


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The fastest strategy that fits the memory budget, and the one that needs the least memory."""

    budget_bytes: int | None
    """The per-device budget; None when none was given and the run's GPU memory is unknown."""
    budget_source: str
    """Where the budget came from, in words."""
    fastest: str | None
    """Trial name: the highest steady-state samples/s among ok trials that fit (all ok trials without a budget)."""
    most_frugal: str | None
    """Trial name: the least memory (``fit_gib``) among ok trials (a tie broken by speed)."""
    fastest_ties: tuple[str, ...] = ()
    """Other trials whose speed cannot be told apart from the fastest's (named in ``lines``)."""
    lines: tuple[Text, ...]
    """The recommendation in sentences, as the report prints it."""
    undecided: Literal["none_qualifies", "too_large", "unstable"] | None = None
    """Why no trial is recommended on speed: no ok trial qualifies (both figures measured, its loss not flagged),
    none fits the budget (more runs change neither), or the fastest by its figure may be unstable; None when one
    is."""


def _f(value: float | None, digits: int) -> str:
    return "—" if value is None or value != value else f"{value:.{digits}f}"


def outside_allocator_gib(rows: pd.DataFrame) -> float | None:
    """Largest measured memory outside torch's allocator (NVML process use less reserved peak); None if unmeasured.

    A negative gap means the NVML samples missed the peak: not a measurement, left out."""
    gaps = (rows["nvml_process_used_gib"] - rows["peak_reserved_gib"]).dropna()
    gaps = gaps[gaps >= 0]
    return float(gaps.max()) if len(gaps) else None


def _names(names: list[str]) -> tuple[str, dict[str, str]]:
    """``**{n0}**, **{n1}** and **{n2}**`` and its values, for :func:`rich`."""
    marks = [f"**{{n{k}}}**" for k in range(len(names))]
    return listed(marks), {f"n{k}": name for k, name in enumerate(names)}


def _speed_text(row: pd.Series) -> str:
    low, high = row.get("samples_per_s_low"), row.get("samples_per_s_high")
    if low is None or low != low:
        return f"{_f(row['samples_per_s'], 2)} samples/s (single run, no interval)"
    return f"{_f(row['samples_per_s'], 2)} samples/s (95% interval {_f(low, 2)}–{_f(high, 2)})"


def _fit_text(row: pd.Series) -> str:
    source = row.get("fit_source")
    return f"{_f(row['fit_gib'], 3)} GiB" + (f" ({source})" if isinstance(source, str) else "")


def _leader_lines(pool: pd.DataFrame, evidence: SweepNoise, head: str, tail: str) -> list[Text]:
    """The fastest of ``pool`` when nothing ties with it, and whether its lead over the runner-up was tested."""
    leader = pool.iloc[0]
    lines = [
        rich(
            head + " **{name}** ({desc}): {speed}, needs {fit}{tail}.",
            name=leader["trial"],
            desc=leader["description"],
            speed=_speed_text(leader),
            fit=_fit_text(leader),
            tail=tail,
        )
    ]
    if len(pool) > 1:
        runner = pool.iloc[1]
        _, with_interval = speed_tie(leader, runner, evidence)
        if not with_interval:
            lead = 100 * (leader["samples_per_s"] / runner["samples_per_s"] - 1)
            lines.append(
                rich(
                    "Its lead over {other} ({lead:.1f}%) is not tested against the noise: that needs at least "
                    "two runs of each trial whose runs share the sweep's noise (measure.repeats, or "
                    "measure.target_precision).",
                    other=runner["trial"],
                    lead=lead,
                )
            )
    return lines


def _left_out_of_tie_lines(pick: FastestPick) -> list[Text]:
    """Why the trials whose interval holds the leader's speed are not named as tying with it."""
    lines = [
        rich(
            "**{name}** is not counted as tying for the fastest, although no interval tells it from **{leader}**: "
            "**{by}** is shown faster than it.",
            name=out.trial["trial"],
            leader=pick.leader["trial"],
            by=out.by["trial"],
        )
        for out in pick.left_out
        if out.shown_faster
    ]
    below = [out for out in pick.left_out if not out.shown_faster]
    if not below:
        return lines
    marks, values = _names([str(out.trial["trial"]) for out in below])
    one = len(below) == 1
    lines.append(
        rich(
            marks + " {verb} not counted as tying for the fastest, although no interval tells {them} from **{name}**: "
            "{what} no faster by its figure than **{beaten}**, which **{name}** is shown faster than.",
            **values,
            verb="is" if one else "are",
            them="it" if one else "them",
            what="it is" if one else "each is",
            name=pick.leader["trial"],
            beaten=below[0].by["trial"],
        )
    )
    return lines


def _fastest_lines(
    pool: pd.DataFrame, evidence: SweepNoise, head: str, compared: pd.DataFrame
) -> tuple[pd.Series, list[Text], tuple[str, ...]]:
    """The fastest of ``pool`` (sorted fastest first, not empty), its ties named and broken by memory
    (:func:`~hfscale.report.fastest.pick_fastest`, ``compared`` the trials a left-out tie is measured against)."""
    pick = pick_fastest(pool, evidence, compared)
    leader, tied, tested = pick.leader, pick.tied, pick.tested
    left_out = _left_out_of_tie_lines(pick)
    vs = leader.get("speedup_vs_baseline")
    tail = "" if vs is None or vs != vs else f", {_f(vs, 2)}x the baseline"
    if len(tied) == 1:
        return leader, _leader_lines(pool, evidence, head, tail) + left_out, ()
    names = [str(r["trial"]) for r in tied]
    marks, values = _names(names)
    speeds = ", ".join(f"{r['trial']} {_f(r['samples_per_s'], 2)}" for r in tied)
    why = (
        "the 95% interval of each speed ratio holds 1 or stays within 2% of it"
        if tested
        else "they are within the 2% noise threshold of each other, and no interval could rank them (fewer than "
        "two runs of each, or a trial that may be unstable)"
    )
    least, best = pick.least, pick.chosen
    by_memory = [best, *(r for r in sorted(tied, key=lambda r: r["fit_gib"]) if r["trial"] != best["trial"])]
    same_memory = len(least) == len(tied)
    line = [rich(head + " " + marks + " tie on speed (samples/s: {speeds}; {why}).", **values, speeds=speeds, why=why)]
    if same_memory:
        line.append(
            rich(
                "They need the same memory too ({fits}), so either will do: no measurement here ranks them; "
                "**{name}** is marked only because {why}.",
                fits=", ".join(_fit_text(r) for r in tied),
                name=leader["trial"],
                why=_why_marked(
                    leader,
                    tied,
                    (_SPEED, _MEMORY),
                    (
                        "its point estimate is the highest",
                        "of those with the highest point estimate it needs the least memory",
                    ),
                ),
            )
        )
        return leader, line + left_out, tuple(n for n in names if n != leader["trial"])
    alike = [str(r["trial"]) for r in least if r["trial"] != best["trial"]]
    line.append(
        rich(
            "The tie is broken by memory, the other axis: **{name}** ({desc}) needs {fit} against {others}{tail}"
            + (
                "; {alike} need{s} as little within 2%, and of those {name}'s point estimate is the highest."
                if alike
                else "."
            ),
            name=best["trial"],
            desc=best["description"],
            fit=_fit_text(best),
            others=", ".join(f"{_f(r['fit_gib'], 3)} GiB ({r['trial']})" for r in by_memory[1:]),
            tail=tail if best["trial"] == leader["trial"] else "",
            alike=", ".join(alike),
            s="" if len(alike) > 1 else "s",
        )
    )
    return best, line + left_out, tuple(n for n in names if n != best["trial"])


_SPEED, _MEMORY = ("samples_per_s", True), ("fit_gib", False)
"""A figure a tie is broken by, and whether higher is better."""
_FRUGAL_WHY = (
    "its memory figure is the lowest",
    "of those with the lowest memory figure its point estimate of speed is the highest",
)


def _why_marked(
    chosen: pd.Series, tied: list[pd.Series], order: tuple[tuple[str, bool], ...], why: tuple[str, ...]
) -> str:
    """Why ``chosen`` is the one marked among ``tied``: the first figure of ``order`` it is strictly best at among
    those equal to it on the figures before (``why`` says each), else the table's order (all figures equal)."""
    others = [r for r in tied if r["trial"] != chosen["trial"]]
    for (key, higher), words in zip(order, why, strict=True):
        if all(chosen[key] > r[key] if higher else chosen[key] < r[key] for r in others):
            return words
        others = [r for r in others if r[key] == chosen[key]]
    return "it comes first in the table (their figures are equal)"


def _frugal_lines(candidates: pd.DataFrame, evidence: SweepNoise) -> tuple[pd.Series, list[Text]]:
    by_memory = candidates.sort_values(["fit_gib", "samples_per_s"], ascending=[True, False], kind="stable")
    leader = by_memory.iloc[0]
    tied = [leader] + [r for _, r in by_memory.iloc[1:].iterrows() if memory_tie(leader, r)]
    saved = leader.get("memory_saved_pct")
    vs = f", {_f(saved, 1)} % less than the baseline" if saved is not None and saved == saved and saved > 0 else ""
    if len(tied) == 1:
        return leader, [
            rich(
                "Least memory: **{name}** ({desc}): needs {fit}, peak {peak} GiB, {speed}{vs}.",
                name=leader["trial"],
                desc=leader["description"],
                fit=_fit_text(leader),
                peak=_f(leader["peak_gib"], 3),
                speed=_speed_text(leader),
                vs=vs,
            )
        ]
    marks, values = _names([str(r["trial"]) for r in tied])
    fits = ", ".join(f"{r['trial']} {_f(r['fit_gib'], 3)} GiB" for r in tied)
    by_speed = sorted(tied, key=lambda r: -r["samples_per_s"])
    best = by_speed[0]
    said = [speed_tie(best, r, evidence) for r in by_speed[1:]]
    lines = [rich("Least memory: " + marks + " tie (within 2%: {fits}).", **values, fits=fits)]
    if all(tie for tie, _ in said):
        lines.append(
            rich(
                "Their speeds tie too, so either will do; **{name}** is marked only because {why}.",
                name=leader["trial"],
                why=_why_marked(leader, tied, (_MEMORY, _SPEED), _FRUGAL_WHY),
            )
        )
        return leader, lines
    if not all(not tie and tested for tie, tested in said):  # faster than every other one, tested, or no claim
        lines.append(
            rich(
                "Speed does not break the tie: no test shows one of them faster than all the others (some tie, or "
                "have fewer than two runs, or may be unstable); **{name}** is marked only because {why}.",
                name=leader["trial"],
                why=_why_marked(leader, tied, (_MEMORY, _SPEED), _FRUGAL_WHY),
            )
        )
        return leader, lines
    lines.append(
        rich(
            "The tie is broken by speed, the other axis: **{name}** ({desc}) is faster: {speed}.",
            name=best["trial"],
            desc=best["description"],
            speed=_speed_text(best),
        )
    )
    return best, lines


def _other_job_lines(fastest: pd.Series, frame: pd.DataFrame) -> list[Text]:
    """What makes the recommended trial a different job from the baseline's, said beside the recommendation: a
    larger batch (a ``-maxbatch`` row) or LoRA (adapters trained, the base frozen) are faster partly because they
    do less or other work per sample, which samples/s alone does not show."""
    baseline = frame[frame["verdict"] == "baseline"]  # the table's: marked, or the first ok trial where none is
    lines = []
    if not is_missing(fastest.get("max_batch_of")):
        lines.append(
            rich(
                "**{name}** runs {of} at its largest batch: the comparison is samples/s at a different batch size "
                "(optimisation changes with the batch; tune the learning rate before you adopt it).",
                name=fastest["trial"],
                of=fastest["max_batch_of"],
            )
        )
    if bool(fastest.get("lora")) and not (len(baseline) and bool(baseline["lora"].iloc[0])):
        lines.append(
            rich(
                "**{name}** trains LoRA adapters with the base frozen, a different job from the baseline's full "
                "training: its speed says nothing about the quality a run reaches.",
                name=fastest["trial"],
            )
        )
    return lines


_NO_BUDGET = "(no memory budget: none was given with --memory-budget and environment.json records no GPU memory)"


def _where(budget: int | None, source: str) -> str:
    """The budget a speed claim is made under, in words."""
    return f"within {format_bytes(budget)} per device ({source})" if budget is not None else _NO_BUDGET


@dataclass(frozen=True, kw_only=True)
class _Pool:
    """The ok rows of a report, sorted into those that qualify and those left out, with the reason."""

    candidates: pd.DataFrame
    """Ok, with throughput and memory measured, and a loss the parity check did not flag."""
    steady: pd.DataFrame
    """Candidates not flagged "may be unstable": the only ones recommended on speed."""
    unstable: pd.DataFrame
    """Candidates flagged "may be unstable"."""
    flagged: pd.DataFrame
    """Ok rows whose loss the parity check flagged."""
    unmeasured: pd.DataFrame
    """Ok rows (not pruned) without a throughput or a memory figure: they cannot be ranked, and are said to be left
    out rather than silently missing from the answer."""
    tracks_unstable: bool
    """Whether the frame has the ``unstable`` column (a frame without it has no unstable rows)."""
    frugal: pd.DataFrame
    """The candidates with the trials an adaptive search pruned: pruned on speed, their memory is as measured as
    any other's, and the least memory is asked of all."""


def _pool(frame: pd.DataFrame) -> _Pool:
    ok = frame[frame["status"] == "ok"]
    measured = ok["samples_per_s"].notna() & ok["peak_gib"].notna()
    flagged_mask = ok["parity_flagged"].fillna(False).astype(bool)
    frugal = ok[measured & ~flagged_mask]  # pruned or not: a search prunes on speed
    kept = ok["pruned"].isna() if "pruned" in ok else measured | True  # an adaptive search found them slower
    unmeasured, flagged = ok[kept & ~measured], ok[kept & measured & flagged_mask]
    candidates = frugal[kept[frugal.index]]
    if "unstable" not in candidates:
        return _Pool(
            candidates=candidates, steady=candidates, unstable=candidates.iloc[0:0], flagged=flagged,
            unmeasured=unmeasured, tracks_unstable=False, frugal=frugal,
        )  # fmt: skip
    unstable_mask = candidates["unstable"].fillna(False).astype(bool)
    return _Pool(
        candidates=candidates, steady=candidates[~unstable_mask], unstable=candidates[unstable_mask],
        flagged=flagged, unmeasured=unmeasured, tracks_unstable=True, frugal=frugal,
    )  # fmt: skip


def _speed_lines(
    pool: _Pool, budget: int | None, source: str, evidence: SweepNoise
) -> tuple[pd.Series | None, list[Text], tuple[str, ...]]:
    """The speed recommendation: the fastest steady trial within the budget (None when there is none to name), the
    sentences that say it, and the trials tied with it."""
    candidates = pool.candidates
    where = _where(budget, source)
    contenders = candidates if budget is None else candidates[candidates["fit_gib"] * GIB <= budget]
    if contenders.empty:  # first: more runs, on however idle a machine, would not change it
        smallest = candidates.sort_values("fit_gib").iloc[0]
        line = rich(
            "No ok trial fits " + where + "; the smallest, **{name}**, needs {fit}.",
            name=smallest["trial"],
            fit=_fit_text(smallest),
        )
        return None, [line], ()
    by_speed = pool.steady.sort_values(["samples_per_s", "fit_gib"], ascending=[False, True], kind="stable")
    # A steady trial is recommended on speed only if no trial that may be unstable (and fits) measured faster: a
    # slower steady trial is not "the fastest", and the faster figure cannot be trusted.
    top = contenders.sort_values(["samples_per_s", "fit_gib"], ascending=[False, True], kind="stable").head(1)
    if pool.tracks_unstable and bool(top["unstable"].fillna(False).iloc[0]):
        line = rich(
            "No trial is recommended on speed " + where + ": the fastest by its figure, **{name}**, "
            "may be unstable (below), and no steady trial measured faster.",
            name=top["trial"].iloc[0],
        )
        return None, [line], ()
    if budget is None:
        return _fastest_lines(
            by_speed,
            evidence,
            "No memory budget: none was given (--memory-budget) and environment.json records no GPU memory; fastest "
            "overall:",
            by_speed,
        )
    return _fastest_lines(by_speed[by_speed["fit_gib"] * GIB <= budget], evidence, f"Fastest {where}:", by_speed)


def _memory_note(candidates: pd.DataFrame) -> Text:
    """What the memory figures are, and what no allocator figure holds (the CUDA context)."""
    if not candidates["peak_reserved_gib"].notna().any():
        return rich(
            "Only trials with status ok qualify. Memory here is each process's resident set high-water mark "
            "(CPU training), max over ranks."
        )
    outside = outside_allocator_gib(candidates)
    context = (
        f"NVML saw up to {outside:.3f} GiB per process outside it in these trials (NVML process use less "
        "reserved peak: the CUDA context and libraries)"
        if outside is not None
        else "it was not measured here (no NVML reading), so measure it on your device"
    )
    return rich(
        "Only trials with status ok qualify. A budget is checked against what the device had to hold: "
        "NVML's process memory where it was read, else the allocator's reserved peak, max over ranks; the "
        "CUDA context is in no allocator figure: {context}.",
        context=context,
    )


def _left_out_lines(pool: _Pool, frame: pd.DataFrame) -> list[Text]:
    """The ok trials not recommended, and why: may be unstable (not on speed), a loss the parity check flagged, or
    pruned by an adaptive search."""
    lines = []
    if "pruned" in frame and frame["pruned"].notna().any():
        names = ", ".join(str(name) for name in frame.loc[frame["pruned"].notna(), "trial"])
        lines.append(rich("Pruned by the adaptive search (How the search decided, below): {names}.", names=names))
    if not pool.unstable.empty:
        names = "; ".join(f"{r['trial']} ({r['unstable_reason']})" for _, r in pool.unstable.iterrows())
        lines.append(rich("Not recommended on speed because they may be unstable: {names}.", names=names))
    if not pool.flagged.empty:
        names = ", ".join(f"{r['trial']} ({r['parity_reason'] or 'flagged'})" for _, r in pool.flagged.iterrows())
        lines.append(rich("Left out because their loss was flagged by the parity check: {names}.", names=names))
    if not pool.unmeasured.empty:
        names = ", ".join(f"{r['trial']} ({_missing_figures(r)})" for _, r in pool.unmeasured.iterrows())
        lines.append(rich("Left out because a figure was not measured: {names}.", names=names))
    return lines


def _missing_figures(row: pd.Series) -> str:
    missing = [what for key, what in (("samples_per_s", "throughput"), ("peak_gib", "memory")) if is_missing(row[key])]
    return f"no {' and no '.join(missing)} figure"


def recommend(
    frame: pd.DataFrame, budget: int | None, source: str, evidence: SweepNoise | None = None
) -> Recommendation:
    """Only ok trials with throughput and memory measured, a loss the parity check did not flag, and not pruned by
    an adaptive search, qualify; a budget is checked against ``fit_gib`` (what the device had to hold: NVML process
    memory, else the allocator's reserved peak, else the peak). Trials flagged "may be unstable" are not recommended
    on speed. Ties (see :mod:`hfscale.report.noise`) are named as ties and broken by the other axis."""
    evidence = evidence if evidence is not None else sweep_noise({})
    pool = _pool(frame)
    if pool.candidates.empty:
        line = rich(
            "No trial qualifies (status ok, throughput and memory measured, a loss the parity check did not flag), so "
            "nothing can be recommended."
        )
        return Recommendation(
            budget_bytes=budget, budget_source=source, fastest=None, most_frugal=None,
            lines=(line, *_left_out_lines(pool, frame)), undecided="none_qualifies",
        )  # fmt: skip
    fastest, said, ties = _speed_lines(pool, budget, source, evidence)
    lines = list(said)
    if fastest is not None:
        lines += _other_job_lines(fastest, frame)
    frugal, said = _frugal_lines(pool.frugal, evidence)
    lines += said
    lines.append(_memory_note(pool.candidates))
    lines += _left_out_lines(pool, frame)
    fits = budget is None or bool((pool.candidates["fit_gib"] * GIB <= budget).any())
    return Recommendation(
        budget_bytes=budget,
        budget_source=source,
        fastest=None if fastest is None else str(fastest["trial"]),
        most_frugal=str(frugal["trial"]),
        lines=tuple(lines),
        fastest_ties=ties,
        undecided=None if fastest is not None else "unstable" if fits else "too_large",
    )


__all__ = ["Recommendation", "outside_allocator_gib", "pareto_front", "recommend"]
