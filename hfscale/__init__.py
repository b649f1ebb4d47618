"""hfscale: measure what each memory/throughput technique costs and saves for a Hugging Face Trainer run.

The public names are imported lazily so that ``hfscale --help`` and config generation do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

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
    "make_classification_dataset": "hfscale.data",
    "make_causal_lm_dataset": "hfscale.data",
    "load_run": "hfscale.report",
    "compare_runs": "hfscale.report",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hfscale' has no attribute {name!r}")
