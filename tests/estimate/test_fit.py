"""hfscale.estimate.fit: the predicted peak plus the reserve against a budget, and the reason a trial is skipped."""

from __future__ import annotations

import pytest

from hfscale.core.units import GIB, parse_memory_size
from hfscale.estimate import CUDA_CONTEXT_BYTES, MemoryEstimate, predict_fit, predicted_to_fit
from hfscale.strategy import Strategy
from hfscale.workload.spec import DataSpec, ModelSpec, TrialSpec


def test_memory_budget_strings():
    assert parse_memory_size("80GiB") == 80 * GIB
    assert parse_memory_size("16GB") == 16 * 10**9
    assert parse_memory_size("512 MiB") == 512 * 1024**2
    with pytest.raises(ValueError, match="expected a number and a unit"):
        parse_memory_size("1024")
    with pytest.raises(ValueError, match="expected a number and a unit"):
        parse_memory_size("lots")


def test_predicted_to_fit_counts_the_cuda_context():
    est = MemoryEstimate(
        weights_gib=1, gradients_gib=1, optimizer_gib=2, activations_gib=1, overhead_gib=0, total_gib=5
    )
    assert predicted_to_fit(est, 5 * GIB + CUDA_CONTEXT_BYTES)
    assert not predicted_to_fit(est, 5 * GIB)
    assert predicted_to_fit(est, 5 * GIB, reserve_bytes=0)
    on_cpu = MemoryEstimate(
        weights_gib=1, gradients_gib=1, optimizer_gib=2, activations_gib=1, overhead_gib=0, total_gib=5, device="cpu"
    )
    assert predicted_to_fit(on_cpu, 5 * GIB)  # no CUDA context on the CPU


def _big_trial() -> TrialSpec:
    return TrialSpec(
        name="big",
        strategy=Strategy(per_device_batch_size=64),
        model=ModelSpec(type="bert", config={"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}),
        data=DataSpec(seq_len=512),
    )


def test_predict_fit_gives_a_skip_reason():
    spec = _big_trial()
    small = predict_fit(spec, 80 * GIB)
    tight = predict_fit(spec, GIB)
    assert small.fits and small.reason is None
    assert not tight.fits
    assert f"{tight.estimate.total_gib:.2f} GiB" in tight.reason and "budget 1.00 GiB" in tight.reason
    # the default reserve is labelled an assumption where a user reads it
    assert f"+ {CUDA_CONTEXT_BYTES / GIB:.2f} GiB CUDA context (assumed, V100 reference)" in tight.reason
    assert set(tight.estimate.to_dict()) >= {
        "weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "overhead_gib", "total_gib"
    }  # fmt: skip


def test_predict_fit_names_a_measured_reserve_as_such():
    reason = predict_fit(_big_trial(), GIB, reserve_bytes=GIB // 2).reason
    assert "+ 0.50 GiB reserve >" in reason and "assumed" not in reason
