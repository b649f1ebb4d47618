"""The user's own model and data in a recipe, as callables: ``model.factory`` and ``data.factory``.

A reference is ``"package.module:function"`` (imported as Python imports it: an installed package) or
``"path/to/file.py:function"`` (loaded from that file, its folder first on ``sys.path`` so it can import its
neighbours; a recipe's relative path is resolved against the recipe's folder when the recipe is loaded). The model
factory is called with ``model.config`` as keyword arguments and returns the model (a ``PreTrainedModel`` or any
``nn.Module`` the Trainer can train); the data factory is called with ``data.factory_kwargs`` and returns a
``datasets.Dataset``, or a ``(dataset, collator)`` pair.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def split_reference(reference: str) -> tuple[str, str]:
    """``("package.module", "function")`` or ``("path/file.py", "function")``.

    Raises:
        ValueError: when it is not of either form.
    """
    where, sep, name = reference.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{reference!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    return where, name


def resolve_reference(reference: str, folder: Path) -> str:
    """A ``file.py:function`` reference with its file made absolute against ``folder``; others unchanged."""
    where, name = split_reference(reference)
    if not where.endswith(".py") or Path(where).is_absolute():
        return reference
    return f"{(folder / where).resolve()}:{name}"


def load_callable(reference: str) -> Callable[..., Any]:
    """The function a reference names, imported.

    Raises:
        ValueError: when the module or file cannot be imported (the import's own error quoted), or it holds no
            callable of that name.
    """
    where, name = split_reference(reference)
    try:
        module = _load_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except (Exception, SystemExit) as exc:  # the user's module runs at import (argparse in it exits): it did not
        raise ValueError(f"{reference!r}: cannot import {where} ({type(exc).__name__}: {exc})") from exc
    found = getattr(module, name, None)
    if not callable(found):
        raise ValueError(f"{reference!r}: {where} has no function {name!r}")
    return found


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise ImportError(f"{path} does not exist")
    module_name = f"hfscale_user_{path.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]  # not a half-run module that the next load would return as imported
        raise
    return module


def build_from_data_factory(reference: str, kwargs: dict[str, Any]) -> tuple[Any, Callable[..., Any] | None]:
    """The data factory's dataset and collator (None when it returned a dataset alone).

    Raises:
        ValueError: as :func:`load_callable`, or when it returned something else.
    """
    made = load_callable(reference)(**kwargs)
    dataset, collator = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"data.factory {reference!r} returned {type(made).__name__}: expected a datasets.Dataset or "
                         "a (dataset, collator) pair")  # fmt: skip
    if collator is not None and not callable(collator):
        raise ValueError(f"data.factory {reference!r}: the collator it returned is not callable")
    return dataset, collator


__all__ = ["build_from_data_factory", "load_callable", "resolve_reference", "split_reference"]
