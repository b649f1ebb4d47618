"""What a run folder is missing: the recipe's trials without a row, split into those that were started (a trial
folder with logs: killed, or still running) and those that never started, with how far each started one got.

The recipe copy in the run folder (``recipe.yaml``) says which trials exist (only its trial names are read: the
copy was validated when its sweep started, and validating builds each model's config, which imports transformers
and torch); a trial folder holds the logs a started trial wrote. A folder that cannot be read as a recipe leaves
the count unknown, and the report says so.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hfscale.records.batch import max_batch_base
from hfscale.results.run_folder import STDERR_FILE, STDOUT_FILE, RunFolder

logger = logging.getLogger(__name__)

_LOG_READ_LIMIT = 8 * 2**20
"""Bytes of a log read to see how far a trial got (the whole log of any ordinary trial)."""
_LOSS_LINE = re.compile(r"\{'loss': ")
_EPOCH = re.compile(r"'epoch': '?([0-9.]+)'?")
_SIGNAL = re.compile(r"got signal: (\d+)|Signals\.(SIG[A-Z]+)|signal (\d+)")


@dataclass(frozen=True, kw_only=True)
class Interrupted:
    """A recipe trial that was started (its folder holds logs) but has no row."""

    trial: str
    progress: str
    """How far it got, from its logs (``logged 122 training steps (epoch 0.95)``)."""


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """The recipe's trials against the rows of the run."""

    recipe_trials: tuple[str, ...]
    """Every trial the recipe defines, in recipe order; empty when the recipe could not be read."""
    with_rows: tuple[str, ...]
    """Recipe trials with at least one row."""
    interrupted: tuple[Interrupted, ...] = ()
    never_started: tuple[str, ...] = ()
    not_in_recipe: tuple[str, ...] = ()
    """Trials with rows the recipe does not define (a recipe edited after the run)."""
    recipe_error: str | None = None
    """Why the recipe could not be read, if it could not."""
    workload: str | None = None
    """The user's own job the recipe names (its script with the arguments, or its model and data factories); None
    when the trials train the model and data hfscale builds."""
    workload_key: str | None = None
    """What the run trained, as one comparable text: the recipe copy's ``workload``, ``model`` and ``data``
    sections (:func:`workload_key`); None when the copy cannot be read."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def complete(self) -> bool:
        return bool(self.recipe_trials) and not self.interrupted and not self.never_started

    def sentence(self) -> str:
        """The coverage line of the report."""
        if not self.recipe_trials:
            why = f": {self.recipe_error}" if self.recipe_error else ""
            return f"Coverage unknown: the run folder has no readable recipe copy{why}."
        parts = [f"{len(self.with_rows)} of {len(self.recipe_trials)} recipe trials have a result."]
        if self.interrupted:
            listed = "; ".join(f"{i.trial} ({i.progress})" for i in self.interrupted)
            parts.append(f"Started but no result (interrupted or killed): {listed}.")
        if self.never_started:
            parts.append(f"Never started: {', '.join(self.never_started)}.")
        if self.not_in_recipe:
            parts.append(f"Not in the recipe copy: {', '.join(self.not_in_recipe)}.")
        return " ".join(parts)


def _read_tail(path: Path) -> str:
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            handle.seek(max(0, size - _LOG_READ_LIMIT))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def progress(trial_dir: Path) -> str:
    """How far a started trial got, from its logs: the training steps it logged (the Trainer's loss lines, one
    per logging step) and the last epoch, and the signal that ended it where the launcher recorded one."""
    logs = [p for p in (trial_dir / STDOUT_FILE, trial_dir / STDERR_FILE) if p.is_file()]
    logs += sorted(p for p in trial_dir.glob(f"repeat-*/{STDOUT_FILE}"))
    logs += sorted(p for p in trial_dir.glob(f"repeat-*/{STDERR_FILE}"))
    text = "\n".join(_read_tail(p) for p in logs)
    steps = len(_LOSS_LINE.findall(text))
    epochs = _EPOCH.findall(text)
    if steps:
        got = f"logged {steps} training steps" + (f", last at epoch {float(epochs[-1]):.2f}" if epochs else "")
    else:
        got = "no training step logged"
    signals = _SIGNAL.findall(text)
    if signals:
        number, name, plain = signals[-1]
        got += f"; ended by signal {number or name or plain}"
    return got


def _recipe_copy(path: Path) -> dict | None:
    """The recipe copy's YAML document, unvalidated; None when it cannot be read."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def workload_key(path: Path) -> str | None:
    """The recipe copy's ``workload``, ``model`` and ``data`` sections as one JSON text (keys sorted): two runs
    trained the same job when these are equal (:attr:`Coverage.workload_key`)."""
    import json

    data = _recipe_copy(path)
    if data is None:
        return None
    return json.dumps({key: data.get(key) for key in ("workload", "model", "data")}, sort_keys=True, default=str)


def recipe_workload(path: Path) -> str | None:
    """The user's own job a recipe copy names, as written (:attr:`Coverage.workload`): the script and its
    arguments, or the model and data factories; read without validating."""
    data = _recipe_copy(path) or {}
    raw = data.get("workload")
    if isinstance(raw, dict) and raw.get("script"):
        command = " ".join([Path(str(raw["script"])).name, *(str(a) for a in raw.get("args") or [])])
        return f"your own script, {command} (the recipe's workload:; a trial's script_args follow it)"
    factories = [
        f"{key} factory {Path(str(section['factory'])).name}"
        for key in ("model", "data")
        if isinstance(section := data.get(key), dict) and section.get("factory")
    ]
    return ", ".join(factories) if factories else None


def coverage(folder: RunFolder, row_trials: Iterable[str]) -> Coverage:
    """The run's coverage of its recipe (see :class:`Coverage`)."""
    # The names only: validating the recipe would build each model's config (transformers, torch: seconds).
    from hfscale.recipes.recipe import read_trial_names

    have = list(dict.fromkeys(row_trials))
    try:
        names = read_trial_names(folder.recipe_path) if folder.recipe_path.is_file() else []
        error = None if names else f"no {folder.recipe_path.name}"
    except (OSError, ValueError) as exc:
        names, error = [], str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        logger.warning("%s: cannot read the recipe copy: %s", folder.recipe_path, error)
    interrupted, never = [], []
    for name in names:
        if name in have:
            continue
        trial_dir = folder.trial_dir(name)
        started = trial_dir.is_dir() and (
            any((trial_dir / f).is_file() for f in (STDOUT_FILE, STDERR_FILE)) or any(trial_dir.glob("repeat-*"))
        )
        if started:
            interrupted.append(Interrupted(trial=name, progress=progress(trial_dir)))
        else:
            never.append(name)
    return Coverage(
        recipe_trials=tuple(names),
        with_rows=tuple(n for n in names if n in have),
        interrupted=tuple(interrupted),
        never_started=tuple(never),
        # A max-batch row (sweep.batch: both|max) is its recipe trial's, at another batch.
        not_in_recipe=tuple(n for n in have if names and n not in names and max_batch_base(n) not in names),
        recipe_error=error,
        workload=recipe_workload(folder.recipe_path),
        workload_key=workload_key(folder.recipe_path),
    )


__all__ = ["Coverage", "Interrupted", "coverage", "progress", "recipe_workload", "workload_key"]
