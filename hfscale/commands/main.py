"""The ``hfscale`` command: a thin dispatcher to each module's own ``main``.

Each subcommand owns its arguments in the module that implements it (``hfscale.commands.sweep``,
``hfscale.commands.report``, ...),
so ``hfscale sweep X`` and ``python -m hfscale.sweep X`` are the same program, and a subcommand's heavy imports
(torch, pandas) happen only when it runs.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "config": (
        "hfscale.commands.config",
        "main",
        "write accelerate/DeepSpeed/TrainingArguments configs for a strategy",
    ),
    "recipes": (
        "hfscale.commands.recipes",
        "main",
        "list the recipes that ship with hfscale; 'hfscale recipes show NAME' prints one",
    ),
    "sweep": (
        "hfscale.commands.sweep",
        "main",
        "train a recipe's trials, each in a fresh process, and record results",
    ),
    "slurm": (
        "hfscale.commands.slurm",
        "main",
        "write an sbatch script running a sweep on several nodes (and each node's command without Slurm)",
    ),
    "report": ("hfscale.commands.report", "main", "write report.md, report.html and results.csv for a run folder"),
    "compare": ("hfscale.commands.report", "compare_main", "the same trials of two run folders side by side"),
    "estimate": ("hfscale.commands.estimate", "main", "predict each strategy's peak memory before running"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: hfscale COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run 'hfscale COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from hfscale import __version__

        print(f"hfscale {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hfscale: unknown command {name!r}; expected one of {', '.join(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


def console() -> int:
    """The ``hfscale`` command (a process of its own): :func:`main` without transformers' import of peft, which no
    command uses (a sweep's trials are processes of their own that decide for themselves)."""
    from hfscale.core.imports import leave_out_peft

    leave_out_peft()
    return main()


if __name__ == "__main__":
    sys.exit(console())
