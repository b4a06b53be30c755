"""`sparse_region_attention`: causal softmax attention of each query over the keys of the regions its
KV group selected (Step-5 CSA, SEMANTICS §1.2), without expanding region ids to token ids.

Backends: "reference" (the chunked PyTorch oracle, CPU or CUDA), "gather" (Triton kernels that read
each selected region's key rows from `region_sources` and load only those K/V rows; on CPU through
TRITON_INTERPRET=1), "flex" (compiled FlexAttention over `build_region_block_mask`'s 128×128
BlockMask, whose mask_mod reads the query's packed region bitmap at the key's region; CUDA only),
"auto" (see `auto_backend`). "fa4" is refused: FlashAttention-4's block-sparse path takes tiles
plus its own causal mask, and region routes need a per-key membership test it does not run.

The Flex backend and the boundary checks are `sparse_gqa`'s (`sparse_gqa.flex`,
`sparse_gqa.checks`); Flex kernel options are `flex_kernel_options`' for the bitmap mask_mod: on
sm_90 with 16-bit inputs and head_dim <= 192 the tiles that fit its shared memory there; torch's
defaults otherwise. The GPU generation is read once per call (`backend.device_capability`) and
handed to the mask build, `auto_backend` and the Flex options.
"""

import numbers

import torch

from sa_kernels.backend import device_capability
from sa_kernels.sparse_gqa.checks import (
    check_fast_backend,
    check_one_device,
    check_qkv,
    check_tensors,
    softmax_scale_value,
)
from sa_kernels.sparse_gqa.flex import (
    FLEX_TESTED_CAPABILITIES,
    FLEX_TESTED_DTYPES,
    compiled_flex,
    flex_attend,
    flex_kernel_options,
)
from sa_kernels.sparse_gqa.triton_kernels import natural_lse

from .block_mask import (
    FLEX_MIN_OCCUPANCY,
    RegionBlockMask,
    RegionTileStatistics,
    build_region_block_mask,
)
from .reference import sparse_region_attention_reference
from .triton_kernels import MAX_HEAD_DIM, region_attention_backward, region_attention_forward

__all__ = [
    "RegionBlockMask",
    "RegionTileStatistics",
    "auto_backend",
    "build_region_block_mask",
    "sparse_region_attention",
    "sparse_region_attention_reference",
]

BACKENDS = ("auto", "flex", "gather", "fa4", "reference")


class _RegionGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, query, key, value, routes, counts, sources, query_start, scale, return_lse=False
    ):
        out, lse = region_attention_forward(
            query, key, value, routes, counts, sources, query_start, scale
        )
        ctx.save_for_backward(query, key, value, out, lse, routes, counts, sources)
        ctx.query_start = query_start
        ctx.scale = scale
        if not return_lse:
            return out
        natural = natural_lse(lse)  # [B, Q, H], natural log; carries no gradient
        ctx.mark_non_differentiable(natural)
        return out, natural

    @staticmethod
    def backward(ctx, grad_out, *_grad_lse):
        query, key, value, out, lse, routes, counts, sources = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        dq, dk, dv = region_attention_backward(
            query, key, value, out, grad_out, lse, routes, counts, sources,
            ctx.query_start, ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None


def _flex_in_envelope(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Inputs and GPU where `auto` may pick Flex (those it was measured and tested on)."""
    return dtype in FLEX_TESTED_DTYPES and capability in FLEX_TESTED_CAPABILITIES


def auto_backend(
    block_mask: RegionBlockMask,
    device: torch.device | str,
    *,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] | None = None,
) -> str:
    """The backend `backend="auto"` runs for these routes: "reference", "flex" or "gather".

    CPU: "reference". CUDA: "flex" when the mask holds a Flex BlockMask, its tile statistics show
    the routes clustering into tiles (occupancy = selected pairs / area of the touched 128×128
    tiles >= FLEX_MIN_OCCUPANCY, 0.5: Flex's dense tile math then wastes at most half its work,
    while the gather kernels' cost follows the selected pairs), the inputs are bfloat16/float16 and
    the GPU's compute capability is in `sparse_gqa.FLEX_TESTED_CAPABILITIES` (`capability`;
    default: the device's own); also "flex" for head_dim > 256, which the gather kernels do not
    take, when the mask holds one; "gather" otherwise. The threshold is sparse_gqa's (measured on
    token routes); bench_sparse_region_attention.py times both backends on region routes. Decided
    from host numbers the mask build already holds: no device sync.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "reference"
    if capability is None:
        capability = device_capability(device)
    return _cuda_choice(block_mask, head_dim, _flex_in_envelope(dtype, capability))


def _cuda_choice(block_mask: RegionBlockMask, head_dim: int, in_envelope: bool) -> str:
    """`auto_backend` on CUDA, given whether the dtype and GPU lie in Flex's tested envelope."""
    if block_mask.flex is not None and head_dim > MAX_HEAD_DIM:
        return "flex"
    stats = block_mask.statistics
    clustered = (
        block_mask.flex is not None and stats is not None and stats.occupancy >= FLEX_MIN_OCCUPANCY
    )
    return "flex" if clustered and in_envelope else "gather"


def _validate(fn, query, key, value, region_ids, region_sources, backend):
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}; got {backend!r}")
    check_tensors(
        fn,
        query=query,
        key=key,
        value=value,
        region_ids=region_ids,
        region_sources=region_sources,
    )
    check_qkv(fn, query, key, value)
    if region_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: region_ids must be int32 or int64; got {region_ids.dtype}")
    if region_sources.dtype != torch.int32:
        raise TypeError(f"{fn}: region_sources must be int32; got {region_sources.dtype}")
    batch, queries, heads, head_dim = query.shape
    if min(query.shape) < 1:
        raise ValueError(f"{fn}: query must have no empty dim; got shape {tuple(query.shape)}")
    if (
        key.shape != value.shape
        or key.shape[0] != batch
        or key.shape[3] != head_dim
        or min(key.shape) < 1
    ):
        raise ValueError(
            f"{fn}: key and value must be [batch={batch}, kv_length >= 1, kv_groups, "
            f"head_dim={head_dim}]; got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    groups = key.shape[2]
    if heads % groups:
        raise ValueError(f"{fn}: query heads ({heads}) must be a multiple of kv_groups ({groups})")
    if region_ids.dim() != 4 or tuple(region_ids.shape[:3]) != (batch, groups, queries):
        raise ValueError(
            f"{fn}: region_ids must be [batch, kv_groups, queries, slots] = [{batch}, {groups}, "
            f"{queries}, slots]; got {tuple(region_ids.shape)}"
        )
    if region_ids.shape[-1] < 1:
        raise ValueError(f"{fn}: region_ids must hold at least one slot per row; got 0")
    if (
        region_sources.dim() != 3
        or region_sources.shape[0] != batch
        or min(region_sources.shape) < 1
    ):
        raise ValueError(
            f"{fn}: region_sources must be [batch={batch}, regions >= 1, region_size >= 1]; got "
            f"{tuple(region_sources.shape)}"
        )
    check_one_device(fn, (query, key, value, region_ids, region_sources))


def _query_start(fn: str, query_start: object, queries: int, kv_length: int) -> int:
    if isinstance(query_start, bool) or not isinstance(query_start, numbers.Integral):
        raise TypeError(f"{fn}: query_start must be an int; got {query_start!r}")
    query_start = int(query_start)
    if not 0 <= query_start <= kv_length - queries:
        raise ValueError(
            f"{fn}: query_start must be in [0, kv_length - queries] = [0, {kv_length - queries}] "
            f"(the queries are global rows [query_start, query_start + {queries}) of the "
            f"{kv_length} keys); got {query_start}"
        )
    return query_start


def _check_block_mask(fn, block_mask, region_ids, region_sources, key, heads, query_start):
    if not isinstance(block_mask, RegionBlockMask):
        raise TypeError(
            f"{fn}: block_mask must be a RegionBlockMask from build_region_block_mask; got "
            f"{type(block_mask).__name__}"
        )
    built = (
        tuple(block_mask.routes.shape),
        block_mask.region_count,
        block_mask.kv_length,
        block_mask.query_heads,
        block_mask.query_start,
        block_mask.routes.device,
    )
    wanted = (
        tuple(region_ids.shape),
        region_sources.shape[1],
        key.shape[1],
        heads,
        query_start,
        region_ids.device,
    )
    if built != wanted:
        names = "(routes shape, regions, kv_length, query_heads, query_start, device)"
        raise ValueError(
            f"{fn}: block_mask was built for {names} = {built}; these inputs need {wanted}"
        )


def sparse_region_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    region_ids: torch.Tensor,
    region_sources: torch.Tensor,
    *,
    query_start: int = 0,
    softmax_scale: float | None = None,
    backend: str = "auto",
    block_mask: RegionBlockMask | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of each query over the keys of its KV group's selected regions.

    Query row q (global row query_start + q) attends, for its KV group, to every key row k listed
    by one of its selected regions with k <= query_start + q. Regions lie inside the query's
    document by construction, so no document test is made.

    Args:
        query: [batch, queries, heads, head_dim] bf16/fp16/fp32 (float64: reference only).
        key: [batch, kv_length, kv_groups, head_dim], same dtype; heads % kv_groups == 0, the heads
            of group g are g·hpg … (g + 1)·hpg − 1 (hpg = heads // kv_groups).
        value: [batch, kv_length, kv_groups, head_dim], same dtype.
        region_ids: int32 (or int64) [batch, kv_groups, queries, slots], the selected region ids
            of each (batch, group, query), e.g. `RegionSelection.region_ids`; ids outside
            [0, regions) are unused slots, any order, repeats count once.
        region_sources: int32 [batch, regions, region_size], the key row of each offset of each
            region, -1 (or any row outside [0, kv_length)) where it has none, e.g.
            `RegionMetadata.region_sources`. Regions must be disjoint (a key row listed at most
            once per batch row), as region metadata builds them.
        query_start: global row of query 0 (a context-parallel shard's start); the queries are rows
            [query_start, query_start + queries) of the kv_length keys.
        softmax_scale: multiplies the scores; default head_dim ** -0.5; finite and > 0.
        backend: "auto" | "gather" | "flex" | "reference" ("fa4" raises). "auto": the reference
            on CPU; on CUDA Flex when the routes cluster into 128×128 tiles, else the gather
            kernels (`auto_backend` gives the rule).
        block_mask: a `build_region_block_mask(region_ids, region_sources, kv_length, heads,
            query_start=...)` result for these routes, to reuse across calls (recompute); built
            here when None (auto on CUDA with 16-bit inputs computes the tile statistics: one more
            host sync). When given, the fast backends attend over its canonical routes and do not
            read `region_ids` again (only their shape is checked), so it must come from these ids;
            the reference reads `region_ids`.
        return_lse: also return the attention's log-sum-exp, from the same forward (no extra
            pass over the keys).
    Returns:
        out: [batch, queries, heads, head_dim] in query.dtype; FP32 softmax; a row with no visible
            key gives 0 and zero gradients.
        lse (only with `return_lse`): float32 [batch, queries, heads], the natural log of
            `Σ exp(softmax_scale · q · k)` over the row's visible keys (what `out` is normalised
            by); −inf for a row with none. Returned without an autograd graph (detached, or marked
            non-differentiable): no gradient flows through it. The reference computes it, gather
            converts its kernels' log2 LSE, Flex returns its own (natural log).
        `out` alone without `return_lse`, `(out, lse)` with it.
    Raises:
        TypeError: non-tensor inputs, mismatched or unsupported dtypes (float64 on a fast backend),
            non-integer region_ids, region_sources not int32, query_start not an int, a
            softmax_scale that is not a number, a block_mask that is not a RegionBlockMask, a
            return_lse that is not a bool.
        ValueError: shapes that disagree, an unknown backend, tensors on several devices, a
            query_start outside [0, kv_length - queries], a softmax_scale that is not finite and
            positive, a block_mask built for other inputs or without the Flex mask for 'flex',
            head_dim > 256 on 'gather'.
        RuntimeError: 'fa4' (not wired for region routes), 'flex' on CPU tensors, 'gather' on CPU
            without TRITON_INTERPRET=1.
    """
    fn = "sparse_region_attention"
    _validate(fn, query, key, value, region_ids, region_sources, backend)
    if not isinstance(return_lse, bool):
        raise TypeError(f"{fn}: return_lse must be a bool; got {return_lse!r}")
    batch, queries, heads, head_dim = query.shape
    kv_length = key.shape[1]
    query_start = _query_start(fn, query_start, queries, kv_length)
    scale = softmax_scale_value(fn, softmax_scale, head_dim)
    if block_mask is not None:
        _check_block_mask(fn, block_mask, region_ids, region_sources, key, heads, query_start)
    if backend == "fa4":
        raise RuntimeError(
            f"{fn}: backend='fa4' is not wired for region routes (FA4's block sparsity takes whole "
            "tiles plus its own causal mask; selected regions need a per-key membership test); "
            "use 'gather', 'flex' or 'auto'"
        )
    if backend == "auto" and query.device.type != "cuda":
        backend = "reference"
    if backend == "reference":
        return sparse_region_attention_reference(
            query, key, value, region_ids, region_sources, query_start, scale, return_lse=return_lse
        )
    check_fast_backend(fn, backend, query)
    capability = device_capability(query)  # None on CPU
    region_sources = (
        region_sources if region_sources.stride(-1) == 1 else region_sources.contiguous()
    )
    in_envelope = backend == "auto" and _flex_in_envelope(query.dtype, capability)
    if block_mask is None:
        if backend == "auto":
            build_flex = True if head_dim > MAX_HEAD_DIM else (None if in_envelope else False)
        else:
            build_flex = backend == "flex"
        block_mask = build_region_block_mask(
            region_ids,
            region_sources,
            kv_length,
            heads,
            query_start=query_start,
            build_flex=build_flex,
        )
    if backend == "auto":
        backend = _cuda_choice(block_mask, head_dim, in_envelope)
    if backend == "flex":
        if block_mask.flex is None:
            raise ValueError(f"{fn}: backend='flex' needs a block_mask built with build_flex=True")
        options = flex_kernel_options(head_dim, query.dtype, query.device.type, capability)
        return flex_attend(
            compiled_flex(),
            query,
            key,
            value,
            block_mask.flex,
            scale,
            options,
            return_lse=return_lse,
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: backend='gather' takes head_dim <= {MAX_HEAD_DIM}; got {head_dim}")
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return _RegionGather.apply(
        query,
        key,
        value,
        block_mask.routes,
        block_mask.counts,
        region_sources,
        query_start,
        scale,
        return_lse,
    )
