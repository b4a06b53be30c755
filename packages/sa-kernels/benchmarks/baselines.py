"""Baselines the sa-kernels benchmarks measure in the same run (imported by the sibling bench scripts)."""

import torch
from triton.testing import do_bench


def copy_bandwidth_gbps(nbytes: int) -> float:
    """Device-to-device copy bandwidth (GB/s, bytes read + written) of a `nbytes` BF16 tensor."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100)
    return 2 * nbytes / ms / 1e6
