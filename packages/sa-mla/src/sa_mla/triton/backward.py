"""Sparse MLA backward in Triton: delta = rowsum(dO * O), then a dkv kernel and a dq kernel.

Both recompute the scores from the saved lse (log2 domain, sink included). The dq kernel keeps dq in
registers; the dkv kernel adds every slot's contribution to dkv with FP32 atomics (a key may be named by
many queries, and twice by one query). Scores are computed transposed ([slots, heads]) so q and dO feed
the MMAs from shared memory.
"""

import torch
import triton
import triton.language as tl

from sa_mla.triton.forward import LOG2E, VALUE_DIM
from sa_mla.triton.launch import (
    LaunchConfig,
    _launch,
    dkv_configs,
    dq_configs,
    dq_from_ds_configs,
)
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
    DS,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_dot,
    stride_doh,
    stride_dkvt,
    stride_dst,
    t0,
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
    STORE_DS: tl.constexpr,
):
    """dkv[id_j] += ds_j^T q (+ p_j^T dO on the value dims), added atomically per slot (FP32), for
    tokens t0 + program_id(1). With STORE_DS, also writes ds (scale included, in DS's dtype) to
    DS[t − t0, slot, head] for the dq kernel that reads it back.

    Slots are the MMAs' M dimension (transposed scores), and the value dims run in chunks of DC so
    no [BLOCK_K, 512] accumulator has to live in registers.
    """
    DC: tl.constexpr = 64
    hb = tl.program_id(0)
    t = t0 + tl.program_id(1).to(tl.int64)
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
        if STORE_DS:
            tl.store(
                DS + (t - t0) * stride_dst + slots[:, None] * heads + offs_h[None, :],
                dst.to(DS.dtype.element_ty),
                mask=(slots < length)[:, None] & hmask[None, :],
            )
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


@triton.jit
def _sparse_mla_bwd_dq_from_ds_kernel(
    DS,
    KV,
    IDX,
    TOPK_LEN,
    LSE2,
    DQ,
    stride_dst,
    stride_kvt,
    stride_it,
    stride_dqt,
    stride_dqh,
    t0,
    heads,
    keys,
    width,
    HAS_LEN: tl.constexpr,
    D_ROPE: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    UNCHAIN: tl.constexpr,
):
    """dq[t, h] = sum_j ds[t, j, h] k_j, with ds as the dkv kernel wrote it (STORE_DS): one MMA per
    slot block instead of the three (scores, dP, dq) of recomputing ds. Tokens t0 + program_id(1)."""
    hb = tl.program_id(0)
    t = t0 + tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    lse2 = tl.load(LSE2 + t * heads + offs_h, mask=hmask, other=float("inf"))
    # The dkv kernel skipped the same slots (and whole empty rows): their ds was never written.
    length = _slot_length(TOPK_LEN, t, width, lse2, HAS_LEN)
    offs_v = tl.arange(0, DV)
    offs_r = DV + tl.arange(0, DR)
    idx_row = IDX + t * stride_it
    ds_rows = DS + (t - t0) * stride_dst + offs_h[None, :]
    dq_nope = tl.zeros([BLOCK_H, DV], tl.float32)
    dq_rope = tl.zeros([BLOCK_H, DR], tl.float32)
    for start in range(0, length, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        ds_t = tl.load(
            ds_rows + slots[:, None] * heads,
            mask=(slots < length)[:, None] & hmask[None, :],
            other=0.0,
        )
        kv_row = KV + ids.to(tl.int64) * stride_kvt
        k_nope = tl.load(kv_row[:, None] + offs_v[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            ds_t = ds_t.to(tl.float32)
            k_nope = k_nope.to(tl.float32)
        ds = tl.trans(ds_t)
        dq_nope += tl.dot(ds, k_nope)
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            dq_rope += tl.dot(ds, k_rope)
    dq_row = DQ + t * stride_dqt + offs_h[:, None] * stride_dqh
    tl.store(dq_row + offs_v[None, :], dq_nope.to(DQ.dtype.element_ty), mask=hmask[:, None])
    if D_ROPE > 0:
        tl.store(dq_row + offs_r[None, :], dq_rope.to(DQ.dtype.element_ty), mask=hmask[:, None])


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


# The saved-ds method holds ds for this many bytes' worth of tokens at a time ([tokens, width, heads] in
# q's dtype): 1024 tokens at width 2048, 128 heads, bf16.
DS_BUFFER_BYTES = 1 << 29
DQ_METHODS = ("saved_ds", "recompute")


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
    dq_method: str = "saved_ds",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq [T, H, D] q.dtype, dkv [T_kv, D] fp32).

    lse_total [T, H] fp32 is the natural-log lse including the sink (+inf for empty rows);
    delta [T, H] fp32 is `sparse_mla_delta(out, dout)`. The dkv kernel adds every slot's share with
    atomics. `dq_method` "saved_ds": the dkv kernel also writes ds (at most DS_BUFFER_BYTES of tokens
    at a time, in q's dtype, which is what the MMAs read anyway) and dq is one MMA over it;
    "recompute": a dq kernel recomputes the scores and dP (three MMAs) and needs no buffer.
    """
    if dq_method not in DQ_METHODS:
        raise ValueError(f"dq_method must be one of {DQ_METHODS}, got {dq_method!r}")
    tokens, heads, head_dim = q.shape
    width = ids.shape[1]
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if tokens == 0:
        return dq, dkv
    lse2 = (lse_total * LOG2E).contiguous()
    common = dict(HAS_LEN=topk_length is not None, D_ROPE=head_dim - VALUE_DIM, DR=64, DV=VALUE_DIM)
    lengths = topk_length if topk_length is not None else ids
    flags = (heads, head_dim, q.dtype, topk_length is not None)
    saved_ds = dq_method == "saved_ds"
    chunk = tokens
    if saved_ds:
        chunk = max(1, min(tokens, DS_BUFFER_BYTES // max(1, width * heads * q.element_size())))
    ds = torch.empty(chunk if saved_ds else 0, width, heads, dtype=q.dtype, device=q.device)
    for t0 in range(0, tokens, chunk):
        n = min(chunk, tokens - t0)
        grid_of = lambda c, n=n: (triton.cdiv(heads, c.block_h), n)
        _launch(
            _sparse_mla_bwd_dkv_kernel,
            None if dkv_config is not None else ("dkv", saved_ds, *flags),
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
            ds,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            ids.stride(0),
            dout.stride(0),
            dout.stride(1),
            dkv.stride(0),
            width * heads,
            t0,
            heads,
            kv.shape[0],
            width,
            float(softmax_scale),
            float(softmax_scale) * LOG2E,
            STORE_DS=saved_ds,
            **common,
        )
        if saved_ds:
            _launch(
                _sparse_mla_bwd_dq_from_ds_kernel,
                None if dq_config is not None else ("dq_from_ds", *flags),
                [dq_config] if dq_config is not None else dq_from_ds_configs(heads),
                grid_of,
                ds,
                kv,
                ids,
                lengths,
                lse2,
                dq,
                width * heads,
                kv.stride(0),
                ids.stride(0),
                dq.stride(0),
                dq.stride(1),
                t0,
                heads,
                kv.shape[0],
                width,
                **common,
            )
    if not saved_ds:
        _launch(
            _sparse_mla_bwd_dq_kernel,
            None if dq_config is not None else ("dq", *flags),
            [dq_config] if dq_config is not None else dq_configs(heads),
            lambda c: (triton.cdiv(heads, c.block_h), tokens),
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
            width,
            float(softmax_scale),
            float(softmax_scale) * LOG2E,
            **common,
        )
    return dq, dkv
