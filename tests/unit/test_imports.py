"""The package's import graph has no cycles, and the config schema is a leaf.

A cycle means no module in it can be imported, tested or changed on its own, and an import placed
inside a function to break one still hides it: so every import counts here, those inside functions
included. Only imports under `if TYPE_CHECKING:` (annotations, never run) are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import h3train

PACKAGE = Path(h3train.__file__).resolve().parent


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its `__init__.py`)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`), whose imports never run."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _imported(
    name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]
) -> Iterator[str]:
    """The package's modules one import statement of module `name` loads.

    Relative imports are resolved against `name`; `from pkg import x` is module `pkg.x` when that is a
    module, else `pkg` itself. An import of a name below a module counts as that module.
    """
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = node.module or ""
        targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            yield target


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself and its own parent packages left out)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                for target in _imported(name, path.name == "__init__.py", node, modules):
                    # Importing `a.b` runs `a/__init__.py` first: that edge is the package's, not a cycle.
                    if target != name and not name.startswith(target + "."):
                        graph[name].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted (iterative, no recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One import cycle through the component's first module, as `a -> b -> ... -> a` reads."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    return [*component, start]


def test_the_graph_builder_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\nfrom .sub.c import thing\n",
        "b.py": (
            "from typing import TYPE_CHECKING\n"
            "import os\n"
            "if TYPE_CHECKING:\n    from .a import x\n"
            "def f():\n    import pkg.sub\n    from .sub import c\n"
        ),
        "sub/__init__.py": "from ..b import f\n",
        "sub/c.py": "from .. import a\nfrom ..b import f as g\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b", "pkg.sub.c"},  # `from . import b` is module b; `.sub.c` relative
        "pkg.b": {"pkg.sub", "pkg.sub.c"},  # in a function: counted; under TYPE_CHECKING: not
        "pkg.sub": {"pkg.b"},
        "pkg.sub.c": {"pkg.a", "pkg.b"},  # `..` from a module of a subpackage
    }
    assert strongly_connected(graph) == [["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"]]
    assert _cycle_in(["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"], graph) == ["pkg.a", "pkg.sub.c", "pkg.a"]


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [" -> ".join(_cycle_in(c, graph)) for c in strongly_connected(graph)]
    assert not cycles, "import cycles among h3train modules: " + "; ".join(cycles)


def test_the_config_schema_imports_only_errors() -> None:
    """Every module reads the config; were it to import any of them back, that would be a cycle."""
    graph = import_graph()
    package = {name for name in graph if name == "h3train.config" or name.startswith("h3train.config.")}
    assert {"h3train.config.schema", "h3train.config.load", "h3train.config.values"} <= package
    assert set().union(*(graph[name] for name in package)) - package == {"h3train.errors"}
    assert graph["h3train.config.schema"] == set()


def test_the_plan_arithmetic_reads_neither_a_config_nor_data() -> None:
    """The memory arithmetic takes constructor kwargs and mesh sizes; what reads a config or a dataset is apart."""
    graph = import_graph()
    direct = graph["h3train.plan.arithmetic"]
    assert not {name for name in direct if name.startswith(("h3train.config", "h3train.data"))}, direct
    reached, todo = set(), ["h3train.plan.arithmetic"]
    while todo:
        for name in graph[todo.pop()] - reached:
            reached.add(name)
            todo.append(name)
    assert not {name for name in reached if name.startswith("h3train.data")}
    assert "h3train.plan.inputs" not in reached and "h3train.plan.printout" not in reached


# The floors of the house, top first. A package imports only its own floor and those below it, and no
# two packages import each other (directly or round a longer loop): so each floor can be read, tested
# and changed with only what is beneath it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("commands", ("__main__", "cli", "commands")),
    ("tools", ("tools",)),
    ("run", ("run",)),
    ("loop", ("train",)),
    ("services", ("checkpoint", "export", "optim", "plan", "render")),
    ("data", ("data", "encode")),
    ("model", ("lora", "model", "objective", "packing")),
    ("layout", ("ops", "parallel", "tasks")),
    ("base", ("config", "debug", "errors", "infra")),
]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package (or top-level module) -> those it imports, from the module graph.

    The root `__init__` is left out: it only quiets third-party loggers, and importing any
    submodule runs it, so it is beneath every floor.
    """
    packages: dict[str, set[str]] = {_top(name): set() for name in graph if name != PACKAGE.name}
    for name, targets in graph.items():
        if name != PACKAGE.name:
            packages[_top(name)].update(_top(t) for t in targets if t != PACKAGE.name and _top(t) != _top(name))
    return packages


def test_every_package_has_a_floor() -> None:
    placed = [name for _, names in FLOORS for name in names]
    assert len(placed) == len(set(placed)), "a package on two floors"
    unplaced = set(package_graph(import_graph())) - set(placed)
    assert not unplaced, f"packages without a floor: {sorted(unplaced)}"


def test_no_package_imports_a_higher_floor() -> None:
    floor = {name: i for i, (_, names) in enumerate(FLOORS) for name in names}
    graph = import_graph()
    up = [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if PACKAGE.name not in (module, target) and floor[_top(target)] < floor[_top(module)]
    ]
    assert not up, "imports from a lower floor to a higher one: " + "; ".join(up)


def test_no_cycle_among_packages() -> None:
    packages = package_graph(import_graph())
    cycles = [" -> ".join(_cycle_in(c, packages)) for c in strongly_connected(packages)]
    assert not cycles, "package cycles: " + "; ".join(cycles)


def test_the_loop_package_stays_the_loop() -> None:
    """`train/` holds the loop, its hooks and metrics sinks; what grows past this moved in by mistake."""
    lines = sum(len(path.read_text().splitlines()) for path in (PACKAGE / "train").rglob("*.py"))
    assert lines < 3500, f"h3train/train/ has {lines} lines"


def test_the_command_line_only_dispatches() -> None:
    """`cli.py` builds the parser from the commands table and dispatches; each command is a module of `commands/`."""
    lines = len((PACKAGE / "cli.py").read_text().splitlines())
    assert lines < 250, f"h3train/cli.py has {lines} lines"


def _top(module: str) -> str:
    """`h3train.a.b` -> `a`; `h3train.cli` -> `cli`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_read_side_imports_nothing_of_encoding() -> None:
    """`data/` reads samples; `encode/` (media in, samples out) writes them through the sample format."""
    packages = package_graph(import_graph())
    assert "encode" not in packages["data"], sorted(packages["data"])
    assert "data" in packages["encode"]


# A room a newcomer reads in one sitting: the longest module and function the house keeps.
MODULE_LINES, FUNCTION_LINES = 800, 100


def test_no_module_or_function_outgrows_the_house() -> None:
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent).as_posix()
        if len(text.splitlines()) > MODULE_LINES:
            long_modules.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long_modules, f"modules over {MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {FUNCTION_LINES} lines: {long_functions}"


def test_no_two_rooms_share_a_file_name() -> None:
    """A module's file name says which room it is: `checks.py` or `report.py` in two packages would not."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(path.relative_to(PACKAGE.parent).as_posix())
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, shared
