"""Print the shape of hfscale's code: modules over 500 lines, functions over 80 lines, functions over 8 parameters.

    python tools/code_shape.py            # the counts and every offender; exit 1 when there is one
    python tools/code_shape.py --all      # also the ten longest modules and functions

The limits are the house's (docs/architecture.md, "The shape of the code"): a module a reader can keep in mind, a
function that fits on a screen, a parameter list that passes a dataclass instead of its fields. Lines are physical
lines, docstrings and comments included (a module's size is what a reader scrolls through); a function's length runs
from its ``def`` (decorators included) to its last line; its parameters count every name but ``self`` and ``cls``
(positional, keyword-only, ``*args`` and ``**kwargs``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Function:
    where: str
    """``path:line qualified.name``."""
    lines: int
    parameters: int


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len([n for n in names if n not in ("self", "cls")])


def functions(path: Path, base: Path) -> list[Function]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                name = f"{prefix}{child.name}"
                where = f"{path.relative_to(base)}:{child.lineno} {name}"
                found.append(Function(where, (child.end_lineno or first) - first + 1, parameter_count(child)))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also list the ten longest modules and functions")
    parser.add_argument("package", nargs="?", default=str(ROOT / "hfscale"))
    args = parser.parse_args(argv)
    package = Path(args.package).resolve()
    base = package.parent
    paths = sorted(package.rglob("*.py"))
    modules = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in paths}
    funcs = [f for p in paths for f in functions(p, base)]
    long_modules = sorted(((n, p) for p, n in modules.items() if n > MAX_MODULE_LINES), reverse=True)
    long_funcs = sorted((f for f in funcs if f.lines > MAX_FUNCTION_LINES), key=lambda f: -f.lines)
    wide_funcs = sorted((f for f in funcs if f.parameters > MAX_PARAMETERS), key=lambda f: -f.parameters)
    print(f"{len(modules)} modules, {sum(modules.values())} lines, {len(funcs)} functions")
    print(f"modules over {MAX_MODULE_LINES} lines: {len(long_modules)}")
    for n, p in long_modules:
        print(f"  {n:5d}  {p.relative_to(base)}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(long_funcs)}")
    for f in long_funcs:
        print(f"  {f.lines:5d}  {f.where}")
    print(f"functions over {MAX_PARAMETERS} parameters: {len(wide_funcs)}")
    for f in wide_funcs:
        print(f"  {f.parameters:5d}  {f.where}")
    if args.all:
        print("longest modules:")
        for p, n in sorted(modules.items(), key=lambda item: -item[1])[:10]:
            print(f"  {n:5d}  {p.relative_to(base)}")
        print("longest functions:")
        for f in sorted(funcs, key=lambda f: -f.lines)[:10]:
            print(f"  {f.lines:5d}  {f.where}")
    return 1 if long_modules or long_funcs or wide_funcs else 0


if __name__ == "__main__":
    sys.exit(main())
