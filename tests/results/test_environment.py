"""hfscale.results.environment: what environment.json records (here, without NVML; with a stand-in NVML), and its
reader."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest
from helpers.paths import REPO

from hfscale.core.units import GIB
from hfscale.results import environment
from hfscale.results.environment import collect_environment, gpu_memory_bytes, hfscale_install, recorded_env


def test_hfscale_version_and_commit_of_this_checkout():
    install = hfscale_install()
    assert install["version"] == metadata.version("hfscale")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    assert install["commit"] == head.stdout.strip()
    assert isinstance(install["dirty"], bool)
    import hfscale

    # Where the imported package lives: the checkout (editable install) or site-packages (tox installs a wheel).
    assert Path(install["source"]) == Path(hfscale.__file__).parent


def test_one_version_installed_and_recorded():
    """``hfscale.__version__`` is the one source: pyproject.toml reads it, and the installed metadata and
    environment.json carry it (both said 0.1.0 two releases after 0.1, so ``compare`` could not tell versions
    apart). An editable install records its metadata when installed: reinstall after a version bump."""
    from packaging.version import Version

    import hfscale

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject["project"] and pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hfscale.__version__"}
    assert Version(hfscale.__version__) >= Version("0.4.0.dev0")  # the release in progress after 0.3
    assert metadata.version("hfscale") == hfscale.__version__
    record = collect_environment()
    assert record["hfscale"]["version"] == record["packages"]["hfscale"] == hfscale.__version__


def test_hfscale_version_when_not_installed_and_not_a_checkout(monkeypatch):
    """The H100 run recorded `hfscale: null` and `git: null`: run from a source folder that pip did not install.
    The package's own version is recorded then; a copy that is not a checkout records the version, commit None."""
    import hfscale

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(environment.metadata, "version", not_installed)
    monkeypatch.setattr(environment, "git_commit", lambda path=None: None)
    install = hfscale_install()
    assert install["version"] == hfscale.__version__
    assert install["commit"] is None and install["dirty"] is None
    record = collect_environment()
    assert record["packages"]["hfscale"] == hfscale.__version__
    assert record["hfscale"]["version"] == hfscale.__version__
    assert record["git"] is None


def test_record_without_nvml(monkeypatch):
    """This machine has no NVIDIA driver: NVML fails to load, which is recorded, and nothing else breaks."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    record = collect_environment()
    json.dumps(record)  # serialisable as it is written
    assert record["gpus"] == [] and record["gpu_count"] == 0
    if "nvml_error" in record:  # no driver here, or pynvml missing
        assert record["nvml_error"]
    assert record["env"]["OMP_NUM_THREADS"] == "1" and record["env"]["OMP_PROC_BIND"] == "close"
    assert record["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert record["env"]["NCCL_DEBUG"] == "WARN"
    assert "UNRELATED_VARIABLE" not in record["env"]
    assert record["interpreter"]["executable"] == sys.executable
    assert record["hfscale"]["version"] and record["git"]["commit"] == record["hfscale"]["commit"]
    assert gpu_memory_bytes(record) is None


class NVMLError(Exception):
    pass


def fake_pynvml(*, supported: bool) -> types.ModuleType:
    """A stand-in for pynvml with one H100; ``supported=False`` makes every optional query raise, as old drivers
    and some virtual GPUs do."""

    def optional(value):
        def read(*args):
            if not supported:
                raise NVMLError("Not Supported")
            return value

        return read

    module = types.ModuleType("pynvml")
    module.NVML_CLOCK_GRAPHICS, module.NVML_CLOCK_SM, module.NVML_CLOCK_MEM = 0, 1, 2
    module.nvmlInit = lambda: None
    module.nvmlShutdown = lambda: None
    module.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    module.nvmlSystemGetCudaDriverVersion = lambda: 13000
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda index: f"handle{index}"
    module.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=85_520_809_984)
    module.nvmlDeviceGetUUID = optional("GPU-0b5e6d1c-1111-2222-3333-444455556666")
    module.nvmlDeviceGetEnforcedPowerLimit = optional(700_000)
    module.nvmlDeviceGetEccMode = optional((1, 1))
    module.nvmlDeviceGetMigMode = optional((0, 0))
    module.nvmlDeviceGetClockInfo = optional(1980)
    module.nvmlDeviceGetMaxClockInfo = optional(1980)
    return module


@pytest.mark.parametrize("supported", [True, False], ids=["supported", "not-supported"])
def test_gpu_facts_from_nvml(monkeypatch, supported):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(supported=supported))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = environment._nvml_gpus()
    (gpu,) = info["gpus"]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["memory_total_bytes"] == 85_520_809_984
    assert info["driver_version"] == "580.159.04" and info["cuda_driver_version"] == "13.0"
    if supported:
        assert gpu["uuid"] == "GPU-0b5e6d1c-1111-2222-3333-444455556666"
        assert gpu["power_limit_w"] == 700.0
        assert gpu["ecc_enabled"] is True and gpu["mig_enabled"] is False
        assert gpu["clocks"]["sm_mhz"] == 1980 and gpu["clocks"]["memory_max_mhz"] == 1980
    else:
        assert gpu["uuid"] is None and gpu["power_limit_w"] is None
        assert gpu["ecc_enabled"] is None and gpu["mig_enabled"] is None
        assert set(gpu["clocks"].values()) == {None}
    assert gpu_memory_bytes(info) == 85_520_809_984


def test_recorded_env_takes_the_listed_names_and_prefixes():
    environ = {"OMP_NUM_THREADS": "2", "OMP_SCHEDULE": "static", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"}
    assert recorded_env(environ) == {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "2", "OMP_SCHEDULE": "static"}


def test_gpu_memory_is_read_from_the_committed_records():
    h100 = json.loads((REPO / "results/bert_large-h100/environment.json").read_text(encoding="utf-8"))
    assert gpu_memory_bytes(h100) == int(79.6474609375 * GIB)
    cpu = json.loads((REPO / "results/cpu_small-cpu2/environment.json").read_text(encoding="utf-8"))
    assert gpu_memory_bytes(cpu) is None
    two = {"gpus": [{"memory_total_bytes": 85 * GIB}, {"memory_total_bytes": 40 * GIB}]}
    assert gpu_memory_bytes(two) == 40 * GIB  # every rank must fit: the smallest
    assert gpu_memory_bytes({}) is None
