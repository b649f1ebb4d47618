"""Checks that the strategy asked for is the one that runs, at the end of the first optimizer step."""

from __future__ import annotations

import logging
import os
from typing import Any, Literal, get_args

from hfscale.callbacks.base import _batch_counts, _TrainerBoundCallback, _write_json
from hfscale.core.collective import all_gather_object
from hfscale.measure.verify import LinearDtypeProbe, VerificationRecord
from hfscale.strategy import Strategy
from hfscale.techniques.kernels import AttentionProbe
from hfscale.techniques.mesh import shared_batch

logger = logging.getLogger(__name__)

OnMismatch = Literal["raise", "warn"]


class VerificationCallback(_TrainerBoundCallback):
    """Checks, at the end of the first optimizer step, that what trains is the strategy that was asked for.

    Many misconfigurations raise nothing (FSDP on CPU runs as DDP, fp16 on CPU stays fp32, a ZeRO stage or an
    8-bit optimizer that never took effect), so the exit code of a run proves little. This callback reads what
    runs from the objects that train (:func:`hfscale.measure.verify.collect`: distributed type, wrapper, ZeRO stage and
    offload, parameters held per rank, the dtype an ``nn.Linear`` produced in the first forward, the optimizer and
    its state dtypes, checkpointing, and the samples of the first optimizer step counted in the batches across
    ranks) and compares it with the strategy (:func:`hfscale.measure.verify.check`). The end of the first step is the
    earliest point where all of it exists: the model is wrapped at train begin, the compute dtype shows in the first
    forward, and optimizer states are created by the first step. A run too short to reach it is checked at train
    end.

    On a mismatch it raises :class:`hfscale.measure.verify.VerificationError` (``on_mismatch="raise"``, the default: the
    run stops) or logs a warning and trains on (``"warn"``). Either way the record is logged once through
    ``Trainer.log`` (``log_history`` and every ``report_to`` integration) and, with ``output_path``, written as JSON
    by the main process (``{"ok", "strategy", "mismatches", "record"}``); after the check ``record`` and
    ``mismatches`` hold it on every rank.

    Cost: the check runs once; under several processes it gathers two small objects from every rank (parameters
    held and the mismatches, so every rank stops or goes on together), which falls in the second timed step of a
    :class:`ThroughputCallback` (a warm-up step unless ``warmup_steps`` < 2; under ``"auto"`` only when the detected
    warm-up reaches it, else its small cost is measured with that step). Every rank must have this callback.

    Logged keys (``verify/`` + every field of :class:`hfscale.measure.verify.VerificationRecord` that was read, flags as
    0/1 and lists joined with commas):

    ============================ ==================================================================================
    ``verify/ok``                1 when what runs is what was asked, else 0
    ``verify/mismatches``        how many ways it differs
    ``verify/reason``            the mismatches in words (only when there are some)
    ``verify/distributed_type``  accelerate's distributed type (``NO``, ``MULTI_CPU``, ``DEEPSPEED``, ``FSDP``, ...)
    ``verify/wrapper``           ``none``, ``DDP``, ``DeepSpeedEngine``, ``FSDP2``, ``FSDP1``
    ``verify/zero_stage``        the DeepSpeed engine's ZeRO stage (DeepSpeed only)
    ``verify/params_total``      parameter elements of the whole model
    ``verify/params_local_max``  parameter elements on the fullest rank (``verify/params_sharded``: below total)
    ``verify/linear_output_dtype``  what an ``nn.Linear`` produced in the first forward
    ``verify/optimizer_class``   the innermost optimizer (``verify/optimizer_state_dtypes``: its states' dtypes)
    ``verify/global_batch_size`` samples in the first optimizer step, all ranks
    ``verify/gradient_checkpointing``  1 when activations are recomputed
    ============================ ==================================================================================

    Args:
        strategy: the :class:`~hfscale.strategy.Strategy` asked for, or the folder ``hfscale config --out`` wrote
            (its ``strategy.json``), or that file.
        on_mismatch: ``"raise"`` to stop the run, ``"warn"`` to log and train on.
        output_path: where the main process writes the verification as JSON; None writes nothing.

    Raises:
        ValueError: for an unknown ``on_mismatch`` or an invalid ``strategy.json``.
        FileNotFoundError: when a folder holds no ``strategy.json``.
    """

    def __init__(
        self,
        strategy: Strategy | str | os.PathLike[str],
        *,
        on_mismatch: OnMismatch = "raise",
        output_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if on_mismatch not in get_args(OnMismatch):
            raise ValueError(f"on_mismatch: expected one of {', '.join(get_args(OnMismatch))}, got {on_mismatch!r}")
        if not isinstance(strategy, Strategy):
            from hfscale.configs import read_strategy

            strategy = read_strategy(strategy)
        self.strategy = strategy
        self.on_mismatch = on_mismatch
        self.output_path = output_path
        self.record: VerificationRecord | None = None
        self.mismatches: list[str] = []
        self._params_total: int | None = None

    def bind(self, trainer: Any) -> VerificationCallback:
        super().bind(trainer)
        self._params_total = None  # another Trainer's model, if it was bound or built with one before
        if trainer.model_wrapped is trainer.model:  # not wrapped yet: FSDP1 keeps only its shard once it is
            self._count_parameters(trainer.model)
        return self

    # -- events ------------------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._count_parameters(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._begin_run(model)
        self.record = None
        self.mismatches = []
        self._samples = 0
        self._remove_hooks()
        self._probe: LinearDtypeProbe | None = None
        self._attention_probe: AttentionProbe | None = None
        if model is not None:
            self._probe = LinearDtypeProbe(model)
            self._attention_probe = AttentionProbe(model)
            self._hook = model.register_forward_pre_hook(self._count_samples, with_kwargs=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not getattr(self, "_finished", True):
            self._verify(state, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not getattr(self, "_finished", True):
            self._verify(state, control)

    # -- the check ---------------------------------------------------------------------------------------------

    def _count_parameters(self, model: Any) -> None:
        from hfscale.measure.verify import count_parameters_held

        self._params_total, _ = count_parameters_held(model)  # each Trainer's model: at its init, or when bound

    def _count_samples(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training:
            self._samples += _batch_counts(args, kwargs)[0]

    def _remove_hooks(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()
        self._hook = None
        probe = getattr(self, "_probe", None)
        if probe is not None:
            probe.remove()
        if getattr(self, "_attention_probe", None) is not None:
            self._attention_probe.remove()

    def _verify(self, state: Any, control: Any) -> None:
        from hfscale.measure.verify import VerificationError, check, collect

        self._finished = True
        self._remove_hooks()
        samples = sum(all_gather_object(self._samples))  # collective, like collect(): every rank gets here
        samples //= shared_batch()[0]  # the ranks of one tensor/context-parallel group share their samples
        trainer = self._trainer()
        if trainer is None:
            record = None
            mismatches = [
                "no transformers.Trainer bound to VerificationCallback (hfscale.callbacks.attach) or found calling "
                "it, so what runs could not be read"
            ]
        else:
            record = collect(
                trainer,
                self._probe,
                params_total=self._params_total,
                samples_per_step=samples or None,
                attention_probe=self._attention_probe,
            )
            mismatches = check(self.strategy, record)
        # Every rank must stop or go on together: a rank that raised alone would leave the others in a collective.
        mismatches = list(dict.fromkeys(m for rank in all_gather_object(mismatches) for m in rank))
        self.record, self.mismatches = record, mismatches
        payload: dict[str, Any] = {"verify/ok": int(not mismatches), "verify/mismatches": len(mismatches)}
        if mismatches:
            payload["verify/reason"] = "; ".join(mismatches)
        if record is not None:
            payload |= record.log_dict()
        self._log(control, payload)
        if self.output_path is not None and state.is_world_process_zero:
            _write_json(
                self.output_path,
                {
                    "ok": not mismatches,
                    "strategy": self.strategy.to_dict(),
                    "mismatches": mismatches,
                    "record": record.to_dict() if record is not None else None,
                },
            )
        if not mismatches:
            logger.info("VerificationCallback: %s runs as asked", self.strategy.describe())
            return
        message = f"what runs is not what was asked ({self.strategy.describe()}): " + "; ".join(mismatches)
        if self.on_mismatch == "raise":
            raise VerificationError(message, mismatches)
        logger.warning("VerificationCallback: %s", message)


__all__ = ["OnMismatch", "VerificationCallback"]
