"""The adaptive search's first step, before anything runs: skip a trial whose predicted peak cannot fit the budget,
even if the estimate over-predicts by as much as it has been measured to (``docs/search.md``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_SKIP_MARGIN = 0.25
"""How much the estimate may over-predict a peak before a run says so: 25%, the largest over-prediction in the
rows of ``results/bert_large-h100`` (bs4-adafactor: 5.62 GiB predicted, 4.50 GiB measured peak allocated; its
estimate was made before the rule of ``docs/estimate.md`` was fitted). ``tests/sweep/test_search.py`` recomputes it
from those rows. A run's own rows widen it when the estimate over-predicts more there."""


def skip_margin(errors: Sequence[float]) -> float:
    """How much the estimate may over-predict: the largest over-prediction measured in this run (``errors``:
    predicted / measured - 1 of its ok rows), and never less than :data:`DEFAULT_SKIP_MARGIN`."""
    return max([DEFAULT_SKIP_MARGIN, *(e for e in errors if math.isfinite(e))])


def skip_by_estimate(predicted_gib: float | None, budget_gib: float | None, margin: float) -> str | None:
    """Why a trial is not run: its predicted peak does not fit ``budget_gib`` even if the estimate over-predicts by
    ``margin``; None when it may fit (or there is no estimate or no budget)."""
    if predicted_gib is None or budget_gib is None:
        return None
    lowest = predicted_gib / (1 + margin)
    if lowest <= budget_gib:
        return None
    return (
        f"predicted peak {predicted_gib:.2f} GiB: even {margin:.0%} below it ({lowest:.2f} GiB, the estimate's "
        f"largest measured over-prediction) it does not fit the budget of {budget_gib:.2f} GiB"
    )


__all__ = ["DEFAULT_SKIP_MARGIN", "skip_by_estimate", "skip_margin"]
