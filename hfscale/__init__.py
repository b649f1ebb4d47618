"""hfscale: measure what each memory/throughput technique costs and saves for a Hugging Face Trainer run.

The public names are imported lazily so that ``hfscale --help`` and config generation do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.4.0.dev0"
"""The one source of hfscale's version: ``pyproject.toml`` reads it (``dynamic = ["version"]``), the installed
metadata and ``environment.json`` carry it. Bump it with each release (``X.Y.0.dev0`` while X.Y is in progress)."""

_EXPORTS = {
    "MemoryCallback": "hfscale.callbacks",
    "ThroughputCallback": "hfscale.callbacks",
    "VerificationCallback": "hfscale.callbacks",
    "MemorySummary": "hfscale.callbacks",
    "ThroughputSummary": "hfscale.callbacks",
    "Strategy": "hfscale.strategy",
    "DeepSpeedSpec": "hfscale.strategy",
    "FsdpSpec": "hfscale.strategy",
    "StrategyError": "hfscale.strategy",
    "make_classification_dataset": "hfscale.workload.data",
    "make_causal_lm_dataset": "hfscale.workload.data",
    "load_run": "hfscale.report",
    "compare_runs": "hfscale.report",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hfscale' has no attribute {name!r}")
