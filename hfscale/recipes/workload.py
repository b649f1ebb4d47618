"""A recipe's ``workload:`` section: the user's own training script in place of the model and data hfscale builds.

``workload: {script: train.py, args: [...]}`` runs the script unmodified under every trial's strategy
(:mod:`hfscale.trial.script`); a trial's ``script_args:`` are added after ``args``. What needs hfscale's own model
or data before anything runs is refused here, naming the key: ``model:`` and ``data:`` beside a script, the largest
batch search (it builds data of its own), tensor or context parallelism (they reload the model hfscale builds), and
LoRA without ``target_modules`` (a script's model has no default targets known before it runs).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from hfscale.core.validation import Invalid, convert, given, join_path, reject_unknown, show_value
from hfscale.recipes.schema import RecipeError
from hfscale.recipes.yaml_text import read_recipe_yaml
from hfscale.workload.factory import resolve_reference
from hfscale.workload.spec import ModelSpec, ScriptSpec

WORKLOAD_KEYS = ("script", "args")


def parse_workload(data: dict[str, Any], source: str) -> ScriptSpec | None:
    """The recipe's script, its path resolved against the recipe's folder; None without ``workload:``."""
    raw = data.get("workload")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise Invalid("workload", f"expected a mapping with script: and args:, got {show_value(raw)}")
    reject_unknown(raw, WORKLOAD_KEYS, "workload")
    if raw.get("script") is None:
        raise Invalid("workload.script", "missing: the path of your training script (relative to the recipe's folder)")
    text = convert(str, raw["script"], "workload.script")
    if not text.strip():
        raise Invalid("workload.script", "empty: the path of your training script (relative to the recipe's folder)")
    written = Path(text)
    args = convert(list[str], given(raw, "args", []), "workload.args")
    folder = recipe_folder(source)
    path = written if written.is_absolute() else folder / written
    if path.is_dir():
        raise Invalid("workload.script", f"{path} is a folder: expected your training script's file")
    if not path.is_file():
        raise Invalid("workload.script", f"{path} does not exist (a relative path is read from the recipe's folder)")
    for key in ("model", "data"):
        if data.get(key) is not None:
            raise Invalid(key, f"the script builds its own {key}: remove {key}: (workload.script is set)")
    return ScriptSpec(path=str(path.resolve()), args=tuple(args))


def resolve_factories(spec: Any, source: str) -> Any:
    """``spec`` (a ``ModelSpec`` or ``DataSpec``) with a ``file.py:function`` factory made absolute against the
    recipe's folder, so the trial process finds it from any working directory."""
    if getattr(spec, "factory", None) is None:
        return spec
    key = "model.factory" if isinstance(spec, ModelSpec) else "data.factory"
    try:
        return dataclasses.replace(spec, factory=resolve_reference(spec.factory, recipe_folder(source)))
    except ValueError as exc:
        raise Invalid(key, str(exc)) from exc


def recipe_folder(source: str) -> Path:
    """Where a recipe's relative paths are read from: its file's folder (the working directory for a recipe given
    as text)."""
    return Path(source).resolve().parent if Path(source).is_file() else Path.cwd()


def recipe_with_script(recipe: str | os.PathLike[str], script: str, args: list[str]) -> Path:
    """``hfscale sweep --script SCRIPT RECIPE -- ARGS``: the recipe with ``workload: {script, args}`` in place of its
    ``model:`` and ``data:``, written to a new temporary file (the sweep copies it into the run folder, so a resume
    and a comparison see the script). Its trials, measure and run sections are the recipe's.

    Raises:
        RecipeError: when the recipe is not a YAML mapping or the script does not exist.
    """
    path, data = read_recipe_yaml(recipe)
    source = Path(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: expected a mapping at the top level")
    if not Path(script).is_file():
        raise RecipeError(f"--script {script}: no such file")
    for key in ("model", "data"):
        data.pop(key, None)
    data["workload"] = {"script": str(Path(script).resolve()), "args": list(args)}
    derived = Path(tempfile.mkdtemp(prefix="hfscale-recipe-")) / source.name
    derived.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return derived


def check_script_trial(strategy: Any, batch: str, path: str) -> None:
    """Refuse what a trial of a script cannot run, at the trial's key."""
    if batch != "fixed":
        raise Invalid(
            join_path(path, "batch"),
            f"{batch}: the largest-batch search trains data hfscale builds; with workload.script use batch: fixed",
        )
    mesh = strategy.parallelism
    if mesh is not None and (mesh.tp > 1 or mesh.cp > 1):
        raise Invalid(
            join_path(path, "parallelism"),
            "tensor and context parallelism reload the model hfscale builds: not with workload.script",
        )
    if strategy.lora is not None and strategy.lora.target_modules is None:
        raise Invalid(
            join_path(join_path(path, "lora"), "target_modules"),
            "a script's model has no default LoRA targets known before it runs: name its Linear layers "
            "(target_modules: [q_proj, v_proj])",
        )


__all__ = ["WORKLOAD_KEYS", "check_script_trial", "parse_workload", "recipe_with_script", "resolve_factories"]
