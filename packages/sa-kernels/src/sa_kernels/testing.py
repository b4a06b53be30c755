"""Test and benchmark support, not an API for users: helpers the kernel tests and benchmarks of this
package, sa-routing and sa-mla share (they live here, not under a package's tests/ or benchmarks/, so
that every package's suites can import them)."""

import os
import subprocess
import sys
from collections.abc import Callable


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


def kernel_device_ms(fn: Callable[[], object], iters: int = 3) -> dict[str, float]:
    """{kernel name: mean device ms per call} of `fn` on CUDA under torch.profiler, after one
    warm-up call; kernels of one name are summed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.self_device_time_total:
            ms = event.self_device_time_total / 1e3 / iters
            times[event.key] = times.get(event.key, 0.0) + ms
    return times
