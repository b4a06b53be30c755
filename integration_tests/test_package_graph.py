"""The package graph points one way: sa-cp, sa-kernels -> sa-routing, sa-mla -> sa-layers."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "sa_cp": set(),
    "sa_kernels": set(),
    "sa_routing": {"sa_cp", "sa_kernels"},
    "sa_mla": {"sa_kernels"},
    "sa_layers": {"sa_cp", "sa_kernels", "sa_routing", "sa_mla"},
}


def imported_workspace_modules(package_dir: Path) -> set[str]:
    found = set()
    for path in (package_dir / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found.update(name.split(".")[0] for name in names if name.split(".")[0] in ALLOWED)
    return found


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_sources_import_only_packages_upstream(module):
    package_dir = ROOT / "packages" / module.replace("_", "-")
    assert imported_workspace_modules(package_dir) - {module} <= ALLOWED[module]


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_every_workspace_import_is_a_declared_dependency(module):
    package_dir = ROOT / "packages" / module.replace("_", "-")
    declared = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"][
        "dependencies"
    ]
    declared_modules = {
        d.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for d in declared
    }
    assert imported_workspace_modules(package_dir) - {module} <= declared_modules


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_every_package_imports(module):
    __import__(module)
