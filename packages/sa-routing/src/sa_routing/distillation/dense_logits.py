"""Triton kernels of the dense warm-up's indexer side: logits over a tile's candidate units, the KL to
the target and its gradients, without a `[G, rows, units]` logit or gradient tensor per index head.

The indexer's logit of query q, route group g and unit u is `Σ_h c_h · relu(q_h · key_u)` over the
index heads h (`c_h` the head weight, or one scale for all). The PyTorch path of
`blockwise.distillation_sum` runs four FP32 matmuls per head and tile and a dozen elementwise passes
over `[G, rows, units]` tensors. Here the dot rows are the flattened (query, head) pairs of `BLOCK_Q`
queries (`BLOCK_Q · BLOCK_H` rows, the heads summed by a reshape of the rows), and two kernels stream
the units `BLOCK_N` at a time:

- `_dense_rows_kernel`, one program per (query block, group): a first walk over the block's candidate
  units keeps the online log-sum-exp of the logits and the sums `Σ t`, `Σ t · logit` and `Σ t · log t`
  of the target t, from which each query's KL is `Σ t log t − Σ t · logit + lse · Σ t`; a second walk
  forms `d_logit = (softmax − t) · w` (w the query's loss weight), the index queries' and head
  weights' gradients in registers (plain stores: a (query, group) belongs to one program), and writes
  `d_logit` for the keys' pass;
- `_dense_keys_kernel`, one program per (unit block, chunk of query rows): the unit keys' gradient
  `Σ_{g, q, h} d_dot · q_h` over the chunk's rows that see the block, into one partial per chunk
  (summed afterwards: deterministic, no atomics).

Products are FP32-accurate: tensor-core dots of FP32 operands at TF32×3 precision (each operand split
into a TF32 part and a TF32 remainder, three products, FP32 accumulation; the relative error of a
product is near FP32 rounding, where the PyTorch path runs FP32 matmuls). Under `TRITON_INTERPRET=1`
the dots are NumPy FP32 products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 32  # units per step
_ROW_CHUNK = 256  # query rows per program of the keys' pass
_DOT_ROWS = 64  # (query, head) rows of one dot
_WARPS = {"rows": 8, "keys": 8}
_STAGES = {"rows": 1, "keys": 1}


@triton.jit
def _tf32x3_dot(a, b):
    """FP32-accurate a @ b from three TF32 tensor-core products."""
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _heads_to_rows(x, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_Q, BLOCK_N] per query → [BLOCK_Q · BLOCK_H, BLOCK_N] per (query, head) dot row."""
    return tl.reshape(
        tl.broadcast_to(x[:, None, :], (BLOCK_Q, BLOCK_H, BLOCK_N)), (BLOCK_Q * BLOCK_H, BLOCK_N)
    )


@triton.jit
def _unit_dots(
    q, keys_ptr, stride_kn, stride_kd, n0, units, index_dim,
    BLOCK_N: tl.constexpr, BLOCK_DI: tl.constexpr,
):  # fmt: skip
    """(keys [BLOCK_N, BLOCK_DI], dots [rows of q, BLOCK_N]) of units n0 … n0 + BLOCK_N − 1."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_DI)
    keys = tl.load(
        keys_ptr + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
        mask=(offs_n < units)[:, None] & (offs_d < index_dim)[None, :],
        other=0.0,
    ).to(tl.float32)
    return keys, _tf32x3_dot(q, tl.trans(keys))


@triton.jit
def _dense_rows_kernel(
    iq_ptr, iw_ptr, keys_ptr, t_ptr, cs_ptr, ce_ptr, w_ptr, dl_ptr, kl_ptr, dq_ptr, dw_ptr,
    stride_iqq, stride_iqg, stride_iqh, stride_iqd,
    stride_iwq, stride_iwg, stride_iwh,
    stride_kn, stride_kd,
    stride_tg, stride_tq,
    stride_dqq, stride_dqg, stride_dqh, stride_dqd,
    stride_dwq, stride_dwg, stride_dwh,
    rows, units, index_heads, index_dim, scale,
    HAS_WEIGHTS: tl.constexpr, WANT_Q: tl.constexpr, WANT_W: tl.constexpr, WANT_K: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DI: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    g = tl.program_id(1)
    # per query
    offs_q = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = offs_q < rows
    cs = tl.load(cs_ptr + offs_q, mask=q_ok, other=0)
    ce = tl.load(ce_ptr + offs_q, mask=q_ok, other=0)
    weight = tl.load(w_ptr + g * rows + offs_q, mask=q_ok, other=0.0)
    lo = tl.min(tl.where(q_ok & (ce > cs), cs, units))
    hi = tl.max(tl.where(q_ok, ce, 0))
    # per (query, head) dot row
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    row = pid * BLOCK_Q + offs_m // BLOCK_H
    head = offs_m % BLOCK_H
    m_ok = (row < rows) & (head < index_heads)
    offs_d = tl.arange(0, BLOCK_DI)
    md_ok = m_ok[:, None] & (offs_d < index_dim)[None, :]
    q = tl.load(
        iq_ptr + row[:, None].to(tl.int64) * stride_iqq + g * stride_iqg
        + head[:, None] * stride_iqh + offs_d[None, :] * stride_iqd,
        mask=md_ok, other=0.0,
    ).to(tl.float32)  # fmt: skip
    if HAS_WEIGHTS:
        coefficient = tl.load(
            iw_ptr + row.to(tl.int64) * stride_iwq + g * stride_iwg + head * stride_iwh,
            mask=m_ok, other=0.0,
        ).to(tl.float32)  # fmt: skip
    else:
        coefficient = tl.where(m_ok, scale, 0.0)
    t_rows = g * stride_tg + offs_q[:, None].to(tl.int64) * stride_tq  # target and d_logit rows
    # walk 1: online log-sum-exp of the logits, the target's sums
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    sum_t = tl.zeros([BLOCK_Q], tl.float32)
    sum_tl = tl.zeros([BLOCK_Q], tl.float32)
    sum_tlogt = tl.zeros([BLOCK_Q], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        _, dots = _unit_dots(
            q, keys_ptr, stride_kn, stride_kd, n0, units, index_dim, BLOCK_N, BLOCK_DI
        )
        contribution = tl.maximum(dots, 0.0) * coefficient[:, None]
        logits = tl.sum(tl.reshape(contribution, (BLOCK_Q, BLOCK_H, BLOCK_N)), axis=1)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        candidate = (offs_n[None, :] >= cs[:, None]) & (offs_n[None, :] < ce[:, None])
        t = tl.load(t_ptr + t_rows + offs_n[None, :], mask=candidate, other=0.0)
        sum_t += tl.sum(t, axis=1)
        sum_tl += tl.sum(t * logits, axis=1)  # t is 0 off the candidates
        sum_tlogt += tl.sum(t * tl.log(tl.where(t > 0, t, 1.0)), axis=1)
        logits = tl.where(candidate, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - shift) + tl.sum(tl.exp(logits - shift[:, None]), axis=1)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), 0.0)
    kl = tl.where(sum_t > 0, sum_tlogt - sum_tl + lse * sum_t, 0.0) * weight
    tl.store(kl_ptr + g * rows + offs_q, kl, mask=q_ok)
    if WANT_Q or WANT_W or WANT_K:
        # walk 2: d_logit = (softmax − t) · weight; the rows' gradients
        d_q = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_DI], tl.float32)
        d_w = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            keys, dots = _unit_dots(
                q, keys_ptr, stride_kn, stride_kd, n0, units, index_dim, BLOCK_N, BLOCK_DI
            )
            contribution = tl.maximum(dots, 0.0) * coefficient[:, None]
            logits = tl.sum(tl.reshape(contribution, (BLOCK_Q, BLOCK_H, BLOCK_N)), axis=1)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            candidate = (offs_n[None, :] >= cs[:, None]) & (offs_n[None, :] < ce[:, None])
            t = tl.load(t_ptr + t_rows + offs_n[None, :], mask=candidate, other=0.0)
            p = tl.where(candidate, tl.exp(logits - lse[:, None]), 0.0)
            d_logit = (p - t) * weight[:, None]
            if WANT_K:
                tl.store(dl_ptr + t_rows + offs_n[None, :], d_logit, mask=candidate)
            d_rows = _heads_to_rows(d_logit, BLOCK_Q, BLOCK_H, BLOCK_N)
            if WANT_W:
                d_w += tl.sum(tl.maximum(dots, 0.0) * d_rows, axis=1)
            if WANT_Q:
                d_dots = tl.where(dots > 0, d_rows * coefficient[:, None], 0.0)
                d_q += _tf32x3_dot(d_dots, keys)
        if WANT_Q:
            tl.store(
                dq_ptr + row[:, None].to(tl.int64) * stride_dqq + g * stride_dqg
                + head[:, None] * stride_dqh + offs_d[None, :] * stride_dqd,
                d_q, mask=md_ok,
            )  # fmt: skip
        if WANT_W:
            tl.store(
                dw_ptr + row.to(tl.int64) * stride_dwq + g * stride_dwg + head * stride_dwh,
                d_w, mask=m_ok,
            )  # fmt: skip


@triton.jit
def _dense_keys_kernel(
    iq_ptr, iw_ptr, keys_ptr, dl_ptr, cs_ptr, ce_ptr, out_ptr,
    stride_iqq, stride_iqg, stride_iqh, stride_iqd,
    stride_iwq, stride_iwg, stride_iwh,
    stride_kn, stride_kd,
    stride_tg, stride_tq,
    stride_oc, stride_on,
    rows, units, groups, index_heads, index_dim, scale, row_chunk,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DI: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    chunk = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_DI)
    keys = tl.load(
        keys_ptr + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
        mask=(offs_n < units)[:, None] & (offs_d < index_dim)[None, :],
        other=0.0,
    ).to(tl.float32)
    d_keys = tl.zeros([BLOCK_N, BLOCK_DI], tl.float32)
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    r_start = chunk * row_chunk
    r_stop = tl.minimum(r_start + row_chunk, rows)
    for q0 in range(r_start, r_stop, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        q_ok = offs_q < r_stop
        cs = tl.load(cs_ptr + offs_q, mask=q_ok, other=0)
        ce = tl.load(ce_ptr + offs_q, mask=q_ok, other=0)
        candidate = (offs_n[None, :] >= cs[:, None]) & (offs_n[None, :] < ce[:, None])
        candidate &= q_ok[:, None]
        if tl.max(tl.max(candidate.to(tl.int32), axis=1), axis=0) > 0:
            row = q0 + offs_m // BLOCK_H
            head = offs_m % BLOCK_H
            m_ok = (row < r_stop) & (head < index_heads)
            md_ok = m_ok[:, None] & (offs_d < index_dim)[None, :]
            for g in range(groups):
                q = tl.load(
                    iq_ptr + row[:, None].to(tl.int64) * stride_iqq + g * stride_iqg
                    + head[:, None] * stride_iqh + offs_d[None, :] * stride_iqd,
                    mask=md_ok, other=0.0,
                ).to(tl.float32)  # fmt: skip
                if HAS_WEIGHTS:
                    coefficient = tl.load(
                        iw_ptr + row.to(tl.int64) * stride_iwq + g * stride_iwg
                        + head * stride_iwh,
                        mask=m_ok, other=0.0,
                    ).to(tl.float32)  # fmt: skip
                else:
                    coefficient = tl.where(m_ok, scale, 0.0)
                d_logit = tl.load(
                    dl_ptr + g * stride_tg + offs_q[:, None].to(tl.int64) * stride_tq
                    + offs_n[None, :],
                    mask=candidate, other=0.0,
                )  # fmt: skip
                dots = _tf32x3_dot(q, tl.trans(keys))
                d_rows = _heads_to_rows(d_logit, BLOCK_Q, BLOCK_H, BLOCK_N)
                d_dots = tl.where(dots > 0, d_rows * coefficient[:, None], 0.0)
                d_keys += _tf32x3_dot(tl.trans(d_dots), q)
    tl.store(
        out_ptr + chunk * stride_oc + offs_n[:, None].to(tl.int64) * stride_on + offs_d[None, :],
        d_keys,
        mask=(offs_n < units)[:, None] & (offs_d < index_dim)[None, :],
    )


def _block_q(index_heads: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_H): `_DOT_ROWS` dot rows of (query, head) pairs, at least 16."""
    block_h = triton.next_power_of_2(index_heads)
    return max(1, max(16, _DOT_ROWS) // block_h), block_h


def dense_tile_loss(
    index_queries: torch.Tensor,
    index_weights: torch.Tensor | None,
    scale: float,
    unit_keys: torch.Tensor,
    target: torch.Tensor,
    candidate_start: torch.Tensor,
    candidate_stop: torch.Tensor,
    row_weight: torch.Tensor,
    d_queries: torch.Tensor | None,
    d_weights: torch.Tensor | None,
    d_keys: torch.Tensor | None,
    *,
    row_chunk: int = _ROW_CHUNK,
) -> torch.Tensor:
    """The weighted KL sum of one dense warm-up tile, its gradients written on the way.

    Args (one tile: `rows` queries, `G` groups, `units` units):
        index_queries: [rows, G, Hi, Di] floating; index_weights: [rows, G, Hi] or None (every head's
            coefficient `scale`); unit_keys: [units, Di] floating.
        target: float32 [G, rows, units], L1-normalised over each row's candidates, 0 elsewhere.
        candidate_start, candidate_stop: int32 [rows], the candidate units `[start, stop)` (tile-local).
        row_weight: float32 [G, rows], the weight of each (group, query)'s KL (0: no loss).
        d_queries: float32 [rows, G, Hi, Di] and d_weights: float32 [rows, G, Hi], overwritten;
            d_keys: float32 [units, Di], added to; None where not wanted.
        row_chunk: query rows per program of the keys' pass (a multiple of the kernels' BLOCK_Q).
    Returns:
        float32 scalar `Σ row_weight · KL(target || softmax(logits))`.
    """
    rows, groups, index_heads, index_dim = index_queries.shape
    units = unit_keys.shape[0]
    device = index_queries.device
    target, row_weight = target.contiguous(), row_weight.contiguous()
    block_q, block_h = _block_q(index_heads)
    block_di = max(16, triton.next_power_of_2(index_dim))
    weights = index_weights if index_weights is not None else index_queries
    query_strides = (*index_queries.stride(), *weights.stride()[:3])
    meta = {"BLOCK_Q": block_q, "BLOCK_H": block_h, "BLOCK_N": _BLOCK_N, "BLOCK_DI": block_di}
    want_k = d_keys is not None
    d_logits = torch.empty_like(target) if want_k else target
    kl = torch.empty(groups, rows, dtype=torch.float32, device=device)
    dq = d_queries if d_queries is not None else kl.new_zeros(1, 1, 1, 1)
    dw = d_weights if d_weights is not None else kl.new_zeros(1, 1, 1)
    _dense_rows_kernel[(triton.cdiv(rows, block_q), groups)](
        index_queries, weights, unit_keys, target, candidate_start, candidate_stop, row_weight,
        d_logits, kl, dq, dw,
        *query_strides, *unit_keys.stride(), target.stride(0), target.stride(1),
        *dq.stride(), *dw.stride(),
        rows, units, index_heads, index_dim, float(scale),
        HAS_WEIGHTS=index_weights is not None, WANT_Q=d_queries is not None,
        WANT_W=d_weights is not None, WANT_K=want_k, **meta, num_warps=_WARPS["rows"],
        num_stages=_STAGES["rows"],
    )  # fmt: skip
    if want_k:
        chunks = triton.cdiv(rows, row_chunk)
        partial = torch.zeros(chunks, units, index_dim, dtype=torch.float32, device=device)
        _dense_keys_kernel[(triton.cdiv(units, _BLOCK_N), chunks)](
            index_queries, weights, unit_keys, d_logits, candidate_start, candidate_stop, partial,
            *query_strides, *unit_keys.stride(), target.stride(0), target.stride(1),
            partial.stride(0), partial.stride(1),
            rows, units, groups, index_heads, index_dim, float(scale), row_chunk,
            HAS_WEIGHTS=index_weights is not None, **meta, num_warps=_WARPS["keys"],
            num_stages=_STAGES["keys"],
        )  # fmt: skip
        d_keys += partial.sum(dim=0)
    return kl.sum()
