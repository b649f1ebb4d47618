"""Memory probes: what one process holds now and at its peak, on a CUDA device or on the CPU.

Three sources, each read where it is cheap and never on every step:

- CUDA: the torch caching allocator (``torch.cuda.memory_allocated`` / ``max_memory_allocated``, reserved, and the
  ``num_alloc_retries`` / ``num_ooms`` counters of ``torch.cuda.memory_stats``). Reading them does not synchronise.
- CPU: the kernel's resident-set figures for this process (``VmRSS`` and the high-water mark ``VmHWM`` in
  ``/proc/self/status``). Writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark to the current RSS,
  so a peak can be taken over one phase of training instead of the process's whole life (``ru_maxrss`` cannot be
  reset, so it is never used).
- NVML: the driver's view of a device (memory used by this process and by the whole device), which includes the
  CUDA context and anything allocated outside torch. Optional (``pip install hfscale[gpu]``); every failure
  (library missing, no permission, no such device) gives None.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from hfscale.core.units import parse_memory_size, to_gib

logger = logging.getLogger(__name__)


_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"


# --------------------------------------------------------------------------------------------------------------
# CPU: /proc/self/status
# --------------------------------------------------------------------------------------------------------------


def _read_status_kib(field: str) -> int | None:
    try:
        with open(_PROC_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])  # "VmRSS:\t  123456 kB"
    except OSError:
        return None
    return None


def cpu_rss_bytes() -> int | None:
    """This process's resident set size now (``VmRSS``), or None where ``/proc`` is missing (not Linux)."""
    kib = _read_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def cpu_peak_rss_bytes() -> int | None:
    """This process's peak resident set size since start or since :func:`reset_cpu_peak_rss` (``VmHWM``)."""
    kib = _read_status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_cpu_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False (and a warning) where that is not possible.

    Costs one small write to ``/proc`` (tens of microseconds). It resets the mark for the whole process (all
    threads share one address space), which is what a peak for one training run wants.
    """
    try:
        with open(_PROC_CLEAR_REFS, "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError as exc:
        logger.warning("cannot reset the RSS high-water mark (%s); CPU peaks are since process start", exc)
        return False
    return True


# --------------------------------------------------------------------------------------------------------------
# NVML
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NvmlMemory:
    """One reading of the driver's view of a device's memory."""

    process_used_bytes: int | None
    """Memory the driver attributes to this process (context included); None where the driver lists no process
    with this pid, as in a container with its own pid namespace."""
    device_used_bytes: int
    """Memory used on the whole device, by every process."""
    device_total_bytes: int


def _nvml_handle(pynvml: Any, device_index: int) -> Any:
    """The NVML handle of torch's CUDA device ``device_index``, matched by UUID (NVML ignores CUDA_VISIBLE_DEVICES)."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    except Exception:  # torch without CUDA, or a build without the uuid property
        uuid = None
    if uuid is not None:
        text = str(uuid)
        for candidate in (text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}", text):
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(candidate)
            except pynvml.NVMLError:
                continue
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device_index
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if device_index < len(entries) and entries[device_index].isdigit():
            index = int(entries[device_index])
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_memory(device_index: int) -> NvmlMemory | None:
    """NVML's view of CUDA device ``device_index`` (torch numbering), or None where NVML is not usable.

    None when ``pynvml`` (``pip install hfscale[gpu]``) is not installed, the NVML library is missing
    (``NVMLError_LibraryNotFound`` on a machine without a driver), or any NVML call fails. Never raises.
    """
    try:
        import pynvml
    except ImportError:
        logger.debug("pynvml is not installed (pip install hfscale[gpu]); no NVML memory figures")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.debug("NVML unavailable: %s", exc)
        return None
    try:
        handle = _nvml_handle(pynvml, device_index)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        process_used: int | None = None
        pid = os.getpid()
        try:
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError as exc:  # e.g. NotSupported on some vGPU / MIG set-ups: keep the device figures
            logger.debug("NVML process list unavailable: %s", exc)
            processes = []
        for proc in processes:
            used = getattr(proc, "usedGpuMemory", None)
            if proc.pid == pid and isinstance(used, int):
                process_used = (process_used or 0) + used
        return NvmlMemory(
            process_used_bytes=process_used, device_used_bytes=int(info.used), device_total_bytes=int(info.total)
        )
    except pynvml.NVMLError as exc:
        logger.debug("NVML query failed: %s", exc)
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


# --------------------------------------------------------------------------------------------------------------
# Probes: one interface over the two allocators
# --------------------------------------------------------------------------------------------------------------


class MemoryProbe(Protocol):
    """What :class:`~hfscale.callbacks.MemoryCallback` reads; one implementation per device kind."""

    device: str

    def current_bytes(self) -> int | None:
        """Memory held now (CUDA: allocated by tensors; CPU: RSS)."""
        ...

    def peak_bytes(self) -> int | None:
        """Peak held since the last :meth:`reset_peak` (CUDA: allocated; CPU: RSS)."""
        ...

    def peak_reserved_bytes(self) -> int | None:
        """Peak reserved by the caching allocator since the last reset; None on CPU."""
        ...

    def reset_peak(self) -> None: ...

    def counters(self) -> tuple[int | None, int | None]:
        """Cumulative (allocator retries, out-of-memory errors); (None, None) on CPU."""
        ...

    def nvml(self) -> NvmlMemory | None: ...


class CpuProbe:
    """Process RSS from ``/proc/self/status``; the peak is ``VmHWM``, reset through ``/proc/self/clear_refs``."""

    device = "cpu"

    def current_bytes(self) -> int | None:
        return cpu_rss_bytes()

    def peak_bytes(self) -> int | None:
        return cpu_peak_rss_bytes()

    def peak_reserved_bytes(self) -> int | None:
        return None

    def reset_peak(self) -> None:
        reset_cpu_peak_rss()

    def counters(self) -> tuple[int | None, int | None]:
        return None, None

    def nvml(self) -> NvmlMemory | None:
        return None


class CudaProbe:
    """The torch caching allocator of one CUDA device. No call here synchronises the device."""

    device = "cuda"

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index

    def current_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.memory_allocated(self.device_index))

    def peak_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device_index))

    def peak_reserved_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_reserved(self.device_index))

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device_index)

    def counters(self) -> tuple[int | None, int | None]:
        import torch

        stats = torch.cuda.memory_stats(self.device_index)
        return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0))

    def nvml(self) -> NvmlMemory | None:
        return nvml_memory(self.device_index)


def probe_for(device: Any) -> MemoryProbe:
    """The probe for a ``torch.device`` (or its string): :class:`CudaProbe` for CUDA, :class:`CpuProbe` otherwise."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaProbe(dev.index if dev.index is not None else torch.cuda.current_device())
    return CpuProbe()


__all__ = [
    "CpuProbe",
    "CudaProbe",
    "MemoryProbe",
    "NvmlMemory",
    "cpu_peak_rss_bytes",
    "cpu_rss_bytes",
    "nvml_memory",
    "parse_memory_size",
    "probe_for",
    "reset_cpu_peak_rss",
    "to_gib",
]
