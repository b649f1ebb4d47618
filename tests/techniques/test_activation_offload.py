"""hfscale.techniques.activation_offload: activations offloaded through saved-tensor hooks, DeepSpeed's checkpoint
function
installed from the JSON's activation_checkpointing section, both verified from inside a real run, and the silent
fallbacks caught.

The two real runs are launched as the sweep launches a trial (``accelerate launch -m hfscale.trial``): tiny BERT
(hidden 64, 2 layers), 64-token sequences, 4 optimizer steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.models import TINY_BERT, TINY_LLAMA
from helpers.runs import launch_as_sweep

from hfscale.configs import deepspeed_config
from hfscale.records.measurements import VerificationRecord
from hfscale.records.row import TrialOutcome
from hfscale.strategy import DeepSpeedSpec, Strategy
from hfscale.techniques.activation_offload import (
    ActivationOffload,
    check,
    collect,
    deepspeed_checkpoint_function,
    deepspeed_options_in_use,
    offload_activations,
)

STEPS = 4
# The first DeepSpeed use JIT-builds its CPU ops (minutes, cached under TORCH_EXTENSIONS_DIR).
LAUNCH_TIMEOUT_S = 900


def _cpu(name: str, **fields) -> Strategy:
    return Strategy(name=name, device="cpu", per_device_batch_size=4, **fields)


def launch(tmp_path: Path, strategy: Strategy) -> TrialOutcome:
    """One trial as the sweep runs it (``conftest.launch_as_sweep``)."""
    return launch_as_sweep(tmp_path, strategy, steps=STEPS, num_samples=32)


# -- real runs -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_activation_offload_cpu_run_verified(tmp_path):
    outcome = launch(tmp_path, _cpu("act_offload", activation_offload=True))
    v = outcome.verification
    assert v is not None and v.activation_offload_tensors is not None
    assert v.activation_offload_tensors > 0  # the hooks ran on the Trainer's first training forward
    assert v.ds_activation_checkpointing is None


@pytest.mark.slow
def test_deepspeed_cpu_checkpointing_run_verified(tmp_path):
    strategy = _cpu(
        "zero1_ds_ckpt",
        gradient_checkpointing=True,
        deepspeed=DeepSpeedSpec(zero_stage=1, partition_activations=True, cpu_checkpointing=True),
    )
    outcome = launch(tmp_path, strategy)
    v = outcome.verification
    assert v.wrapper == "DeepSpeedEngine" and v.gradient_checkpointing
    # The model's checkpointed layers call deepspeed.checkpointing.checkpoint, configured from the JSON's section.
    assert v.ds_activation_checkpointing == ["partition_activations", "cpu_checkpointing"]


def test_cpu_checkpointing_alone_refused_on_cpu(monkeypatch):
    # Measured: DeepSpeed's copy to the CPU is a no-op there, and it then empties the input it meant to keep
    # ("both arguments to linear need to be at least 1D" in the next forward). Refused wherever the accelerator
    # DeepSpeed sees is the CPU, so the test says it is (it runs on a GPU machine too).
    monkeypatch.setattr("hfscale.techniques.deepspeed_checkpointing._on_cpu", lambda: True)
    with pytest.raises(ValueError, match="cpu_checkpointing without partition_activations fails on a CPU"):
        deepspeed_checkpoint_function({"activation_checkpointing": {"cpu_checkpointing": True}})


# -- fallbacks caught ----------------------------------------------------------------------------------------------


def _record(**fields) -> VerificationRecord:
    base = dict(
        distributed_type="NO", world_size=1, device="cpu", mixed_precision="no", wrapper="none",
        wrapper_class="x", params_total=1, params_local_per_rank=[1],
    )  # fmt: skip
    return VerificationRecord(**(base | fields))


def test_zero_offloaded_tensors_is_not_applied():
    strategy = _cpu("act_offload", activation_offload=True)
    assert check(strategy, _record(activation_offload_tensors=5)) == []
    with_zero = check(strategy, _record(activation_offload_tensors=0))
    assert len(with_zero) == 1 and "handled 0 saved tensors" in with_zero[0]
    never_ran = check(strategy, _record())
    assert len(never_ran) == 1 and "hooks never ran" in never_ran[0]
    assert "strategy.activation_offload is False" in check(_cpu("plain"), _record(activation_offload_tensors=3))[0]


def test_deepspeed_section_alone_is_not_applied():
    # On CUDA: on CPU the strategy refuses cpu_checkpointing without partition_activations (DeepSpeed fails there).
    strategy = Strategy(
        name="ds", gradient_checkpointing=True, deepspeed=DeepSpeedSpec(zero_stage=1, cpu_checkpointing=True)
    )
    problems = check(strategy, _record(ds_activation_checkpointing=None))
    assert len(problems) == 1 and "section alone changes nothing" in problems[0]
    wrong = check(strategy, _record(ds_activation_checkpointing=["partition_activations"]))
    assert len(wrong) == 1 and "cpu_checkpointing was asked for" in wrong[0]
    assert check(strategy, _record(ds_activation_checkpointing=["cpu_checkpointing"])) == []


def test_deepspeed_options_reported_only_once_its_checkpoint_ran(monkeypatch):
    """The options are DeepSpeed's process-wide settings, which hfscale itself configured: they are the record only
    after a checkpointed layer really called DeepSpeed's function (counted by the wrapper), None before."""
    from types import SimpleNamespace

    from deepspeed.runtime.activation_checkpointing import checkpointing

    from hfscale.techniques.deepspeed_checkpointing import _tensor_arguments_only

    monkeypatch.setattr(checkpointing, "PARTITION_ACTIVATIONS", True)
    function = _tensor_arguments_only(checkpointing.checkpoint)
    layers = [torch.nn.Linear(2, 2) for _ in range(2)]
    for layer in layers:
        layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, function
    trainer = SimpleNamespace(model=torch.nn.Sequential(*layers))
    assert function.calls == 0
    assert collect(trainer)["ds_activation_checkpointing"] is None  # installed, never called
    function.calls = 2  # what two checkpointed layers' calls leave (counting: below)
    assert collect(trainer)["ds_activation_checkpointing"] == ["partition_activations"]

    counting = _tensor_arguments_only(lambda f, *args: f(*args))
    assert counting(lambda x, y: x + 1, torch.ones(1), None) == 2 and counting.calls == 1


# -- the hooks, in process -----------------------------------------------------------------------------------------


def test_hooks_skip_parameters_and_tiny_tensors_and_keep_gradients(tiny_bert):
    torch.manual_seed(0)
    ids = torch.randint(100, 1000, (2, 16))
    labels = torch.zeros(2, dtype=torch.long)
    tiny_bert.train()
    tiny_bert.config.hidden_dropout_prob = tiny_bert.config.attention_probs_dropout_prob = 0.0
    for module in tiny_bert.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    reference = tiny_bert(input_ids=ids, labels=labels).loss
    reference.backward()
    expected = [p.grad.clone() for p in tiny_bert.parameters()]
    tiny_bert.zero_grad(set_to_none=True)

    offload = ActivationOffload(min_bytes=1024)
    with offload:
        loss = tiny_bert(input_ids=ids, labels=labels).loss
    loss.backward()  # outside the context: the hooks travel with each saved tensor
    assert torch.equal(loss, reference)
    for got, want in zip((p.grad for p in tiny_bert.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want)
    counts = offload.first
    assert counts is not None and counts.tensors > 0 and counts.bytes >= 1024 * counts.tensors
    assert counts.skipped > 0  # the weights nn.Linear saves are parameters


def test_autocast_weight_casts_are_not_offloaded():
    """Under bf16 autocast a matmul saves autocast's cached cast of its weight (through a transpose view): copying
    it to host frees nothing (the cache keeps the device copy), so it is skipped; the activations are still packed
    and the gradients are unchanged."""

    class Recording(ActivationOffload):
        def __init__(self) -> None:
            super().__init__(min_bytes=0)
            self.packed: list[tuple[int, ...]] = []

        def _pack(self, tensor):
            before = self.last.tensors
            packed = super()._pack(tensor)
            if self.last.tensors > before:
                self.packed.append(tuple(tensor.shape))
            return packed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    x = torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    offload = Recording()
    with offload, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().sum()
    loss.backward()
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want)
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.t().shape) for p in model.parameters()}
    assert offload.packed and all(shape[0] == 8 for shape in offload.packed), offload.packed  # activations only
    assert not weight_shapes & set(offload.packed)
    assert offload.first.skipped >= 1  # the second layer's weight cast, saved for the input's gradient


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    return LlamaForCausalLM(config).train()


def _saved_activations(model, ids) -> tuple[int, set[int]]:
    """(saves, storage addresses) of what autograd saves in one step, non-parameters of at least 1 KiB, counted by
    plain pass-through hooks (they keep every tensor alive, so no address is reused within the step)."""
    saves, storages = 0, set()

    def pack(tensor):
        nonlocal saves
        if not isinstance(tensor, torch.nn.Parameter) and tensor.numel() * tensor.element_size() >= 1024:
            saves += 1
            storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids).loss.backward()
    return saves, storages


def test_offload_counts_each_storage_once():
    """A tiny Llama saves 73 activations that share 53 storages (a tensor saved by several operations, views of
    one tensor): the counts are the 53, with their bytes, not 73 copies (3.09 MiB against 2.18 MiB unique)."""
    model = _tiny_llama()
    ids = torch.randint(0, 1000, (4, 32))
    saves, storages = _saved_activations(model, ids)
    assert saves > len(storages)
    model.zero_grad(set_to_none=True)

    offload = ActivationOffload()
    with offload:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert offload.first.tensors == len(storages)
    assert offload.first.saves == saves


def test_offload_copies_each_storage_once_and_gradients_are_unchanged(monkeypatch):
    """The copy path, run on CPU by treating host tensors as device ones: one host copy per storage, every saved
    view rebuilt on it (dtype, shape, strides, offset), and the gradients bit for bit those of no offload."""
    from hfscale.techniques import activation_offload

    model = _tiny_llama()
    ids = torch.randint(0, 1000, (4, 32))
    _, storages = _saved_activations(model, ids)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    copied: list[int] = []

    class CountedCopy(activation_offload._HostCopy):
        def __init__(self, storage, device, pin) -> None:
            copied.append(storage.nbytes())
            super().__init__(storage, device, pin)

    monkeypatch.setattr(activation_offload, "_in_host_memory", lambda tensor: False)
    monkeypatch.setattr(activation_offload, "_HostCopy", CountedCopy)
    offload = ActivationOffload(pin_memory=False)
    with offload:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert len(copied) == len(storages) == offload.first.tensors
    assert sum(copied) == offload.first.bytes
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        assert torch.equal(got, want)


def test_data_parallel_refused():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="DataParallel, whose replica threads"):
        offload_activations(SimpleNamespace(args=SimpleNamespace(n_gpu=2), compute_loss=None))


def test_hooks_do_not_reach_other_threads():
    """Why nn.DataParallel is refused: a forward in another thread saves past the hooks."""
    import threading

    x = torch.randn(64, 64, requires_grad=True)
    offload = ActivationOffload(min_bytes=0)
    with offload:
        thread = threading.Thread(target=lambda: (x * x).sum())
        thread.start()
        thread.join()
        assert offload.last.saves == 0
        (x * x).sum()
    assert (offload.last.saves, offload.last.tensors) == (2, 1)  # x saved twice: one storage


def test_min_bytes_refused_by_name():
    with pytest.raises(ValueError, match="min_bytes: expected a non-negative integer"):
        ActivationOffload(min_bytes=-1)


def test_offload_activations_wraps_the_trainer_once(tiny_bert, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=tiny_bert, args=args)
    offload_activations(trainer)
    assert collect(trainer)["activation_offload_tensors"] == 0  # wrapped, not yet run
    batch = {"input_ids": torch.randint(100, 1000, (2, 16)), "labels": torch.zeros(2, dtype=torch.long)}
    with torch.no_grad():  # an evaluation's forward is not the first training step
        trainer.compute_loss(tiny_bert, batch)
    assert collect(trainer)["activation_offload_tensors"] == 0
    trainer.compute_loss(tiny_bert, batch).backward()
    assert collect(trainer)["activation_offload_tensors"] > 0
    with pytest.raises(ValueError, match="already offloaded"):
        offload_activations(trainer)


def test_user_trainer_offload_verified_and_forgotten_line_caught(tmp_path):
    """A user's own Trainer: ``offload_activations(trainer)`` passes VerificationCallback; without it, it raises."""
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from hfscale.callbacks import VerificationCallback, attach
    from hfscale.measure.verify import VerificationError
    from hfscale.workload.data import make_classification_dataset

    strategy = Strategy(name="offload", device="cpu", per_device_batch_size=2, activation_offload=True)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=2, report_to="none",
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip

    def trainer(offload: bool) -> tuple[Trainer, VerificationCallback]:
        model = BertForSequenceClassification(BertConfig(**TINY_BERT))
        built = Trainer(model=model, args=args, train_dataset=make_classification_dataset(8, 16))
        if offload:
            offload_activations(built)
        verify = VerificationCallback(strategy)
        attach(built, verify)
        return built, verify

    with_line, verify = trainer(offload=True)
    with_line.train()
    assert verify.mismatches == [] and verify.record.activation_offload_tensors > 0
    without_line, _ = trainer(offload=False)
    with pytest.raises(VerificationError, match=r"activation offload was asked for .* hooks never ran"):
        without_line.train()


# -- the DeepSpeed JSON --------------------------------------------------------------------------------------------


def test_activation_checkpointing_section_read_by_deepspeed():
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    strategy = _cpu(
        "ds",
        gradient_checkpointing=True,
        deepspeed=DeepSpeedSpec(zero_stage=2, partition_activations=True, cpu_checkpointing=True),
    )
    config = deepspeed_config(strategy)
    parsed = DeepSpeedActivationCheckpointingConfig(config)
    assert parsed.partition_activations and parsed.cpu_checkpointing and not parsed.contiguous_memory_optimization
    assert "activation_checkpointing" not in deepspeed_config(_cpu("z", deepspeed=DeepSpeedSpec(zero_stage=2)))
    assert deepspeed_options_in_use() == []  # nothing configured in this process


def test_config_cli_prints_the_script_lines(tmp_path, capsys):
    from hfscale.commands.config import main as config_main

    argv = ["--out", str(tmp_path), "--device", "cpu", "--gradient-checkpointing", "--zero-stage", "1"]
    argv += ["--ds-partition-activations", "--ds-cpu-checkpointing", "--activation-offload"]
    assert config_main(argv) == 0
    out = capsys.readouterr().out
    assert "offload_activations(trainer)" in out and "use_deepspeed_checkpointing(trainer)" in out
    written = json.loads((tmp_path / "deepspeed.json").read_text())["activation_checkpointing"]
    assert written["partition_activations"] and written["cpu_checkpointing"]
    assert config_main(["--out", str(tmp_path / "x"), "--ds-cpu-checkpointing"]) == 2
    assert "--ds-cpu-checkpointing configure DeepSpeed ZeRO: add --zero-stage" in capsys.readouterr().err


# -- the estimate --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_estimate_keeps_one_layer_on_the_device(tiny_bert, checkpointing):
    from hfscale.estimate import activation_bytes, estimate_memory, model_shape_from_module

    shape = model_shape_from_module(tiny_bert)
    common = dict(batch_size=8, seq_len=128, precision="bf16", gradient_checkpointing=checkpointing)
    plain = activation_bytes(shape, device="cuda", **common)
    offloaded = activation_bytes(shape, device="cuda", activation_offload=True, **common)
    assert offloaded.saved == plain.per_layer < plain.saved
    assert offloaded.saved + offloaded.offloaded == plain.saved
    on_cpu = activation_bytes(shape, device="cpu", activation_offload=True, **common)
    assert on_cpu == activation_bytes(shape, device="cpu", **common)  # host memory already: nothing moves

    strategy = Strategy(name="s", precision="bf16", gradient_checkpointing=checkpointing, per_device_batch_size=8)
    before = estimate_memory(shape, strategy, seq_len=128)
    after = estimate_memory(shape, strategy.replace(activation_offload=True), seq_len=128)
    assert after.activations_gib * 2**30 == pytest.approx(plain.per_layer)
    assert after.activations_gib < before.activations_gib


# -- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_offload_lowers_peak_gpu_memory():
    """The activations of a forward pass leave the GPU: the peak between forward and backward drops."""
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(**(TINY_BERT | {"hidden_size": 256, "intermediate_size": 1024})))
    model.cuda().train()
    ids = torch.randint(100, 1000, (16, 512), device="cuda")
    labels = torch.zeros(16, dtype=torch.long, device="cuda")

    def peak(offload: bool) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if offload:
            with ActivationOffload():
                loss = model(input_ids=ids, labels=labels).loss
        else:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    peak(False)  # warm-up: cuBLAS workspaces, allocator pools
    plain, offloaded = peak(False), peak(True)
    assert offloaded < 0.8 * plain, (plain, offloaded)
