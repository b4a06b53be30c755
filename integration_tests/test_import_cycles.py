"""No package imports itself in a loop: the module import graph of each package, read from the sources.

Every `import` and `from ... import` counts wherever it stands (at module level, in a `try`, or
lazily inside a function), except under `if TYPE_CHECKING:`, which never runs. An edge goes from a
module to the module it names (`from a.b import c` names `a.b.c` when that is a module, else
`a.b`); relative imports resolve against the importing module's package. Only edges between modules
of one package count: the graph between packages is `test_package_graph.py`'s.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = sorted(
    path.parent for path in (ROOT / "packages").glob("*/src/*/__init__.py") if path.is_file()
)


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package rooted at `package_dir` (a folder with `__init__.py`)."""
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree` outside the body of an `if TYPE_CHECKING:`."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            visit(child)

    visit(tree)
    return found


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that module `name` (file `path`) imports."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1]  # level 1: the package itself
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        for alias in node.names:
            submodule = f"{prefix}.{alias.name}"
            targets.add(submodule if submodule in modules else prefix)
    return {target for target in targets if target in modules and target != name}


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package that it imports."""
    files = module_files(package_dir)
    return {name: imported_modules(name, path, set(files)) for name, path in sorted(files.items())}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component of the graph
    with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_within(graph, set(component)) for component in components]


def _cycle_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of `component` (breadth-first, inside it)."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")


@pytest.mark.parametrize("package_dir", SOURCE_ROOTS, ids=[p.name for p in SOURCE_ROOTS])
def test_package_has_no_import_cycle(package_dir):
    cycles = import_cycles(import_graph(package_dir))
    assert cycles == [], f"import cycles in {package_dir.name}:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_every_package_is_checked():
    assert {p.name for p in SOURCE_ROOTS} >= {
        "sa_cp",
        "sa_kernels",
        "sa_routing",
        "sa_mla",
        "sa_layers",
    }


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_loop_through_a_lazy_and_a_relative_import_is_found(tmp_path):
    """The shape of a loop that sa-mla once had: a -> sub.b inside a function -> sub.c -> a."""
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\n",
            "pkg/a.py": "def f():\n    from pkg.sub.b import g\n    return g()\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "from .c import h\n\ndef g():\n    return h()\n",
            "pkg/sub/c.py": "from ..a import f as _f\n\ndef h():\n    return 1\n",
        },
    )
    assert import_cycles(import_graph(package)) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]


def test_from_package_import_names_the_submodule_or_the_package(tmp_path):
    """`from . import b` is an edge to the module b; `from pkg import name` (not a module) one to
    pkg's `__init__`, which here imports the importer back."""
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from . import b\nfrom .c import value\n",
            "pkg/b.py": "X = 1\n",
            "pkg/c.py": "from pkg import b\nfrom pkg import helper\nvalue = 1\n",
        },
    )
    graph = import_graph(package)
    assert graph == {"pkg": {"pkg.b", "pkg.c"}, "pkg.b": set(), "pkg.c": {"pkg", "pkg.b"}}
    assert import_cycles(graph) == [["pkg", "pkg.c", "pkg"]]


def test_type_checking_imports_and_one_way_imports_are_no_cycle(tmp_path):
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import f\n",
            "pkg/a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
            "pkg/b.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.a import f\n"
                "else:\n    import os\n\ndef g():\n    return 1\n"
            ),
        },
    )
    assert import_cycles(import_graph(package)) == []
