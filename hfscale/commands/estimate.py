"""``hfscale estimate``: each strategy's predicted peak per device, as a table or JSON, before anything runs.

A recipe gives its own trials; a bare model type gives :func:`default_strategies`, the usual ladder from fp32 to
ZeRO-3 offload, so one command answers "which of these would fit my GPU".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from hfscale.core.units import GIB, parse_memory_size
from hfscale.core.validation import Invalid
from hfscale.estimate.fit import default_reserve_bytes, predicted_to_fit
from hfscale.estimate.peak import estimate_memory
from hfscale.records.estimate import MemoryEstimate
from hfscale.strategy import DeepSpeedSpec, FsdpSpec, Strategy, StrategyError
from hfscale.workload.model import ModelConfigError
from hfscale.workload.spec import DataSpec, ModelSpec, TrialSpec


def default_strategies(
    *, num_gpus: int, num_machines: int = 1, batch_size: int = 8, device: Literal["cuda", "cpu"] = "cuda"
) -> list[Strategy]:
    """The strategies ``hfscale estimate MODEL`` compares when no recipe is given."""
    half = "bf16"
    base = Strategy(
        name="fp32", device=device, per_device_batch_size=batch_size, num_processes=num_gpus, num_machines=num_machines
    )
    out = [
        base,
        base.replace(name=half, precision=half),
        base.replace(name=f"{half}-ckpt", precision=half, gradient_checkpointing=True),
        base.replace(name=f"{half}-adafactor", precision=half, optimizer="adafactor"),
        base.replace(name=f"{half}-adam8bit", precision=half, optimizer="adamw_bnb_8bit"),
        base.replace(name=f"{half}-zero2", precision=half, deepspeed=DeepSpeedSpec(zero_stage=2)),
        base.replace(
            name=f"{half}-zero2-offload", precision=half, deepspeed=DeepSpeedSpec(zero_stage=2, offload_optimizer="cpu")
        ),
        base.replace(name=f"{half}-zero3", precision=half, deepspeed=DeepSpeedSpec(zero_stage=3)),
        base.replace(
            name=f"{half}-zero3-offload",
            precision=half,
            deepspeed=DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu"),
        ),
    ]
    if num_gpus > 1:
        out.append(base.replace(name=f"{half}-fsdp", precision=half, fsdp=FsdpSpec()))
    if num_machines > 1 and num_gpus > num_machines:
        # HSDP: sharded over one machine's GPUs, replicated across machines
        out.append(base.replace(name=f"{half}-hsdp", precision=half, fsdp=FsdpSpec(sharding="hybrid_shard")))
    return out


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--config expects key=value, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.strip(), parsed


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfscale estimate",
        description="Predict each strategy's peak memory per device before running (the model is built on the "
        "meta device: nothing is allocated or downloaded).",
    )
    parser.add_argument(
        "target",
        help="a recipe YAML or a shipped recipe's name ('hfscale recipes'), or a transformers model type (bert, ...)",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        type=_parse_override,
        metavar="KEY=VALUE",
        help="model config override (repeatable), e.g. --config hidden_size=1024",
    )
    parser.add_argument("--task", choices=["classification", "causal_lm"], default=None)
    parser.add_argument(
        "--num-gpus", type=_positive_int, default=None, help="processes in all (default: recipe's or 1)"
    )
    parser.add_argument(
        "--num-machines",
        type=_positive_int,
        default=None,
        help="machines the processes are spread over (default: recipe's or 1); hybrid_shard shards within one",
    )
    parser.add_argument("--memory-budget", default=None, help="memory per device, e.g. 80GiB, 16GB")
    parser.add_argument("--seq-len", type=_positive_int, default=None)
    parser.add_argument("--batch-size", type=_positive_int, default=None, help="per-device batch size")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _specs_from_args(args: argparse.Namespace) -> list[TrialSpec]:
    target = args.target
    overrides: dict[str, Any] = dict(args.config)
    from hfscale.recipes.catalog import recipe_names

    if target.endswith((".yaml", ".yml")) or Path(target).is_file() or target in recipe_names():
        from hfscale.recipes.recipe import load_recipe

        recipe = load_recipe(target)
        specs = recipe.trial_specs(num_processes=args.num_gpus, num_machines=args.num_machines)
        changed = []
        for spec in specs:
            strategy = spec.strategy
            if args.batch_size is not None:
                strategy = strategy.replace(per_device_batch_size=args.batch_size)
            if args.device is not None:
                strategy = strategy.replace(device=args.device)
            model = spec.model
            if overrides or args.task:
                model = dataclasses.replace(model, config={**model.config, **overrides}, task=args.task or model.task)
            data = spec.data if args.seq_len is None else dataclasses.replace(spec.data, seq_len=args.seq_len)
            changed.append(dataclasses.replace(spec, strategy=strategy, model=model, data=data))
        for spec in changed[:1] if overrides or args.task or args.seq_len is not None else ():
            _check_as_a_recipe(spec.model, spec.data, target)
        return changed
    model = ModelSpec(type=target, task=args.task or "classification", config=overrides)
    data = DataSpec(seq_len=args.seq_len or DataSpec().seq_len)
    _check_as_a_recipe(model, data, target)
    strategies = default_strategies(
        num_gpus=args.num_gpus or 1,
        num_machines=args.num_machines or 1,
        batch_size=args.batch_size or 8,
        device=args.device or "cuda",
    )
    return [TrialSpec(name=s.name, strategy=s, model=model, data=data) for s in strategies]


def _check_as_a_recipe(model: ModelSpec, data: DataSpec, target: str) -> None:
    """Refuse the model and length the command line describes as a recipe's ``model`` and ``data`` are refused
    (:func:`hfscale.recipes.checks.check_model`: unknown type or config key, a size that is not a positive integer,
    a length beyond the learned positions, a model transformers cannot build), named by the option that set it.
    The estimate reads shapes, not token ids, so the ids are checked at the smallest range every vocabulary holds."""
    from hfscale.recipes.checks import check_model

    try:
        check_model(model, dataclasses.replace(data, token_low=0, token_high=1))
    except Invalid as exc:
        raise ValueError(_as_option(exc, target)) from None


def _as_option(exc: Invalid, target: str) -> str:
    """A recipe check's message, named by the command line's option rather than the recipe's key."""
    if exc.path == "model.type":  # transformers' own message lists its 400-odd types and never says recipe
        import difflib

        from transformers import CONFIG_MAPPING

        from hfscale.recipes.catalog import recipe_names

        close = difflib.get_close_matches(target, [*recipe_names(), *sorted(CONFIG_MAPPING.keys())], n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return (
            f"{target!r} is neither a recipe (a .yaml file, or a shipped recipe's name: 'hfscale recipes' lists them) "
            f"nor a transformers model type (bert, gpt2, llama, ...){hint}"
        )
    options = {"model.config": "--config", "model.task": "--task", "data.seq_len": "--seq-len"}
    key = exc.path.removeprefix("model.config.")
    option = options.get(exc.path) or (f"--config {key}" if key != exc.path else exc.path)
    return f"{option}: {exc.message}"


def _gib_cell(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3f}" if value < 0.01 else f"{value:.2f}"


def format_table(rows: Sequence[tuple[TrialSpec, MemoryEstimate, bool | None]]) -> str:
    """A plain-text table of estimates (GiB per device), one row per trial."""
    headers = ["trial", "strategy", "weights", "grads", "optim", "activ", "overhead", "-overlap", "total", "fits"]
    lines = []
    for spec, est, fits in rows:
        lines.append(
            [
                spec.name,
                spec.strategy.describe(),
                *(
                    _gib_cell(x)
                    for x in (
                        est.weights_gib,
                        est.gradients_gib,
                        est.optimizer_gib,
                        est.activations_gib,
                        est.overhead_gib,
                        est.overlap_gib,
                        est.total_gib,
                    )
                ),
                "" if fits is None else ("yes" if fits else "NO"),
            ]
        )
    widths = [max(len(h), *(len(r[k]) for r in lines)) for k, h in enumerate(headers)]

    def fmt(cells: Iterable[str]) -> str:
        out = []
        for k, cell in enumerate(cells):
            out.append(cell.ljust(widths[k]) if k < 2 else cell.rjust(widths[k]))
        return "  ".join(out).rstrip()

    return "\n".join([fmt(headers), fmt("-" * w for w in widths), *(fmt(r) for r in lines)])


def main(argv: list[str] | None = None) -> int:
    """Run ``hfscale estimate``; 0 on success, 2 on a bad argument, recipe or model config (said on stderr)."""
    args = _build_parser().parse_args(argv)
    try:
        budget = parse_memory_size(args.memory_budget) if args.memory_budget else None
        specs = _specs_from_args(args)
        rows = []
        for spec in specs:
            est = estimate_memory(spec)
            rows.append((spec, est, None if budget is None else predicted_to_fit(est, budget)))
    except (ModelConfigError, RuntimeError, TypeError, ArithmeticError) as exc:  # transformers/torch refusing a value
        print(f"hfscale estimate: cannot build the model from its config (check --config): {exc}", file=sys.stderr)
        return 2
    except (ValueError, StrategyError, FileNotFoundError, ImportError) as exc:
        print(f"hfscale estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"trial": s.name, "fits": f, "estimate": e.to_dict()} for s, e, f in rows], indent=2))
        return 0
    first_spec, first = rows[0][0], rows[0][1]
    header = (
        f"{first_spec.model.type} ({first.num_params / 1e6:.1f}M parameters, largest layer "
        f"{first.largest_layer_params / 1e6:.1f}M), seq {first.seq_len}, GiB per device"
    )
    if budget is not None:
        reserve = default_reserve_bytes(first.device)
        header += f"; budget {budget / GIB:.2f} GiB, fits = total" + (
            f" + {reserve / GIB:.2f} GiB CUDA context within budget (context assumed, not measured: a V100's figure "
            "after CUDA initialisation from the transformers documentation; see docs/estimate.md)"
            if reserve
            else " within budget"
        )
    print(header)
    print(format_table(rows))
    notes = sorted({n for _, e, _ in rows for n in e.notes})
    for note in notes:
        print(f"note: {note}")
    return 0


__all__ = ["default_strategies", "format_table", "main"]
