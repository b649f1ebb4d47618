"""Real runs the tests share: one trial launched as the sweep launches it, and the tiny sweep's recipe."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from helpers.models import TINY_BERT


def write_recipe(folder: Path, data: dict[str, Any], name: str = "r.yaml") -> Path:
    """``data`` as a recipe file ``folder/name``; returns its path."""
    path = folder / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """``OMP_NUM_THREADS=1`` for the sweeps started inside (their trials inherit it), restored after: two ranks on
    two cores do not fight over threads."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def session_root(tmp_path_factory) -> Path:
    """A folder every process of this test session shares: pytest-xdist's workers each get a base temp folder
    under the session's own (``.../pytest-N/popen-gwK``); a run without xdist has only its own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(root: Path, make: Callable[[Path], None]) -> Path:
    """``root`` after ``make(root)`` has run once in this session, whichever process asked first: the others wait on
    a file lock and find it made (a real sweep is evidence for every test that reads it, not once per worker). A
    ``make`` that raised leaves it unmade, and the next process to ask tries again, failing its own test."""
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    made = root / ".made"
    with FileLock(root.with_name(root.name + ".lock")):
        if not made.exists():
            make(root)
            made.touch()
    return root


def launch_as_sweep(
    tmp_path, strategy, *, steps: int = 4, num_samples: int = 64, seq_len: int = 64, timeout_s: int = 600
):
    """Run one trial of tiny BERT as the sweep launches it (``write_configs``, then ``accelerate launch ... -m
    hfscale.trial``) and return its outcome; fails with the trial's stderr when it did not run, when it is not
    ``ok``, or when its loss curve is not ``steps`` finite values. The first DeepSpeed use JIT-builds its CPU ops
    (minutes, cached under TORCH_EXTENSIONS_DIR): hence the long default time limit."""
    import subprocess

    from hfscale.configs import launch_command, write_configs
    from hfscale.launch.process import free_port
    from hfscale.trial.train import read_outcome
    from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

    spec = TrialSpec(
        name=strategy.name,
        strategy=strategy,
        model=ModelSpec(type="bert", config=TINY_BERT),
        data=DataSpec(num_samples=num_samples, seq_len=seq_len),
        measure=MeasureSpec(max_steps=steps, warmup_steps=1),
    )
    configs = write_configs(strategy, tmp_path)  # as the sweep does: FSDP's block class is the runner's to find
    spec.write(tmp_path / "spec.json")
    result = tmp_path / "result.json"
    target = ["-m", "hfscale.trial", str(tmp_path / "spec.json"), "--result", str(result)]
    cmd = launch_command(str(configs.accelerate_yaml), target, main_process_port=free_port())
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    outcome = read_outcome(result)
    assert outcome.status == "ok", outcome.mismatches
    assert len(outcome.loss_curve) == steps
    assert all(math.isfinite(x) for x in outcome.loss_curve), outcome.loss_curve
    return outcome


# -- one real tiny sweep, shared by the sweep, report, parity and estimate tests ----------------------------------

TINY_SWEEP_RECIPE = {
    "name": "tiny",
    "description": "the test suite's shared sweep: tiny BERT, 32 tokens, 4 steps, one process",
    "device": "cpu",
    "model": {"type": "bert", "task": "classification", "config": dict(TINY_BERT)},
    "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
    "training_args": {"report_to": "none", "seed": 0},
    "measure": {"warmup_steps": 1, "max_steps": 4, "timeout_s": 600, "repeats": 1},  # a bound on hangs only
    "run": {"env": {"OMP_NUM_THREADS": "1"}},
    "baseline": "fp32",
    "defaults": {"per_device_batch_size": 4, "num_processes": 1, "optimizer": "adamw_torch"},
    "trials": [
        {"name": "fp32"},
        {"name": "bf16", "precision": "bf16"},
        {"name": "ckpt", "gradient_checkpointing": True, "measure": {"repeats": 2}},
        # Half a GiB of address space: the launcher cannot even map torch's libraries (a real, fast OOM).
        {"name": "oom", "run": {"memory_limit_gib": 0.5}},
        # Planned for two machines: skipped before launching, with the reason.
        {"name": "two-machines", "num_machines": 2, "num_processes": 2},
    ],
}
"""Trials: fp32 (the baseline), bf16, gradient checkpointing (two repeats), one out of memory, one skipped."""


# -- scripted launches: rows without processes, for the sweep's own logic --------------------------------------------


def scripted_launches(monkeypatch, speed=None, *, step_times=None, samples_per_step: int = 4) -> list[tuple[str, int]]:
    """Replace the launch of a trial's process group by an ok row, measuring either ``speed(trial, repeat)``
    samples/s (4 equal steps) or steps of ``step_times(trial, repeat)`` seconds, ``samples_per_step`` samples each;
    returns the (trial, repeat) launched, in order."""
    import statistics

    import hfscale.sweep.loop
    from hfscale.launch.rows import planned_row
    from hfscale.records.measurements import ThroughputSummary
    from hfscale.records.row import TrialOutcome

    launched = []

    def times_of(name: str, repeat: int) -> list[float]:
        if step_times is not None:
            return list(step_times(name, repeat))
        return [samples_per_step / speed(name, repeat)] * 4

    def launch_trial(run, folder, *, baseline, **_):
        if run.skip_reason is not None:
            return planned_row(run, baseline=baseline, status="skipped", reason=run.skip_reason)
        launched.append((run.name, run.repeat))
        times = times_of(run.name, run.repeat)
        mean = sum(times) / len(times)
        throughput = ThroughputSummary(
            samples_per_s=samples_per_step / mean, tokens_per_s=None, step_time_median_s=statistics.median(times),
            step_time_p90_s=None, step_time_mean_s=mean, measured_steps=len(times), warmup_steps=1,
            samples_per_step=samples_per_step, tokens_per_sample=None, world_size=1, flops_per_token=None, mfu=None,
            peak_flops_per_s=None, device_name="cpu", step_times_s=times,
        )  # fmt: skip
        measured = TrialOutcome(trial=run.name, status="ok", throughput=throughput)
        return planned_row(run, baseline=baseline, status="ok", measured=measured, wall_time_s=1.0)

    monkeypatch.setattr(hfscale.sweep.loop, "launch_trial", launch_trial)
    return launched
