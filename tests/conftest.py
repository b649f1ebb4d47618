"""Shared fixtures: tiny models built from configs (never downloaded) and hardware markers."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's sweeps take turns on the device locks of this session only, not with other sweeps on the machine.
os.environ.setdefault("HFSCALE_LOCK_DIR", tempfile.mkdtemp(prefix="hfscale-test-locks-"))


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip hardware-bound tests where the hardware is missing; they are collected, never deleted."""
    n_gpus = _cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason=f"needs 2+ CUDA devices, found {n_gpus}")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


TINY_BERT = dict(
    vocab_size=30522,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    num_labels=2,
)
TINY_GPT2 = dict(vocab_size=30522, n_embd=64, n_layer=2, n_head=2, n_positions=512)
TINY_LLAMA = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def launch_as_sweep(
    tmp_path, strategy, *, steps: int = 4, num_samples: int = 64, seq_len: int = 64, timeout_s: int = 600
):
    """Run one trial of tiny BERT as the sweep launches it (``write_configs``, then ``accelerate launch ... -m
    hfscale.trial``) and return its outcome; fails with the trial's stderr when it did not run, when it is not
    ``ok``, or when its loss curve is not ``steps`` finite values. The first DeepSpeed use JIT-builds its CPU ops
    (minutes, cached under TORCH_EXTENSIONS_DIR): hence the long default time limit."""
    import math
    import subprocess

    from hfscale.configs import launch_command, write_configs
    from hfscale.process import free_port
    from hfscale.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec
    from hfscale.trial import read_outcome

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


def counted_flops_per_token(model, batch: int, seq_len: int) -> float:
    """FLOPs per token of one training forward and backward of ``model`` (a causal or masked LM, labels = inputs)
    as torch's own FLOP counter (``torch.utils.flop_counter.FlopCounterMode``) counts them: the independent
    expectation for :mod:`hfscale.flops`' formula."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops() / (batch * seq_len)


@pytest.fixture
def tiny_bert():
    """A 2-layer, hidden-64 BERT classifier with random weights (about 2M parameters, mostly embeddings)."""
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(**TINY_BERT))


@pytest.fixture
def tiny_gpt2():
    """A 2-layer, hidden-64 GPT-2 causal LM with random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**TINY_GPT2))


@pytest.fixture
def malloc_in_use():
    """A function giving the bytes glibc's allocator holds now (``mallinfo2``: every CPU tensor is a malloc), to
    measure what CPU tensors hold without torch's help (torch keeps no CPU allocator statistics)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                "keepcost",
            )
        ]  # fmt: skip

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    fn.restype = MallInfo2

    def in_use() -> int:
        info = fn()
        return info.uordblks + info.hblkhd

    return in_use


# -- one real tiny sweep, shared by the sweep, report, parity and estimate tests ----------------------------------

TINY_SWEEP_RECIPE = {
    "name": "tiny",
    "description": "the test suite's shared sweep: tiny BERT, 32 tokens, 4 steps, one process",
    "device": "cpu",
    "model": {"type": "bert", "task": "classification", "config": dict(TINY_BERT)},
    "data": {"num_samples": 16, "seq_len": 32, "token_high": 1000},
    "training_args": {"report_to": "none", "seed": 0},
    "measure": {"warmup_steps": 1, "max_steps": 4, "timeout_s": 120, "repeats": 1},
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


@pytest.fixture(scope="session")
def tiny_sweep_run(tmp_path_factory: pytest.TempPathFactory):
    """The run folder of ONE real sweep of :data:`TINY_SWEEP_RECIPE` (no report written: tests write their own).

    Treat it as read-only (copy it to change it): every test of the session sees the same folder.
    """
    import yaml

    from hfscale.sweep import run_sweep

    root = tmp_path_factory.mktemp("tiny-sweep")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY_SWEEP_RECIPE), encoding="utf-8")
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        run_sweep(recipe, run_dir=root / "run", report=False, progress=lambda line: None)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    return root / "run"
