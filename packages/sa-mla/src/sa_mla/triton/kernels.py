"""Triton kernels for sparse MLA: forward, the backward preprocess (delta), and the fused backward.

Layout (validated by the caller): q [T, H, D] and kv [T_kv, D] row-major with unit last stride,
ids [T, W] int32, D = 512 (values only) or 576 (512 value dims + 64 rope dims). One program owns one
query token and a block of heads; it streams that token's top-k slots in blocks of BLOCK_K, gathers the
latent rows they name, and keeps an online softmax in base 2. The backward recomputes the scores from the
saved lse, accumulates dq in registers and adds each slot's dkv with FP32 atomics (a key may be named by
many queries, and twice by one query: every slot counts).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sa_kernels._backend import triton_interpret

LOG2E = 1.4426950408889634
VALUE_DIM = 512


# Triton's interpreter multiplies bf16 dot operands as raw uint16 (Triton 3.9); the kernels widen them to
# FP32 first when interpreting (UPCAST), which the compiled kernels never do.


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and warps for one kernel launch."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int


def _head_block(heads: int) -> int:
    return 64 if heads > 32 else max(16, triton.next_power_of_2(heads))


def forward_configs(heads: int) -> list[LaunchConfig]:
    """Configs to try in order: the first that fits the GPU's shared memory and registers is kept."""
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = _head_block(heads)
    return [LaunchConfig(h, 64, 8, 2), LaunchConfig(h, 32, 8, 2), LaunchConfig(16, 32, 4, 1)]


def dq_configs(heads: int) -> list[LaunchConfig]:
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = _head_block(heads)
    return [LaunchConfig(h, 64, 8, 1), LaunchConfig(h, 32, 8, 1), LaunchConfig(16, 32, 4, 1)]


def dkv_configs(heads: int) -> list[LaunchConfig]:
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = min(32, _head_block(heads))
    return [LaunchConfig(h, 64, 4, 1), LaunchConfig(h, 32, 4, 1), LaunchConfig(16, 32, 4, 1)]


_CHOSEN: dict[tuple, LaunchConfig] = {}


def _launch(
    kernel, key: tuple | None, configs: list[LaunchConfig], grid_of, *args, **constexprs
) -> None:
    """Launch with the first config that compiles within the device's limits (remembered per key)."""
    if key is not None and key in _CHOSEN:
        configs = [_CHOSEN[key]]
    error = None
    for config in configs:
        try:
            kernel[grid_of(config)](
                *args,
                **constexprs,
                BLOCK_H=config.block_h,
                BLOCK_K=config.block_k,
                UPCAST=triton_interpret(),
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
        except triton.runtime.errors.OutOfResources as exc:
            error = exc
            continue
        if key is not None:
            _CHOSEN[key] = config
        return
    raise error


@triton.jit
def _sparse_mla_fwd_kernel(
    Q,
    KV,
    IDX,
    TOPK_LEN,
    SINK,
    OUT,
    LSE,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_ot,
    stride_oh,
    heads,
    keys,
    width,
    scale_log2,
    HAS_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    D_ROPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    offs_v = tl.arange(0, DV)
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
    if D_ROPE > 0:
        offs_r = DV + tl.arange(0, D_ROPE)
        q_rope = tl.load(q_row + offs_r[None, :], mask=hmask[:, None], other=0.0)
        if UPCAST:
            q_rope = q_rope.to(tl.float32)
    length = width
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), width)
    idx_row = IDX + t * stride_it

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for start in range(0, length, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        kv_row = KV + ids.to(tl.int64) * stride_kvt
        k_nope = tl.load(kv_row[:, None] + offs_v[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            k_nope = k_nope.to(tl.float32)
        s = tl.dot(q_nope, tl.trans(k_nope))
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            s += tl.dot(q_rope, tl.trans(k_rope))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope)
        m_i = m_new

    nonempty = l_i > 0.0
    denominator = l_i
    if HAS_SINK:
        sink = tl.load(SINK + offs_h, mask=hmask, other=float("-inf")).to(tl.float32)
        denominator += tl.exp2(sink * 1.4426950408889634 - tl.where(nonempty, m_i, 0.0))
    scale = tl.where(nonempty, 1.0 / tl.where(nonempty, denominator, 1.0), 0.0)
    out = acc * scale[:, None]
    o_row = OUT + t * stride_ot + offs_h[:, None] * stride_oh
    tl.store(o_row + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=hmask[:, None])
    lse = tl.where(
        nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("inf")
    )
    tl.store(LSE + t * heads + offs_h, lse, mask=hmask)


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
):
    """dq[t, h] = scale * sum_j p_j (dO . v_j - delta) k_j over the token's valid slots."""
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
        st = tl.dot(k_nope, tl.trans(q_nope))
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            st += tl.dot(k_rope, tl.trans(q_rope))
        pt = tl.exp2(st * scale_log2 - lse2[None, :])
        pt = tl.where(valid[:, None], pt, 0.0)
        dpt = tl.dot(k_nope, tl.trans(do))
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
            st += tl.dot(k_c, tl.trans(q_c))
            dpt += tl.dot(k_c, tl.trans(do_c))
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            st += tl.dot(k_rope, tl.trans(q_rope))
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
            dk_c = tl.dot(dst.to(q_c.dtype), q_c) + tl.dot(pt.to(do_c.dtype), do_c)
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


def sparse_mla_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    ids: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], kv [T_kv, D], ids [T, W] int32 -> (out [T, H, 512] q.dtype, lse [T, H] fp32 natural log)."""
    tokens, heads, head_dim = q.shape
    out = torch.empty(tokens, heads, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out, lse
    configs = [config] if config is not None else forward_configs(heads)
    key = (
        None
        if config is not None
        else ("fwd", heads, head_dim, q.dtype, topk_length is not None, attn_sink is not None)
    )
    _launch(
        _sparse_mla_fwd_kernel,
        key,
        configs,
        lambda c: (triton.cdiv(heads, c.block_h), tokens),
        q,
        kv,
        ids,
        topk_length if topk_length is not None else ids,
        attn_sink if attn_sink is not None else lse,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        ids.stride(0),
        out.stride(0),
        out.stride(1),
        heads,
        kv.shape[0],
        ids.shape[1],
        float(softmax_scale) * LOG2E,
        HAS_LEN=topk_length is not None,
        HAS_SINK=attn_sink is not None,
        D_ROPE=head_dim - VALUE_DIM,
        DV=VALUE_DIM,
    )
    return out, lse


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
