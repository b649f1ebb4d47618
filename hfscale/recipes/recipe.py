"""Recipes: one YAML file -> a validated list of trials for a sweep.

A recipe names what is trained (the model and the dummy data), how it is measured, and the strategies to compare.
It is read by :func:`hfscale.recipes.yaml_text.read_recipe_yaml` (a key given twice refused) and walked against the
dataclass fields it fills; an unknown key, a value of the wrong type or a choice out of range fails before any
process starts, with the file and the dotted key path::

    recipes/x.yaml: trials[2].deepspeed.zero_stage: expected one of 0, 1, 2, 3, got 4

Format (every section but ``trials``/``matrix`` is optional)::

    name: cpu_small                  # defaults to the file's stem
    description: what this compares
    device: cpu                      # cuda | cpu, for every trial
    model: {type: bert, task: classification, config: {hidden_size: 64, num_hidden_layers: 2}}
    data: {num_samples: 128, seq_len: 128}
    training_args: {learning_rate: 5.0e-5, logging_steps: 1}   # passed to TrainingArguments
    measure: {warmup_steps: 2, num_epochs: 1, timeout_s: 600}
    run: {memory_limit_gib: 8, env: {OMP_NUM_THREADS: "1"}}     # how each trial's processes are started
    sweep: {batch: both}             # fixed | max | both: also compare each trial at the largest batch it fits
    baseline: fp32                   # the trial others are compared with (default: the first)
    defaults: {per_device_batch_size: 8}                      # Strategy fields applied to every trial
    trials:                          # Strategy fields, plus optional per-trial `measure:` / `run:` /
      - name: fp32                   # `training_args:` overrides (merged over the recipe's, key by key)
      - {name: lr-too-high, training_args: {learning_rate: 10}}
      - {name: bf16, precision: bf16, batch: max}                 # this trial at its largest batch only
      - {name: zero2-x2, deepspeed: {zero_stage: 2}, num_processes: 2}
    matrix:                          # the product of the axes, each trial named from its values (zero2-bf16)
      deepspeed.zero_stage: [1, 2]
      precision: [fp32, bf16]

A trial that does not set ``num_processes`` (nor ``num_machines``) takes the count of the sweep's launch (the outer
``accelerate launch``, or ``--num-processes``); see :meth:`Recipe.resolve`.

This module is the loader; the types it builds are in :mod:`hfscale.recipes.schema`, the trials and matrix as
written in :mod:`hfscale.recipes.entries`, and the checks beyond types in :mod:`hfscale.recipes.checks`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfscale.core.units import noise_floor_spec
from hfscale.core.validation import Invalid, build, convert, field_types, given, join_path, reject_unknown, show_value
from hfscale.recipes.catalog import recipe_names, shipped_recipe
from hfscale.recipes.checks import (
    check_batch_fits_data,
    check_data,
    check_epoch_steps,
    check_folder_name,
    check_lengths,
    check_liger,
    check_lora,
    check_measure,
    check_measured_steps,
    check_model,
    check_tensor_parallel,
)
from hfscale.recipes.entries import (
    TrialEntry,
    check_partial_strategy,
    expand_matrix,
    merge_fields,
    trial_entries,
    undot,
)
from hfscale.recipes.schema import (
    BatchMode,
    Recipe,
    RecipeError,
    RecipeTrial,
    RunSpec,
    ShippedRecipe,
    SweepOptions,
)
from hfscale.recipes.training_args import (
    OWNED_TRAINING_ARGS,
    REFUSED_TRAINING_ARGS,
    check_trainer_accepts,
    check_training_args,
)
from hfscale.recipes.workload import check_script_trial, parse_workload, recipe_folder, resolve_factories
from hfscale.recipes.yaml_text import read_recipe_yaml
from hfscale.records.batch import MAX_BATCH_SUFFIX
from hfscale.strategy import Device, Strategy
from hfscale.workload.spec import DataSpec, MeasureSpec, ModelSpec, ScriptSpec, TrialSpec

_TOP_KEYS = (
    "name",
    "description",
    "device",
    "model",
    "data",
    "training_args",
    "measure",
    "run",
    "sweep",
    "baseline",
    "defaults",
    "trials",
    "matrix",
    "workload",
)


def parse_recipe(data: Any, *, source: str = "<recipe>", default_name: str = "recipe") -> Recipe:
    """A :class:`Recipe` from already-parsed YAML data.

    Args:
        data: the YAML document (a mapping).
        source: shown at the start of every error message (the file name).
        default_name: the recipe's name when the document sets none.

    Raises:
        RecipeError: naming the source and the dotted key path of the first problem.
    """
    try:
        return _parse(data, default_name=default_name, source=source)
    except Invalid as exc:
        raise _located(source, exc) from None


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Load and validate a recipe file, or a shipped recipe by name (``cpu_small``; ``hfscale recipes`` lists them).

    Raises:
        FileNotFoundError: when it is neither a file nor a shipped recipe's name; the message lists the names.
        RecipeError: when it is not valid YAML or not a valid recipe; the message names the file and key path.
    """
    source, data = read_recipe_yaml(path)
    return parse_recipe(data, source=source, default_name=Path(source).stem)


def read_trial_names(path: str | os.PathLike[str]) -> list[str]:
    """The names of a recipe's trials, in recipe order, as :func:`load_recipe` names them, without validating it.

    For reading a finished run (the report's coverage line reads the run folder's recipe copy): validating builds
    each model's config, which imports transformers and torch, about 10 s of a report on 2 cores, and a run
    folder's copy was validated when its sweep started. Only what decides the names is checked.

    Raises:
        FileNotFoundError: as :func:`load_recipe`.
        RecipeError: when the file is not YAML, or its trials or matrix cannot be read; names the file and key path.
    """
    source, data = read_recipe_yaml(path)
    return _trial_names(source, data)


def _trial_names(source: str, data: Any) -> list[str]:
    try:
        if not isinstance(data, dict):
            raise Invalid("", f"expected a mapping at the top level, got {show_value(data)}")
        entries = trial_entries(given(data, "trials", []))
        if data.get("matrix") is not None:
            entries += expand_matrix(data["matrix"])
    except Invalid as exc:
        raise _located(source, exc) from None
    return [entry.name for entry in entries]


def _located(source: str, exc: Invalid) -> RecipeError:
    return RecipeError(f"{source}: {exc.path}: {exc.message}" if exc.path else f"{source}: {exc.message}")


@dataclass(frozen=True, kw_only=True)
class _Shared:
    """What every trial of a recipe shares (its top-level sections), for building each trial."""

    device: Device
    model: ModelSpec
    data: DataSpec
    training_args: dict[str, Any]
    measure_raw: dict[str, Any]
    run_raw: dict[str, Any]
    defaults: dict[str, Any]
    batch: BatchMode
    script: ScriptSpec | None = None


def _parse(data: Any, *, default_name: str, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise Invalid("", f"expected a mapping at the top level, got {show_value(data)}")
    reject_unknown(data, _TOP_KEYS, "")
    name = convert(str, data.get("name", default_name), "name")
    check_folder_name(name, "name")
    description = convert(str, data.get("description", ""), "description")
    device = convert(field_types(Recipe)["device"], data.get("device", "cuda"), "device")
    model = resolve_factories(build(ModelSpec, given(data, "model", {}), "model"), source)
    data_spec = resolve_factories(build(DataSpec, given(data, "data", {}), "data"), source)
    script = parse_workload(data, source)
    if script is None:
        check_data(data_spec)
        check_model(model, data_spec)
        check_lengths(model, data_spec)
    measure_raw = given(data, "measure", {})
    measure = build(MeasureSpec, measure_raw, "measure")
    check_measure(measure, "measure")
    run_raw = given(data, "run", {})
    run = build(RunSpec, run_raw, "run")
    training_args = convert(dict[str, Any], given(data, "training_args", {}), "training_args")
    training_args = check_training_args(training_args)
    sweep = _with_noise_floor(build(SweepOptions, given(data, "sweep", {}), "sweep"), source)
    defaults = given(data, "defaults", {})
    if not isinstance(defaults, dict):
        raise Invalid("defaults", f"expected a mapping of strategy fields, got {show_value(defaults)}")
    check_partial_strategy(defaults, "defaults")

    entries = trial_entries(given(data, "trials", []))
    if data.get("matrix") is not None:
        entries += expand_matrix(data["matrix"])
    if not entries:
        raise Invalid("", "no trials: give a `trials:` list and/or a `matrix:` of strategy axes")
    shared = _Shared(
        device=device, model=model, data=data_spec, training_args=training_args, measure_raw=measure_raw,
        run_raw=run_raw, defaults=undot(defaults), batch=sweep.batch, script=script,
    )  # fmt: skip
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.name in seen:
            fix = (
                "a matrix names its trials from their values, and these differ where the name does not show: list "
                "them under trials: with names of their own"
                if entry.path.startswith("matrix") and seen[entry.name].startswith("matrix")
                else "give each trial a unique name"
            )
            raise Invalid(entry.path, f"duplicate trial name {entry.name!r} (also {seen[entry.name]}); {fix}")
        seen[entry.name] = entry.path
    trials = [_build_trial(entry, shared) for entry in entries]
    baseline = data.get("baseline", trials[0].name)
    convert(str, baseline, "baseline")
    _check_names(trials, baseline)
    _check_search(sweep, trials)
    return Recipe(
        name=name,
        description=description,
        device=device,
        model=model,
        data=data_spec,
        training_args=training_args,
        measure=measure,
        run=run,
        sweep=sweep,
        baseline=baseline,
        trials=tuple(trials),
        path=source,
    )


def _build_trial(entry: TrialEntry, shared: _Shared) -> RecipeTrial:
    """One trial: its strategy fields over the recipe's ``defaults``, its overrides over the recipe's sections, and
    the checks that need the model or the data beside the strategy."""
    path = entry.path
    merged = merge_fields(shared.defaults, entry.fields)
    pinned = frozenset(k for k in ("num_processes", "num_machines") if k in merged)
    strategy = build(Strategy, {**merged, "name": entry.name}, path, device=shared.device)
    if shared.script is None:
        check_tensor_parallel(shared.model, shared.data, strategy, path)  # needs the model: a tp plan
        check_liger(strategy, shared.model, path)
        check_lora(strategy, shared.model, path)
        check_batch_fits_data(strategy, shared.data, path)
        if entry.script_args:
            raise Invalid(join_path(path, "script_args"), "only with workload.script (the recipe runs no script)")
    else:
        check_script_trial(strategy, entry.batch or shared.batch, path)
    args_over = (
        check_training_args(entry.training_args, join_path(path, "training_args")) if entry.training_args else {}
    )
    trial_measure = build(MeasureSpec, {**shared.measure_raw, **entry.measure}, join_path(path, "measure"))
    check_measure(trial_measure, join_path(path, "measure"))
    own = {"warmup_steps", "max_steps"} & set(entry.measure)  # where the two came from, to name the key written
    check_measured_steps(trial_measure, join_path(path, "measure") if own else "measure")
    run_merged = {**shared.run_raw, **entry.run}
    if isinstance(shared.run_raw.get("env"), dict) and isinstance(entry.run.get("env"), dict):
        run_merged["env"] = {**shared.run_raw["env"], **entry.run["env"]}
    trial_run = build(RunSpec, run_merged, join_path(path, "run"))
    spec = TrialSpec(
        name=entry.name,
        strategy=strategy,
        model=shared.model,
        data=shared.data,
        training_args={**shared.training_args, **args_over},
        measure=trial_measure,
        script=_trial_script(shared.script, entry.script_args),
    )
    check_epoch_steps(spec, join_path(path, "measure") if own else "measure")
    if shared.script is None:  # a script builds its own arguments
        _check_trainer_accepts(spec, shared.training_args, join_path(path, "training_args"))
    batch = entry.batch or shared.batch
    return RecipeTrial(spec=spec, run=trial_run, pinned=pinned, source=path, batch=batch)


def _check_trainer_accepts(spec: TrialSpec, recipe_args: dict[str, Any], trial_path: str) -> None:
    """:func:`check_trainer_accepts` of the arguments the trial runs with, naming the recipe's ``training_args``
    where they are refused without the trial's own too, else the trial's (a recipe value every trial overrides is
    never refused)."""
    own = {k for k, v in spec.training_args.items() if k not in recipe_args or recipe_args[k] != v}
    try:
        check_trainer_accepts(spec, trial_path if own else "training_args", trial_keys=own)
    except Invalid:
        if own:
            check_trainer_accepts(dataclasses.replace(spec, training_args=recipe_args), "training_args")
        raise


def _trial_script(script: ScriptSpec | None, extra: tuple[str, ...]) -> ScriptSpec | None:
    return None if script is None else ScriptSpec(path=script.path, args=(*script.args, *extra))


def _with_noise_floor(sweep: SweepOptions, source: str) -> SweepOptions:
    """``sweep.noise_floor`` as the settings record it: a figure's fraction, or a run folder's absolute path (a
    relative one is read from the recipe's folder; the sweep checks the folder before anything runs)."""
    if sweep.noise_floor is None:
        return sweep
    try:
        floor = noise_floor_spec(sweep.noise_floor, recipe_folder(source), must_exist=False)
        return dataclasses.replace(sweep, noise_floor=floor)
    except ValueError as exc:
        raise Invalid("sweep.noise_floor", str(exc)) from exc


def _check_search(sweep: SweepOptions, trials: list[RecipeTrial]) -> None:
    if sweep.search == "adaptive" and (refusal := adaptive_refusal(trials)) is not None:
        raise Invalid(*refusal)


def adaptive_refusal(trials: Sequence[RecipeTrial]) -> tuple[str, str] | None:
    """What an adaptive search cannot do yet, as (key path, why): decide the run count together with
    ``measure.target_precision`` (both would), or compare at the largest batch only (``batch: max``: the own
    batch's run is a probe there, not a contender). None when it can run these trials."""
    for trial in trials:
        if trial.spec.measure.target_precision is not None:
            return (
                join_path(trial.source, "measure.target_precision"),
                "an adaptive search (sweep.search, --search) decides the run count itself; remove target_precision "
                "or search the grid",
            )
        if trial.batch == "max":
            return (
                join_path(trial.source, "batch"),
                "an adaptive search (sweep.search, --search) compares each trial at its own batch and at its largest "
                "(batch: both); batch: max is not supported with it",
            )
    return None


def _check_names(trials: list[RecipeTrial], baseline: str) -> None:
    """The baseline is a trial, and no trial has the name of another's max-batch row (``sweep.batch``)."""
    seen = {t.name: t.source for t in trials}
    if baseline not in seen:
        raise Invalid("baseline", f"{baseline!r} is not a trial; trials are {', '.join(seen)}")
    # A trial's max-batch row is named after it: a trial of that name would be two rows of one name.
    searched = {t.name: t.batch for t in trials if t.batch != "fixed"}
    for name in seen:
        if name.endswith(MAX_BATCH_SUFFIX) and name.removesuffix(MAX_BATCH_SUFFIX) in searched:
            of = name.removesuffix(MAX_BATCH_SUFFIX)
            raise Invalid(
                seen[name],
                f"trial name {name!r} is the name of {of!r}'s max-batch row (batch: {searched[of]}); rename it",
            )


def shipped_recipes() -> list[ShippedRecipe]:
    """Every shipped recipe as ``hfscale recipes`` lists it, sorted by name, read as :func:`read_trial_names` reads
    a recipe: without building its models (that imported transformers, and peft for a LoRA trial, about 6 s of a
    listing on 2 cores, and printed transformers' warnings about configs nobody asked to build). The test suite
    loads and validates every shipped recipe.

    Raises:
        RecipeError: when a shipped recipe cannot be read (a bug in hfscale).
    """
    out = []
    for name in recipe_names():
        path = shipped_recipe(name)
        source, data = read_recipe_yaml(path)
        trial_names = _trial_names(source, data)
        try:
            description = convert(str, data.get("description", ""), "description")
            device = convert(field_types(Recipe)["device"], data.get("device", "cuda"), "device")
        except Invalid as exc:
            raise _located(source, exc) from None
        out.append(
            ShippedRecipe(
                name=name,
                path=path,
                description=" ".join(description.split()),
                device=device,
                trial_count=len(trial_names),
            )
        )
    return out


__all__ = [
    "OWNED_TRAINING_ARGS",
    "REFUSED_TRAINING_ARGS",
    "adaptive_refusal",
    "load_recipe",
    "parse_recipe",
    "read_trial_names",
    "shipped_recipes",
]
