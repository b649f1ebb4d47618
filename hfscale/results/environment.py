"""The environment a sweep ran in, as ``environment.json`` records it: machine, GPUs, library versions, commit; in a
multi-machine sweep each machine's own record as well (``machines/machine-{rank}.json``).

The sweep's own process never initialises CUDA (a context would hold GPU memory through every trial): GPUs are
read through NVML (``pynvml``, the ``gpu`` extra) and, where NVML is missing, in a short child process with torch.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from hfscale.core.files import utc_now, write_atomic
from hfscale.core.units import GIB
from hfscale.results.run_folder import MACHINES_DIR

logger = logging.getLogger(__name__)


PACKAGES: tuple[str, ...] = (
    "hfscale",
    "torch",
    "transformers",
    "accelerate",
    "deepspeed",
    "bitsandbytes",
    "datasets",
    "nvidia-ml-py",
    "nvidia-cublas-cu12",
    "nvidia-cublas",
    "nvidia-nccl-cu12",
    "nvidia-nccl-cu13",
)
"""Distributions whose versions are recorded (None when not installed). The cuBLAS and NCCL wheels are the ones a
pip-installed CUDA torch loads: their versions are the libraries' (torch reports NCCL's itself, not cuBLAS's)."""

ENV_VARS: tuple[str, ...] = (
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TORCH_EXTENSIONS_DIR",
    "NCCL_P2P_DISABLE",
    "NCCL_IB_DISABLE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "HF_HUB_OFFLINE",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
)
"""Environment variables that change what a trial measures, recorded when set."""

ENV_PREFIXES: tuple[str, ...] = ("OMP_", "NCCL_")
"""Every variable with one of these prefixes is recorded too (thread counts and affinity, NCCL's tuning)."""

_TORCH_PROBE = """
import json, torch
out = {"cuda_version": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "gpus": []}
# What fp32 matmuls run in unless a trial changes it (TrainingArguments.tf32 does): TF32 on Ampere and later.
out["matmul_precision"] = {
    "float32_matmul_precision": torch.get_float32_matmul_precision(),
    "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    "cuda_matmul_allow_bf16_reduced_precision_reduction":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    "cuda_matmul_allow_fp16_reduced_precision_reduction":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
}
if out["cuda_available"]:
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append({"index": i, "name": p.name, "memory_total_bytes": p.total_memory,
                            "memory_total_gib": p.total_memory / 2**30,
                            "compute_capability": f"{p.major}.{p.minor}"})
    out["cudnn_version"] = torch.backends.cudnn.version()
    try:
        nccl = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:
        out["nccl_version"] = None
print(json.dumps(out))
"""


def package_versions() -> dict[str, str | None]:
    """Installed versions of :data:`PACKAGES`, read from their metadata (nothing is imported)."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _nvml_gpus() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"nvml_error": "pynvml is not installed (pip install 'hfscale[gpu]')"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound and friends: no NVIDIA driver here
        return {"nvml_error": f"{type(exc).__name__}: {exc}"}
    try:
        out: dict[str, Any] = {"driver_version": _text(pynvml.nvmlSystemGetDriverVersion())}
        try:
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            out["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:  # older drivers
            pass
        visible = _visible_indices(pynvml.nvmlDeviceGetCount())
        gpus = []
        for index in visible:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            gpus.append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "memory_total_bytes": total,
                    "memory_total_gib": total / GIB,
                    **_nvml_device_facts(pynvml, handle),
                }
            )
        out["gpus"] = gpus
        return out
    finally:
        pynvml.nvmlShutdown()


def _nvml_read(read: Any, *args: Any) -> Any:
    """One NVML query, or None where the device or driver does not support it (NVMLError_NotSupported, ...)."""
    try:
        return read(*args)
    except Exception:  # pynvml raises a family of NVMLError subclasses
        return None


def _nvml_device_facts(pynvml: Any, handle: Any) -> dict[str, Any]:
    """UUID, power limit, clocks, ECC and MIG mode of one GPU: what makes two "H100" rows differ. Each fact is None
    where NVML cannot read it."""
    power_mw = _nvml_read(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    ecc = _nvml_read(pynvml.nvmlDeviceGetEccMode, handle)  # (current, pending)
    mig = _nvml_read(pynvml.nvmlDeviceGetMigMode, handle)  # (current, pending)
    clocks = {}
    for label, kind in (("sm", "NVML_CLOCK_SM"), ("memory", "NVML_CLOCK_MEM"), ("graphics", "NVML_CLOCK_GRAPHICS")):
        clock = getattr(pynvml, kind, None)
        if clock is not None:
            clocks[f"{label}_mhz"] = _nvml_read(pynvml.nvmlDeviceGetClockInfo, handle, clock)
            clocks[f"{label}_max_mhz"] = _nvml_read(pynvml.nvmlDeviceGetMaxClockInfo, handle, clock)
    uuid = _nvml_read(pynvml.nvmlDeviceGetUUID, handle)
    return {
        "uuid": _text(uuid) if uuid is not None else None,
        "power_limit_w": power_mw / 1000 if power_mw is not None else None,
        "clocks": clocks,
        "ecc_enabled": bool(ecc[0]) if isinstance(ecc, (tuple, list)) else None,
        "mig_enabled": bool(mig[0]) if isinstance(mig, (tuple, list)) else None,
    }


def _visible_indices(count: int) -> list[int]:
    """NVML indices of the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible (all when unset; UUIDs are not mapped)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    out = []
    for part in visible.split(","):
        part = part.strip()
        if not part.isdigit():
            return list(range(count))
        if int(part) < count:
            out.append(int(part))
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _torch_probe(python: str) -> dict[str, Any]:
    """CUDA facts from torch in a child process, so this process never holds a CUDA context."""
    try:
        done = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"torch_probe_error": str(exc)}
    if done.returncode != 0:
        return {"torch_probe_error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _driver_from_proc() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for word in text.split():
        if word[:1].isdigit() and "." in word:
            return word
    return None


def gpu_info(*, python: str = sys.executable) -> dict[str, Any]:
    """GPUs (index, name, ``memory_total_gib``), ``gpu_count``, driver and CUDA versions.

    NVML first; where it is missing, torch in a child process (skipped for a CPU-only torch build).
    """
    info = _nvml_gpus()
    torch_version = package_versions().get("torch")
    if torch_version is None or "+cpu" in torch_version:
        info.setdefault("gpus", [])
        info["cuda_version"] = None
    else:
        probe = _torch_probe(python)
        if "gpus" not in info:  # no NVML: torch's view, and the driver from /proc
            info["gpus"] = probe.get("gpus", [])
            if driver := _driver_from_proc():
                info["driver_version"] = driver
        info.update({k: v for k, v in probe.items() if k != "gpus"})
    info["gpu_count"] = len(info["gpus"])
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError):
        pass
    return None


def git_commit(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout holding ``path`` (default: hfscale's own source),
    or None outside a checkout or without git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())}


def hfscale_install() -> dict[str, Any]:
    """hfscale's version and commit, however it is installed: ``version`` from the package metadata (or, run from a
    source folder without installing, the package's ``__version__``), ``commit`` and ``dirty`` from git when the
    source folder is a checkout (an editable install or a clone), else None; ``source`` is that folder."""
    import hfscale

    try:
        version: str | None = metadata.version("hfscale")
    except metadata.PackageNotFoundError:
        version = getattr(hfscale, "__version__", None)
    source = Path(hfscale.__file__).resolve().parent
    commit = git_commit(source)
    return {
        "version": version,
        "commit": commit["commit"] if commit else None,
        "dirty": commit["dirty"] if commit else None,
        "source": str(source),
    }


def recorded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of :data:`ENV_VARS` and with a prefix of :data:`ENV_PREFIXES` that are set, sorted by name."""
    environ = dict(os.environ if environ is None else environ)
    return {k: environ[k] for k in sorted(environ) if k in ENV_VARS or k.startswith(ENV_PREFIXES)}


def gpu_memory_bytes(environment: dict[str, Any]) -> int | None:
    """The memory of one GPU of a run, in bytes, as :func:`collect_environment` recorded it; None without a GPU.

    Reads ``gpus[i].memory_total_bytes`` (written since 0.2), else ``gpus[i].memory_total_gib`` (the committed
    0.1 records). With several GPUs the smallest, since every rank must fit.
    """
    sizes = []
    for gpu in environment.get("gpus") or []:
        if not isinstance(gpu, dict):
            continue
        if isinstance(gpu.get("memory_total_bytes"), int):
            sizes.append(gpu["memory_total_bytes"])
        elif isinstance(gpu.get("memory_total_gib"), int | float):
            sizes.append(int(gpu["memory_total_gib"] * GIB))
    return min(sizes) if sizes else None


def collect_environment(*, python: str = sys.executable, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record written to ``environment.json``.

    Args:
        python: the interpreter the trials run with (its torch is the one probed).
        extra: more keys to record (the sweep adds its launch: processes, machines, command line).
    """
    record: dict[str, Any] = {
        "time": utc_now(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "interpreter": {
            "executable": python,
            "version": sys.version.split()[0] if python == sys.executable else None,
            "implementation": platform.python_implementation(),
        },
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_memory_total_gib": _memory_total_gib(),
    }
    record.update(gpu_info(python=python))
    record["packages"] = package_versions()
    install = hfscale_install()
    record["hfscale"] = install
    if record["packages"].get("hfscale") is None:
        record["packages"]["hfscale"] = install["version"]
    record["git"] = {"commit": install["commit"], "dirty": install["dirty"]} if install["commit"] else None
    record["env"] = recorded_env()
    record.update(extra or {})
    return record


@dataclass(frozen=True, kw_only=True)
class MachineEnvironment:
    """One machine's environment record in a multi-machine run (``machines/machine-{rank}.json``).

    ``environment.json`` is written by machine 0 only; each machine's driver writes its own record here at sweep
    start, so the report can list every machine's GPUs, driver and host, not only the main one's.
    """

    machine_rank: int
    """The machine's rank (accelerate's ``machine_rank``; 0 is the main machine)."""
    hostname: str
    """``socket.gethostname()`` on that machine."""
    record: dict[str, Any]
    """The full record, as :func:`collect_environment` gives it (plus ``hostname`` and ``machine_rank``)."""
    path: Path | None = None
    """Where it was read from; None for a record built in memory."""

    @property
    def gpus(self) -> list[dict[str, Any]]:
        return [g for g in self.record.get("gpus") or [] if isinstance(g, dict)]

    @property
    def gpu_memory_bytes(self) -> int | None:
        """The smallest GPU's memory on this machine (:func:`gpu_memory_bytes`); None without a GPU."""
        return gpu_memory_bytes(self.record)

    @classmethod
    def from_record(cls, record: dict[str, Any], *, path: Path | None = None) -> MachineEnvironment:
        """Build from a written record.

        Raises:
            ValueError: when ``machine_rank`` is not a non-negative integer or ``hostname`` is not a string.
        """
        where = f"{path}: " if path is not None else ""
        rank = record.get("machine_rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"{where}machine_rank: expected a non-negative integer, got {rank!r}")
        hostname = record.get("hostname")
        if not isinstance(hostname, str):
            raise ValueError(f"{where}hostname: expected the machine's host name (a string), got {hostname!r}")
        return cls(machine_rank=rank, hostname=hostname, record=dict(record), path=path)


def machine_environment_path(run_dir: str | os.PathLike[str], machine_rank: int) -> Path:
    """``RUN_DIR/machines/machine-{rank}.json``."""
    return Path(run_dir) / MACHINES_DIR / f"machine-{machine_rank}.json"


def write_machine_environment(
    run_dir: str | os.PathLike[str],
    machine_rank: int,
    *,
    record: dict[str, Any] | None = None,
    hostname: str | None = None,
    python: str = sys.executable,
) -> Path:
    """Write this machine's environment record to ``machines/machine-{rank}.json`` of a run folder; returns it.

    Every machine's sweep driver calls this at sweep start (machine 0 too), so the report lists each machine's
    GPUs, driver and host. The write is atomic (:func:`hfscale.core.files.write_atomic`): a report reading while a
    machine writes sees the old record or the new one, never half of one.

    Args:
        record: the record :func:`collect_environment` already gave this process (the sweep has one for
            ``environment.json``); None collects it now, probing ``python``'s torch.
        hostname: the machine's host name; None is this process's (``socket.gethostname()``). Give it when
            machine 0 writes a record another machine sent it (that record's ``host``).

    Raises:
        ValueError: when ``machine_rank`` is not a non-negative integer.
        OSError: when the folder cannot be written.
    """
    if isinstance(machine_rank, bool) or not isinstance(machine_rank, int) or machine_rank < 0:
        raise ValueError(f"machine_rank: expected a non-negative integer (0 is the main machine), got {machine_rank!r}")
    data = dict(record) if record is not None else collect_environment(python=python)
    data["hostname"] = hostname if hostname is not None else socket.gethostname()
    data["machine_rank"] = machine_rank
    path = machine_environment_path(run_dir, machine_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the temporary file has the pid in its name: two drivers that claim the same rank never share one
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def read_machine_environments(run_dir: str | os.PathLike[str]) -> list[MachineEnvironment]:
    """Every machine's record of a run folder, by machine rank; empty when it has none (one-machine runs and
    runs written before hfscale kept them).

    Raises:
        ValueError: when a record is not valid JSON or lacks its rank or host name (the message names the file).
    """
    folder = Path(run_dir) / MACHINES_DIR
    if not folder.is_dir():
        return []
    machines = []
    for path in sorted(folder.glob("machine-*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot be read as a machine's environment record: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object (a machine's environment record), got {type(data)}")
        machines.append(MachineEnvironment.from_record(data, path=path))
    return sorted(machines, key=lambda m: m.machine_rank)


__all__ = [
    "ENV_PREFIXES",
    "ENV_VARS",
    "MACHINES_DIR",
    "PACKAGES",
    "MachineEnvironment",
    "collect_environment",
    "git_commit",
    "gpu_info",
    "gpu_memory_bytes",
    "hfscale_install",
    "machine_environment_path",
    "package_versions",
    "read_machine_environments",
    "recorded_env",
    "write_machine_environment",
]
