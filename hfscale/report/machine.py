"""Where a run ran, as the report shows ``environment.json``: the header lines and the full record.

The GPU memory a budget defaults to is read by :func:`hfscale.results.environment.gpu_memory_bytes`, beside the writer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hfscale.core.units import GIB


def format_bytes(size_bytes: int | float) -> str:
    """``17179869184`` -> ``16 GiB``; the form a report prints a budget in."""
    gib = size_bytes / GIB
    return f"{gib:.3g} GiB" if gib >= 1 else f"{size_bytes / 2**20:.4g} MiB"


def env_items(environment: Mapping[str, Any]) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []
    for key, value in environment.items():
        if isinstance(value, Mapping) and value and all(not isinstance(v, Mapping | list) for v in value.values()):
            items += [(f"{key}.{k}", "—" if v is None else str(v)) for k, v in value.items()]
        elif isinstance(value, Mapping | list):
            items.append((str(key), json.dumps(value, sort_keys=True)))
        else:
            items.append((str(key), "—" if value is None else str(value)))
    return items


def _gib_text(value: Any) -> str:
    return f"{float(value):.1f} GiB" if isinstance(value, int | float) and not isinstance(value, bool) else "?"


def env_header(environment: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The few lines that say where a run ran, from the keys ``hfscale.results.environment`` writes: machine, GPUs,
    driver and CUDA, library versions, Python, commit, time. Empty when the record has none of those keys."""
    env = environment
    rows: list[tuple[str, str]] = []
    machine = [str(env[k]) for k in ("host", "cpu_model") if env.get(k)]
    if env.get("cpu_count"):
        machine.append(f"{env['cpu_count']} CPUs")
    if env.get("host_memory_total_gib") is not None:
        machine.append(f"{_gib_text(env['host_memory_total_gib'])} RAM")
    if machine:
        rows.append(("machine", ", ".join(machine)))
    if isinstance(env.get("gpus"), list):
        names: dict[str, int] = {}
        for gpu in env["gpus"]:
            if isinstance(gpu, Mapping):
                label = f"{gpu.get('name', '?')} ({_gib_text(gpu.get('memory_total_gib'))})"
                names[label] = names.get(label, 0) + 1
        rows.append(("GPUs", ", ".join(f"{n} x {label}" for label, n in names.items()) or "none"))
    driver = [f"{label} {env[k]}" for k, label in _DRIVER_KEYS if env.get(k)]
    if driver:
        rows.append(("driver / CUDA", ", ".join(driver)))
    if isinstance(env.get("packages"), Mapping):
        versions = [f"{name} {v}" for name, v in env["packages"].items() if v]
        rows.append(("libraries", ", ".join(versions) or "?"))
    if env.get("python"):
        rows.append(("python", f"{env['python']}" + (f" on {env['platform']}" if env.get("platform") else "")))
    git = env.get("git")
    if isinstance(git, Mapping) and git.get("commit"):
        rows.append(("commit", str(git["commit"])[:12] + (" (with uncommitted changes)" if git.get("dirty") else "")))
    if env.get("time"):
        rows.append(("started", str(env["time"])))
    return rows


_DRIVER_KEYS = (
    ("driver_version", "driver"),
    ("cuda_driver_version", "driver CUDA"),
    ("cuda_version", "torch CUDA"),
    ("cudnn_version", "cuDNN"),
)


__all__ = ["env_header", "env_items", "format_bytes"]
