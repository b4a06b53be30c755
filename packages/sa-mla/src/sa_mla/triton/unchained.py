"""`unchained_dot`: a `tl.dot` that Triton does not lay out as a link of a dot chain.

Triton gives a dot whose result feeds another dot (the flash-attention chain: scores, then P·V) all of
its warps along the rows. The sparse MLA kernels' score dots have 64 rows (heads or slots), so at 8
warps that is two warpgroups of 64 rows each: every score is computed twice. Triton finds the chain in
the dot's forward slice, which stops at a region's terminator; so the dot is placed in both branches of
an `if` on a run-time condition, and the warpgroups split the columns instead. The later dot then reads
its operand through shared memory. Identical branches rather than a constant in one of them: the
constant would be staged through shared memory too, and the key tiles leave no room for it.

H200 (2026-11-29, docs/benchmarks.md): forward 236 -> 281 TFLOP/s; backward 93 -> 107 TFLOP/s from the
8-warp dq kernel (the dkv kernel's default runs 4 warps, one warpgroup, where the layout is the same).
"""

import torch
import triton
import triton.language as tl


def unchain_dots(device: torch.device) -> bool:
    """Whether the kernels keep their score dots out of the chain on `device`: on Hopper (sm_90),
    where the duplicated scores were seen and the fix measured. Elsewhere (sm_80's MMA layouts differ,
    Blackwell's were not looked at) and on CPU tensors (the interpreter tests) the dots stay plain; both
    forms compute the same dot. (torch caches the device properties behind the capability.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@triton.jit
def unchained_dot(
    a, b, acc, opaque_condition, UNCHAIN: tl.constexpr, TRANS_B: tl.constexpr = False
):
    """`tl.dot(a, b, acc)`, or with `TRANS_B` `tl.dot(a, tl.trans(b), acc)` (`acc` None: no
    accumulator), kept out of a dot chain where `UNCHAIN` holds (see `unchain_dots`; elsewhere the plain
    dot). The transpose is taken inside the branches, next to its dot, as a plain
    `tl.dot(a, tl.trans(b))` would have it: taken outside, the transposed operand is staged in shared
    memory once more. `opaque_condition`: any boolean the compiler cannot fold (its value does not
    matter: both branches are the same dot). Two calls whose results feed each other need different
    conditions: MLIR merges adjacent `if`s on one condition into one region, and the chain would show
    again."""
    if UNCHAIN:
        if opaque_condition:
            out = _dot(a, b, acc, TRANS_B)
        else:
            out = _dot(a, b, acc, TRANS_B)
    else:
        out = _dot(a, b, acc, TRANS_B)
    return out


@triton.jit
def _dot(a, b, acc, TRANS_B: tl.constexpr):
    if TRANS_B:
        b = tl.trans(b)
    if acc is None:
        return tl.dot(a, b)
    return tl.dot(a, b, acc)
