"""Typed rows and run folders for the report tests (imported by tests/test_report_*.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hfscale.estimate import MemoryEstimate
from hfscale.measure.verify import VerificationRecord
from hfscale.records.activity import MachineActivity
from hfscale.records.measurements import MemorySummary, ThroughputSummary
from hfscale.records.parity import ParityResult
from hfscale.records.row import TrialOutcome, TrialResult
from hfscale.results.run_folder import RunFolder
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy


def memory(
    peak: float,
    *,
    load: float,
    fwd: float,
    bwd: float,
    opt: float | None,
    reserved: float | None = None,
    world_size: int = 1,
    notes: list[str] | None = None,
) -> MemorySummary:
    phases = {"model_load": load, "forward": fwd, "backward": bwd, "optimizer_step": opt}
    return MemorySummary(
        device="cuda",
        world_size=world_size,
        peak_gib=peak,
        peak_reserved_gib=reserved,
        phases_gib=phases,
        phase_peaks_gib={k: None if v is None else v * 1.1 for k, v in phases.items()},
        alloc_retries=0,
        ooms=0,
        nvml_process_used_gib=None,
        nvml_device_used_gib=None,
        notes=list(notes or []),
    )


def throughput(samples_per_s: float, *, world_size: int = 1, mfu: float | None = 0.31) -> ThroughputSummary:
    return ThroughputSummary(
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * 512,
        step_time_median_s=8 / samples_per_s,
        step_time_p90_s=9 / samples_per_s,
        step_time_mean_s=8.5 / samples_per_s,
        measured_steps=20,
        warmup_steps=5,
        samples_per_step=8,
        tokens_per_sample=512,
        world_size=world_size,
        flops_per_token=2.0e9,
        mfu=mfu,
        peak_flops_per_s=None if mfu is None else 989.5e12,
        device_name="NVIDIA H100 80GB HBM3",
    )


def verification(strategy: Strategy, state_dtypes: list[str]) -> VerificationRecord:
    return VerificationRecord(
        distributed_type="NO",
        world_size=strategy.num_processes,
        device="cuda",
        mixed_precision="no" if strategy.precision == "fp32" else strategy.precision,
        wrapper="none",
        wrapper_class="BertForSequenceClassification",
        params_total=1000,
        optimizer_state_dtypes=state_dtypes,
    )


def estimate(total: float) -> MemoryEstimate:
    return MemoryEstimate(
        weights_gib=1.5, gradients_gib=1.5, optimizer_gib=3.0, activations_gib=0.6, overhead_gib=0.3, total_gib=total
    )


def ok_row(name: str, strategy: Strategy, speed: float, peak: float, **kw: Any) -> TrialResult:
    """An ok row: weights 0.2, activations 0.2, gradients 0.2, optimizer 0.3 of the peak; 0.1 left for the rest."""
    mem = kw.pop("memory", None) or memory(
        peak,
        load=0.2 * peak,
        fwd=0.4 * peak,
        bwd=0.4 * peak,
        opt=0.7 * peak,
        reserved=kw.pop("reserved", peak * 1.05),
        world_size=strategy.num_processes,
    )
    measured = TrialOutcome(
        trial=name,
        status="ok",
        train_runtime_s=100.0 / speed,
        train_samples_per_second=speed * 0.93,
        loss_curve=kw.pop("loss_curve", [0.75, 0.72, 0.70 - speed / 1000]),
        memory=mem,
        throughput=throughput(speed, world_size=strategy.num_processes, mfu=kw.pop("mfu", 0.31)),
        verification=kw.pop("verification", None),
        world_size=strategy.num_processes,
    )
    return TrialResult(
        trial=name,
        strategy=strategy,
        description=strategy.describe(),
        status="ok",
        wall_time_s=100.0 / speed + 7.25,
        measured=measured,
        **kw,
    )


def constructed_rows() -> list[TrialResult]:
    """Hand-made case: bf16 (15/s, 6 GiB) and zero3 (12/s, 3 GiB) form the Pareto front; fsdp (not_applied) is
    faster and smaller than both but must never count."""
    base = Strategy(name="baseline")
    fsdp = ok_row("fsdp", base.replace(name="fsdp", fsdp=FsdpSpec(), num_processes=2), 20.0, 2.0)
    fsdp.status, fsdp.reason = "not_applied", "asked for FSDP2 full_shard, ran DDP: accelerate does not switch to FSDP"
    return [
        ok_row("baseline", base, 10.0, 8.0, is_baseline=True),
        ok_row("grad_ckpt", base.replace(name="grad_ckpt", gradient_checkpointing=True), 7.0, 5.0),
        ok_row("bf16", base.replace(name="bf16", precision="bf16"), 15.0, 6.0, reserved=6.0, estimate=estimate(6.9)),
        ok_row(
            "zero3",
            base.replace(name="zero3", deepspeed=DeepSpeedSpec(zero_stage=3), num_processes=2),
            12.0,
            3.0,
            parity=ParityResult(flagged=False, compared=True, baseline="baseline"),
        ),
        ok_row("adam8bit", base.replace(name="adam8bit", optimizer="adamw_bnb_8bit"), 9.0, 7.0, mfu=None),
        fsdp,
        TrialResult(
            trial="big_batch",
            strategy=base.replace(name="big_batch", per_device_batch_size=64),
            status="oom",
            reason="CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)",
            exit_code=1,
            stderr_tail="Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory",
        ),
        TrialResult(
            trial="ddp",
            strategy=base.replace(name="ddp", num_processes=2),
            status="crashed",
            reason="exit code -9 (SIGKILL) <killed> & 'gone'",
            exit_code=-9,
        ),
        TrialResult(
            trial="offload",
            strategy=base.replace(name="offload", deepspeed=DeepSpeedSpec(zero_stage=2, offload_optimizer="cpu")),
            status="skipped",
            reason="deepspeed is not installed: pip install 'hfscale[deepspeed]'",
        ),
    ]


H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_gib": 79.1}
ENV = {  # as hfscale.results.environment.collect_environment writes it
    "time": "2026-11-20T10:00:00+00:00",
    "host": "node-7",
    "platform": "Linux-5.15-x86_64-with-glibc2.35",
    "python": "3.11.7",
    "cpu_model": "Intel(R) Xeon(R) Platinum 8480+",
    "cpu_count": 224,
    "host_memory_total_gib": 2015.6,
    "driver_version": "550.54.15",
    "cuda_driver_version": "12.4",
    "gpus": [{"index": 0, **H100}, {"index": 1, **H100}],
    "gpu_count": 2,
    "cuda_version": "12.4",
    "packages": {"hfscale": "0.1.0", "torch": "2.6.0", "transformers": "4.56.0", "bitsandbytes": None},
    "git": {"commit": "abc1234def5678", "dirty": False},
    "env": {"CUDA_VISIBLE_DEVICES": "0,1"},
}


def write_run(folder: Path, rows: list[TrialResult], environment: dict[str, Any] | None = None) -> Path:
    run = RunFolder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    run.results_path.touch()
    for row in rows:
        run.append(row)
    if environment is not None:
        run.write_environment(environment)
    return folder


def md_table(text: str, heading: str) -> list[dict[str, str]]:
    """The first Markdown table under ``## heading``, as one dict per row keyed by header."""
    lines = text.split(f"## {heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    split = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table]
    return [dict(zip(split[0], row, strict=True)) for row in split[2:]]


def with_steps(row: TrialResult, times: list[float], *, repeat: int = 0, repeats: int = 1) -> TrialResult:
    """``row`` with these measured step times (samples/s and tokens/s made consistent with them: 8 samples of 512
    tokens per step), as repeat ``repeat`` of ``repeats``."""
    import dataclasses
    import statistics

    tp = row.throughput
    speed = 8 / statistics.fmean(times)
    throughput = dataclasses.replace(
        tp, step_times_s=list(times), samples_per_s=speed, tokens_per_s=speed * 512, measured_steps=len(times)
    )
    measured = dataclasses.replace(row.measured, throughput=throughput)
    return dataclasses.replace(row, measured=measured, repeat=repeat, repeats=repeats)


def noisy_steps(mean_s: float, n: int, *, cv: float = 0.03, seed: int = 0) -> list[float]:
    """``n`` step times around ``mean_s`` with the given coefficient of variation (seeded, positive)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [float(max(t, mean_s * 0.1)) for t in rng.normal(mean_s, cv * mean_s, size=n)]


CPU_HOG = MachineActivity(
    samples=20,
    duration_s=20.0,
    cpu_count=2,
    other_cores_mean=0.95,
    other_cores_max=1.0,
    busy_processes=["stress (4242): 95% of a core"],
)
"""What the activity sampler records when another process keeps a core busy during a trial: it flags the trial."""


def runs_of(
    name: str, mean_s: float, *, seed: int, runs: int = 2, peak: float = 4.0, cv: float = 0.03, drift: float = 0.01,
    **kw,
) -> list:  # fmt: skip
    """``runs`` runs of one trial (strategy ``name`` over defaults), each 40 steps, their means ``drift`` apart
    (run-to-run drift: 1% by default)."""
    strategy = Strategy(name=name)
    return [
        with_steps(
            ok_row(name, strategy, 8 / mean_s, peak, **kw),
            noisy_steps(mean_s * (1 + drift * k), 40, cv=cv, seed=seed + 10 * k),
            repeat=k,
            repeats=runs,
        )
        for k in range(runs)
    ]
