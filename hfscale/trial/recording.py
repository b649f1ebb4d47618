"""What a trial records beside the callbacks: the loss of every optimizer step, and the time of every phase."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import Trainer, TrainerCallback


class LossRecorder:
    """The training loss of every optimizer step, kept on the device during training and read once at the end.

    With ``logging_steps=1`` the Trainer would gather the loss across ranks and call ``.item()`` on every step: a
    host-device synchronisation (and an all-gather with several processes) inside every timed step, which a user's
    Trainer (logging every 500 steps by default) does not pay. Instead :meth:`wrap` keeps what each micro-batch's
    ``training_step`` returns (exactly what the Trainer adds to the loss it logs) as a detached device tensor, with
    the optimizer step it belongs to, and :meth:`curve` adds them up per step and averages over ranks, as the
    Trainer's logged loss does. Two differences, both on purpose: a NaN or inf loss is kept (the Trainer's
    ``logging_nan_inf_filter`` would log the running average instead; the parity check must see it), and every rank
    must run the same number of micro-batches (accelerate's default ``even_batches``) for the gather.
    """

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._losses: list[Any] = []

    def wrap(self, trainer: Trainer) -> None:
        """Record every ``training_step`` of ``trainer`` from now on."""
        inner = trainer.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = inner(*args, **kwargs)
            self._steps.append(trainer.state.global_step)
            self._losses.append(loss.detach().float().reshape(()))
            return loss

        trainer.training_step = training_step  # type: ignore[method-assign]

    def curve(self, trainer: Trainer) -> list[float]:
        """The loss per optimizer step, mean over ranks. Collective: call it on every rank."""
        import torch

        if not self._losses:
            return []
        local = torch.stack(self._losses)
        gathered = trainer.accelerator.gather(local).reshape(-1, len(self._losses)).mean(dim=0).tolist()
        per_step: dict[int, float] = {}
        for step, value in zip(self._steps, gathered, strict=True):
            per_step[step] = per_step.get(step, 0.0) + value
        return [per_step[step] for step in sorted(per_step)]


def train_phase_clock() -> TrainerCallback:
    from transformers import TrainerCallback

    class _TrainPhaseClock(TrainerCallback):
        """Marks the first step's start and training's end, to split ``train()`` into set-up and loop."""

        def __init__(self) -> None:
            self.train_begin: float | None = None
            self.train_end: float | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_begin = time.perf_counter()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.train_end = time.perf_counter()

    return _TrainPhaseClock()


class PhaseTimer:
    """Seconds per phase of a trial (the outcome's ``timings_s``): each :meth:`lap` is the time since the last."""

    def __init__(self, process_start: float | None) -> None:
        self.last = time.perf_counter()
        wall_start = time.time()
        self.process_start = wall_start if process_start is None else process_start
        """Epoch time the process started (``startup`` is the time from it to the runner)."""
        self.timings: dict[str, float] = {"startup": wall_start - self.process_start}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = now - self.last
        self.last = now


__all__ = ["LossRecorder", "PhaseTimer", "train_phase_clock"]
