"""Device meshes: a strategy's ``parallelism`` as accelerate's ``ParallelismConfig``, a model's tensor-parallel plan,
and what ran, read from inside the run.

A :class:`~hfscale.strategy.ParallelismSpec` names the sizes of the mesh (``dp_replicate x dp_shard x tp x cp x
sp``); the strategy already refuses sizes that do not multiply to the process count, ``sp`` without DeepSpeed and
``dp_shard``/``cp`` without FSDP2. What needs the model or the libraries lives here:

* **Where the mesh is given.** ``accelerate launch`` passes a YAML ``parallelism_config`` section to the processes
  only with FSDP2 (``_validate_launch_command`` refuses ``use_parallelism_config`` otherwise), so the YAML carries it
  for FSDP2 strategies (:func:`accelerate_section`); every trial also hands the mesh to the Trainer as
  ``TrainingArguments(parallelism_config=...)`` (:func:`accelerate_parallelism_config`), the one way that works for
  all of them (a ``ParallelismConfig`` object cannot live in ``training_args.json``). That is the strategy's own
  mesh, except where transformers shards a tp model with HSDP itself (:func:`accelerate_mesh`).
* **Tensor parallelism needs the model sharded when it is loaded.** transformers splits the weights in
  ``from_pretrained(..., tp_plan="auto")`` following the config's ``base_model_tp_plan``; ``from_config`` takes
  no plan. :func:`load_tensor_parallel` saves the random model into the trial's scratch folder and loads it back
  sharded. A model type without a plan is refused when the recipe is loaded (:func:`tp_plan_problem`).
* **On CPU** accelerate 1.15 refuses any mesh on ``MULTI_CPU`` ("ParallelismConfig is only compatible
  DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED"), although every
  later step works over gloo: :func:`enable_mesh_on_cpu` lifts that one check, in the manner of
  :mod:`hfscale.techniques.fsdp_cpu`.
* **Verification.** :func:`collect` reads the mesh accelerate built and the DTensor placements of one Linear
  weight; :func:`check` compares them with the strategy, so a model that trained with plain weights while tp=2
  was asked is a ``not_applied`` row, not a silent one.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfscale.configs import fsdp as fsdp_configs
from hfscale.configs.accelerate import accelerate_section
from hfscale.techniques.base import ScriptLine, Technique, TrainedRun, patch_once

if TYPE_CHECKING:
    from accelerate import ParallelismConfig
    from transformers import PretrainedConfig, PreTrainedModel, Trainer

    from hfscale.records.measurements import VerificationRecord
    from hfscale.strategy import Strategy
    from hfscale.workload.spec import TrialSpec

logger = logging.getLogger(__name__)

MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
"""The mesh dimensions, in the order ``ParallelismSpec`` and accelerate's ``ParallelismConfig`` name them."""

SCRIPT_LINE = "import hfscale.techniques.mesh; hfscale.techniques.mesh.enable_mesh_on_cpu()"
"""The line a user's own script needs, before the Trainer, to run a device mesh on CPU processes."""

# Model types a user is likely to know, named first when a model without a tensor-parallel plan is refused.
_WELL_KNOWN = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "granite", "olmo2")


# --------------------------------------------------------------------------------------------------------------
# The strategy's mesh, as the tools take it
# --------------------------------------------------------------------------------------------------------------


def tensor_parallel(strategy: Strategy) -> bool:
    """Whether ``strategy`` splits Linear weights over a ``tp`` dimension wider than one."""
    return strategy.parallelism is not None and strategy.parallelism.tp > 1


def accelerate_parallelism_config(strategy: Strategy) -> ParallelismConfig | None:
    """accelerate's ``ParallelismConfig`` for ``strategy.parallelism`` (``TrainingArguments.parallelism_config``),
    or None without one. DeepSpeed's sequence parallel is ``sp_backend="deepspeed"`` (accelerate's only one).

    Raises:
        ImportError: when accelerate is missing.
        ValueError: what accelerate refuses in the sizes (context parallel beside replication alone, tensor parallel
            too before 1.16: ``dp_replicate > 1`` needs ``dp_shard > 1`` there).
    """
    p = strategy.parallelism
    if p is None:
        return None
    from accelerate import ParallelismConfig

    sizes = accelerate_mesh(strategy)
    return ParallelismConfig(**{f"{n}_size": sizes.get(n, 1) for n in MESH_DIMS}, sp_backend="deepspeed")


def accelerate_mesh(strategy: Strategy) -> dict[str, int]:
    """The mesh accelerate builds for ``strategy.parallelism`` (dimensions wider than one): the strategy's own, except
    where transformers shards the model with HSDP itself (:func:`~hfscale.configs.fsdp.fsdp_by_transformers`):
    accelerate then places the data over every data-parallel rank as one ``dp_shard``. The Trainer sets ``dp_shard``
    to that size and keeps a ``dp_replicate`` it is given (a mesh of 16 on 8 processes, measured, transformers 5.25)."""
    p = strategy.parallelism
    mesh = p.mesh() if p is not None else {}
    if p is not None and p.dp_replicate > 1 and fsdp_configs.fsdp_by_transformers(strategy):
        mesh = {"dp_shard": p.dp_replicate * p.dp_shard} | {n: s for n, s in mesh.items() if not n.startswith("dp_")}
    return mesh


# --------------------------------------------------------------------------------------------------------------
# The model's tensor-parallel plan
# --------------------------------------------------------------------------------------------------------------


def tp_plan(config: PretrainedConfig) -> dict[str, str]:
    """The model's tensor-parallel plan (``config.base_model_tp_plan``: module pattern -> ``colwise``/``rowwise``);
    empty when the model type has none."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


@functools.cache
def model_types_with_tp_plan() -> tuple[str, ...]:
    """The transformers model types whose config carries a tensor-parallel plan (imports every config class once:
    a few seconds, paid only when a message needs the list)."""
    from transformers import CONFIG_MAPPING

    types = []
    for name in list(CONFIG_MAPPING):
        try:
            cls = CONFIG_MAPPING[name]
        except Exception:  # a config whose optional dependency is missing
            continue
        if getattr(cls, "base_model_tp_plan", None):
            types.append(name)
    return tuple(sorted(types))


def tp_plan_problem(config: PretrainedConfig, strategy: Strategy) -> str | None:
    """Why ``strategy`` cannot split this model's Linear weights, or None when it can (or asks for no tp).

    transformers shards a model only along its config's ``base_model_tp_plan``; without one,
    ``from_pretrained(tp_plan="auto")`` has nothing to follow.
    """
    if not tensor_parallel(strategy) or tp_plan(config):
        return None
    with_plan = model_types_with_tp_plan()
    known = [t for t in _WELL_KNOWN if t in with_plan]
    model_type = getattr(config, "model_type", None) or type(config).__name__
    return (
        f"parallelism.tp={strategy.parallelism.tp} (strategy {strategy.name!r}) needs a model with a "  # type: ignore[union-attr]
        f"tensor-parallel plan, and model type {model_type!r} has none (its config's base_model_tp_plan is "
        f"empty); {len(with_plan)} model types have one, e.g. {', '.join(known)}; use one of them or parallelism.tp=1"
    )


def save_for_reload(model: PreTrainedModel, path: str | os.PathLike[str]) -> None:
    """Save ``model`` to be loaded straight back (tensor parallel, QLoRA), its fp32 tensors stored in bf16.

    Every rank saves its own copy into its own scratch folder (a rank cannot know when another has finished
    writing before the process group exists), so the copy is kept at half the bytes: 8 ranks of a Llama-3.2-1B
    write 8 x 2.5 GB instead of 8 x 5 GB. Load it back with ``dtype=torch.float32``: the weights are then the
    seeded random ones rounded to bf16 (identical on every rank), which a trial of random weights does not notice.
    Tied tensors stay tied (one cast per shared storage).
    """
    import torch

    casts: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.dtype != torch.float32:
            state[name] = tensor
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key not in casts:
            casts[key] = tensor.to(torch.bfloat16)
        state[name] = casts[key]
    model.save_pretrained(path, state_dict=state)


def load_tensor_parallel(model: PreTrainedModel, strategy: Strategy, scratch_dir: str | os.PathLike[str]) -> Any:
    """``model`` loaded back sharded over ``strategy.parallelism.tp`` ranks along its tensor-parallel plan.

    ``from_config`` takes no plan, so the (random) model is saved into ``scratch_dir/tp-model`` and loaded with
    ``from_pretrained(path, tp_plan="auto", tp_size=tp)``: every rank builds the same seeded model and saves its
    own copy (in bf16, :func:`save_for_reload`), so nothing is shared between ranks. Call it inside the process
    group (after the launcher set ``RANK``/``WORLD_SIZE``). Returns ``model`` unchanged when no tensor
    parallelism is asked.
    """
    if not tensor_parallel(strategy):
        return model
    path = Path(scratch_dir) / "tp-model"
    save_for_reload(model, path)
    # transformers 5 loads through DistributedConfig (tp_plan/tp_size as keywords are deprecated there); 4 without.
    if fsdp_configs.loads_with_distributed_config():
        from transformers.distributed import DistributedConfig

        sharding: dict[str, Any] = {"distributed_config": DistributedConfig(**distributed_config_kwargs(strategy))}
    else:
        sharding = {"tp_plan": "auto", "tp_size": strategy.parallelism.tp}  # type: ignore[union-attr]
    loaded = type(model).from_pretrained(path, dtype=model.dtype, **sharding)
    logger.info("model loaded sharded: %s", ", ".join(f"{k} {v}" for k, v in strategy.parallelism.mesh().items()))  # type: ignore[union-attr]
    return loaded


def distributed_config_kwargs(strategy: Strategy) -> dict[str, Any]:
    """transformers' ``DistributedConfig`` keywords for a tp model: its plan and tp size, and where transformers
    shards it with FSDP2 too (:func:`~hfscale.configs.fsdp.fsdp_by_transformers`), the FSDP size, offload and, under
    bf16, bf16 gathers (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: without it FSDP
    gathers the fp32 weights and bf16 is autocast alone, twice the gathered bytes the estimate counts)."""
    p = strategy.parallelism
    assert p is not None
    kwargs: dict[str, Any] = {"tp_plan": "auto", "tp_size": p.tp}
    if fsdp_configs.fsdp_by_transformers(strategy):
        kwargs["fsdp_size"] = p.dp_shard
        if p.dp_replicate > 1:
            kwargs["dp_replicate_size"] = p.dp_replicate
        if strategy.fsdp is not None and strategy.fsdp.cpu_offload:
            kwargs["fsdp_cpu_offload"] = True
        if strategy.precision == "bf16":
            kwargs["fsdp_mixed_precision"] = True
    return kwargs


def script_lines(strategy: Strategy) -> list[ScriptLine]:
    """``(why, line)`` for what a user's own script needs for ``strategy.parallelism`` beside the generated files
    (``hfscale config`` prints them): the adjustment on CPU, the model loaded along its plan, and the mesh for the
    Trainer. Empty without a mesh."""
    p = strategy.parallelism
    if p is None:
        return []
    lines = []
    if needed_on_cpu(strategy):
        lines.append(("your script needs this line before the Trainer (accelerate refuses a mesh on CPU)", SCRIPT_LINE))
    if p.tp > 1:
        lines.append(
            (
                "load the model sharded along its tensor-parallel plan (from_config takes none: save a random model "
                "first)"
                + (
                    "; transformers shards it with FSDP2 too (the configs give accelerate no FSDP)"
                    if fsdp_configs.fsdp_by_transformers(strategy)
                    else ""
                ),
                "model = AutoModelForCausalLM.from_pretrained(PATH, distributed_config=DistributedConfig("
                + ", ".join(f"{k}={v!r}" for k, v in distributed_config_kwargs(strategy).items())
                + "))",
            )
        )
    sizes = ", ".join(f"{n}_size={size}" for n, size in accelerate_mesh(strategy).items())
    sp = ", sp_backend='deepspeed'" if p.sp > 1 else ""
    lines.append(
        (
            "and give the Trainer the mesh (not JSON, so training_args.json cannot hold it)",
            f"TrainingArguments(..., parallelism_config=accelerate.ParallelismConfig({sizes}{sp}))",
        )
    )
    return lines


# --------------------------------------------------------------------------------------------------------------
# CPU: the one check accelerate makes that gloo does not need
# --------------------------------------------------------------------------------------------------------------


def needed_on_cpu(strategy: Strategy) -> bool:
    """Whether ``strategy`` runs a mesh on CPU processes, where :func:`enable_mesh_on_cpu` is needed."""
    return strategy.parallelism is not None and strategy.device == "cpu" and strategy.parallelism.size > 1


class _MultiDeviceView:
    """An accelerator as ``ParallelismConfig._validate_accelerator`` sees it, with ``MULTI_CPU`` counted as the
    multi-device kind it is (every other attribute is the accelerator's own)."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    @property
    def multi_device(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def enable_mesh_on_cpu() -> None:
    """Let accelerate accept a ``ParallelismConfig`` on CPU processes (``MULTI_CPU``), for the rest of this process.

    accelerate 1.15's ``ParallelismConfig._validate_accelerator`` accepts a mesh only for FSDP2, DeepSpeed and the
    ``MULTI_<ACCELERATOR>`` kinds. On ``MULTI_CPU`` the rest already works over gloo: the device mesh is built on
    ``cpu``, a tensor-parallel model is left unwrapped (``prepare_model`` takes its tensor-parallel branch before
    the ``MULTI_CPU`` DDP one), and the data loader gives every tensor-parallel rank the same batch. So only that
    check is told ``MULTI_CPU`` is multi-device; every other check of it still runs. Idempotent; it changes
    nothing for other distributed types. Whether the mesh then took effect is read by :func:`collect`.
    """
    from accelerate.parallelism_config import ParallelismConfig

    patch_once(ParallelismConfig, "_validate_accelerator", _multi_cpu_as_multi_device)


def _multi_cpu_as_multi_device(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ParallelismConfig._validate_accelerator`` shown a multi-process ``MULTI_CPU`` accelerator as multi-device."""
    from accelerate.utils import DistributedType

    def _validate_accelerator(self: Any, accelerator: Any) -> Any:
        if accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.use_distributed:
            return original(self, _MultiDeviceView(accelerator))
        return original(self, accelerator)

    return _validate_accelerator


def shared_batch() -> tuple[int, int]:
    """``(samples, tokens)``: how many ranks of this run count the same samples, and the same tokens, when every
    rank's batch is summed. The ranks of one tensor-parallel group get the same batch (accelerate's data loader);
    context parallel and DeepSpeed's sequence parallel give their ranks the same samples but split the sequence, so
    the tokens are counted once. ``(1, 1)`` without a mesh (or without accelerate state)."""
    try:
        from accelerate.state import AcceleratorState

        pc = AcceleratorState().parallelism_config if AcceleratorState._shared_state else None
    except (ImportError, AttributeError):
        return 1, 1
    if pc is None:
        return 1, 1
    tp, cp, sp = (int(getattr(pc, f"{n}_size", 1) or 1) for n in ("tp", "cp", "sp"))
    return tp * cp * sp, tp


# --------------------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------------------


def _mesh_sizes(state: Any) -> dict[str, int] | None:
    mesh = getattr(state, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) if mesh is not None else None
    if names:
        shape = tuple(mesh.shape)  # type: ignore[union-attr]
        sizes = {n: int(s) for n, s in zip(names, shape, strict=False) if n in MESH_DIMS and s > 1}
        return dict(sorted(sizes.items(), key=lambda item: MESH_DIMS.index(item[0])))
    pc = getattr(state, "parallelism_config", None)  # DeepSpeed's sequence parallel builds no torch mesh
    if pc is None:
        return None
    sizes = {n: int(getattr(pc, f"{n}_size", 1) or 1) for n in MESH_DIMS}
    # The config is what hfscale passed; the sequence-parallel size is read from the groups DeepSpeed built.
    sizes["sp"] = _deepspeed_sequence_parallel_size()
    return {n: s for n, s in sizes.items() if s > 1}


def _deepspeed_sequence_parallel_size() -> int:
    """The size of the sequence-parallel group DeepSpeed built in this process, 1 when it built none (or DeepSpeed
    is missing or not started). deepspeed 0.19.8 has no public reader: this is the one accelerate itself calls
    (``deepspeed.utils.groups._get_sequence_parallel_world_size``), which answers 1 without a group."""
    try:
        from deepspeed import comm as ds_dist
        from deepspeed.utils import groups
    except ImportError:
        return 1
    try:
        if not ds_dist.is_initialized():
            return 1
        return int(groups._get_sequence_parallel_world_size())
    except (AttributeError, AssertionError, KeyError, RuntimeError):
        return 1


TP_DIM = "tp"
"""The name of the tensor-parallel mesh dimension: accelerate's ``ParallelismConfig`` mesh and the mesh
transformers builds for ``DistributedConfig(tp_plan="auto")`` both call it ``tp`` (measured on CPU: a Linear weight
of the tp=2 trial is recorded ``tp=Shard(dim=0)``). A mesh without names falls back to any ``Shard``."""


def _linear_weight_placements(model: Any) -> str | None:
    """The placements of the first ``nn.Linear`` weight that is a DTensor, None when every one is plain: per named
    mesh dimension (``"tp=Shard(dim=0)"``, ``"dp_shard=Shard(dim=0), tp=Shard(dim=0)"``) when its mesh names them, else
    ``str(placements)`` (``"(Shard(dim=0),)"``)."""
    import torch
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and isinstance(module.weight, DTensor):
            placements = tuple(module.weight.placements)
            names = getattr(module.weight.device_mesh, "mesh_dim_names", None)
            if names and len(names) == len(placements):
                return ", ".join(f"{n}={p!r}" for n, p in zip(names, placements, strict=True))
            return str(placements)
    return None


def placements_by_dim(placements: str | None) -> dict[str, str] | None:
    """A recorded placements string read back per mesh dimension (``{"tp": "Shard(dim=0)"}``), None when it names
    no dimension (an unnamed mesh's ``"(Shard(dim=0),)"``, or no DTensor)."""
    if not placements:
        return None
    pairs = re.findall(r"(\w+)=(\w+\([^)]*\))", placements)
    return dict(pairs) or None


def collect(trainer: Trainer) -> dict[str, Any]:
    """``device_mesh`` and ``linear_weight_placements`` of a :class:`~hfscale.records.measurements.VerificationRecord`,
    read from accelerate's state (the mesh it built, dimension -> size for those wider than one) and from the
    model the Trainer stepped (the placements of its first DTensor Linear weight)."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState()
    return {
        "device_mesh": _mesh_sizes(state),
        "linear_weight_placements": _linear_weight_placements(trainer.model),
    }


def check(strategy: Strategy, rec: VerificationRecord) -> list[str]:
    """How the mesh that ran differs from ``strategy.parallelism``, one sentence each (empty: it took effect).

    The mesh accelerate built must have the asked sizes (:func:`accelerate_mesh`: the replicas folded into
    ``dp_shard`` where transformers shards a tp model with HSDP itself); under tensor parallelism a Linear weight
    must be a DTensor sharded (``Shard``) over it, over the ``tp`` dimension where the mesh names its dimensions
    (FSDP2 shards the same weight over ``dp_shard``, which is no proof of tensor parallelism); a weight that is a plain
    tensor is the fallback this catches (the model was not loaded with its plan, or a library dropped it). A
    record from before these fields were read (``device_mesh`` None without any mesh asked) is left alone.
    """
    problems: list[str] = []
    p = strategy.parallelism
    asked = accelerate_mesh(strategy)
    if asked and rec.device_mesh != asked:
        ran = ", ".join(f"{k} {v}" for k, v in (rec.device_mesh or {}).items()) or "none"
        want = ", ".join(f"{k} {v}" for k, v in asked.items())
        own = ", ".join(f"{k} {v}" for k, v in p.mesh().items()) if p is not None else ""
        whose = "parallelism asks for" if own == want else f"accelerate's mesh for parallelism {own} is"
        problems.append(f"the device mesh that ran is {ran}, {whose} {want}")
    if tensor_parallel(strategy):
        by_dim = placements_by_dim(rec.linear_weight_placements)
        if rec.linear_weight_placements is None:
            problems.append(
                f"the Linear weights are plain tensors, parallelism.tp={p.tp} asks for them sharded: the model was "  # type: ignore[union-attr]
                "not split along its tensor-parallel plan"
            )
        elif by_dim is not None:  # a named mesh: FSDP2's own Shard over dp_shard is not tensor parallel
            if "Shard" not in by_dim.get(TP_DIM, ""):
                problems.append(
                    f"a Linear weight is placed {rec.linear_weight_placements}, parallelism.tp={p.tp} asks for it "  # type: ignore[union-attr]
                    f"sharded over the {TP_DIM!r} mesh dimension: the model was not split along its tensor-parallel "
                    "plan"
                )
        elif "Shard" not in rec.linear_weight_placements:
            problems.append(
                f"a Linear weight is placed {rec.linear_weight_placements} (replicated), parallelism.tp={p.tp} asks "  # type: ignore[union-attr]
                "for it sharded"
            )
    elif rec.linear_weight_placements is not None and strategy.fsdp is None:
        problems.append(
            f"a Linear weight is a DTensor placed {rec.linear_weight_placements}, but {strategy.describe()!r} keeps "
            "plain weights"
        )
    return problems


class Mesh(Technique):
    """A device mesh (``strategy.parallelism``): the model loaded sharded under tensor parallelism, the mesh handed
    to ``TrainingArguments``, and the mesh and placements read back."""

    name = "mesh"

    def load_model(self, model: Any, spec: TrialSpec, scratch_dir: str | os.PathLike[str]) -> Any:
        # Process-wide and idempotent; made before loading, as a user's script makes it (script_lines).
        if needed_on_cpu(spec.strategy):
            enable_mesh_on_cpu()
        return load_tensor_parallel(model, spec.strategy, scratch_dir)

    def prepare_arguments(self, strategy: Strategy) -> dict[str, Any]:
        # An object, kept apart from the JSON-able keywords the result records.
        if strategy.parallelism is None:
            return {}
        return {"parallelism_config": accelerate_parallelism_config(strategy)}

    def collect(self, run: TrainedRun) -> dict[str, Any]:
        return collect(run.trainer)

    check = staticmethod(check)

    script_lines = staticmethod(script_lines)


TECHNIQUE = Mesh()
"""This module's :class:`~hfscale.techniques.base.Technique` (registered in ``hfscale.techniques.TECHNIQUES``)."""

__all__ = [
    "MESH_DIMS",
    "SCRIPT_LINE",
    "TECHNIQUE",
    "Mesh",
    "accelerate_mesh",
    "accelerate_parallelism_config",
    "accelerate_section",
    "check",
    "collect",
    "enable_mesh_on_cpu",
    "load_tensor_parallel",
    "model_types_with_tp_plan",
    "needed_on_cpu",
    "placements_by_dim",
    "save_for_reload",
    "script_lines",
    "shared_batch",
    "tensor_parallel",
    "tp_plan",
    "tp_plan_problem",
]
