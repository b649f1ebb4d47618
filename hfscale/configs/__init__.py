"""Strategy -> what the real tools consume: accelerate config YAML, DeepSpeed JSON, FSDP, TrainingArguments.

Each generator is a pure function from a :class:`~hfscale.strategy.Strategy` to a dict; :func:`write_configs`
writes them side by side in one folder, which is what a trial (and a user) launches from::

    OUT/accelerate.yaml      accelerate launch --config_file OUT/accelerate.yaml ...
    OUT/deepspeed.json       when the strategy uses DeepSpeed (TrainingArguments.deepspeed points here)
    OUT/training_args.json   the strategy's TrainingArguments keywords
    OUT/strategy.json        the strategy itself, read back by ``hfscale.callbacks.VerificationCallback(OUT)``
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from hfscale.configs.accelerate import accelerate_config, launch_command
from hfscale.configs.deepspeed import deepspeed_config
from hfscale.configs.fsdp import fsdp_plugin_kwargs, fsdp_training_args
from hfscale.configs.training_args import training_args_kwargs
from hfscale.strategy import Strategy

ACCELERATE_FILE = "accelerate.yaml"
DEEPSPEED_FILE = "deepspeed.json"
TRAINING_ARGS_FILE = "training_args.json"
STRATEGY_FILE = "strategy.json"


@dataclass(frozen=True, kw_only=True)
class GeneratedConfigs:
    """The files :func:`write_configs` wrote."""

    accelerate_yaml: Path
    """accelerate config for ``accelerate launch --config_file``."""
    deepspeed_json: Path | None
    """DeepSpeed JSON, or None when the strategy uses no DeepSpeed."""
    training_args_json: Path
    """``TrainingArguments`` keywords (JSON object) the strategy sets."""
    strategy_json: Path | None = None
    """The strategy (``Strategy.to_dict()``), so a verification can compare what runs with what was asked."""
    main_process_port: int | None = None
    """Port given to :func:`write_configs` (already in the YAML); kept for reference."""

    def launch_command(self, target: list[str], *, python: str = sys.executable) -> list[str]:
        """argv running ``target`` (a script and its args, or ``["-m", MODULE, ...]``) under these configs."""
        return launch_command(str(self.accelerate_yaml), target, python=python)

    def training_args(self) -> dict:
        """The ``TrainingArguments`` keywords read back from :attr:`training_args_json`."""
        return json.loads(self.training_args_json.read_text(encoding="utf-8"))


def _dump_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_strategy(path: str | os.PathLike[str]) -> Strategy:
    """The strategy :func:`write_configs` wrote: ``path`` is the config folder or its ``strategy.json``.

    Raises:
        FileNotFoundError: when there is no ``strategy.json`` (configs written by hfscale 0.1 have none: write them
            again with ``hfscale config``).
        ValueError: when the file is not a valid strategy (:class:`~hfscale.strategy.StrategyError` included).
    """
    target = Path(path)
    if target.is_dir():
        target = target / STRATEGY_FILE
    if not target.is_file():
        raise FileNotFoundError(
            f"{target}: no {STRATEGY_FILE}; give the folder `hfscale config --out` wrote (write it again with "
            "`hfscale config` if it predates strategy.json)"
        )
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{target}: not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{target}: expected a JSON object (a strategy), got {type(data).__name__}")
    try:
        return Strategy.from_dict(data)
    except TypeError as exc:  # a missing or misspelt field the dataclass itself refuses
        raise ValueError(f"{target}: not a strategy: {exc}") from exc


def render_yaml(config: dict) -> str:
    """The accelerate config as YAML text (keys sorted, as ``accelerate config`` writes them)."""
    return yaml.safe_dump(config, sort_keys=True, default_flow_style=False)


def write_configs(
    strategy: Strategy,
    out_dir: str | os.PathLike[str],
    *,
    transformer_layer_cls: str | None = None,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
) -> GeneratedConfigs:
    """Write ``accelerate.yaml``, ``deepspeed.json`` (with DeepSpeed), ``training_args.json`` and ``strategy.json``
    into ``out_dir``.

    Paths inside the files are absolute, so the configs work from any working directory. A stale
    ``deepspeed.json`` from an earlier strategy is removed.

    Raises:
        ValueError: as :func:`~hfscale.configs.accelerate.accelerate_config` does.
    """
    out = Path(out_dir).resolve()
    ds = deepspeed_config(strategy)
    ds_path = out / DEEPSPEED_FILE if ds is not None else None
    # Everything is generated (and so validated) before anything is written: a refused strategy leaves no files.
    acc = accelerate_config(
        strategy,
        deepspeed_config_file=str(ds_path) if ds_path else None,
        transformer_layer_cls=transformer_layer_cls,
        machine_rank=machine_rank,
        main_process_ip=main_process_ip,
        main_process_port=main_process_port,
    )
    ta = training_args_kwargs(
        strategy,
        deepspeed_config_path=str(ds_path) if ds_path else None,
        transformer_layer_cls=transformer_layer_cls,
    )
    out.mkdir(parents=True, exist_ok=True)
    if ds is not None and ds_path is not None:
        _dump_json(ds, ds_path)
    elif (out / DEEPSPEED_FILE).exists():
        (out / DEEPSPEED_FILE).unlink()
    acc_path = out / ACCELERATE_FILE
    acc_path.write_text(render_yaml(acc), encoding="utf-8")
    ta_path = out / TRAINING_ARGS_FILE
    _dump_json(ta, ta_path)
    strategy_path = out / STRATEGY_FILE
    _dump_json(strategy.to_dict(), strategy_path)
    return GeneratedConfigs(
        accelerate_yaml=acc_path,
        deepspeed_json=ds_path,
        training_args_json=ta_path,
        strategy_json=strategy_path,
        main_process_port=main_process_port,
    )


__all__ = [
    "ACCELERATE_FILE",
    "DEEPSPEED_FILE",
    "STRATEGY_FILE",
    "TRAINING_ARGS_FILE",
    "GeneratedConfigs",
    "accelerate_config",
    "deepspeed_config",
    "fsdp_plugin_kwargs",
    "fsdp_training_args",
    "launch_command",
    "read_strategy",
    "render_yaml",
    "training_args_kwargs",
    "write_configs",
]
