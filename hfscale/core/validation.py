"""Typed data from YAML: walk a parsed mapping against dataclass fields, with errors that name the dotted key.

The recipe loader (and anything else that reads user YAML into our frozen dataclasses) goes through :func:`build`:
an unknown key is refused with a did-you-mean suggestion and the valid keys, a value of the wrong type or a choice
out of range says what was expected and what was written (``trials[2].deepspeed.zero_stage: expected one of 0, 1,
2, 3, got 4``), and the dataclass's own cross-field checks (``__post_init__``) are reported at the key of the
mapping that built it. Plain dataclasses and type hints are the schema, so no second declaration of the fields
exists to drift from the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin

_FLOAT_TEXT = re.compile(r"^[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def float_text(value: Any) -> float | None:
    """``5e-5`` written in YAML: PyYAML (YAML 1.1) reads it as a string, so float fields take it as a number."""
    if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
        return float(value.replace("_", ""))
    return None


class Invalid(Exception):
    """A value that does not fit its field; carries the dotted path relative to where the walk started."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def describe_type(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is Any:
        return "anything"
    if origin is Literal:
        return "one of " + ", ".join(show_value(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin is dict or tp is dict:
        return "a mapping"
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def show_value(value: Any) -> str:
    """A value as the user wrote it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)


def field_types(cls: type) -> dict[str, Any]:
    """Each field of a dataclass with its resolved type hint."""
    return typing.get_type_hints(cls)


def convert(tp: Any, value: Any, path: str) -> Any:
    """``value`` checked (and, for nested dataclasses, built) as type ``tp``; raises :class:`Invalid`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        # `True == 1` in Python: compare types too, so `zero_stage: true` is not stage 1.
        if not any(value == c and type(value) is type(c) for c in choices):
            raise Invalid(path, f"expected {describe_type(tp)}, got {show_value(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        members = get_args(tp)
        if value is None:
            if type(None) in members:
                return None
            raise Invalid(path, f"expected {describe_type(tp)}, got null")
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return convert(member, value, path)
            except Invalid as exc:
                errors.append(exc)
        # One non-null member (the usual `X | None`): its own message is the most precise.
        if len(errors) == 1:
            raise errors[0]
        raise Invalid(path, f"expected {describe_type(tp)}, got {show_value(value)}")
    if tp is type(None):
        if value is not None:
            raise Invalid(path, f"expected null, got {show_value(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise Invalid(path, f"expected true or false, got {show_value(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(path, f"expected an integer, got {show_value(value)}")
        return value
    if tp is float:
        number = float_text(value)
        if number is None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise Invalid(path, f"expected a number, got {show_value(value)}")
            number = float(value)
        if math.isnan(number):  # YAML's .nan; .inf is checked where it cannot mean "no limit"
            raise Invalid(path, f"expected a number, got {show_value(value)}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise Invalid(path, f"expected a string, got {show_value(value)}")
        return value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise Invalid(path, f"expected a mapping, got {show_value(value)}")
        key_tp, val_tp = get_args(tp) or (str, Any)
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise Invalid(join_path(path, str(k)), f"keys must be strings, got {show_value(k)}")
            if key_tp is int and (isinstance(k, bool) or not isinstance(k, int)):
                raise Invalid(join_path(path, str(k)), f"keys must be integers (unquoted), got {show_value(k)}")
            out[k] = convert(val_tp, v, join_path(path, str(k)))
        return out
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list):
            raise Invalid(path, f"expected a list, got {show_value(value)}")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [convert(item_tp, v, join_path(path, i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    raise TypeError(f"recipe loader: unsupported field type {tp!r} at {path}")  # a bug in hfscale, not the recipe


def given(data: dict[str, Any], key: str, empty: Any) -> Any:
    """``data[key]``, or ``empty`` where the key is missing or null (``model:`` with nothing under it). Any other
    value, however falsy (``model: []``, ``data: false``), is the user's and goes on to be checked as written."""
    value = data.get(key)
    return empty if value is None else value


def reject_unknown(data: dict[str, Any], known: typing.Iterable[str], path: str) -> None:
    known = list(known)
    for key in data:
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise Invalid(
                join_path(path, str(key)),
                f"unknown key{hint}; valid keys here are {', '.join(sorted(known))}",
            )


def build(cls: type, data: Any, path: str, **extra: Any) -> Any:
    """An instance of dataclass ``cls`` from a mapping: unknown keys rejected, each field converted by its type,
    and the class's own validation (``__post_init__``) reported at ``path``."""
    if not isinstance(data, dict):
        raise Invalid(path, f"expected a mapping, got {show_value(data)}")
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    reject_unknown(data, [n for n in fields if n not in extra], path)
    kwargs = dict(extra)
    for key, value in data.items():
        kwargs[key] = convert(hints[key], value, join_path(path, key))
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise Invalid(path, f"missing required key(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # StrategyError included: the dataclass's own cross-field checks
        raise Invalid(path, str(exc)) from exc


__all__ = [
    "Invalid",
    "build",
    "convert",
    "describe_type",
    "field_types",
    "float_text",
    "given",
    "join_path",
    "reject_unknown",
    "show_value",
]
