"""`chain_break`: an identity that keeps Triton from laying out two dots as a dot chain.

Triton gives a dot whose result feeds another dot (the flash-attention chain: scores, then P·V) all of
its warps along the rows. The sparse MLA kernels' score dots have 64 rows (heads or slots), so at 8
warps that is two warpgroups of 64 rows each: every score is computed twice. Triton finds the chain in
the dot's forward slice, which stops at a region's terminator; so the value that links the two dots
passes through an `if` on a run-time condition, and the warpgroups split the columns instead.

Only the link goes through the `if`, not the dots: Triton's pipeliner does not look into the
branches, so dots placed there would load the gathered key tiles without asynchronous copies. On the
H200 the portable forward runs at 236 TFLOP/s as a chain, 281 with the dots in the branches and 288
with only the link there.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import device_capability


def unchain_dots(device: torch.device) -> bool:
    """Whether the kernels break their dot chains on `device`: on Hopper (sm_90), where the
    duplicated scores were seen and the fix measured. Elsewhere (sm_80's MMA layouts differ, Blackwell's
    were not looked at) and on CPU tensors (the interpreter tests) `chain_break` is the identity itself.
    `device`: a tensor's device (a CUDA one names its index)."""
    return device.type == "cuda" and device_capability(device.index)[0] == 9


@triton.jit
def chain_break(x, opaque_condition, UNCHAIN: tl.constexpr):
    """`x`, passed through an `if` where `UNCHAIN` holds (see the module docstring); elsewhere `x`.

    `opaque_condition`: any boolean the compiler cannot fold (its value does not matter). Two calls
    whose results feed the same dot need different conditions: MLIR merges adjacent `if`s on one
    condition into one region. The branches differ (`x + 0.0` is not folded, as it turns −0 into +0,
    which no consumer here can tell apart), so MLIR does not fold the `if` away either.
    """
    if UNCHAIN:
        if opaque_condition:
            y = x + 0.0
        else:
            y = x
    else:
        y = x
    return y
