"""What every hfscale callback shares: binding to its Trainer, logging through it, and the rank helpers.

How a callback reaches ``Trainer.log``: the Trainer builds each log dict inside its own methods and gives callbacks
no hook in between, and the ``report_to`` integrations run before user callbacks in ``on_log``, so adding keys to
someone else's log in ``on_log`` would reach ``log_history`` but not TensorBoard/W&B. Instead each callback keeps a
weak reference to its Trainer: the one given to :func:`attach` (or ``callback.bind(trainer)``), else, as a fallback
for a callback passed in ``Trainer(callbacks=[...])`` and never bound, the Trainer found at train begin in the
caller frames of the ``on_train_begin`` event (checked to be a ``transformers.Trainer`` whose handler holds this
callback). At the end of the last step it calls ``Trainer.log(trainer, summary)``: one log event of its own, which
the Trainer appends to ``log_history`` and dispatches to every callback, exactly as its own loss logs. The
``should_log`` flag that this event resets is restored, so the Trainer's own loss log for that step still happens.
Where no Trainer is found (a custom loop calling the hooks), the summary is still computed and written; only the
log event is skipped, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

_BATCH_KEYS: tuple[str, ...] = ("input_ids", "inputs_embeds", "input_values", "pixel_values", "labels")
_TOKEN_KEYS: frozenset[str] = frozenset({"input_ids", "inputs_embeds"})


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _find_trainer(callback: TrainerCallback) -> Any | None:
    """The ``transformers.Trainer`` whose event is running this callback, found in the caller frames, or None.

    Called once per training run (on_train_begin); a frame is accepted only if its ``self`` is a Trainer whose
    callback handler holds this very callback object.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            handler = getattr(candidate, "callback_handler", None)
            if handler is not None and any(cb is callback for cb in handler.callbacks):
                return candidate
        frame = frame.f_back
    return None


def _trains(trainer: Any, model: Any) -> bool:
    """Whether ``model`` (an event's) is ``trainer``'s: its model, or the one its callbacks are given (FSDP1 swaps
    ``trainer.model`` for its wrapper; the callback handler keeps the original)."""
    handler = getattr(trainer, "callback_handler", None)
    return trainer.model is model or getattr(handler, "model", None) is model


def _batch_counts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """``(samples, tokens)`` in one forward call's inputs: the first dimension of ``input_ids`` (or the first batch
    key present, or the first positional tensor), and samples x sequence length for token inputs; ``(0, 0)`` when
    no input has a shape."""
    for key in _BATCH_KEYS:
        value = kwargs.get(key)
        if value is not None and hasattr(value, "shape"):
            break
    else:
        key, value = "", args[0] if args and hasattr(args[0], "shape") else None
    if value is None or len(value.shape) == 0:
        return 0, 0
    samples = int(value.shape[0])
    tokens = samples * int(value.shape[1]) if key in _TOKEN_KEYS and len(value.shape) >= 2 else 0
    return samples, tokens


def _write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class _TrainerBoundCallback(TrainerCallback):
    """A callback that calls into its Trainer (``Trainer.log``, the wrapped model): bound explicitly with
    :meth:`bind` (or :func:`attach`), else found in the caller frames at train begin."""

    def bind(self, trainer: Any) -> _TrainerBoundCallback:
        """Tie this callback to ``trainer`` (a weak reference), so it never searches the call stack for it.

        Returns the callback. Raises:
            TypeError: when ``trainer`` is not a ``transformers.Trainer``.
            ValueError: when this callback is not among ``trainer``'s callbacks (add it first, or use :func:`attach`).
        """
        from transformers import Trainer

        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"{type(self).__name__}.bind: expected a transformers.Trainer, got {type(trainer).__name__}"
            )
        if not any(cb is self for cb in trainer.callback_handler.callbacks):
            raise ValueError(
                f"{type(self).__name__}.bind: this callback is not among the Trainer's callbacks; pass it in "
                "Trainer(callbacks=[...]) or use hfscale.callbacks.attach(trainer, callback)"
            )
        self._bound_ref = weakref.ref(trainer)
        return self

    def _begin_run(self, model: Any = None) -> None:
        """Find the Trainer of the run beginning (``model``: the one ``on_train_begin`` was given): the bound one if
        it is that run's (a callback bound to one Trainer and reused in another must report to the other), else
        the Trainer whose on_train_begin event is running."""
        bound = getattr(self, "_bound_ref", None)
        trainer = bound() if bound is not None else None
        if trainer is not None and model is not None and not _trains(trainer, model):
            trainer = None  # bound to another Trainer than the one training now
        if trainer is None:
            trainer = _find_trainer(self)
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None
        self._finished = False

    def _trainer(self) -> Any | None:
        ref = getattr(self, "_trainer_ref", None)
        return ref() if ref is not None else None

    def _log(self, control: Any, payload: dict[str, Any]) -> None:
        trainer = self._trainer()
        if trainer is None:
            logger.warning(
                "%s: no transformers.Trainer bound (hfscale.callbacks.attach) or found calling this callback; the "
                "summary is computed but not logged",
                type(self).__name__,
            )
            return
        if not payload:
            return
        from transformers import Trainer

        should_log = control.should_log
        # The base class's log, not a subclass override: some (TRL's trainers) drain their own accumulated metrics
        # into whatever is logged, which would move them from the loss log into this one.
        Trainer.log(trainer, dict(payload))
        # Trainer.log resets should_log through the callback handler; restore it so the Trainer's own log for this
        # step (the loss) still happens.
        control.should_log = should_log


def attach(trainer: Any, *callbacks: TrainerCallback) -> None:
    """Add ``callbacks`` to ``trainer`` (those it does not hold yet) and bind each hfscale callback to it.

    The explicit alternative to the call-stack search: use it after building the Trainer, before ``train()``::

        trainer = Trainer(model=model, args=args, train_dataset=data)
        attach(trainer, MemoryCallback(), VerificationCallback("configs/zero3"))

    Raises:
        TypeError: when ``trainer`` is not a ``transformers.Trainer``.
    """
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(f"attach: expected a transformers.Trainer, got {type(trainer).__name__}")
    for callback in callbacks:
        if not any(cb is callback for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(callback)
        if isinstance(callback, _TrainerBoundCallback):
            callback.bind(trainer)


class _SummaryCallback(_TrainerBoundCallback):
    """Finds the Trainer at train begin, finishes once (at the last step's end, else at train end), logs, writes."""

    def _finish(self, args: Any, state: Any, control: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # DefaultFlowCallback (always first in the handler) has already decided whether this was the last step;
        # finishing here, before the Trainer's own end-of-training log and before the report_to integrations
        # close their writers in on_train_end, puts the figures in the same log stream as the loss.
        if control.should_training_stop or (state.max_steps > 0 and state.global_step >= state.max_steps):
            self._finish(args, state, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Training stopped some other way (early stopping, a short iterable data set): finish now.
        self._finish(args, state, control)


__all__ = ["attach"]
