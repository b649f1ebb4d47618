"""The recipes that ship with hfscale, found by name.

The recipe files live in the package (``hfscale/recipes/*.yaml``; the checkout's ``recipes/`` points there), so an
installed wheel can run them from any folder: ``hfscale sweep cpu_small``. Every command that takes a recipe goes
through :func:`resolve_recipe`: an existing path is used as given, otherwise a bare name is looked up here. The
files are read as data (``yaml.safe_load`` through :func:`hfscale.recipes.recipe.load_recipe`), never imported.

``hfscale recipes`` lists them; ``hfscale recipes show NAME`` prints one, the natural start for a recipe of one's own.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent / "shipped"
"""Where the shipped recipe files are (package data; a plain folder in both a wheel install and a checkout)."""

_SUFFIXES = (".yaml", ".yml")


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
