"""Shared fixtures: tiny models built from configs (never downloaded) and hardware markers."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

import pytest
from helpers.models import TINY_BERT, TINY_GPT2
from helpers.runs import TINY_SWEEP_RECIPE, made_once, one_thread, session_root

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's sweeps take turns on the device locks of this session only, not with other sweeps on the machine (the
# Slurm cluster's and the killed-second-machine test's lock in folders of their own: tests/helpers/slurm.py).
os.environ.setdefault("HFSCALE_LOCK_DIR", tempfile.mkdtemp(prefix="hfscale-test-locks-"))
# Every process started from here on (xdist's workers, and what the tests launch) runs tests/site/sitecustomize.py.
_SITE = str(Path(__file__).parent / "site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SITE, os.environ.get("PYTHONPATH")]))


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.hookimpl(trylast=True)  # after -m/-k deselection, so the order counts the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip hardware-bound tests where the hardware is missing (they are collected, never deleted); order the files
    as the workers should take them."""
    n_gpus = _cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason=f"needs 2+ CUDA devices, found {n_gpus}")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)
    items[:] = _in_the_order_files_should_start(items)


START_FIRST = (
    "tests/sweep/test_slurm_cluster.py",
    "tests/scenarios/test_install.py",
    "tests/scenarios/test_script.py",
    "tests/scenarios/test_adaptive.py",
    "tests/scenarios/test_user_configs.py",
)
"""Files handed out before the others, in this order. The first two spend most of their wall time off the session's
device lock (the Slurm test waits on its cluster's daemons, whose sweeps lock in a folder of their own; the wheel test
builds a wheel and a venv before its one trial); the others are long runs of one or a few tests (an 11-run sweep, a
search with a resume, seven launches that take no lock), which in xdist's order came last and ended the suite alone
on one core."""


def _in_the_order_files_should_start(items: list[pytest.Item]) -> list[pytest.Item]:
    """:data:`START_FIRST`, then pytest-xdist's own order (the files with the most tests first), each file's tests in
    their own order.

    Under ``pytest -n 3 --dist loadfile --no-loadscope-reorder`` (tox) xdist queues whole files in this order; it
    gives each worker two at the start, so the first six go out at once, two to a worker. In xdist's own order the
    files of :data:`START_FIRST`, of one to eight tests, came last, and the suite ended with one of them running alone
    while a core idled (the Slurm test for about 40 s). Every file with slow tests first was slower: their trials
    waited on each other's device lock (docs/development.md)."""
    missing = [path for path in START_FIRST if not (Path(__file__).parent.parent / path).is_file()]
    assert not missing, f"tests/conftest.py START_FIRST names files that do not exist: {missing}"
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def starts_early(tests: list[pytest.Item]) -> tuple[int, int]:
        path = tests[0].nodeid.split("::", 1)[0]
        return (START_FIRST.index(path) if path in START_FIRST else len(START_FIRST), -len(tests))

    return [item for tests in sorted(files.values(), key=starts_early) for item in tests]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left alive: the test modules' imports (torch and transformers, about 420,000 objects the
    garbage collector tracks) live as long as the session, and every full collection during a thousand in-process
    tests would scan them again (hfscale.core.collector does the same in a trial). Measured on 2 cores: the report,
    estimate, results, records, recipes and measure tests (not slow) took 73 s with it against 89 s without.

    The tests themselves then run at the interpreter's own thresholds, as they did before (some measure memory in
    this process): where tests/site/sitecustomize.py raised the first one for the imports, it is set back."""
    gc.collect()
    gc.freeze()
    site = sys.modules.get("sitecustomize")
    if site is not None and hasattr(site, "DEFAULT_THRESHOLD"):
        gc.set_threshold(*site.DEFAULT_THRESHOLD)


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


@pytest.fixture(scope="session")
def tiny_sweep_run(tmp_path_factory: pytest.TempPathFactory):
    """The run folder of ONE real sweep of :data:`TINY_SWEEP_RECIPE` (no report written: tests write their own),
    made once per test session: under pytest-xdist the first worker to need it makes it, and the others wait for it
    and read the same folder (:func:`helpers.runs.made_once`).

    Treat it as read-only (copy it to change it): every test of the session sees the same folder.
    """
    import yaml

    from hfscale.sweep.loop import run_sweep

    def make(root):
        recipe = root / "tiny.yaml"
        recipe.write_text(yaml.safe_dump(TINY_SWEEP_RECIPE), encoding="utf-8")
        with one_thread():
            run_sweep(recipe, run_dir=root / "run", report=False, progress=lambda line: None)

    return made_once(session_root(tmp_path_factory) / "tiny-sweep", make) / "run"
