"""The technique protocol: what every module of :mod:`hfscale.techniques` provides, written down.

A technique is a way of training that the strategy asks for and that no generated file alone makes happen, or that
can silently not happen: tensor parallelism, LoRA, activation offloading, the kernels, FSDP on CPU, several
machines. Each lives in one module, which implements :class:`Technique` once and is registered in
:data:`hfscale.techniques.TECHNIQUES`. The trial runner (:mod:`hfscale.trial.train`) and the verification
(:mod:`hfscale.measure.verify`) iterate that registry instead of calling each technique by hand, so adding one is:
its module, its line in the registry, and its test.

A trial calls the members in this order, each for every registered technique:

1. :meth:`Technique.load_model`, then :meth:`Technique.adapt_model`, on the model the trial built;
2. :meth:`Technique.prepare_arguments`, just before ``TrainingArguments`` are built;
3. :meth:`Technique.apply`, on the Trainer, before ``train()``;
4. :meth:`Technique.collect`, from inside the run (the end of the first optimizer step), into the
   :class:`~hfscale.records.measurements.VerificationRecord`; then :meth:`Technique.check` compares the record
   with the strategy.

``hfscale config`` prints :meth:`Technique.script_lines` of the techniques in ``SCRIPT_ORDER`` for a user's own script.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from transformers import Trainer

    from hfscale.records.measurements import VerificationRecord
    from hfscale.strategy import Strategy
    from hfscale.workload.spec import TrialSpec

ScriptLine = tuple[str, str]
"""``(why, line)``: a line of Python a user's own training script needs, and why no generated file does it."""


@dataclass(frozen=True)
class TrainedRun:
    """What a technique reads back from inside a run (:meth:`Technique.collect`)."""

    trainer: Trainer
    """The Trainer that trained: its ``model_wrapped`` is what was stepped, its ``model`` the model inside."""
    world_size: int
    """Processes of the run (accelerate's ``num_processes``)."""
    attention_probe: Any = None
    """The :class:`hfscale.techniques.kernels.AttentionProbe` installed at train begin, or None (left unread)."""

    @property
    def model(self) -> Any:
        """The model the Trainer trained (``trainer.model``: unwrapped by DDP, DeepSpeed and compile)."""
        return self.trainer.model


class Technique:
    """One technique: what a trial does for it, how it is read back from a run, and what a user's script needs.

    Subclass it in the technique's module, override the members the technique has (each default does nothing), and
    register one instance in :data:`hfscale.techniques.TECHNIQUES`. A member that acts must act only when the
    strategy asks for the technique: every member is called for every strategy.

    Validation of the technique's fields is not a member: the fields are validated where they are declared
    (:mod:`hfscale.strategy`, frozen dataclasses whose errors name the field), and what needs the model or the
    installed libraries is checked when a recipe is loaded (:mod:`hfscale.recipes.checks` calls
    :func:`hfscale.techniques.kernels.check_liger_model_type`, :func:`hfscale.techniques.lora.default_target_modules`,
    :func:`hfscale.techniques.mesh.accelerate_parallelism_config` and :func:`hfscale.techniques.mesh.tp_plan_problem`),
    so a trial that cannot take effect is refused before anything runs.
    """

    name: ClassVar[str] = ""
    """The technique's name (its module's), unique in the registry."""

    def load_model(self, model: Any, spec: TrialSpec, scratch_dir: str | os.PathLike[str]) -> Any:
        """The model as this technique needs it loaded, in place of the one the trial built (tensor parallelism:
        saved and loaded back sharded along its plan); ``model`` itself when the strategy does not ask for it.

        Every technique's ``load_model`` runs before any ``adapt_model``, so an adaptation sees the final weights.
        ``scratch_dir`` is the trial's temporary folder (removed after the trial).
        """
        return model

    def adapt_model(self, model: Any, spec: TrialSpec, scratch_dir: str | os.PathLike[str]) -> Any:
        """The loaded model changed or wrapped for this technique before any Trainer sees it (LoRA: adapters on a
        frozen base); ``model`` itself when the strategy does not ask for it.

        Raises:
            ImportError: when the technique's optional dependency is missing, naming the pip extra.
        """
        return model

    def prepare_arguments(self, strategy: Strategy) -> dict[str, Any]:
        """Called just before ``TrainingArguments`` are built: process-wide adjustments that must precede them
        (FSDP on CPU), and the ``TrainingArguments`` keywords that cannot live in ``training_args.json`` (a mesh's
        ``ParallelismConfig`` object). Returns those keywords; ``{}`` for none."""
        return {}

    def apply(self, trainer: Trainer, strategy: Strategy) -> None:
        """Apply the technique to the built Trainer, before ``train()`` (activation offloading wraps its
        ``compute_loss``). Does nothing when the strategy does not ask for it."""

    def collect(self, run: TrainedRun) -> dict[str, Any]:
        """Read back from inside the run whether the technique took effect: this technique's
        :class:`~hfscale.records.measurements.VerificationRecord` fields, by name (no other technique's).

        A field that cannot be read (a library whose internals moved) is None, never guessed. Called on every rank;
        a collective here (a gather) must be one every rank makes.
        """
        return {}

    def check(self, strategy: Strategy, record: VerificationRecord) -> list[str]:
        """The ways ``record`` (what ran) differs from what ``strategy`` asks of this technique, one sentence each,
        naming the field asked for and what ran; empty when it took effect. A record field that is None (not read,
        or an older record) is not compared."""
        return []

    def script_lines(self, strategy: Strategy) -> list[ScriptLine]:
        """The lines a user's own training script needs for this technique beside the generated files (what
        ``hfscale config`` prints), in the order they go in the script; empty when none is needed."""
        return []


PATCH_MARKER = "_hfscale_patched"
"""The attribute that marks a library function hfscale replaced (:func:`patch_once`), so a second call is a no-op."""


def patch_once(owner: Any, name: str, patch: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``patch(original)``, once per process however often it is called.

    For the narrow adjustments a technique makes to a library (accelerate's checks that refuse a CPU run which
    works): the replacement keeps the original's name and docstring (``functools.wraps``) and carries
    :data:`PATCH_MARKER`, by which a second call recognises it.
    """
    original = getattr(owner, name)
    if getattr(original, PATCH_MARKER, False):
        return
    replacement = functools.wraps(original)(patch(original))
    setattr(replacement, PATCH_MARKER, True)
    setattr(owner, name, replacement)


__all__ = ["PATCH_MARKER", "ScriptLine", "Technique", "TrainedRun", "patch_once"]
