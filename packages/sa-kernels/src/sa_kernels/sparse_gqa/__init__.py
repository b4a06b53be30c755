"""`sparse_gqa_attention`: softmax attention of each query over the keys its route selects.

Backends: "reference" (the chunked PyTorch oracle, CPU or CUDA), "gather" (Triton kernels that load
only the selected K/V rows; on CPU through TRITON_INTERPRET=1), "flex" (compiled FlexAttention over
`build_route_block_mask`'s 128×128 BlockMask, CUDA only; shared or per-KV-group routes; kernel
options in `flex.py`), "fa4" (FlashAttention-4's block-sparse kernels, for routes of whole tiles
plus exact causal cuts; needs the optional flash-attn-4; see `fa4.py`), "auto" (see
`auto_backend`).

Each decision is made once per call: the GPU generation is read once (`backend.device_capability`)
and handed to `auto_backend`, the FA4 checks and the Flex options; a backend `auto_backend` picks is
not checked again, and an explicitly requested one is checked once before it runs.
"""

import torch

from sa_kernels.backend import device_capability

from .block_mask import FLEX_MIN_OCCUPANCY, RouteBlockMask, build_route_block_mask
from .checks import (
    check_fast_backend,
    check_one_device,
    check_qkv,
    check_tensors,
    softmax_scale_value,
)
from .fa4 import fa4_attention, fa4_route_issue, fa4_unavailable_reason
from .flex import (
    FLEX_TESTED_CAPABILITIES,
    FLEX_TESTED_DTYPES,
    compiled_flex,
    flex_attend,
    flex_kernel_options,
)
from .reference import sparse_gqa_attention_reference
from .triton_kernels import gather_attention_backward, gather_attention_forward, natural_lse

__all__ = [
    "FLEX_TESTED_CAPABILITIES",
    "RouteBlockMask",
    "auto_backend",
    "build_route_block_mask",
    "flex_kernel_options",
    "sparse_gqa_attention",
]

BACKENDS = ("auto", "flex", "gather", "fa4", "reference")


class _GatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, routes, counts, scale, return_lse=False):
        out, lse = gather_attention_forward(query, key, value, routes, counts, scale)
        ctx.save_for_backward(query, key, value, out, lse, routes, counts)
        ctx.scale = scale
        if not return_lse:
            return out
        natural = natural_lse(lse)  # [B, Q, Hq], natural log; carries no gradient
        ctx.mark_non_differentiable(natural)
        return out, natural

    @staticmethod
    def backward(ctx, grad_out, *_grad_lse):
        query, key, value, out, lse, routes, counts = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        dq, dk, dv = gather_attention_backward(
            query, key, value, out, grad_out, lse, routes, counts, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


def auto_backend(
    block_mask: RouteBlockMask,
    device: torch.device | str,
    *,
    dtype: torch.dtype,
    head_dim: int,
    capability: tuple[int, int] | None = None,
    requires_grad: bool = True,
) -> str:
    """The backend `backend="auto"` runs for these routes: "reference", "fa4", "flex" or "gather".

    CPU: "reference". CUDA: when the routes cluster into tiles and the call lies inside the
    envelope where Flex was measured and tested, "fa4" if flash-attn-4 runs here and the routes are
    whole tiles plus exact causal cuts (`fa4.fa4_route_issue`), else "flex"; otherwise "gather"
    (verified on every route structure). At head_dim 256 a call without gradients (`requires_grad`
    False) keeps Flex: FA4's forward there runs 64-key tiles and takes 13.2 ms against Flex's 5.3 at
    32k on the H200, while fwd+bwd it takes 26.7 against 35.9 (docs/results/sparse_gqa_clustered.json).
    Clustered: the mask was built with its tile statistics (`build_flex=None` or True), its Flex
    BlockMask exists and the occupancy (selected pairs / area of the 128×128 tiles they
    touch) is at least FLEX_MIN_OCCUPANCY (0.5), so Flex's dense tile math wastes at most half of
    its work. Envelope: bfloat16/float16 inputs, head_dim <= 128 (shared or per-KV-group routes) or
    256 (shared routes), a GPU whose compute capability is in FLEX_TESTED_CAPABILITIES (`capability`;
    default: the device's own). `dtype` and `head_dim` are the query's. Decided from host numbers
    the build already holds: no device sync per call.
    """
    if torch.device(device).type != "cuda":
        return "reference"
    if capability is None:
        capability = device_capability(device)
    shared_routes = block_mask.routes.shape[1] == 1
    in_envelope = (
        dtype in FLEX_TESTED_DTYPES
        and (head_dim <= 128 or (head_dim == 256 and shared_routes))
        and capability in FLEX_TESTED_CAPABILITIES
    )
    stats = block_mask.statistics
    clustered = (
        block_mask.flex is not None and stats is not None and stats.occupancy >= FLEX_MIN_OCCUPANCY
    )
    if not (clustered and in_envelope):
        return "gather"
    if (
        dtype != torch.float32
        and (head_dim <= 128 or requires_grad)
        and fa4_route_issue(block_mask, head_dim) is None
        and fa4_unavailable_reason(device, capability) is None
    ):
        return "fa4"
    return "flex"


def _validate(fn, query, key, value, token_ids, backend):
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}; got {backend!r}")
    check_tensors(fn, query=query, key=key, value=value, token_ids=token_ids)
    check_qkv(fn, query, key, value)
    if token_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: token_ids must be int32 or int64; got {token_ids.dtype}")
    batch, queries, query_heads, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"{fn}: key and value must be [batch={batch}, kv_length, kv_heads, head_dim={head_dim}]; "
            f"got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    kv_heads = key.shape[2]
    if kv_heads < 1 or query_heads < 1 or query_heads % kv_heads:
        raise ValueError(
            f"{fn}: query heads ({query_heads}) must be a positive multiple of kv heads ({kv_heads})"
        )
    if key.shape[1] < 1:
        raise ValueError(
            f"{fn}: key and value must hold at least one key (kv_length >= 1); got key "
            f"{tuple(key.shape)}"
        )
    if head_dim < 1:
        raise ValueError(f"{fn}: head_dim must be >= 1; got query {tuple(query.shape)}")
    shared = (batch, queries)
    grouped = (batch, kv_heads, queries)
    if not (
        (token_ids.dim() == 3 and tuple(token_ids.shape[:2]) == shared)
        or (token_ids.dim() == 4 and tuple(token_ids.shape[:3]) == grouped)
    ):
        raise ValueError(
            f"{fn}: token_ids must be [batch, queries, W] = [{batch}, {queries}, W] or "
            f"[batch, kv_heads, queries, W] = [{batch}, {kv_heads}, {queries}, W]; "
            f"got {tuple(token_ids.shape)}"
        )
    if token_ids.shape[-1] < 1:
        raise ValueError(f"{fn}: token_ids must hold at least one slot per row; got W = 0")
    check_one_device(fn, (query, key, value, token_ids))


def _check_block_mask(fn, block_mask, query, key, token_ids):
    if not isinstance(block_mask, RouteBlockMask):
        raise TypeError(
            f"{fn}: block_mask must be a RouteBlockMask from build_route_block_mask; "
            f"got {type(block_mask).__name__}"
        )
    route_heads = 1 if token_ids.dim() == 3 else token_ids.shape[1]
    expected = (query.shape[0], route_heads, query.shape[1], token_ids.shape[-1])
    if (
        tuple(block_mask.routes.shape) != expected
        or block_mask.kv_length != key.shape[1]
        or block_mask.query_heads != query.shape[2]
        or block_mask.routes.device != query.device
    ):
        raise ValueError(
            f"{fn}: block_mask was built for routes {tuple(block_mask.routes.shape)}, kv_length "
            f"{block_mask.kv_length}, query_heads {block_mask.query_heads} on "
            f"{block_mask.routes.device}; these inputs need {expected}, {key.shape[1]}, "
            f"{query.shape[2]} on {query.device}"
        )


def sparse_gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
    block_mask: RouteBlockMask | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query row over the keys its route selects (GQA, K/V not expanded).

    Args:
        query: [batch, queries, query_heads, head_dim] bf16/fp16/fp32 (float64: reference only).
        key: [batch, kv_length, kv_heads, head_dim], same dtype; query_heads % kv_heads == 0.
        value: [batch, kv_length, kv_heads, head_dim], same dtype.
        token_ids: int32/int64 [batch, queries, W] (one route shared by every KV group) or
            [batch, kv_heads, queries, W] (one route per KV group): global key ids; ids outside
            [0, kv_length) (−1 by convention) are padding; repeats count once (set semantics). No
            causal mask is added: the routes say what each query sees.
        softmax_scale: multiplies the scores; default head_dim ** -0.5.
        backend: "auto" | "gather" | "flex" | "fa4" | "reference". "auto" runs the reference on
            CPU; on CUDA it runs Flex when the routes cluster into 128×128 tiles (occupancy >=
            FLEX_MIN_OCCUPANCY, known from the mask build) and the gather kernels when they scatter
            (`auto_backend` gives the choice).
        block_mask: a `build_route_block_mask(token_ids, kv_length, query_heads)` result for these
            routes, to reuse across layers and recompute; built here when None (gather, flex, auto;
            auto builds with `build_flex=None`: one host sync for the tile statistics). A mask built
            with `build_flex=False` makes "auto" run gather. When given, the fast backends attend
            over the mask's routes and do not read `token_ids` again (only its shape is checked:
            comparing the ids would cost a pass and a host sync per call), so the mask must come
            from these same ids; the reference backend reads `token_ids`.
    Returns:
        [batch, queries, query_heads, head_dim] in query.dtype; FP32 softmax; a row with no valid id
        gives 0 and zero gradients. With batch or queries 0 the (empty) result is returned without
        running a backend.
    Raises:
        TypeError: non-tensor inputs, mismatched or unsupported dtypes, non-integer token_ids, a
            block_mask that is not a RouteBlockMask, a softmax_scale that is not a number, a
            return_lse that is not a bool.
        ValueError: shapes that disagree, no key (kv_length 0), no channel (head_dim 0), no query
            or KV head, an unknown backend, tensors on several devices, a softmax_scale that is not
            finite and > 0, a block_mask built for other routes, backend 'fa4' on routes it does
            not serve.
        RuntimeError: backend 'flex' or 'fa4' on CPU tensors, 'gather' on CPU without
            TRITON_INTERPRET=1, 'fa4' where flash-attn-4 cannot run (the reason is given), 'fa4'
            with `return_lse` where flash-attn-4 returns no log-sum-exp.
    """
    return _attention(
        query,
        key,
        value,
        token_ids,
        softmax_scale,
        backend=backend,
        block_mask=block_mask,
        return_lse=return_lse,
    )


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
    block_mask: RouteBlockMask | None = None,
    flex_options: dict | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`sparse_gqa_attention`, for benchmarks: `flex_options` (Flex `kernel_options`) replaces
    `flex_kernel_options`' choice on the Flex backend (`bench_sparse_gqa.py --sweep`)."""
    fn = "sparse_gqa_attention"
    _validate(fn, query, key, value, token_ids, backend)
    if not isinstance(return_lse, bool):
        raise TypeError(f"{fn}: return_lse must be a bool; got {return_lse!r}")
    if block_mask is not None:
        _check_block_mask(fn, block_mask, query, key, token_ids)
    head_dim = query.shape[-1]
    scale = softmax_scale_value(fn, softmax_scale, head_dim)
    if query.shape[0] == 0 or query.shape[1] == 0:
        empty = query * 0  # empty, and still on query's autograd graph
        if return_lse:
            return empty, query.new_empty(query.shape[:3], dtype=torch.float32)
        return empty
    capability = device_capability(query)  # None on CPU
    if backend == "fa4":
        if query.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{fn}: backend='fa4' takes bfloat16 or float16; got {query.dtype}")
        reason = fa4_unavailable_reason(query.device, capability)
        if reason is not None:
            raise RuntimeError(f"{fn}: backend='fa4' cannot run: {reason}")
    if backend == "auto" and query.device.type != "cuda":
        backend = "reference"
    if backend == "reference":
        return sparse_gqa_attention_reference(
            query, key, value, token_ids, scale, return_lse=return_lse
        )
    check_fast_backend(fn, backend, query)
    if block_mask is None:
        block_mask = build_route_block_mask(
            token_ids,
            key.shape[1],
            query.shape[2],
            build_flex={"flex": True, "fa4": True, "gather": False}.get(backend),
        )
    if backend == "auto":  # its choice of fa4 has checked the routes and the install
        backend = auto_backend(
            block_mask,
            query.device,
            dtype=query.dtype,
            head_dim=head_dim,
            capability=capability,
            requires_grad=torch.is_grad_enabled()
            and any(t.requires_grad for t in (query, key, value)),
        )
    elif backend == "fa4" and (issue := fa4_route_issue(block_mask, head_dim)) is not None:
        raise ValueError(f"{fn}: backend='fa4': {issue}")
    if backend == "fa4":
        return fa4_attention(query, key, value, block_mask, scale, return_lse=return_lse)
    if backend == "flex":
        if block_mask.flex is None:
            raise ValueError(f"{fn}: backend='flex' needs a block_mask built with build_flex=True")
        options = flex_options
        if options is None:
            options = flex_kernel_options(
                head_dim,
                query.dtype,
                query.device.type,
                capability,
                bitmap_mask=block_mask.tile_statistics().causal_offset is None,
            )
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
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return _GatherAttention.apply(
        query, key, value, block_mask.routes, block_mask.counts, scale, return_lse
    )
