"""hfscale.techniques.kernels: torch.compile, attention implementation, TF32 and Liger, generated and verified from
inside
real tiny CPU Trainer runs (compile with the ``eager`` backend: inductor costs ~30 s on CPU), GPU parts marked."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from hfscale.configs import training_args_kwargs
from hfscale.records.measurements import VerificationRecord
from hfscale.strategy import CompileSpec, Strategy, StrategyError
from hfscale.techniques import kernels
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, TrialSpec

TINY = dict(
    vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip
DATA = DataSpec(num_samples=32, seq_len=32, token_high=1000)


def _strategy(**changes) -> Strategy:
    return Strategy(device="cpu", optimizer="adamw_torch", per_device_batch_size=4, **changes)


def _train(strategy: Strategy, tmp_path, *, steps: int = 5, training_args: dict | None = None, attn=None):
    """Train the tiny BERT in this process with the Throughput and Verification callbacks (warn mode)."""
    from transformers import Trainer, TrainingArguments, set_seed

    from hfscale.callbacks import ThroughputCallback, VerificationCallback, attach
    from hfscale.workload.data import make_dataset
    from hfscale.workload.model import build_model

    torch._dynamo.reset()  # dynamo's counters are per process: start each run from zero
    set_seed(0)
    model = build_model(ModelSpec(type="bert", config=TINY), DATA, attn_implementation=attn)
    kwargs = training_args_kwargs(strategy) if training_args is None else training_args
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        dataloader_pin_memory=False,
        **kwargs,
    )
    throughput = ThroughputCallback(warmup_steps=1)
    verify = VerificationCallback(strategy, on_mismatch="warn")
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=make_dataset(DATA, "classification"),
        callbacks=[throughput, verify],
    )
    attach(trainer, throughput, verify)
    trainer.train()
    return verify, throughput


# -- generators ----------------------------------------------------------------------------------------------------


def test_training_args_carry_compile_tf32_and_liger():
    cuda = Strategy(torch_compile=CompileSpec(backend="inductor", mode="max-autotune"), tf32=True)
    kwargs = training_args_kwargs(cuda)
    assert kwargs["torch_compile"] is True
    assert kwargs["torch_compile_backend"] == "inductor"
    assert kwargs["torch_compile_mode"] == "max-autotune"
    assert kwargs["tf32"] is True
    assert "use_liger_kernel" not in kwargs
    assert training_args_kwargs(Strategy(use_liger_kernel=True))["use_liger_kernel"] is True
    # Unset, transformers turns TF32 on by itself for torch_compile on Ampere+: a compiled fp32 row says False.
    assert training_args_kwargs(Strategy(torch_compile=CompileSpec()))["tf32"] is False
    plain = training_args_kwargs(_strategy())
    assert not {"torch_compile", "tf32", "use_liger_kernel", "attn_implementation"} & set(plain)


def test_the_real_training_arguments_take_them():
    from transformers import TrainingArguments

    kwargs = training_args_kwargs(_strategy(torch_compile=CompileSpec(backend="aot_eager")))
    args = TrainingArguments(output_dir="unused", **kwargs)
    assert (args.torch_compile, args.torch_compile_backend, args.torch_compile_mode) == (True, "aot_eager", "default")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_build_model_takes_the_attention_implementation(attn):
    from hfscale.workload.model import build_config, build_model

    spec = ModelSpec(type="bert", config=TINY)
    assert build_model(spec, DATA, attn_implementation=attn).config._attn_implementation == attn
    assert build_config(spec, DATA, attn_implementation=attn)._attn_implementation == attn


def test_config_cli_tells_a_script_how_to_set_attention():
    from hfscale.commands.config import script_lines

    lines = [line for _, line in script_lines(_strategy(attn_implementation="eager"), "cfg")]
    assert any("attn_implementation='eager'" in line and "from_pretrained" in line for line in lines)
    assert not any("attn_implementation" in line for _, line in script_lines(_strategy(), "cfg"))


def test_config_cli_flags_make_the_strategy(tmp_path):
    import json

    from hfscale.commands.config import main

    out = tmp_path / "cfg"
    assert main(["--out", str(out), "--device", "cpu", "--compile", "aot_eager", "--attn", "eager"]) == 0
    args = json.loads((out / "training_args.json").read_text(encoding="utf-8"))
    assert (args["torch_compile"], args["torch_compile_backend"]) == (True, "aot_eager")
    strategy = json.loads((out / "strategy.json").read_text(encoding="utf-8"))
    assert strategy["attn_implementation"] == "eager" and strategy["torch_compile"]["backend"] == "aot_eager"
    assert main(["--out", str(tmp_path / "x"), "--compile-mode", "max-autotune"]) == 2


def test_a_compiled_ddp_model_is_still_seen_as_ddp(tmp_path):
    """accelerate compiles after wrapping in DDP: the wrapper check looks inside the compile wrapper."""
    import torch.distributed as dist

    from hfscale.measure.verify import _wrapper_kind

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2)), backend="eager")
        assert _wrapper_kind(compiled) == "none"
        assert _wrapper_kind(kernels.uncompiled(compiled)) == "DDP"
    finally:
        dist.destroy_process_group()


class _OwnForward(torch.nn.Module):
    """A model class of this test's own: dynamo keeps compiled code on the ``forward`` code object, which no other
    test compiles."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def test_compiling_another_function_does_not_make_an_uncompiled_model_pass():
    """The model is wrapped by torch.compile but its forward ran eagerly (the module inside the wrapper was
    called), while another function in the process was compiled: the process-wide graph count said "compiled";
    the model's own forward code holds no compiled code, so it is not."""
    x = torch.randn(2, 4)
    compiled = torch.compile(_OwnForward(), backend="eager")
    compiled._orig_mod(x)
    torch.compile(lambda t: t * 2 + 1, backend="eager")(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert kernels.compile_facts(compiled)["compiled"] is False

    compiled(x)  # now through dynamo: the forward's own code is compiled by this wrapper's backend
    facts = kernels.compile_facts(compiled)
    assert facts["compiled"] is True and facts["compile_backend"] == "eager"
    # Another wrapper of the same class with a different backend has compiled nothing of its own.
    assert kernels.compile_facts(torch.compile(_OwnForward(), backend="aot_eager"))["compiled"] is False


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"])
def test_compile_mode_is_read_back_and_a_mismatch_caught(mode):
    """inductor keeps the mode as its options only (``triton.cudagraphs`` for reduce-overhead, ...): the mode is
    read back from them, and a strategy asking for another mode gets a mismatch naming both."""
    facts = kernels.compile_facts(torch.compile(_OwnForward(), mode=mode))  # built, not run: no inductor compile
    assert facts["compile_backend"] == "inductor" and facts["compile_mode"] == mode
    ran = _record(**(facts | {"compiled": True}))
    assert kernels.check(Strategy(torch_compile=CompileSpec(mode=mode)), ran) == []
    other = "max-autotune" if mode != "max-autotune" else "default"
    problems = kernels.check(Strategy(torch_compile=CompileSpec(mode=other)), ran)
    assert problems == [f"torch.compile ran in mode {mode!r}, torch_compile.mode={other!r} was asked for"]


# -- verified from inside real runs --------------------------------------------------------------------------------


def test_compiled_run_is_verified_and_compile_time_is_apart(tmp_path):
    strategy = _strategy(torch_compile=CompileSpec(backend="eager"))
    verify, throughput = _train(strategy, tmp_path, steps=6)
    rec = verify.record
    assert verify.mismatches == []
    assert rec.compiled is True and rec.compile_backend == "eager"
    # hfscale's own probes must not split the compiled model (they did: 8 graph breaks, the encoder run eagerly).
    assert rec.compile_graph_breaks == 0
    summary = throughput.summary
    assert summary.first_step_s is not None and summary.step_time_min_s is not None
    # The compilation is in the first step. Against the fastest step: a median was outrun under a busy machine (a
    # test of the same pytest run beside it).
    assert summary.first_step_s > 5 * summary.step_time_min_s


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_implementation_is_verified(tmp_path, attn):
    verify, _ = _train(_strategy(attn_implementation=attn), tmp_path, steps=2, attn=attn)
    assert verify.mismatches == []
    assert verify.record.attn_implementation == attn
    assert verify.record.attention_scores_kept is (attn == "eager")
    assert verify.record.compiled is False


def test_sdpa_asked_but_eager_ran_is_caught(tmp_path, monkeypatch):
    """A kernel registry that silently dispatches 'sdpa' to eager attention: the config still says sdpa."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.bert.modeling_bert import eager_attention_forward

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", eager_attention_forward)
    monkeypatch.setitem(
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["eager"]
    )
    verify, _ = _train(_strategy(attn_implementation="sdpa"), tmp_path, steps=2, attn="sdpa")
    assert verify.record.attn_implementation == "sdpa"
    assert any("eager attention ran" in m for m in verify.mismatches), verify.mismatches


def test_compile_asked_but_not_compiled_makes_the_row_not_applied(tmp_path):
    """The strategy asks for compile, but the TrainingArguments that ran lack it (a script that dropped them)."""
    from hfscale.trial.train import run_trial

    strategy = _strategy(name="compiled", torch_compile=CompileSpec(backend="eager"))
    spec = TrialSpec(
        name="compiled",
        model=ModelSpec(type="bert", config=TINY),
        data=DATA,
        strategy=strategy,
        measure=MeasureSpec(warmup_steps=1, max_steps=3),
    )
    without_compile = {k: v for k, v in training_args_kwargs(strategy).items() if not k.startswith("torch_compile")}
    torch._dynamo.reset()
    outcome = run_trial(spec, strategy_kwargs=without_compile)
    assert outcome.status == "not_applied"
    assert outcome.verification.compiled is False
    assert any("not compiled" in m for m in outcome.mismatches), outcome.mismatches


# -- the checker on records ----------------------------------------------------------------------------------------


def _record(**changes) -> VerificationRecord:
    base = VerificationRecord(
        distributed_type="NO", world_size=1, device="cuda", mixed_precision="no", wrapper="none",
        wrapper_class="x", params_total=1, compiled=False, tf32_matmul=False,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("strategy", "record", "expected"),
    [
        (Strategy(tf32=True), _record(tf32_matmul=False), "TF32 matmuls are not allowed"),
        (Strategy(torch_compile=CompileSpec()), _record(compiled=True, tf32_matmul=True), "turns TF32 on"),
        (Strategy(torch_compile=CompileSpec()), _record(compiled=True, compile_backend="eager"), "backend 'eager'"),
        (Strategy(), _record(compiled=True, compile_backend="inductor"), "asks for no torch_compile"),
        (Strategy(torch_compile=CompileSpec(mode="max-autotune")),
         _record(compiled=True, compile_backend="inductor", compile_mode="default"), "mode 'default'"),
        (Strategy(attn_implementation="flash_attention_2", precision="bf16"), _record(attn_implementation="sdpa"),
         "'sdpa'.*'flash_attention_2' was asked"),
        (Strategy(attn_implementation="eager"), _record(attn_implementation="eager", attention_scores_kept=False),
         "no seq x seq"),
        (Strategy(use_liger_kernel=True), _record(), "no module of the model runs a Liger kernel"),
        (Strategy(), _record(liger_patched=["LlamaRMSNorm"]), "patched LlamaRMSNorm"),
    ],
)  # fmt: skip
def test_each_kernel_mismatch_is_named(strategy, record, expected):
    import re

    problems = kernels.check(strategy, record)
    assert any(re.search(expected, p) for p in problems), problems


def test_matching_kernels_have_no_mismatch():
    strategy = Strategy(tf32=True, torch_compile=CompileSpec(), attn_implementation="sdpa", use_liger_kernel=True)
    record = _record(
        compiled=True, compile_backend="inductor", tf32_matmul=True, attn_implementation="sdpa",
        attention_scores_kept=False, liger_patched=["LlamaRMSNorm"],
    )  # fmt: skip
    assert kernels.check(strategy, record) == []


# -- TF32 and MFU --------------------------------------------------------------------------------------------------


@pytest.fixture
def tf32_on():
    """TF32 set as transformers 5 sets it on torch >= 2.9 (torch.backends.fp32_precision; a flag, fine on CPU)."""
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision API")
    previous, matmul = torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    # "none" inherits the global setting; an earlier test that set the legacy allow_tf32 leaves "ieee" here.
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.fp32_precision = "tf32"
    yield
    torch.backends.fp32_precision = previous
    torch.backends.cuda.matmul.fp32_precision = matmul


def test_tf32_flag_is_read_through_the_new_api(tf32_on):
    assert kernels.tf32_matmul_enabled() is True


def test_mfu_divides_by_the_tf32_peak_when_tf32_is_on(tf32_on):
    """Reading the legacy allow_tf32 after the new API raises; compute_dtype used to swallow it and say fp32."""
    from hfscale.measure.flops import DEVICE_PEAK_FLOPS, compute_dtype, peak_flops_per_s

    args = types.SimpleNamespace(bf16=False, fp16=False, tf32=None)
    assert compute_dtype(args, observed="float32") == "tf32"
    # H100 SXM dense TF32: 989.4 TFLOP/s with 2:4 sparsity, halved (NVIDIA H100 datasheet; flops.py cites it).
    assert peak_flops_per_s("NVIDIA H100 80GB HBM3", "tf32") == DEVICE_PEAK_FLOPS["H100 SXM"]["tf32"] == 494.7e12


def test_tf32_off_by_default():
    from hfscale.measure.flops import compute_dtype

    assert kernels.tf32_matmul_enabled() is False
    assert compute_dtype(types.SimpleNamespace(bf16=False, fp16=False, tf32=None), observed="float32") == "fp32"


# -- Liger ---------------------------------------------------------------------------------------------------------


def test_liger_refuses_a_model_type_it_does_not_patch():
    with pytest.raises(StrategyError, match=r"use_liger_kernel=True with model type 'bert'.*supported types: .*llama"):
        kernels.check_liger_model_type(Strategy(use_liger_kernel=True), "bert")
    kernels.check_liger_model_type(Strategy(use_liger_kernel=True), "llama")
    kernels.check_liger_model_type(Strategy(), "bert")


def test_recipe_with_liger_on_bert_is_refused(tmp_path):
    from hfscale.recipes.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(
        "name: r\nmodel: {type: bert, config: {vocab_size: 1000, hidden_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 2, intermediate_size: 128}}\ndata: {token_high: 1000}\n"
        "trials: [{name: liger, use_liger_kernel: true}]\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match=r"use_liger_kernel.*'bert'.*llama"):
        load_recipe(path)


def test_liger_patched_modules_are_read_from_their_forward():
    """Liger binds its forward on the instance (_bind_method_to_module); a function from liger_kernel shows it."""
    patched = types.ModuleType("liger_kernel.transformers.rms_norm")
    exec("def forward(self, x):\n    return x\n", patched.__dict__)
    patched.forward.__module__ = "liger_kernel.transformers.rms_norm"
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    model[0].__dict__["forward"] = patched.forward.__get__(model[0], type(model[0]))
    assert kernels.liger_patched_modules(model) == ["LayerNorm"]
    assert kernels.liger_patched_modules(torch.nn.Linear(2, 2)) == []


# -- the estimate follows the attention implementation -------------------------------------------------------------


def _saved_bytes(attn: str) -> int:
    """Bytes of the distinct storages autograd saves in one training forward of the tiny BERT (fp32, batch 4 x 32)."""
    from hfscale.workload.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelSpec(type="bert", config=TINY), DATA, attn_implementation=attn).train()
    storages: dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 1000, (4, 32)), labels=torch.zeros(4, dtype=torch.long))
    return sum(storages.values())


def test_estimate_activations_follow_the_attention_implementation():
    """Hand-derived, fp32, attention dropout 0, b=4, s=32, a=2, 2 layers: eager keeps the fp32 softmax output per
    layer (a·s²·b x 4 bytes), which is also the tensor the value matmul reads (no cast, no dropout: not a second
    copy); the fused path keeps a log-sum-exp (4·b·a·s bytes) instead.
    2 x (2·32²·4·4 - 4·4·2·32) = 2 x (32,768 - 1,024) = 63,488 bytes, and autograd saves exactly that much more."""
    from hfscale.estimate import estimate_memory

    spec = ModelSpec(type="bert", config=TINY)
    parts = {}
    for attn in ("eager", "sdpa"):
        est = estimate_memory(spec, _strategy(attn_implementation=attn), seq_len=32, data=DATA)
        parts[attn] = est.activation_parts
    assert parts["eager"]["attention_path"].startswith("eager")
    assert parts["sdpa"]["attention_path"].startswith("sdpa fused")
    assert parts["eager"]["layers_kept_bytes"] - parts["sdpa"]["layers_kept_bytes"] == 63_488
    assert _saved_bytes("eager") - _saved_bytes("sdpa") == 63_488


# -- GPU (skipped without CUDA) ------------------------------------------------------------------------------------


def _gpu_train(strategy: Strategy, tmp_path, model_spec: ModelSpec, attn=None):
    from transformers import Trainer, TrainingArguments

    from hfscale.callbacks import ThroughputCallback, VerificationCallback, attach
    from hfscale.workload.data import make_dataset
    from hfscale.workload.model import build_model

    model = build_model(model_spec, DATA, attn_implementation=attn)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, report_to="none", save_strategy="no", **training_args_kwargs(strategy)
    )
    throughput = ThroughputCallback(warmup_steps=1)
    verify = VerificationCallback(strategy, on_mismatch="warn")
    trainer = Trainer(
        model=model, args=args, train_dataset=make_dataset(DATA, model_spec.task), callbacks=[throughput, verify]
    )
    attach(trainer, throughput, verify)
    trainer.train()
    return verify, throughput


@pytest.mark.gpu
def test_tf32_is_verified_on_gpu(tmp_path):
    strategy = Strategy(tf32=True, per_device_batch_size=4)
    verify, throughput = _gpu_train(strategy, tmp_path, ModelSpec(type="bert", config=TINY))
    assert verify.mismatches == [] and verify.record.tf32_matmul is True
    assert throughput.summary.compute_dtype == "tf32"


@pytest.mark.gpu
def test_flash_attention_2_is_verified_on_gpu(tmp_path):
    pytest.importorskip("flash_attn")
    llama = ModelSpec(
        type="llama", task="causal_lm",
        config=dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=128),
    )  # fmt: skip
    strategy = Strategy(precision="bf16", attn_implementation="flash_attention_2", per_device_batch_size=4)
    verify, _ = _gpu_train(strategy, tmp_path, llama, attn="flash_attention_2")
    assert verify.mismatches == [] and verify.record.attention_scores_kept is False


@pytest.mark.gpu
def test_liger_is_verified_on_gpu(tmp_path):
    pytest.importorskip("liger_kernel")
    llama = ModelSpec(
        type="llama", task="causal_lm",
        config=dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=128),
    )  # fmt: skip
    strategy = Strategy(use_liger_kernel=True, per_device_batch_size=4)
    verify, _ = _gpu_train(strategy, tmp_path, llama)
    assert verify.mismatches == [] and "LlamaRMSNorm" in verify.record.liger_patched
