"""Gluon (Triton's lower-level language) names that moved between Triton 3.6, torch 2.11's, and the lock
file's 3.9, resolved once for every Gluon kernel of the workspace.

Importing this module raises ImportError (or AttributeError) where the installed Triton has no Gluon
or neither spelling of a name: callers then keep to their Triton kernels.
"""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# The CTA-wide barrier (within a warp-specialised partition: that partition's warps).
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# cp.async of a tensor of pointers into shared memory (`async_load` in 3.9).
async_gather = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# A TMA load into shared memory: `async_load` in 3.9, whose `async_copy_global_to_shared` still
# exists but fails to compile ("has been removed").
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

__all__ = ["async_gather", "cta_barrier", "tma_load"]
