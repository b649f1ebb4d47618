"""Where activations live between forward and backward: offloaded to host memory, or checkpointed by DeepSpeed.

Two techniques, each applied to a ``transformers.Trainer`` by one call after it is built, and each verified from
inside the run (README, "Activation offloading and DeepSpeed activation checkpointing"):

* :func:`offload_activations`: every tensor autograd saves for the backward pass during the Trainer's forward
  (``compute_loss``) goes through ``torch.autograd.graph.saved_tensors_hooks`` that copy it to host memory and
  bring it back when the backward pass needs it, as torch's ``save_on_cpu``, torchtune's ``OffloadActivations``
  and TRL's activation offloading do. Parameters and tensors under :data:`MIN_OFFLOAD_BYTES` stay where they are
  (copying a weight every step, or a scalar, costs more than it frees). It trades device memory (the saved
  activations, the largest part of the peak at long sequences) for two copies over PCIe per saved storage per step
  (one for all the tensors that view it). On a CPU run the tensors already live in host memory: the hooks run and
  count, nothing is copied.
* :func:`use_deepspeed_checkpointing`: the DeepSpeed JSON's ``activation_checkpointing`` section
  (``partition_activations``, ``cpu_checkpointing``, ...) configures ``deepspeed.checkpointing``, which a Hugging
  Face model never calls: transformers checkpoints its layers with ``torch.utils.checkpoint``, so the section alone
  changes nothing. This installs ``deepspeed.checkpointing.checkpoint`` as the model's checkpoint function
  (:mod:`hfscale.techniques.deepspeed_checkpointing`, re-exported here).

:data:`TECHNIQUE` applies both in a trial, reads them back (:func:`collect`) and checks them (:func:`check`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hfscale.techniques.base import ScriptLine, Technique, TrainedRun
from hfscale.techniques.deepspeed_checkpointing import (
    DS_OPTIONS,
    deepspeed_checkpoint_calls,
    deepspeed_checkpoint_function,
    deepspeed_options_in_use,
    install_deepspeed_checkpointing,
    use_deepspeed_checkpointing,
)

if TYPE_CHECKING:
    import torch
    from transformers import Trainer

    from hfscale.records.measurements import VerificationRecord
    from hfscale.strategy import Strategy

logger = logging.getLogger(__name__)

MIN_OFFLOAD_BYTES = 1024
"""Tensors smaller than this stay on the device (torchtune's ``min_offload_size`` default): a copy of a few bytes
costs a launch and frees nothing."""

_TRAINER_ATTRIBUTE = "_hfscale_activation_offload"
"""Where :func:`offload_activations` keeps its :class:`ActivationOffload` on the Trainer, for :func:`collect`."""


# --------------------------------------------------------------------------------------------------------------
# Activation offloading
# --------------------------------------------------------------------------------------------------------------


@dataclass
class OffloadCounts:
    """What the hooks handled in one forward pass.

    A storage is copied once however many times it is saved: autograd saves the same tensor for several
    operations, and views of one tensor (a transpose, a reshape) share its storage. Copying each save moved 1.4x
    the unique bytes on a tiny Llama (73 copies of 53 storages, 3.09 MiB against 2.18 MiB, in
    ``tests/techniques/test_activation_offload.py``), overstating the technique's cost.
    """

    tensors: int = 0
    """Storages moved to host memory (or, on a CPU run, already there and kept there), each counted once."""
    bytes: int = 0
    """Their size in bytes: what crosses the host link each way, per step."""
    saves: int = 0
    """Saved tensors the hooks took: ``tensors`` plus the saves of a storage already moved."""
    skipped: int = 0
    """Saved tensors left where they were: parameters, autocast's casts of trainable weights, and tensors under the
    size threshold."""


def _in_host_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` already lives in host memory (a CPU run): it is then kept as it is, nothing is copied."""
    return tensor.device.type == "cpu"


class _HostCopy:
    """One storage saved for backward, copied to host memory once; brought back once for all its views."""

    def __init__(self, storage: Any, device: torch.device, pin: bool) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef

        self.device = device
        # A freed storage's address can be reused by a later activation in the same forward: the weak reference
        # tells the storage that was copied from a new one at the same address.
        self.source = StorageWeakRef(storage)
        whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.host = torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(whole, non_blocking=pin)
        self._on_device: Any = None

    def storage(self) -> Any:
        """The storage on its device again, copied back at the first view's unpack and shared by the others (it
        lives as long as a saved view still needs it, as the original would have)."""
        if self._on_device is None:
            self._on_device = self.host.to(self.device, non_blocking=self.host.is_pinned()).untyped_storage()
        return self._on_device


_View = tuple["torch.dtype", "torch.Size", tuple[int, ...], int]
"""A saved tensor as a view of its storage: dtype, shape, strides, storage offset."""
_Packed = tuple["_HostCopy | torch.device | None", "torch.Tensor | _View"]
"""What a save becomes: (None, the tensor kept), (its device, its own host copy), or (the shared copy, the view)."""


class ActivationOffload:
    """A context manager: tensors saved for backward inside it are held in host memory until backward uses them.

    Usable on its own around any forward pass (``with ActivationOffload(): loss = model(**batch).loss``; the
    backward pass may run outside it: the hooks travel with each saved tensor). On CUDA the copy goes to pinned
    memory without blocking the host, ordered on the current stream, and comes back the same way. Each storage is
    copied once per forward pass, however many saved tensors view it; unpacking rebuilds each view (dtype, shape,
    strides, offset) on the one storage brought back.

    Args:
        min_bytes: tensors smaller than this stay on the device.
        pin_memory: copy into page-locked host memory (faster, asynchronous copies); None pins when CUDA is
            available.

    Attributes:
        first: the counts of the first forward pass run inside the context (the one verification reads).
        last: the counts of the latest forward pass.
    """

    def __init__(self, *, min_bytes: int = MIN_OFFLOAD_BYTES, pin_memory: bool | None = None) -> None:
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes: expected a non-negative integer of bytes, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.pin_memory = pin_memory
        self.first: OffloadCounts | None = None
        self.last = OffloadCounts()
        self._hooks: Any = None
        # (device, storage address, version) -> its host copy (None: in host memory already), for one forward pass.
        self._held: dict[tuple[Any, int, int], _HostCopy | None] = {}

    def __enter__(self) -> ActivationOffload:
        import torch

        if self.pin_memory is None:
            self.pin_memory = torch.cuda.is_available()
        self.last = OffloadCounts()
        self._held = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._held = {}  # the saved views keep their copies alive; this forward's deduplication is over
        if self.first is None:
            self.first = self.last

    def _stays(self, tensor: torch.Tensor) -> bool:
        import torch

        return (
            isinstance(tensor, torch.nn.Parameter)
            or tensor.layout != torch.strided
            or tensor.numel() * tensor.element_size() < self.min_bytes
            or _is_autocast_weight_cast(tensor)
        )

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        import torch

        if self._stays(tensor):
            self.last.skipped += 1
            return None, tensor
        self.last.saves += 1
        if type(tensor) is not torch.Tensor or tensor.is_conj() or tensor.is_neg():
            return self._pack_alone(tensor)  # a subclass or a lazy conjugate: no plain storage to share
        storage = tensor.untyped_storage()
        # The version is shared by every view of a storage and bumped by in-place writes: a storage written after
        # its first save is a new copy, never stale data.
        key = (tensor.device, storage.data_ptr(), tensor._version)
        if key not in self._held or (self._held[key] is not None and self._held[key].source.expired()):
            pin = bool(self.pin_memory)
            self._held[key] = None if _in_host_memory(tensor) else _HostCopy(storage, tensor.device, pin)
            self.last.tensors += 1
            self.last.bytes += storage.nbytes()
        held = self._held[key]
        if held is None:
            return None, tensor  # already in host memory
        return held, (tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _pack_alone(self, tensor: torch.Tensor) -> _Packed:
        """A tensor copied on its own (no storage to share): the way every save was handled before 0.4."""
        import torch

        self.last.tensors += 1
        self.last.bytes += tensor.numel() * tensor.element_size()
        if _in_host_memory(tensor):
            return None, tensor
        pin = bool(self.pin_memory)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        return tensor.device, host

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        import torch

        where, payload = packed
        if where is None:
            return payload  # type: ignore[return-value]
        if not isinstance(where, _HostCopy):
            return payload.to(where, non_blocking=payload.is_pinned())  # type: ignore[union-attr]
        dtype, size, stride, offset = payload  # type: ignore[misc]
        return torch.empty(0, dtype=dtype, device=where.device).set_(where.storage(), offset, size, stride)


def _is_autocast_weight_cast(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or the tensor it is a view of) is autocast's cast of a trainable weight.

    Under bf16/fp16 autocast a matmul saves the low-precision copy of its weight (often through a transpose view),
    a plain tensor whose ``grad_fn`` is ``ToCopyBackward0`` from the Parameter's ``AccumulateGrad``. Autocast
    keeps that copy in its cache for the whole forward pass, so copying it to host memory frees nothing on the
    device and only costs a transfer per step: it is left where it is (and counted as skipped). A cast of a
    Parameter made outside autocast is skipped too (rare; it is a weight, not an activation).
    """
    import torch

    base = tensor._base if tensor._base is not None else tensor
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":  # (autocast is switched off while its kernels run: no test)
        return False
    sources = fn.next_functions
    return len(sources) == 1 and isinstance(getattr(sources[0][0], "variable", None), torch.nn.Parameter)


def offload_activations(trainer: Trainer, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> ActivationOffload:
    """Offload the activations of ``trainer``'s training forward passes to host memory, from now on.

    Wraps the Trainer's ``compute_loss`` (the forward pass of ``training_step``; evaluation, run without gradients,
    is left alone) in an :class:`ActivationOffload` context; the backward pass brings each tensor back as it needs
    it. Add it after building the Trainer::

        trainer = Trainer(...)
        offload_activations(trainer)
        trainer.train()

    Returns:
        the context, whose ``first`` / ``last`` counts say what the hooks handled.

    Raises:
        ValueError: when the Trainer's activations are already offloaded, or it runs ``nn.DataParallel``.
    """
    if getattr(trainer, _TRAINER_ATTRIBUTE, None) is not None:
        raise ValueError("offload_activations: this Trainer's activations are already offloaded (called twice)")
    if getattr(trainer.args, "n_gpu", 1) > 1:
        # Saved-tensor hooks are thread-local, and nn.DataParallel runs each replica's forward in its own thread:
        # the replicas' activations would stay on their GPUs (checked: a thread's saves never reach the hooks).
        raise ValueError(
            f"offload_activations: the Trainer drives {trainer.args.n_gpu} GPUs through nn.DataParallel, whose "
            "replica threads the (thread-local) saved-tensor hooks do not reach; launch one process per GPU (DDP)"
        )
    offload = ActivationOffload(min_bytes=min_bytes)
    inner = trainer.compute_loss

    @functools.wraps(inner)
    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        import torch

        if not torch.is_grad_enabled():  # evaluation (prediction_step) saves nothing: not a training step
            return inner(*args, **kwargs)
        with offload:
            return inner(*args, **kwargs)

    trainer.compute_loss = compute_loss  # type: ignore[method-assign]
    setattr(trainer, _TRAINER_ATTRIBUTE, offload)
    return offload


# --------------------------------------------------------------------------------------------------------------
# The run: applied, collected, checked
# --------------------------------------------------------------------------------------------------------------


def apply(trainer: Trainer, strategy: Strategy) -> None:
    """Apply what ``strategy`` asks of activations to ``trainer`` (the trial runner's one call)."""
    if strategy.activation_offload:
        offload_activations(trainer)
    if strategy.ds_activation_checkpointing:
        use_deepspeed_checkpointing(trainer)


def script_lines(strategy: Strategy) -> list[ScriptLine]:
    """``(why, line)`` for a user's own script (``hfscale config``): no generated file turns these on."""
    lines = []
    if strategy.activation_offload:
        lines.append(
            (
                "activation offload is a hook around the Trainer's forward, not a TrainingArguments option: after "
                "building the Trainer, add",
                "from hfscale.techniques.activation_offload import offload_activations; offload_activations(trainer)",
            )
        )
    if strategy.ds_activation_checkpointing:
        lines.append(
            (
                "deepspeed.json's activation_checkpointing section alone changes nothing for a Hugging Face model "
                "(it checkpoints with torch.utils.checkpoint): after building the Trainer, add",
                "from hfscale.techniques.activation_offload import use_deepspeed_checkpointing; "
                "use_deepspeed_checkpointing(trainer)",
            )
        )
    return lines


def collect(trainer: Trainer) -> dict[str, Any]:
    """The :class:`~hfscale.records.measurements.VerificationRecord` fields of this module, read from ``trainer``:
    ``activation_offload_tensors`` (None without offloading) and ``ds_activation_checkpointing`` (None unless the
    model's checkpointed layers called DeepSpeed's function at least once; the options are DeepSpeed's process-wide
    settings, so they count only once a call went through them)."""
    offload: ActivationOffload | None = getattr(trainer, _TRAINER_ATTRIBUTE, None)
    tensors = None
    if offload is not None:
        counts = offload.first or offload.last
        tensors = counts.tensors
    ds_options = None
    if deepspeed_checkpoint_calls(trainer.model):  # installed and called: not only configured
        ds_options = deepspeed_options_in_use()
    return {"activation_offload_tensors": tensors, "ds_activation_checkpointing": ds_options}


def check(strategy: Strategy, record: VerificationRecord) -> list[str]:
    """The ways ``record`` differs from what ``strategy`` asks of activations, one sentence each."""
    problems = []
    tensors = record.activation_offload_tensors
    if strategy.activation_offload and not tensors:
        problems.append(
            "activation offload was asked for (strategy.activation_offload) but "
            + (
                "its hooks never ran: the Trainer's compute_loss was not wrapped "
                "(hfscale.techniques.activation_offload.offload_activations)"
                if tensors is None
                else "its hooks handled 0 saved tensors in the first training step"
            )
        )
    elif not strategy.activation_offload and tensors:
        problems.append(f"activations were offloaded ({tensors} tensors) but strategy.activation_offload is False")
    asked = strategy.ds_activation_checkpointing
    ran = record.ds_activation_checkpointing
    if asked and ran is None:
        problems.append(
            f"DeepSpeed activation checkpointing ({', '.join(asked)}) was asked for, but the model's checkpointed "
            "layers do not call deepspeed.checkpointing.checkpoint: the JSON's activation_checkpointing section "
            "alone changes nothing for a Hugging Face model "
            "(hfscale.techniques.activation_offload.use_deepspeed_checkpointing)"
        )
    elif asked and sorted(ran or []) != sorted(asked):
        problems.append(
            f"deepspeed.checkpointing runs with {', '.join(ran or []) or 'no options'}, "
            f"{', '.join(asked)} was asked for"
        )
    return problems


class ActivationMemory(Technique):
    """Where activations live between forward and backward (``strategy.activation_offload``,
    ``strategy.ds_activation_checkpointing``): hooks added to the built Trainer, read back from inside the run."""

    name = "activation_offload"

    def apply(self, trainer: Trainer, strategy: Strategy) -> None:
        apply(trainer, strategy)

    def collect(self, run: TrainedRun) -> dict[str, Any]:
        return collect(run.trainer)

    check = staticmethod(check)

    script_lines = staticmethod(script_lines)


TECHNIQUE = ActivationMemory()
"""This module's :class:`~hfscale.techniques.base.Technique` (registered in ``hfscale.techniques.TECHNIQUES``)."""

__all__ = [
    "DS_OPTIONS",
    "MIN_OFFLOAD_BYTES",
    "TECHNIQUE",
    "ActivationMemory",
    "ActivationOffload",
    "OffloadCounts",
    "apply",
    "check",
    "collect",
    "deepspeed_checkpoint_function",
    "deepspeed_options_in_use",
    "install_deepspeed_checkpointing",
    "offload_activations",
    "script_lines",
    "use_deepspeed_checkpointing",
]
