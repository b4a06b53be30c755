"""The forward kernel's score dots keep out of Triton's dot chain (see `sa_mla.triton.unchained`).

Compiled offline for sm_90 (no GPU needed), in a subprocess without TRITON_INTERPRET, which would hand
the compiler interpreted functions. The check reads the MMA layouts of the compiled kernel: a score dot
laid out as a chain link has all 8 warps along its 64 head rows (`warpsPerCTA = [8, 1]`), which computes
every score twice on the H200 (docs/benchmarks.md, sixth session).
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sa_mla.triton.forward import _sparse_mla_fwd_kernel as fn

    const = dict(HAS_LEN=False, HAS_SINK=True, D_ROPE=64, DV=512, BLOCK_H=64, BLOCK_K=64, UPCAST=False)
    pointers = dict(Q="*bf16", KV="*bf16", OUT="*bf16", IDX="*i32", TOPK_LEN="*i32", SINK="*fp32", LSE="*fp32")
    signature = {
        n: "constexpr" if n in const else pointers.get(n, "fp32" if n == "scale_log2" else "i32")
        for n in fn.arg_names
    }
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=const),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 8, "num_stages": 3},
    )
    print("\\n".join(line for line in kernel.asm["ttgir"].splitlines() if line.startswith("#mma")))
    """
)


def _compiled_mma_layouts() -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        pytest.skip(f"Triton cannot compile for sm_90 here: {result.stderr.strip()[-300:]}")
    return [line for line in result.stdout.splitlines() if line.startswith("#mma")]


def test_forward_score_dots_split_the_keys_between_the_warpgroups():
    layouts = _compiled_mma_layouts()
    assert layouts, "no MMA layout in the compiled kernel"
    assert all("warpsPerCTA = [8, 1]" not in line for line in layouts), layouts
    assert any("warpsPerCTA = [4, 2]" in line for line in layouts), layouts
