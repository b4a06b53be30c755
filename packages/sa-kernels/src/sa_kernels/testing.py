"""Test support, not an API for users: helpers the kernel tests of this package and of sa-mla share
(they live here, not under a package's tests/, so that both test suites can import them)."""

import os
import subprocess
import sys


def run_without_interpreter(script: str, timeout: float) -> subprocess.CompletedProcess:
    """Run the Python `script` in a fresh interpreter that sees this process's import path, with
    TRITON_INTERPRET unset: offline compile checks (sm_90 cubins, PTX, layouts) need the real
    compiler, and under the interpreter `triton.jit` hands it interpreted functions. Output is
    captured as text."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
