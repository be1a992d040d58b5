"""No module reaches into another class's private attributes.

A name with a leading underscore is a class's own business: what it holds, how it does a thing. Code
outside the class that reads or sets one (`trainer._metrics = ...`, `Trainer._grad_norm(view)`) ties
itself to that inside and breaks silently when the class changes; the class offers a public method or
property instead, or the value is passed in. The check reads the source with `ast`: a private name is
one some class of the package defines (`self._name = ...` in its methods, `def _name` or
`_name = ...` in its body); an access `expr._name` (or `getattr(expr, "_name")` and its kin) is allowed
on `self`, `cls` or `super()`, and inside the body of a class that defines `_name` itself (a method
comparing `other._name`). Names third-party classes define and the package never does
(`torch._foreach_mul_`) are not the package's to police, nor are those of a third-party protocol that
a class here implements (`DIFFUSERS_PROTOCOL`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import h3train

pytestmark = pytest.mark.one_lane

PACKAGE = Path(h3train.__file__).resolve().parent
SCRIPTS = PACKAGE.parent / "scripts"
# Private names diffusers reads or sets on objects of its own protocols, which classes here define to take
# part: a pipeline's execution device (`RenderPipeline`), an attention processor's backend, which
# `set_attention_backend` sets on every processor (`UlyssesAttnProcessor`).
DIFFUSERS_PROTOCOL = {"_execution_device", "_attention_backend"}
# getattr(obj, "_name"), setattr(obj, "_name", v), hasattr(obj, "_name"), delattr(obj, "_name").
_BY_STRING = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        found = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def defined_private_names(cls: ast.ClassDef) -> set[str]:
    """The private names class `cls` defines: in its body (`def _name`, `_name = ...`) or on `self`."""
    names: set[str] = set()
    for statement in cls.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        for target in _targets(statement):
            if isinstance(target, ast.Name):
                names.add(target.id)
    for node in ast.walk(cls):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return {name for name in names if _is_private(name)}


def package_private_names(files: list[Path]) -> set[str]:
    """Every private name some class of `files` defines."""
    names: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                names |= defined_private_names(node)
    return names


def _own(value: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object reaching its own attributes."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def reach_ins(source: str, private: set[str], filename: str = "<source>") -> list[str]:
    """`line: expr._name` for each access of a name in `private` from outside the classes that define it."""
    found: list[str] = []

    def visit(node: ast.AST, inside: frozenset[str]) -> None:
        if isinstance(node, ast.ClassDef):
            inside = inside | defined_private_names(node)
        accessed: tuple[ast.expr, str] | None = None
        if isinstance(node, ast.Attribute):
            accessed = (node.value, node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _BY_STRING
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            accessed = (node.args[0], node.args[1].value)
        if accessed is not None:
            value, name = accessed
            if _is_private(name) and name in private and name not in inside and not _own(value):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(value)}.{name}")
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(source, filename=filename), frozenset())
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted(SCRIPTS.rglob("*.py"))


def test_the_checker_finds_a_reach_in_and_allows_what_is_the_class_own() -> None:
    source = (
        "class Counter:\n"
        "    _limit = 3\n"
        "    def __init__(self):\n"
        "        self._count = 0\n"
        "    def _bump(self):\n"
        "        self._count += 1\n"
        "    def same(self, other):\n"
        "        return self._count == other._count\n"  # inside the class that defines it: allowed
        "class Child(Counter):\n"
        "    def twice(self):\n"
        "        super()._bump()\n"
        "        self._bump()\n"
        "def outside(counter, torch):\n"
        "    counter._count = 5\n"  # a reach-in
        "    Counter._bump(counter)\n"  # a reach-in through the class
        "    getattr(counter, '_limit')\n"  # a reach-in by name
        "    torch._foreach_mul_([], 2)\n"  # no class here defines it: not the package's
        "    return counter.__class__\n"  # a dunder
    )
    tree = ast.parse(source)
    private = set().union(*(defined_private_names(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)))
    assert private == {"_limit", "_count", "_bump"}
    assert reach_ins(source, private) == [
        "<source>:14: counter._count",
        "<source>:15: Counter._bump",
        "<source>:16: counter._limit",
    ]


def test_no_module_reaches_into_another_class_private_attributes() -> None:
    modules = _modules()
    private = package_private_names([p for p in modules if p.is_relative_to(PACKAGE)]) - DIFFUSERS_PROTOCOL
    found = [
        hit for path in modules for hit in reach_ins(path.read_text(), private, str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, f"{len(found)} private attributes reached from outside their class:\n" + "\n".join(found)
