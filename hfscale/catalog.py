"""The recipes that ship with hfscale, found by name.

The recipe files live in the package (``hfscale/recipes/*.yaml``; the checkout's ``recipes/`` points there), so an
installed wheel can run them from any folder: ``hfscale sweep cpu_small``. Every command that takes a recipe goes
through :func:`resolve_recipe`: an existing path is used as given, otherwise a bare name is looked up here. The
files are read as data (``yaml.safe_load`` through :func:`hfscale.recipe.load_recipe`), never imported.

``hfscale recipes`` lists them; ``hfscale recipes show NAME`` prints one, the natural start for a recipe of one's own.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
"""Where the shipped recipe files are (package data; a plain folder in both a wheel install and a checkout)."""

_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True, kw_only=True)
class ShippedRecipe:
    """One shipped recipe as ``hfscale recipes`` lists it."""

    name: str
    """What to pass to ``hfscale sweep`` (the file's stem)."""
    path: Path
    """The file in the installed package."""
    description: str
    """The recipe's ``description:``."""
    device: str
    """Where its trials train (``cpu`` or ``cuda``)."""
    trial_count: int
    """Trials after the matrix is expanded (each runs ``measure.repeats`` times)."""


def recipe_names() -> list[str]:
    """The names of the shipped recipes, sorted."""
    return sorted(p.stem for p in RECIPES_DIR.iterdir() if p.suffix in _SUFFIXES and p.is_file())


def _shipped(name: str) -> Path | None:
    for suffix in _SUFFIXES:
        candidate = RECIPES_DIR / (name + suffix)
        if candidate.is_file():
            return candidate
    return None


def _unknown(text: str, *, bare: bool) -> FileNotFoundError:
    names = recipe_names()
    close = difflib.get_close_matches(Path(text).stem, names, n=1) if bare else []
    what = "no such recipe file, nor a shipped recipe of that name" if bare else "no such file"
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return FileNotFoundError(f"{text}: {what}; shipped recipes (run by name): {', '.join(names)}{hint}")


def resolve_recipe(recipe: str | os.PathLike[str]) -> Path:
    """The file a recipe argument means: an existing path as given, else the shipped recipe of that name.

    A bare name (no folder part; a ``.yaml``/``.yml`` suffix is allowed) that is not an existing path is looked up
    among the shipped recipes. An existing path always wins: with a ``cpu_small.yaml`` of one's own in the current
    folder, ``cpu_small.yaml`` is that file and ``cpu_small`` the shipped recipe.

    Raises:
        FileNotFoundError: when it is neither an existing path nor a shipped recipe's name; the message lists the
            shipped names (and the closest one).
    """
    path = Path(recipe)
    if path.exists():
        return path
    text = os.fspath(recipe)
    bare = os.sep not in text and (os.altsep is None or os.altsep not in text)
    if bare:
        found = _shipped(path.stem if path.suffix in _SUFFIXES else text)
        if found is not None:
            return found
    raise _unknown(text, bare=bare)


def shipped_recipe(name: str) -> Path:
    """The shipped file of ``name``, whatever files the current folder holds.

    Raises:
        FileNotFoundError: when no shipped recipe has that name; the message lists the names.
    """
    found = _shipped(name)
    if found is None:
        raise _unknown(name, bare=True)
    return found


def shipped_recipes() -> list[ShippedRecipe]:
    """Every shipped recipe, loaded and validated, sorted by name.

    Raises:
        RecipeError: when a shipped recipe is invalid (a bug in hfscale; the test suite loads them all).
    """
    from hfscale.recipe import load_recipe

    out = []
    for name in recipe_names():
        path = shipped_recipe(name)
        recipe = load_recipe(path)
        out.append(
            ShippedRecipe(
                name=name,
                path=path,
                description=" ".join(recipe.description.split()),
                device=recipe.device,
                trial_count=len(recipe.trials),
            )
        )
    return out


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


if __name__ == "__main__":
    sys.exit(main())
