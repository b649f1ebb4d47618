"""The technique protocol and its registry: every technique module registered once, in the order the verification
reports, each member a no-op unless overridden, and the one way a technique patches a library (once per process)."""

from __future__ import annotations

import importlib
import pkgutil

import hfscale.techniques
from hfscale.strategy import FsdpSpec, Strategy
from hfscale.techniques import TECHNIQUES, fsdp_cpu, kernels, mesh
from hfscale.techniques.base import PATCH_MARKER, Technique, TrainedRun, patch_once

HELPER_MODULES = {"base", "deepspeed_checkpointing", "mesh_limits"}
"""Modules of hfscale.techniques that are not a technique of their own (the protocol; a part of activation_offload;
the meshes mesh's trials cannot train, which the recipe check and ``hfscale config`` refuse)."""


def test_every_technique_module_is_registered_once_under_its_name():
    modules = {info.name for info in pkgutil.iter_modules(hfscale.techniques.__path__)}
    registered = [t.name for t in TECHNIQUES]
    assert len(set(registered)) == len(registered)
    assert set(registered) == modules - HELPER_MODULES
    for name in registered:
        module = importlib.import_module(f"hfscale.techniques.{name}")
        assert isinstance(module.TECHNIQUE, Technique)
        assert module.TECHNIQUE in TECHNIQUES


def test_the_registry_is_in_the_order_mismatches_are_reported():
    # hfscale.measure.verify.check reports the techniques' mismatches in this order (as it always has).
    names = [t.name for t in TECHNIQUES]
    assert names == ["kernels", "activation_offload", "lora", "multi_machine", "mesh", "fsdp_cpu"]


def test_every_technique_with_script_lines_is_in_the_script_order_once():
    from hfscale.techniques import SCRIPT_ORDER

    with_lines = {t.name for t in TECHNIQUES if type(t).script_lines is not Technique.script_lines}
    assert [t.name for t in SCRIPT_ORDER] == ["mesh", "fsdp_cpu", "kernels", "lora", "activation_offload"]
    assert {t.name for t in SCRIPT_ORDER} == with_lines and len(SCRIPT_ORDER) == len(with_lines)


def test_a_member_not_overridden_does_nothing():
    technique, model, strategy = Technique(), object(), Strategy()
    assert technique.load_model(model, None, "scratch") is model  # type: ignore[arg-type]
    assert technique.adapt_model(model, None, "scratch") is model  # type: ignore[arg-type]
    assert technique.prepare_arguments(strategy) == {}
    assert technique.apply(None, strategy) is None  # type: ignore[arg-type]
    assert technique.collect(TrainedRun(trainer=None, world_size=1)) == {}  # type: ignore[arg-type]
    assert technique.check(strategy, None) == []  # type: ignore[arg-type]
    assert technique.script_lines(strategy) == []


def test_a_technique_that_is_not_asked_for_adds_nothing():
    plain = Strategy(name="plain", device="cpu")
    for technique in TECHNIQUES:
        assert technique.prepare_arguments(plain) == {}, technique.name
        assert technique.script_lines(plain) == [], technique.name


def test_patch_once_replaces_a_function_once_and_keeps_its_name():
    class Library:
        def check(self) -> str:
            """Refuses something."""
            return "refused"

    def lifted(original):
        def check(self):
            return "lifted, " + original(self)

        return check

    patch_once(Library, "check", lifted)
    patch_once(Library, "check", lifted)  # a second call changes nothing
    assert Library().check() == "lifted, refused"
    assert Library.check.__name__ == "check" and Library.check.__doc__ == "Refuses something."
    assert getattr(Library.check, PATCH_MARKER)


def test_the_cpu_patches_of_fsdp_and_the_mesh_are_made_once(monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState

    # Restored after the test: the patches are process-wide.
    monkeypatch.setattr(AcceleratorState, "__init__", AcceleratorState.__init__)
    monkeypatch.setattr(ParallelismConfig, "_validate_accelerator", ParallelismConfig._validate_accelerator)
    for _ in range(2):
        fsdp_cpu.enable_fsdp2_on_cpu()
        mesh.enable_mesh_on_cpu()
    for patched in (AcceleratorState.__init__, ParallelismConfig._validate_accelerator):
        assert getattr(patched, PATCH_MARKER)
        assert not getattr(patched.__wrapped__, PATCH_MARKER, False)  # wrapped once, not twice


def test_fsdp_on_cpu_is_prepared_and_printed_only_when_asked():
    fsdp = Strategy(name="fsdp", device="cpu", num_processes=2, fsdp=FsdpSpec())
    assert [line for _, line in fsdp_cpu.script_lines(fsdp)] == [fsdp_cpu.SCRIPT_LINE]
    assert fsdp_cpu.script_lines(fsdp.replace(device="cuda")) == []


def test_the_attention_kernel_is_a_script_line():
    lines = kernels.script_lines(Strategy(attn_implementation="sdpa"))
    assert [line for _, line in lines] == ["model = AutoModelForXxx.from_pretrained(name, attn_implementation='sdpa')"]
    assert kernels.script_lines(Strategy()) == []
