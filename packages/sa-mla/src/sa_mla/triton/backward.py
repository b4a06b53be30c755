"""Sparse MLA backward in Triton: delta = rowsum(dO * O), then a dq kernel and a dkv kernel.

Both recompute the scores from the saved lse (log2 domain, sink included). The dq kernel keeps dq in
registers; the dkv kernel adds every slot's contribution to dkv with FP32 atomics (a key may be named by
many queries, and twice by one query). Scores are computed transposed ([slots, heads]) so q and dO feed
the MMAs from shared memory.
"""

import torch
import triton
import triton.language as tl

from sa_mla.triton.forward import LOG2E, VALUE_DIM
from sa_mla.triton.launch import LaunchConfig, _launch, dkv_configs, dq_configs
from sa_mla.triton.unchained import unchained_dot


@triton.jit
def _sparse_mla_delta_kernel(OUT, DOUT, DELTA, rows, DV: tl.constexpr, BLOCK_R: tl.constexpr):
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < rows
    offs_v = tl.arange(0, DV)
    o = tl.load(OUT + offs_r[:, None] * DV + offs_v[None, :], mask=rmask[:, None], other=0.0).to(
        tl.float32
    )
    do = tl.load(DOUT + offs_r[:, None] * DV + offs_v[None, :], mask=rmask[:, None], other=0.0).to(
        tl.float32
    )
    tl.store(DELTA + offs_r, tl.sum(o * do, axis=1), mask=rmask)


@triton.jit
def _load_query_block(
    Q,
    DOUT,
    LSE2,
    DELTA,
    t,
    hb,
    stride_qt,
    stride_qh,
    stride_dot,
    stride_doh,
    heads,
    BLOCK_H: tl.constexpr,
    DV: tl.constexpr,
    D_ROPE: tl.constexpr,
    DR: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    offs_v = tl.arange(0, DV)
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=hmask[:, None], other=0.0)
    q_rope = tl.load(
        q_row + DV + tl.arange(0, DR)[None, :], mask=hmask[:, None] & (D_ROPE > 0), other=0.0
    )
    do = tl.load(
        DOUT + t * stride_dot + offs_h[:, None] * stride_doh + offs_v[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
        do = do.to(tl.float32)
    # lse2: log2-domain lse including the sink, +inf for rows with no valid slot (their p is then 0).
    lse2 = tl.load(LSE2 + t * heads + offs_h, mask=hmask, other=float("inf"))
    delta = tl.load(DELTA + t * heads + offs_h, mask=hmask, other=0.0)
    return offs_h, hmask, q_nope, q_rope, do, lse2, delta


@triton.jit
def _slot_length(TOPK_LEN, t, width, lse2, HAS_LEN: tl.constexpr):
    length = width
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), width)
    return tl.where(
        tl.min(lse2, axis=0) == float("inf"), 0, length
    )  # every head empty: nothing to do


@triton.jit
def _sparse_mla_bwd_dq_kernel(
    Q,
    KV,
    IDX,
    TOPK_LEN,
    DOUT,
    LSE2,
    DELTA,
    DQ,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    heads,
    keys,
    width,
    scale,
    scale_log2,
    HAS_LEN: tl.constexpr,
    D_ROPE: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    UNCHAIN: tl.constexpr,
):
    """dq[t, h] = scale * sum_j p_j (dO . v_j - delta) k_j over the token's valid slots; one program per
    (head block, token) keeps the whole dq row block in registers. (A variant splitting the value dims
    across programs was slower on the H200 and failed its gpu test, 2026-11-29; removed.)
    """
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_h, hmask, q_nope, q_rope, do, lse2, delta = _load_query_block(
        Q,
        DOUT,
        LSE2,
        DELTA,
        t,
        hb,
        stride_qt,
        stride_qh,
        stride_dot,
        stride_doh,
        heads,
        BLOCK_H,
        DV,
        D_ROPE,
        DR,
        UPCAST,
    )
    length = _slot_length(TOPK_LEN, t, width, lse2, HAS_LEN)
    offs_v = tl.arange(0, DV)
    offs_r = DV + tl.arange(0, DR)
    idx_row = IDX + t * stride_it
    dq_nope = tl.zeros([BLOCK_H, DV], tl.float32)
    dq_rope = tl.zeros([BLOCK_H, DR], tl.float32)
    for start in range(0, length, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        kv_row = KV + ids.to(tl.int64) * stride_kvt
        k_nope = tl.load(kv_row[:, None] + offs_v[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            k_nope = k_nope.to(tl.float32)
        # Scores transposed ([slots, heads]) so q and dO are the MMAs' shared-memory B operands.
        st = unchained_dot(k_nope, q_nope, None, start < length, UNCHAIN, TRANS_B=True)
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            st = unchained_dot(k_rope, q_rope, st, start >= 0, UNCHAIN, TRANS_B=True)
        pt = tl.exp2(st * scale_log2 - lse2[None, :])
        pt = tl.where(valid[:, None], pt, 0.0)
        dpt = unchained_dot(k_nope, do, None, start < width, UNCHAIN, TRANS_B=True)
        ds = tl.trans((pt * (dpt - delta[None, :]) * scale).to(k_nope.dtype))
        dq_nope += tl.dot(ds, k_nope)
        if D_ROPE > 0:
            dq_rope += tl.dot(ds, k_rope)
    dq_row = DQ + t * stride_dqt + offs_h[:, None] * stride_dqh
    tl.store(dq_row + offs_v[None, :], dq_nope.to(DQ.dtype.element_ty), mask=hmask[:, None])
    if D_ROPE > 0:
        tl.store(dq_row + offs_r[None, :], dq_rope.to(DQ.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _sparse_mla_bwd_dkv_kernel(
    Q,
    KV,
    IDX,
    TOPK_LEN,
    DOUT,
    LSE2,
    DELTA,
    DKV,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_dot,
    stride_doh,
    stride_dkvt,
    heads,
    keys,
    width,
    scale,
    scale_log2,
    HAS_LEN: tl.constexpr,
    D_ROPE: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    UNCHAIN: tl.constexpr,
):
    """dkv[id_j] += ds_j^T q (+ p_j^T dO on the value dims), added atomically per slot (FP32).

    Slots are the MMAs' M dimension (transposed scores), and the value dims run in chunks of DC so
    no [BLOCK_K, 512] accumulator has to live in registers.
    """
    DC: tl.constexpr = 64
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    offs_c = tl.arange(0, DC)
    offs_r = DV + tl.arange(0, DR)
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    do_row = DOUT + t * stride_dot + offs_h[:, None] * stride_doh
    lse2 = tl.load(LSE2 + t * heads + offs_h, mask=hmask, other=float("inf"))
    delta = tl.load(DELTA + t * heads + offs_h, mask=hmask, other=0.0)
    length = _slot_length(TOPK_LEN, t, width, lse2, HAS_LEN)
    if D_ROPE > 0:
        q_rope = tl.load(q_row + offs_r[None, :], mask=hmask[:, None], other=0.0)
        if UPCAST:
            q_rope = q_rope.to(tl.float32)
    idx_row = IDX + t * stride_it
    for start in range(0, length, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        kv_row = KV + ids.to(tl.int64) * stride_kvt
        st = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
        dpt = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
        for c in tl.static_range(DV // DC):
            k_c = tl.load(
                kv_row[:, None] + c * DC + offs_c[None, :], mask=valid[:, None], other=0.0
            )
            q_c = tl.load(q_row + c * DC + offs_c[None, :], mask=hmask[:, None], other=0.0)
            do_c = tl.load(do_row + c * DC + offs_c[None, :], mask=hmask[:, None], other=0.0)
            if UPCAST:
                k_c = k_c.to(tl.float32)
                q_c = q_c.to(tl.float32)
                do_c = do_c.to(tl.float32)
            st = unchained_dot(k_c, q_c, st, start < length, UNCHAIN, TRANS_B=True)
            dpt = unchained_dot(k_c, do_c, dpt, start >= 0, UNCHAIN, TRANS_B=True)
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            st = unchained_dot(k_rope, q_rope, st, start < length, UNCHAIN, TRANS_B=True)
        pt = tl.exp2(st * scale_log2 - lse2[None, :])
        pt = tl.where(valid[:, None], pt, 0.0)
        dst = pt * (dpt - delta[None, :]) * scale
        dkv_row = DKV + ids.to(tl.int64) * stride_dkvt
        for c in tl.static_range(DV // DC):
            q_c = tl.load(q_row + c * DC + offs_c[None, :], mask=hmask[:, None], other=0.0)
            do_c = tl.load(do_row + c * DC + offs_c[None, :], mask=hmask[:, None], other=0.0)
            if UPCAST:
                q_c = q_c.to(tl.float32)
                do_c = do_c.to(tl.float32)
            dk_c = unchained_dot(dst.to(q_c.dtype), q_c, None, start < length, UNCHAIN)
            dk_c = tl.dot(pt.to(do_c.dtype), do_c, dk_c)
            tl.atomic_add(
                dkv_row[:, None] + c * DC + offs_c[None, :],
                dk_c,
                mask=valid[:, None],
                sem="relaxed",
            )
        if D_ROPE > 0:
            dk_rope = tl.dot(dst.to(q_rope.dtype), q_rope)
            tl.atomic_add(
                dkv_row[:, None] + offs_r[None, :], dk_rope, mask=valid[:, None], sem="relaxed"
            )


def sparse_mla_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """FP32 [T, H]: sum over the 512 value dims of dout * out (both contiguous [T, H, 512])."""
    tokens, heads, _ = out.shape
    delta = torch.empty(tokens, heads, dtype=torch.float32, device=out.device)
    rows = tokens * heads
    if rows == 0:
        return delta
    block_r = 16
    _sparse_mla_delta_kernel[(triton.cdiv(rows, block_r),)](
        out, dout, delta, rows, DV=VALUE_DIM, BLOCK_R=block_r
    )
    return delta


def sparse_mla_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    ids: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    dout: torch.Tensor,
    lse_total: torch.Tensor,
    delta: torch.Tensor,
    dq_config: LaunchConfig | None = None,
    dkv_config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq [T, H, D] q.dtype, dkv [T_kv, D] fp32).

    lse_total [T, H] fp32 is the natural-log lse including the sink (+inf for empty rows);
    delta [T, H] fp32 is `sparse_mla_delta(out, dout)`. Two kernels: dq (registers), dkv (atomics).
    """
    tokens, heads, head_dim = q.shape
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if tokens == 0:
        return dq, dkv
    lse2 = (lse_total * LOG2E).contiguous()
    common = dict(HAS_LEN=topk_length is not None, D_ROPE=head_dim - VALUE_DIM, DR=64, DV=VALUE_DIM)
    lengths = topk_length if topk_length is not None else ids
    grid_of = lambda c: (triton.cdiv(heads, c.block_h), tokens)
    flags = (heads, head_dim, q.dtype, topk_length is not None)
    _launch(
        _sparse_mla_bwd_dq_kernel,
        None if dq_config is not None else ("dq", *flags),
        [dq_config] if dq_config is not None else dq_configs(heads),
        grid_of,
        q,
        kv,
        ids,
        lengths,
        dout,
        lse2,
        delta,
        dq,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        ids.stride(0),
        dout.stride(0),
        dout.stride(1),
        dq.stride(0),
        dq.stride(1),
        heads,
        kv.shape[0],
        ids.shape[1],
        float(softmax_scale),
        float(softmax_scale) * LOG2E,
        **common,
    )
    _launch(
        _sparse_mla_bwd_dkv_kernel,
        None if dkv_config is not None else ("dkv", *flags),
        [dkv_config] if dkv_config is not None else dkv_configs(heads),
        grid_of,
        q,
        kv,
        ids,
        lengths,
        dout,
        lse2,
        delta,
        dkv,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        ids.stride(0),
        dout.stride(0),
        dout.stride(1),
        dkv.stride(0),
        heads,
        kv.shape[0],
        ids.shape[1],
        float(softmax_scale),
        float(softmax_scale) * LOG2E,
        **common,
    )
    return dq, dkv
