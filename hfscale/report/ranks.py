"""A multi-machine run as the report shows it: each machine's environment, and each rank's memory with the machine
it ran on.

Both tables appear only when a run spans more than one machine (more than one ``machines/machine-{rank}.json``,
or a trial whose ranks ran on more than one machine), so a one-machine report reads as before. The estimate is a
per-device figure, so it is compared with the largest rank's peak (the trials table's ``peak_gib``); the table
here says which rank, on which machine, held it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hfscale.records.row import TrialResult
from hfscale.report.columns import Column, fmt
from hfscale.results.environment import MachineEnvironment


@dataclass(frozen=True, kw_only=True)
class RankPeak:
    """One rank's memory in a trial, with where it ran."""

    rank: int
    machine_rank: int | None
    """From the verification record's ``machine_rank_per_rank``; None where it was not read."""
    hostname: str | None
    peak_gib: float | None
    """The rank's training peak (CUDA allocated / CPU resident set)."""
    params_local: int | None
    """Parameter elements the rank held (``params_local_per_rank``); None where it was not read."""


def rank_peaks(row: TrialResult) -> list[RankPeak]:
    """Each rank's figures in one row, in rank order: memory from ``memory.per_rank``, machine, host and
    parameters held from the verification record's per-rank lists (missing entries are None)."""
    memory, verification = row.memory, row.verification
    per_rank = {r.rank: r for r in (memory.per_rank if memory else [])}
    machines = verification.machine_rank_per_rank if verification else []
    hosts = verification.hostname_per_rank if verification else []
    params = verification.params_local_per_rank if verification else []
    count = max([*(rank + 1 for rank in per_rank), len(machines), len(hosts), len(params)], default=0)

    def at(values: Sequence[Any], rank: int) -> Any:
        return values[rank] if rank < len(values) else None

    return [
        RankPeak(
            rank=rank,
            machine_rank=at(machines, rank),
            hostname=at(hosts, rank),
            peak_gib=per_rank[rank].peak_gib if rank in per_rank else None,
            params_local=at(params, rank),
        )
        for rank in range(count)
    ]


def spans_machines(row: TrialResult) -> bool:
    """Whether the row's ranks ran on more than one machine, as its verification record says."""
    verification = row.verification
    return verification is not None and len(set(verification.machine_rank_per_rank)) > 1


def rank_memory_records(groups: Sequence[tuple[str, Sequence[TrialResult]]]) -> list[dict[str, Any]]:
    """One record per multi-machine trial: each rank's peak grouped by machine, the rank that held the largest
    peak, and the estimate against it. Taken from the run with the largest peak, as the trials table's memory is.
    Empty when no trial spans machines."""
    out = []
    for name, group in groups:
        runs = [r for r in group if r.status == "ok"] or list(group)
        row = max(runs, key=lambda r: r.peak_gib if r.peak_gib is not None else -1.0)
        if not spans_machines(row):
            continue
        ranks = rank_peaks(row)
        by_machine: dict[int | None, list[RankPeak]] = {}
        for r in ranks:
            by_machine.setdefault(r.machine_rank, []).append(r)
        measured = [r for r in ranks if r.peak_gib is not None]
        top = max(measured, key=lambda r: r.peak_gib or 0.0) if measured else None
        predicted = row.predicted_gib
        peak = top.peak_gib if top is not None else None
        # the trials table's estimate_error_pct, against the same largest rank
        error = 100.0 * (predicted - peak) / peak if predicted is not None and peak else None
        out.append(
            {
                "trial": name,
                "machines": len([m for m in by_machine if m is not None]),
                "ranks": len(ranks),
                "per_machine": "; ".join(_machine_text(m, rs) for m, rs in by_machine.items()),
                "params_local": ", ".join(fmt(r.params_local) for r in ranks),
                "largest": None if top is None else _where(top),
                "peak_gib": peak,
                "predicted_gib": predicted,
                "estimate_error_pct": error,
            }
        )
    return out


def _where(r: RankPeak) -> str:
    machine = "?" if r.machine_rank is None else str(r.machine_rank)
    return f"rank {r.rank} (machine {machine}" + (f", {r.hostname})" if r.hostname else ")")


def _machine_text(machine: int | None, ranks: Sequence[RankPeak]) -> str:
    hosts = sorted({r.hostname for r in ranks if r.hostname})
    label = "machine ?" if machine is None else f"machine {machine}"
    if hosts:
        label += f" ({', '.join(hosts)})"
    peaks = ", ".join(f"r{r.rank} {fmt(r.peak_gib, 3)}" for r in ranks)
    return f"{label}: {peaks}"


RANK_COLUMNS = [
    Column(key="trial", header="trial", align="left"),
    Column(key="machines", header="machines"),
    Column(key="per_machine", header="peak per rank (GiB), by machine", align="left"),
    Column(key="params_local", header="parameters held per rank", align="left"),
    Column(key="largest", header="largest peak on", align="left", cell=lambda r: r.get("largest") or "—"),
    Column(key="peak_gib", header="largest peak (GiB)", unit="GiB", digits=3),
    Column(key="predicted_gib", header="estimate (GiB)", unit="GiB", digits=3),
    Column(key="estimate_error_pct", header="estimate vs largest (%)", unit="%", digits=1),
]

RANK_NOTE = (
    "Each rank's training peak (GPU: allocated by the caching allocator; CPU: resident set), grouped by the "
    "machine the verification record says it ran on (r2 is global rank 2), from the run with the largest peak. "
    "The estimate is per device, so it is compared with the largest rank's peak, as in the trials table; parameters "
    "held per rank show the sharding (hybrid_shard: one machine's share, replicated across machines)."
)


def _gpus_text(machine: MachineEnvironment) -> str:
    names: dict[str, int] = {}
    for gpu in machine.gpus:
        size = gpu.get("memory_total_gib")
        label = str(gpu.get("name", "?")) + (f" ({float(size):.1f} GiB)" if isinstance(size, int | float) else "")
        names[label] = names.get(label, 0) + 1
    return ", ".join(f"{n} x {label}" for label, n in names.items()) or "none"


def _driver_text(record: Mapping[str, Any]) -> str:
    keys = (("driver_version", "driver"), ("cuda_driver_version", "driver CUDA"), ("cuda_version", "torch CUDA"))
    return ", ".join(f"{label} {record[k]}" for k, label in keys if record.get(k)) or "—"


def _library_differences(machine: MachineEnvironment, main: MachineEnvironment) -> str:
    """The package versions that differ from machine 0's (a mixed cluster is a common cause of odd results)."""
    if machine is main:
        return "—"
    mine, theirs = machine.record.get("packages") or {}, main.record.get("packages") or {}
    differ = [f"{k} {mine.get(k) or 'none'}" for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    return ", ".join(differ) or "same as machine 0"


MACHINE_HEADERS = ("machine", "host", "GPUs", "driver / CUDA", "CPUs", "RAM", "libraries (vs machine 0)")


def machine_rows(machines: Sequence[MachineEnvironment]) -> list[tuple[str, ...]]:
    """One row of text per machine, by machine rank (the "Machines" table)."""
    if not machines:
        return []
    main = machines[0]
    rows = []
    for m in machines:
        record = m.record
        ram = record.get("host_memory_total_gib")
        rows.append(
            (
                str(m.machine_rank),
                m.hostname,
                _gpus_text(m),
                _driver_text(record),
                fmt(record.get("cpu_count")),
                f"{float(ram):.1f} GiB" if isinstance(ram, int | float) else "—",
                _library_differences(m, main),
            )
        )
    return rows


MACHINES_NOTE = (
    "Each machine's driver wrote its own record at sweep start (machines/machine-RANK.json in the run folder); "
    "the Environment section above is machine 0's. A memory budget taken from the records is the smallest GPU of "
    "any machine, since every rank must fit."
)


__all__ = [
    "MACHINES_NOTE",
    "MACHINE_HEADERS",
    "RANK_COLUMNS",
    "RANK_NOTE",
    "RankPeak",
    "machine_rows",
    "rank_memory_records",
    "rank_peaks",
    "spans_machines",
]
