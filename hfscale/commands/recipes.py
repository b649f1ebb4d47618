"""``hfscale recipes``: list the shipped recipes, or print one as a start for a recipe of one's own."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hfscale.recipes.catalog import resolve_recipe
from hfscale.recipes.recipe import shipped_recipes
from hfscale.recipes.schema import ShippedRecipe


def _table(recipes: Sequence[ShippedRecipe]) -> list[str]:
    width = max([len("name"), *(len(r.name) for r in recipes)])
    lines = [f"{'name'.ljust(width)}  device  trials  description"]
    lines += [f"{r.name.ljust(width)}  {r.device.ljust(6)}  {r.trial_count:>6}  {r.description}" for r in recipes]
    return lines


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfscale recipes",
        description="List the recipes that ship with hfscale, or print one (a start for a recipe of your own).",
        epilog="Run one with 'hfscale sweep NAME'; copy one with 'hfscale recipes show NAME > my.yaml'.",
    )
    actions = parser.add_subparsers(dest="action", metavar="{list,show}")
    actions.add_parser("list", help="name, device, trial count and description of each (the default)")
    show = actions.add_parser("show", help="print a recipe's YAML, comments included")
    show.add_argument("name", metavar="NAME", help="a shipped recipe's name (or a recipe file)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.action == "show":
        try:
            text = resolve_recipe(args.name).read_text(encoding="utf-8")
        except OSError as exc:
            print(f"hfscale recipes: error: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    for line in _table(shipped_recipes()):
        print(line)
    print("\nRun one with 'hfscale sweep NAME'; print one with 'hfscale recipes show NAME'.")
    return 0
