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


def spread_copy(t, dim: int, stride: int):
    """A copy of `t` whose dimension `dim` steps `stride` elements (the other dimensions keep a
    contiguous layout among themselves), e.g. heads of a head-major view: offsets along `dim` pass
    2**31 elements while every stride stays an int32 launch argument. Only the copied elements of
    its storage are written. Keeps `t.requires_grad` as a leaf."""
    import math

    import torch

    rest = [n for i, n in enumerate(t.shape) if i != dim]
    block = math.prod(rest)
    if stride < block:
        raise ValueError(f"spread_copy: stride {stride} would overlap the {block} other elements")
    strides = list(torch.empty(rest, device="meta").stride())
    strides.insert(dim, stride)
    storage = torch.empty((t.shape[dim] - 1) * stride + block, dtype=t.dtype, device=t.device)
    view = storage.as_strided(t.shape, strides)
    view.copy_(t.detach())
    return view.requires_grad_(t.requires_grad)
