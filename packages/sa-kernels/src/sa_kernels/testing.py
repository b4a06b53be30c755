"""Helpers for tests of the kernels (used by this package's tests and sa-mla's)."""

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
