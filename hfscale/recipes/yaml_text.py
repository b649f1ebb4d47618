"""A recipe's YAML, read safely and strictly: PyYAML's safe loader, refusing a key given twice in one mapping;
every reader of a recipe file reads it here."""

from __future__ import annotations

import os
import typing
from typing import Any

import yaml

from hfscale.recipes.catalog import resolve_recipe
from hfscale.recipes.schema import RecipeError


def read_recipe_yaml(path: str | os.PathLike[str]) -> tuple[str, Any]:
    """A recipe file's path (a shipped recipe's name resolved) and its YAML document.

    Raises:
        FileNotFoundError: when it is neither a file nor a shipped recipe's name; the message lists the names.
        RecipeError: when it is a folder, not UTF-8 text, or not valid YAML.
    """
    resolved = resolve_recipe(path)
    if resolved.is_dir():
        raise RecipeError(f"{resolved}: is a folder, not a recipe file")
    try:
        text = resolved.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{resolved}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        return str(resolved), load_yaml(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{resolved}: not valid YAML: {exc}") from None


def load_yaml(text: str) -> Any:
    """The YAML document ``text`` holds.

    Raises:
        yaml.YAMLError: when it is not valid YAML, or a mapping gives a key twice (with both lines).
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML forbids it, and PyYAML keeps the last
    one without a word (a second ``trials:`` block replaced the first; the sweep ran only its trials).

    Checked where PyYAML folds a mapping's merges (``<<: *anchor``) into it, once per mapping and before that fold:
    a merged key overridden by the mapping's own is YAML's meaning, not a repeat, and a mapping merged into another
    is folded (in place) before the one that merges it.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark, f"found the key {key!r} twice", key_node.start_mark
                    )
                seen[key] = key_node
        super().flatten_mapping(node)


__all__ = ["load_yaml", "read_recipe_yaml"]
