"""Each package's declared dependencies are complete: what its sources import is the standard
library, the package itself, a workspace package (test_package_graph.py checks those), or one of
its declared third-party requirements; and installed alone into a fresh virtual environment, from
its folder after its workspace dependencies from theirs, every one of its modules imports.

The static check reads every `import` and `importlib.import_module("...")` of a package's sources:
an import that runs when its module loads must name a required dependency; an import that runs
only when called (inside a function) or is guarded by `except ImportError` may also name an extra
(`[project.optional-dependencies]`) or an optional GPU backend listed in OPTIONAL_BACKENDS.

The install check (`slow`) uses uv's pip interface (`uv pip install <folder>`) into a `uv venv`
without system site-packages, pinning third-party versions to the ones of the running interpreter
so that the wheels come from uv's cache (offline when the cache can resolve them).
"""

import ast
import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("sa_cp", "sa_kernels", "sa_routing", "sa_mla", "sa_layers")
WORKSPACE = {module.replace("_", "-") for module in MODULES}
# Backends probed at call time that report their absence with an availability message; built for
# a GPU generation, so no extra can pin them: flash-attn-4 (CuTe DSL), FlashMLA.
OPTIONAL_BACKENDS = {"sa_kernels": {"flash_attn"}, "sa_mla": {"flash_mla"}}
# Import names of declared distributions that are not installed here (so not in the metadata).
IMPORT_NAMES = {"nvidia-cudnn-frontend": {"cudnn"}, "matplotlib": {"matplotlib"}}
GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _folder(module: str) -> Path:
    return ROOT / "packages" / module.replace("_", "-")


def _project(module: str) -> dict:
    return tomllib.loads((_folder(module) / "pyproject.toml").read_text())["project"]


def _distribution(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _installed_import_names() -> dict[str, set[str]]:
    """Import names of every installed distribution, by normalised distribution name."""
    names: dict[str, set[str]] = {}
    for name, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            names.setdefault(_distribution(dist), set()).add(name)
    return names


def _import_names(distribution: str) -> set[str]:
    installed = _installed_import_names().get(distribution)
    return installed or IMPORT_NAMES.get(distribution, {distribution.replace("-", "_")})


def _workspace_dependencies(module: str) -> list[str]:
    """The workspace packages `module` needs, dependencies first (sa-cp, sa-kernels, ...)."""
    needed: list[str] = []
    for requirement in _project(module)["dependencies"]:
        name = _distribution(requirement)
        if name in WORKSPACE:
            for inner in [*_workspace_dependencies(name.replace("-", "_")), name]:
                if inner not in needed:
                    needed.append(inner)
    return needed


class _Imports(ast.NodeVisitor):
    """(top-level module name, eager?, where) of every import of one source file."""

    def __init__(self, path: Path) -> None:
        self.path, self.depth, self.guarded, self.found = path, 0, 0, []

    def _add(self, name: str, node: ast.AST) -> None:
        eager = self.depth == 0 and self.guarded == 0
        self.found.append((name.split(".")[0], eager, f"{self.path}:{node.lineno}"))

    def visit_FunctionDef(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Try(self, node: ast.Try) -> None:
        caught = {
            n.id
            for handler in node.handlers
            for n in ast.walk(handler.type)
            if handler.type is not None and isinstance(n, ast.Name)
        }
        bare = any(handler.type is None for handler in node.handlers)
        guard = bare or bool(caught & GUARDS)
        self.guarded += guard
        for statement in node.body:
            self.visit(statement)
        self.guarded -= guard
        for statement in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(statement)

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return  # never runs
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module, node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if (
            name == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self.depth += 1  # a call: runs when the enclosing code runs, never at import
            self._add(node.args[0].value, node)
            self.depth -= 1
        self.generic_visit(node)


def third_party_imports(module: str) -> list[tuple[str, bool, str]]:
    """(name, eager, where) of the imports of `module`'s sources outside the standard library and
    the workspace."""
    found = []
    for path in sorted((_folder(module) / "src").rglob("*.py")):
        visitor = _Imports(path.relative_to(ROOT))
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        found += [
            item
            for item in visitor.found
            if item[0] not in sys.stdlib_module_names and item[0] not in MODULES
        ]
    return found


def test_the_static_check_sees_guarded_lazy_and_eager_imports(tmp_path):
    source = (
        "import numpy\n"
        "try:\n    import yaml\nexcept ImportError:\n    yaml = None\n"
        "def f():\n    import matplotlib\n    return importlib.import_module('cudnn')\n"
    )
    visitor = _Imports(Path("x.py"))
    visitor.visit(ast.parse(source))
    assert [(name, eager) for name, eager, _ in visitor.found] == [
        ("numpy", True),
        ("yaml", False),
        ("matplotlib", False),
        ("cudnn", False),
    ]


@pytest.mark.parametrize("module", MODULES)
def test_sources_import_only_the_standard_library_workspace_and_declared_dependencies(module):
    project = _project(module)
    required = set().union(*(_import_names(_distribution(r)) for r in project["dependencies"]))
    extras = set().union(
        *(
            _import_names(_distribution(r))
            for group in project.get("optional-dependencies", {}).values()
            for r in group
        )
    )
    optional = extras | OPTIONAL_BACKENDS.get(module, set())
    undeclared = [
        f"{where}: {name}"
        for name, eager, where in third_party_imports(module)
        if name not in required and (eager or name not in optional)
    ]
    assert not undeclared, f"{module} imports packages it does not declare: {undeclared}"


# -- the package alone in a fresh virtual environment ---------------------------------------------


def _uv() -> str:
    uv = shutil.which("uv")
    if uv is None:
        try:
            from uv import find_uv_bin
        except ImportError:
            pytest.skip("the install check needs uv (on PATH or the uv Python package)")
        uv = find_uv_bin()
    return uv


def _pins(path: Path) -> Path:
    """Constraints: every third-party distribution of the running interpreter at its version."""
    lines = sorted(
        {
            f"{_distribution(d.metadata['Name'])}=={d.version}"
            for d in importlib.metadata.distributions()
            if _distribution(d.metadata["Name"]) not in WORKSPACE
        }
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def _install(uv: str, python: Path, constraints: Path, folders: list[Path]) -> None:
    """uv pip install `folders`, from the cache alone when it can resolve them, else online."""
    command = [uv, "pip", "install", "--python", str(python), "-c", str(constraints)]
    attempts = []
    for offline in (["--offline"], []):
        done = subprocess.run(
            [*command, *offline, *map(str, folders)], capture_output=True, text=True, timeout=300
        )
        if done.returncode == 0:
            return
        attempts.append(f"{' '.join(offline) or 'online'}:\n{done.stderr[-3000:]}")
    pytest.fail(f"uv pip install {[f.name for f in folders]} failed\n" + "\n".join(attempts))


IMPORT_ALL = """
import importlib, json, sys
site, names, absent = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
failed, outside = {}, []
for name in names:
    try:
        module = importlib.import_module(name)
    except Exception as error:
        failed[name] = f"{type(error).__name__}: {error}"
        continue
    if not (getattr(module, "__file__", None) or "").startswith(site):
        outside.append(name)
present = [name for name in absent if importlib.util.find_spec(name) is not None]
print(json.dumps({"failed": failed, "outside": outside, "present": present}))
"""


def _module_names(module: str) -> list[str]:
    """Every module of `module`'s sources (`__main__` entry points left out: they run)."""
    src = _folder(module) / "src"
    names = []
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_package_installs_alone_from_its_folder_and_every_module_imports(module, tmp_path):
    uv = _uv()
    venv = tmp_path / "venv"
    subprocess.run(
        [uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    constraints = _pins(tmp_path / "constraints.txt")
    dependencies = _workspace_dependencies(module)
    if dependencies:
        _install(uv, python, constraints, [_folder(d) for d in dependencies])
    _install(uv, python, constraints, [_folder(module)])

    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    names = _module_names(module)
    others = [m for m in MODULES if m != module and m.replace("_", "-") not in dependencies]
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "VIRTUAL_ENV", "UV_"))
    }
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [str(python), "-I", "-c", IMPORT_ALL, site, json.dumps(names), json.dumps(others)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}, f"modules of {module} that do not import: {report['failed']}"
    assert report["outside"] == [], f"imported from outside the venv: {report['outside']}"
    assert report["present"] == [], f"installed without being needed: {report['present']}"
    assert len(names) > 1
