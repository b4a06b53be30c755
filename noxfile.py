# /// script
# dependencies = ["nox>=2025.2.9"]
# ///
"""Test, lint and benchmark sessions. Every session syncs its environment from uv.lock.

uvx nox                    # lint, one test session per package, integration
uvx nox -s "tests(sa-cp)"  # one package
uvx nox -s bench           # CPU benchmarks (GPU ones run through tools/gpu_tests.py)
"""

import os
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PACKAGES = ["sa-cp", "sa-kernels", "sa-routing", "sa-mla", "sa-layers"]
# pytest-xdist workers per test session: CI has two cores; each worker's torch gets one thread.
# sa-cp runs in one process: its gloo tests spawn up to four ranks each, which fill both cores
# already, and the suite is too short to repay a second worker's start-up.
WORKERS = min(2, os.cpu_count() or 1)
SERIAL = {"sa-cp"}
# CPU sessions run the Triton kernels through Triton's interpreter.
CPU_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def sync(session: nox.Session, *args: str) -> None:
    """Install exactly what uv.lock pins for `args` into the session's virtualenv."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def pytest(session: nox.Session, *paths: str, workers: int = WORKERS) -> None:
    """pytest on `paths` with `workers` xdist workers (`-- -n 0` after the session: one process)."""
    session.run(
        "pytest",
        "-c",
        str(ROOT / "pyproject.toml"),
        "--rootdir",
        str(ROOT),
        *(["-n", str(workers)] if workers > 1 else []),
        *paths,
        *session.posargs,
        env={**CPU_ENV, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace."""
    sync(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests with only that package and its declared dependencies installed."""
    sync(session, "--package", package)
    pytest(session, f"packages/{package}/tests", workers=1 if package in SERIAL else WORKERS)


@nox.session
def integration(session: nox.Session) -> None:
    """Tests that cross packages, with every package installed (and the docs against the records)."""
    sync(session, "--all-packages")
    pytest(session, "integration_tests")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """CPU benchmarks (replay overhead and references); GPU benchmarks run via tools/gpu_tests.py."""
    sync(session, "--all-packages")
    session.run(
        "python",
        "tools/gpu_tests.py",
        "--cpu-bench",
        *session.posargs,
        env={"OMP_NUM_THREADS": "2"},
    )
