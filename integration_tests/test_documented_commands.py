"""The commands the READMEs show run as written: nox sessions exist, tools and benchmark scripts take
the flags shown (their --help / --dry-run forms), pip commands name every workspace sibling they need."""

import ast
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
PREFIXES = ("uvx nox", "uv run ", "python ", "pip install ", "pytest ", "TRITON_INTERPRET=1 ")


def documented_commands() -> list[tuple[str, str]]:
    """(README, command) for each command line of a fenced block and each inline `command` span."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                command = line.split("  #")[0].strip()
                if command.startswith(PREFIXES):
                    found.append((doc.relative_to(ROOT).as_posix(), command))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", prose):
            if span.startswith(PREFIXES):
                found.append((doc.relative_to(ROOT).as_posix(), span))
    return found


COMMANDS = documented_commands()


def _ids(commands):
    return [f"{doc}: {command}" for doc, command in commands]


def nox_sessions() -> set[str]:
    """Session names noxfile.py defines (`tests` and `tests(<id>)` for a parametrized one), read
    from its source: the integration environment has no nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.List | ast.Tuple)
    }
    sessions = set()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
        names = [ast.unparse(d) for d in decorators]
        if "nox.session" not in names:
            continue
        sessions.add(node.name)
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "nox.parametrize":
                ids = next((k.value for k in decorator.keywords if k.arg == "ids"), None)
                values = constants[ids.id] if isinstance(ids, ast.Name) else ast.literal_eval(ids)
                sessions.update(f"{node.name}({value})" for value in values)
    return sessions


def test_nox_session_names_are_read_from_the_noxfile():
    sessions = nox_sessions()
    assert {"lint", "integration", "bench", "tests", "tests(sa-cp)", "tests(sa-layers)"} <= sessions


NOX = [(doc, c) for doc, c in COMMANDS if c.startswith("uvx nox")]


@pytest.mark.parametrize(("doc", "command"), NOX, ids=_ids(NOX))
def test_documented_nox_sessions_exist(doc, command):
    words = shlex.split(command)
    words = words[: words.index("--")] if "--" in words else words
    asked = [words[i + 1] for i, w in enumerate(words) if w in ("-s", "--session", "--sessions")]
    sessions = nox_sessions()
    for name in asked:
        assert name in sessions, (
            f"{doc}: `{command}`: nox has no session {name!r}; it has {sorted(sessions)}"
        )


def test_the_readme_shows_the_nox_forms_a_user_needs():
    shown = {c for _, c in NOX}
    assert {"uvx nox", "uvx nox -l"} <= shown
    assert any('-s "tests(' in c for c in shown)


def _python_script(command: str) -> tuple[Path, list[str]] | None:
    words = shlex.split(command.removeprefix("uv run "))
    if words[0] != "python" or len(words) < 2 or not words[1].endswith(".py"):
        return None
    return ROOT / words[1], words[2:]


SCRIPTS = [
    (d, c) for d, c in COMMANDS if "<" not in c and _python_script(c.removeprefix("uv run "))
]


@pytest.mark.parametrize(("doc", "command"), SCRIPTS, ids=_ids(SCRIPTS))
def test_documented_python_commands_take_the_flags_shown(doc, command):
    script, args = _python_script(command)
    assert script.is_file(), f"{doc}: `{command}`: no {script.relative_to(ROOT)}"
    compile(script.read_text(), str(script), "exec")
    if script.name == "gpu_tests.py":  # the exact command, without running anything
        done = subprocess.run(
            [sys.executable, str(script), *args, "--dry-run"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{doc}: `{command}`:\n{done.stderr}"
        return
    flags = {a.strip("[]") for a in args if a.strip("[]").startswith("--")}
    if not flags:
        return  # run as shown without arguments (the tour): the file exists and compiles
    help_text = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert help_text.returncode == 0, f"{doc}: `{command} --help`:\n{help_text.stderr[-2000:]}"
    for flag in flags:
        assert flag in help_text.stdout, f"{doc}: `{command}`: {script.name} has no {flag}"


def _workspace() -> dict[str, set[str]]:
    """{package: its workspace dependencies} from the pyprojects."""
    projects = {}
    for path in ROOT.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(path.read_text())["project"]
        projects[project["name"]] = project
    return {
        name: {re.split(r"[<>=;\[ ]", d)[0] for d in p["dependencies"]} & set(projects)
        for name, p in projects.items()
    }


PIP = [(d, c) for d, c in COMMANDS if c.startswith("pip install ")]


@pytest.mark.parametrize(("doc", "command"), PIP, ids=_ids(PIP))
def test_documented_pip_commands_name_every_sibling_they_need(doc, command):
    workspace = _workspace()
    named = set()
    for word in shlex.split(command)[2:]:
        if word.startswith("packages/"):
            folder, _, extras = word.partition("[")
            assert (ROOT / folder / "pyproject.toml").is_file(), f"{doc}: `{command}`: no {folder}"
            project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
            for extra in filter(None, extras.rstrip("]").split(",")):
                assert extra in project.get("optional-dependencies", {}), f"{doc}: no extra {extra}"
            named.add(project["name"])
    for package in named:
        missing = workspace[package] - named
        assert not missing, (
            f"{doc}: `{command}`: {package} needs {sorted(missing)} in the same command"
        )


def test_every_pyproject_bounds_its_siblings_and_declares_triton_where_imported():
    workspace = _workspace()
    for path in ROOT.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(path.read_text())["project"]
        deps = project["dependencies"]
        for sibling in workspace[project["name"]]:
            assert f"{sibling}>=0.1.0" in deps, f"{path}: {sibling} without a lower bound"
        source = "\n".join(p.read_text() for p in path.parent.glob("src/**/*.py"))
        if re.search(r"^\s*(import|from) triton\b", source, flags=re.M):
            assert any(d.startswith("triton>=") for d in deps), f"{path}: imports triton"
        assert project["license"] == "Apache-2.0" and project["classifiers"] and project["urls"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()


PYTEST = [
    (d, c) for d, c in COMMANDS if c.removeprefix("TRITON_INTERPRET=1 ").startswith("pytest ")
]


@pytest.mark.parametrize(("doc", "command"), PYTEST, ids=_ids(PYTEST))
def test_documented_pytest_commands_name_existing_paths(doc, command):
    paths = [w for w in shlex.split(command) if w.startswith(("packages/", "integration_tests"))]
    assert paths, command
    for path in paths:
        assert (ROOT / path.split("::")[0]).exists(), f"{doc}: `{command}`: no {path}"
