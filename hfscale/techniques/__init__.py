"""Techniques: one module per way of training that a strategy asks for, each behind :class:`~.base.Technique`.

:data:`TECHNIQUES` is the one place they are registered. The trial runner and the verification iterate it instead
of calling each technique by hand, so adding one is: its module (a :class:`~.base.Technique` subclass and its
``TECHNIQUE`` instance), its line here, and its test in ``tests/techniques/``.
"""

from __future__ import annotations

from hfscale.techniques import activation_offload, fsdp_cpu, kernels, lora, mesh, multi_machine
from hfscale.techniques.base import Technique, TrainedRun

TECHNIQUES: tuple[Technique, ...] = (
    kernels.TECHNIQUE,
    activation_offload.TECHNIQUE,
    lora.TECHNIQUE,
    multi_machine.TECHNIQUE,
    mesh.TECHNIQUE,
    fsdp_cpu.TECHNIQUE,
)
"""Every technique, in the order the verification reports their mismatches (:func:`hfscale.measure.verify.check`).

Each member of the protocol is called for every technique in this order (a technique acts only when the strategy
asks for it). A trial runs every technique's :meth:`~.base.Technique.load_model` before any
:meth:`~.base.Technique.adapt_model`, so an adaptation (LoRA) sees the model as loaded (tensor parallel) whatever
their places here; ``hfscale config`` prints the script lines in :data:`SCRIPT_ORDER`."""

SCRIPT_ORDER: tuple[Technique, ...] = (
    mesh.TECHNIQUE,  # the mesh's CPU adjustment, before the model is loaded
    fsdp_cpu.TECHNIQUE,  # accelerate's state, before TrainingArguments
    kernels.TECHNIQUE,  # the attention kernel, chosen when the model is built
    lora.TECHNIQUE,  # the LoraConfig (and QLoRA's BitsAndBytesConfig) keywords
    activation_offload.TECHNIQUE,  # offload hooks and DeepSpeed's checkpoint function, on the Trainer
)
"""The techniques whose :meth:`~.base.Technique.script_lines` a user's own script may need, in the order those
lines go in it (:func:`hfscale.commands.config.script_lines`); every technique that has script lines is here."""

__all__ = ["SCRIPT_ORDER", "TECHNIQUES", "Technique", "TrainedRun"]
