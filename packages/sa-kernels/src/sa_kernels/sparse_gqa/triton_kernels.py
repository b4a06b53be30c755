"""Gather kernels: each program is one (batch, query, KV group); its G query heads share one route.

Only the selected K/V rows are loaded. Routes come canonical (`routes.canonical_routes`): per row its
`count` distinct valid ids, ascending, then the sentinel `kv_length` (which the kernels mask), so the
loop stops at the count. Scores, softmax and accumulators are FP32; the backward scatters dK and dV
into FP32 buffers with FP32 atomics (one add per selected row and column, no repeats inside a
program).

The backward is bound by those atomics. Where the keys' FP32 accumulators outgrow the L2 cache, it runs
in key-range passes (`KEY_SPLIT` keys each): a program (query, group, pass) scans only its route's
slots inside the pass's range (bounds found by binary search on the ascending routes), and programs
are numbered pass-major, so the programs in flight at any time all add into one range's accumulators.
dQ is then summed over the passes with FP32 atomics too.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import triton_interpret
from sa_kernels.triton_dot import fp32_dot

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def natural_lse(lse: torch.Tensor) -> torch.Tensor:
    """The forward kernels' LSE (FP32 [B, H, Q], log2 domain of scale·scores, +inf on an empty row)
    as float32 [B, Q, H] natural log, −inf on an empty row (a new contiguous tensor)."""
    natural = torch.where(lse == float("inf"), float("-inf"), lse * LN2)
    return natural.transpose(1, 2).contiguous()


@triton.jit
def _route_head(h, ROUTE_PER_GROUP: tl.constexpr):
    """The route row of KV group h, int64: route_heads · Q · W passes 2**31 at long lengths."""
    if ROUTE_PER_GROUP:
        rh = h.to(tl.int64)
    else:
        rh = tl.zeros([], dtype=tl.int64)
    return rh


@triton.jit
def _load_group_rows(ptr, b64, q64, stride_b, stride_q, stride_h, heads, offs_d, mask):
    """[BLOCK_G, BLOCK_D] rows of one query's heads of a [B, Q, H, D] tensor (last-dim stride 1)."""
    rows = ptr + b64 * stride_b + q64 * stride_q + heads[:, None] * stride_h + offs_d[None, :]
    return tl.load(rows, mask=mask, other=0.0)


@triton.jit
def _gather_fwd_kernel(
    q_ptr, k_ptr, v_ptr, routes_ptr, counts_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_rb, stride_rh, stride_rq,
    stride_cb, stride_ch,
    stride_ob, stride_oq, stride_oh,
    stride_lb, stride_lh,
    queries, kv_heads, kv_length, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROUTE_PER_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    q_idx = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    rh64 = _route_head(h, ROUTE_PER_GROUP)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, BLOCK_W)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = h.to(tl.int64) * GROUP + offs_g  # int64: head-major views have large head strides
    b64 = b.to(tl.int64)
    q64 = q_idx.to(tl.int64)
    q = _load_group_rows(
        q_ptr, b64, q64, stride_qb, stride_qq, stride_qh, heads, offs_d,
        g_mask[:, None] & d_mask[None, :],
    )  # fmt: skip
    route_base = routes_ptr + b64 * stride_rb + rh64 * stride_rh + q64 * stride_rq
    count = tl.load(counts_ptr + b64 * stride_cb + rh64 * stride_ch + q_idx)
    k_base = k_ptr + b64 * stride_kb + h.to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + h.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, count, BLOCK_W):
        ids = tl.load(route_base + start + offs_w, mask=start + offs_w < count, other=kv_length)
        w_mask = ids < kv_length
        ids = tl.where(w_mask, ids, 0).to(tl.int64)
        kv_mask = w_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + ids[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + ids[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        s = fp32_dot(q, tl.trans(k), IEEE, UPCAST)
        s = tl.where(w_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet (defensive)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = fp32_dot(p.to(v.dtype), v, IEEE, UPCAST)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_base = out_ptr + b64 * stride_ob + q64 * stride_oq
    tl.store(
        o_base + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )
    # Log-sum-exp in the exp2 domain of the scaled scores; +inf marks an empty row.
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + q_idx, lse, mask=g_mask)


@triton.jit
def _gather_bwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, routes_ptr, counts_ptr, bounds_ptr,
    dq_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oq, stride_oh,
    stride_dob, stride_doq, stride_doh,
    stride_lb, stride_lh,
    stride_rb, stride_rh, stride_rq,
    stride_cb, stride_ch,
    stride_dqb, stride_dqq, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    queries, kv_heads, route_heads, passes, kv_length, scale, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROUTE_PER_GROUP: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    q_idx = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    rh64 = _route_head(h, ROUTE_PER_GROUP)
    b64 = b.to(tl.int64)
    q64 = q_idx.to(tl.int64)
    if SPLIT:  # this pass's slots [lo, hi) of the route; bounds [B, route_heads, Q, passes + 1]
        bound = bounds_ptr + ((b64 * route_heads + rh64) * queries + q64) * (passes + 1)
        lo = tl.load(bound + tl.program_id(2))
        hi = tl.load(bound + tl.program_id(2) + 1)
    else:
        lo = tl.zeros([], dtype=tl.int32)
        hi = tl.load(counts_ptr + b64 * stride_cb + rh64 * stride_ch + q_idx)
    # dq starts zeroed: a program with no slots in its range leaves its rows as they are
    if hi > lo:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_w = tl.arange(0, BLOCK_W)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        gd_mask = g_mask[:, None] & d_mask[None, :]
        heads = h.to(tl.int64) * GROUP + offs_g  # int64: head-major views have large head strides
        q = _load_group_rows(
            q_ptr, b64, q64, stride_qb, stride_qq, stride_qh, heads, offs_d, gd_mask
        )
        do = _load_group_rows(
            do_ptr, b64, q64, stride_dob, stride_doq, stride_doh, heads, offs_d, gd_mask
        )
        o = _load_group_rows(
            o_ptr, b64, q64, stride_ob, stride_oq, stride_oh, heads, offs_d, gd_mask
        )
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        lse = tl.load(lse_ptr + b64 * stride_lb + heads * stride_lh + q64, mask=g_mask, other=0.0)
        route_base = routes_ptr + b64 * stride_rb + rh64 * stride_rh + q64 * stride_rq
        k_base = k_ptr + b64 * stride_kb + h.to(tl.int64) * stride_kh
        v_base = v_ptr + b64 * stride_vb + h.to(tl.int64) * stride_vh
        dk_base = dk_ptr + b64 * stride_dkb + h.to(tl.int64) * stride_dkh
        dv_base = dv_ptr + b64 * stride_dkb + h.to(tl.int64) * stride_dkh
        dq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_W):
            ids = tl.load(route_base + start + offs_w, mask=start + offs_w < hi, other=kv_length)
            w_mask = ids < kv_length
            ids = tl.where(w_mask, ids, 0).to(tl.int64)
            kv_mask = w_mask[:, None] & d_mask[None, :]
            k = tl.load(
                k_base + ids[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                v_base + ids[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
            )
            s = fp32_dot(q, tl.trans(k), IEEE, UPCAST)
            dp = fp32_dot(do, tl.trans(v), IEEE, UPCAST)
            p = tl.exp2(s * scale_log2 - lse[:, None])
            p = tl.where(w_mask[None, :] & g_mask[:, None], p, 0.0)
            ds = p * (dp - delta[:, None])
            dq += fp32_dot(ds.to(k.dtype), k, IEEE, UPCAST)
            dk = fp32_dot(tl.trans(ds.to(q.dtype)), q, IEEE, UPCAST)
            dv = fp32_dot(tl.trans(p.to(do.dtype)), do, IEEE, UPCAST)
            row = ids[:, None] * stride_dks + offs_d[None, :]
            tl.atomic_add(dk_base + row, dk * scale, mask=kv_mask, sem="relaxed")
            tl.atomic_add(dv_base + row, dv, mask=kv_mask, sem="relaxed")
        dq_rows = dq_ptr + b64 * stride_dqb + q64 * stride_dqq + heads[:, None] * stride_dqh
        if SPLIT:
            tl.atomic_add(dq_rows + offs_d[None, :], dq * scale, mask=gd_mask, sem="relaxed")
        else:
            tl.store(
                dq_rows + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=gd_mask
            )


def group_blocks(group: int, head_dim: int) -> tuple[int, int]:
    """BLOCK_G and BLOCK_D of a launch whose programs hold one query's `group` heads (the rows of
    every dot: at least 16, as `tl.dot` needs)."""
    return max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim))


def dot_flags(query: torch.Tensor) -> dict:
    """The `fp32_dot` constexprs of a launch over `query`: IEEE FP32 dots for FP32 inputs; 16-bit
    inputs upcast under the interpreter (see `triton_dot`)."""
    return {
        "IEEE": query.dtype == torch.float32,
        "UPCAST": triton_interpret() and query.dtype != torch.float32,
    }


def backward_buffers(
    query: torch.Tensor,
    key: torch.Tensor,
    routes: torch.Tensor,
    counts: torch.Tensor,
    ids: int,
    split: int,
    passes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bounds, dq, dk, dv) of a gather backward over canonical `routes` of ids in [0, ids): with
    several passes of `split` ids, the routes' pass bounds (`key_split_bounds`) and an FP32 dq the
    passes add into; with one, `counts` as a placeholder pointer (the kernels read bounds only when
    split) and a zeroed dq of the query's dtype; dk and dv zeroed FP32 of the key's shape."""
    if passes > 1:
        bounds = key_split_bounds(routes, ids, split)
        dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    else:
        bounds = counts
        dq = torch.zeros_like(query)
    dk = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
    dv = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
    return bounds, dq, dk, dv


# FP32 dK (and as many dV) elements one backward pass accumulates per KV group: 16 MiB for both, which
# leaves the pass's K/V rows room in the H200's L2 cache as well.
PASS_ACCUMULATOR_ELEMENTS = 2**21


def default_config(head_dim: int, backward: bool) -> dict:
    """Keys per step (`BLOCK_W`), warps and pipeline stages of one gather launch, and for the backward
    the keys per pass (`KEY_SPLIT`; 0 = one pass): the fastest of `bench_sparse_gqa.py
    --sweep-gather` on scattered routes on the H200. Backward at 128k, D 128: 947 ms in one pass,
    614 ms in passes of 16384 keys."""
    if backward:
        split = PASS_ACCUMULATOR_ELEMENTS // head_dim
        return {"BLOCK_W": 32, "num_warps": 4, "num_stages": 3, "KEY_SPLIT": split}
    return {"BLOCK_W": 32 if head_dim > 128 else 128, "num_warps": 4, "num_stages": 2}


# Candidates `bench_sparse_gqa.py --sweep-gather` times against the defaults (each is checked against
# the default's result first); the kernels' results do not depend on them beyond FP32 summation order.
SWEEP_FORWARD_CONFIGS = [
    {"BLOCK_W": w, "num_warps": warps, "num_stages": stages}
    for w in (32, 64, 128)
    for warps in (4, 8)
    for stages in (2, 3)
]
SWEEP_BACKWARD_CONFIGS = [
    {"BLOCK_W": w, "num_warps": 4, "num_stages": stages, "KEY_SPLIT": split}
    for w in (16, 32)
    for stages in (2, 3)
    for split in (0, 8192, 16384)
]


def key_split_bounds(routes: torch.Tensor, kv_length: int, split: int) -> torch.Tensor:
    """int32 [B, route_heads, Q, passes + 1]: per route, the first slot whose id reaches each pass's
    first key (pass j covers keys [j·split, (j + 1)·split)); the last column is the count. Rows must
    be ascending (canonical)."""
    passes = triton.cdiv(kv_length, split)
    edges = (torch.arange(passes + 1, device=routes.device, dtype=torch.int32) * split).clamp(
        max=kv_length
    )
    rows = routes.reshape(-1, routes.shape[-1])
    bounds = torch.searchsorted(rows, edges.expand(rows.shape[0], -1).contiguous(), out_int32=True)
    return bounds.view(*routes.shape[:-1], passes + 1)


def gather_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    routes: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    _config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Q, Hq, D] (query dtype) and lse FP32 [B, Hq, Q] (log2 domain of scale·scores).

    `_config` ({"BLOCK_W", "num_warps", "num_stages"}) overrides the launch (benchmark sweeps)."""
    batch, queries, query_heads, head_dim = query.shape
    kv_heads = key.shape[2]
    group = query_heads // kv_heads
    if out is None:
        out = torch.empty_like(query)
    lse = torch.empty(batch, query_heads, queries, dtype=torch.float32, device=query.device)
    block_g, block_d = group_blocks(group, head_dim)
    config = _config or default_config(head_dim, backward=False)
    grid = (queries, batch * kv_heads)
    _gather_fwd_kernel[grid](
        query, key, value, routes, counts, out, lse,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        routes.stride(0), routes.stride(1), routes.stride(2),
        counts.stride(0), counts.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        queries, kv_heads, key.shape[1], scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, ROUTE_PER_GROUP=routes.shape[1] > 1,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_W=config["BLOCK_W"],
        **dot_flags(query),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return out, lse


def gather_attention_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    routes: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
    *,
    _config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (query dtype), dk, dv (key/value dtype), accumulated in FP32; `_config` as for the forward.

    dK and dV are FP32 atomic sums, so their last bits can differ between runs. With more keys than
    one pass holds, dq is too: it is summed over the passes in an FP32 buffer of the query's shape
    (at 128k tokens, 64 heads, D 128: 4 GiB, plus the 2 GiB BF16 result while both are alive)."""
    batch, queries, query_heads, head_dim = query.shape
    kv_heads = key.shape[2]
    group = query_heads // kv_heads
    block_g, block_d = group_blocks(group, head_dim)
    config = _config or default_config(head_dim, backward=True)
    split = config.get("KEY_SPLIT", 0)
    passes = triton.cdiv(key.shape[1], split) if split else 1
    bounds, dq, dk, dv = backward_buffers(query, key, routes, counts, key.shape[1], split, passes)
    grid = (queries, batch * kv_heads, passes)
    _gather_bwd_kernel[grid](
        query, key, value, out, grad_out, lse, routes, counts, bounds,
        dq, dk, dv,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        lse.stride(0), lse.stride(1),
        routes.stride(0), routes.stride(1), routes.stride(2),
        counts.stride(0), counts.stride(1),
        dq.stride(0), dq.stride(1), dq.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        queries, kv_heads, routes.shape[1], passes, key.shape[1], scale, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, ROUTE_PER_GROUP=routes.shape[1] > 1, SPLIT=passes > 1,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_W=config["BLOCK_W"],
        **dot_flags(query),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
