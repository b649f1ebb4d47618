"""The batch search: its walk against scripted probes, and against real training steps under a memory cap."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from hfscale.batch_search import (
    BatchSearchResult,
    ProbeOutcome,
    find_max_batch,
    looks_like_oom,
    suggest_start_batch,
)
from hfscale.estimate import estimate_memory
from hfscale.spec import DataSpec, ModelSpec, TrialSpec
from hfscale.strategy import Strategy


def _scripted(limit: int, *, error_at: int | None = None):
    calls: list[int] = []

    def probe(batch: int) -> ProbeOutcome:
        calls.append(batch)
        if error_at is not None and batch >= error_at:
            return ProbeOutcome(status="error", reason="RuntimeError: NCCL timeout")
        if batch <= limit:
            return ProbeOutcome(status="fits", samples_per_s=10.0 * batch)
        return ProbeOutcome(status="oom", reason="CUDA out of memory")

    return probe, calls


def _assert_bracketed(result: BatchSearchResult, limit: int) -> None:
    outcomes = {p.batch_size: p.outcome.status for p in result.probes}
    assert result.max_batch_size == limit
    assert outcomes[limit] == "fits"
    assert outcomes[limit + 1] == "oom"


@pytest.mark.parametrize("start", [1, 3, 16, 37, 100, 500])
@pytest.mark.parametrize("limit", [1, 5, 37, 64, 300])
def test_finds_the_limit_from_any_start(start, limit):
    probe, calls = _scripted(limit)
    result = find_max_batch(probe, start=start, upper_limit=4096)
    _assert_bracketed(result, limit)
    assert len(calls) == len(set(calls)), "a size is never probed twice"
    assert result.first_oom_batch_size == limit + 1
    assert result.samples_per_s == 10.0 * limit


def test_start_near_the_limit_takes_few_probes():
    probe, calls = _scripted(100)
    find_max_batch(probe, start=90)
    assert len(calls) <= 2 + 7  # 90 fits, 180 oom, then bisect 90..180


def test_nothing_fits():
    probe, calls = _scripted(0)
    result = find_max_batch(probe, start=8)
    assert result.max_batch_size is None
    assert result.first_oom_batch_size == 1
    assert calls == [8, 4, 2, 1]


def test_upper_limit_caps_the_walk():
    probe, calls = _scripted(10_000)
    result = find_max_batch(probe, start=3, upper_limit=20)
    assert result.max_batch_size == 20 and result.reached_upper_limit
    assert max(calls) == 20


def test_an_error_stops_the_search_with_its_reason():
    probe, calls = _scripted(100, error_at=40)
    result = find_max_batch(probe, start=10)
    assert result.max_batch_size == 20
    assert result.stopped_reason == "batch 40: RuntimeError: NCCL timeout"
    assert calls == [10, 20, 40]
    assert [p["status"] for p in result.to_dict()["probes"]] == ["fits", "fits", "error"]


def test_multiple_of_stops_at_the_granularity():
    probe, calls = _scripted(45)
    result = find_max_batch(probe, start=8, multiple_of=8)
    assert result.max_batch_size == 40
    assert all(b % 8 == 0 for b in calls)


def test_suggested_start_is_what_the_estimate_says_fits():
    spec = TrialSpec(
        name="t",
        strategy=Strategy(device="cuda", per_device_batch_size=8),
        model=ModelSpec(type="bert", config={"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}),
        data=DataSpec(seq_len=256),
    )
    budget = 4 * 1024**3
    start = suggest_start_batch(spec, budget, reserve_bytes=0)

    def total(batch: int) -> int:
        return estimate_memory(spec, spec.strategy.replace(per_device_batch_size=batch)).total_bytes

    assert total(start) <= budget < total(start + 1)


# ---------------------------------------------------------------------------------------------------------------
# real training steps under RLIMIT_AS
# ---------------------------------------------------------------------------------------------------------------

_TRAIN_STEP = r"""
import re, sys, time
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=2, dim_feedforward=128, dropout=0.1, batch_first=True)
model = torch.nn.ModuleDict({
    "embed": torch.nn.Embedding(1000, 64),
    "encoder": torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
    "head": torch.nn.Linear(64, 2),
})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for batch in map(int, sys.argv[1:]):  # several sizes in one process only to calibrate
    ids = torch.randint(0, 1000, (batch, 256))
    labels = torch.randint(0, 2, (batch,))
    start = time.perf_counter()
    for _ in range(2):
        hidden = model["encoder"](model["embed"](ids))
        loss = torch.nn.functional.cross_entropy(model["head"](hidden[:, 0]), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    peak = re.search(r"VmPeak:\s+(\d+) kB", open("/proc/self/status").read()).group(1)
    print(f"batch={batch} samples_per_s={2 * batch / elapsed:.3f} vm_peak_kb={peak}")
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # one thread, one arena, and every large block mmapped (freed at once): the address space follows live tensors
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536")
    return env


def _run_step(*batches: int, cap_bytes: int | None) -> subprocess.CompletedProcess:
    def limit() -> None:
        if cap_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    return subprocess.run(
        [sys.executable, "-c", _TRAIN_STEP, *map(str, batches)],
        capture_output=True,
        text=True,
        env=_child_env(),
        preexec_fn=limit,
        timeout=120,
        check=False,
    )


def _fields(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in (item.split("=") for item in line.split())}


def _rlimit_probe(cap_bytes: int):
    def probe(batch: int) -> ProbeOutcome:
        proc = _run_step(batch, cap_bytes=cap_bytes)
        if proc.returncode == 0:
            return ProbeOutcome(status="fits", samples_per_s=_fields(proc.stdout)["samples_per_s"])
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return ProbeOutcome(status="oom" if looks_like_oom(proc.stderr) else "error", reason=last)

    return probe


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_search_finds_the_real_limit_under_a_memory_cap():
    # calibrate: address space of training steps at batch 1, then 2, without a cap
    proc = _run_step(1, 2, cap_bytes=None)
    assert proc.returncode == 0, proc.stderr
    vm = {int(f["batch"]): f["vm_peak_kb"] * 1024 for f in map(_fields, proc.stdout.splitlines())}
    per_sample = vm[2] - vm[1]
    assert per_sample > 1024**2, "a sample should cost megabytes (s^2 attention scores)"
    cap = int(vm[1] + 11.5 * per_sample)

    result = find_max_batch(_rlimit_probe(cap), start=8, upper_limit=64)
    assert result.stopped_reason is None, result.to_dict()
    limit = result.max_batch_size
    assert limit is not None and 2 <= limit < 64, result.to_dict()
    _assert_bracketed(result, limit)
    oom_reasons = [p.outcome.reason for p in result.probes if p.outcome.status == "oom"]
    assert oom_reasons and all("can't allocate memory" in r for r in oom_reasons), oom_reasons


def test_looks_like_oom():
    assert looks_like_oom("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    assert looks_like_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not looks_like_oom("RuntimeError: shape mismatch")
