"""The dense warm-up's indexer side on CUDA: three FP32 GEMMs and one fused Triton kernel per tile.

The indexer's logit of query q, route group g and unit u is `Σ_h c_h · relu(q_h · key_u)` over the
index heads h (`c_h` the head weight, or one scale for all). The PyTorch path of
`blockwise.distillation_sum` runs four FP32 matmuls per head and tile (the dots twice) and a dozen
elementwise passes over `[G, rows, units]` tensors. Here, per tile:

1. `dots = q · keysᵀ`, FP32 `[G, Hi, rows, units]`, one batched GEMM over every (group, head);
2. `_dense_kl_kernel`, one program per (query block, group): a first walk over the block's candidate
   units keeps the online log-sum-exp of the logits and the sums `Σ t`, `Σ t · logit` and
   `Σ t · log t` of the target t, from which each query's KL is `Σ t log t − Σ t · logit + lse · Σ t`;
   a second walk forms `d_logit = (softmax − t) · w` (w the query's loss weight), the head weights'
   gradient `Σ_u d_logit · relu(dot)` in registers, and overwrites the dots with
   `d_dot = d_logit · c_h · [dot > 0]` (0 off the candidates);
3. the index queries' gradient `d_dot · keys` and the unit keys' gradient `Σ_{g, h, q} d_dotᵀ · q_h`,
   two more GEMMs.

The GEMMs follow `torch.backends.cuda.matmul.allow_tf32`, as the PyTorch path's matmuls do (FP32
products by default). The largest temporary is the `[G, Hi, rows, units]` dot tensor, `Hi` times the
tile's target.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_Q = 16  # queries per program
_BLOCK_N = 64  # units per step
_WARPS = 4


@triton.jit
def _logits(
    dots_ptr, dot_offsets, c, ok,
):  # fmt: skip
    """(dots [BLOCK_H, BLOCK_Q, BLOCK_N], logits [BLOCK_Q, BLOCK_N]) at `dot_offsets` (masked `ok`)."""
    dots = tl.load(dots_ptr + dot_offsets, mask=ok, other=0.0)
    return dots, tl.sum(tl.maximum(dots, 0.0) * c[:, :, None], axis=0)


@triton.jit
def _dense_kl_kernel(
    dots_ptr, iw_ptr, t_ptr, cs_ptr, ce_ptr, w_ptr, kl_ptr, dw_ptr,
    stride_dg, stride_dh, stride_dq,
    stride_iwq, stride_iwg, stride_iwh,
    stride_tg, stride_tq,
    stride_dwq, stride_dwg, stride_dwh,
    rows, units, index_heads, scale,
    HAS_WEIGHTS: tl.constexpr, BACKWARD: tl.constexpr, WANT_W: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    g = tl.program_id(1)
    offs_q = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = offs_q < rows
    offs_h = tl.arange(0, BLOCK_H)
    hq_ok = (offs_h < index_heads)[:, None] & q_ok[None, :]  # [BLOCK_H, BLOCK_Q]
    cs = tl.load(cs_ptr + offs_q, mask=q_ok, other=0)
    ce = tl.load(ce_ptr + offs_q, mask=q_ok, other=0)
    weight = tl.load(w_ptr + g * rows + offs_q, mask=q_ok, other=0.0)
    lo = tl.min(tl.where(q_ok & (ce > cs), cs, units))
    hi = tl.max(tl.where(q_ok, ce, 0))
    if HAS_WEIGHTS:
        c = tl.load(
            iw_ptr + offs_q[None, :].to(tl.int64) * stride_iwq + g * stride_iwg
            + offs_h[:, None] * stride_iwh,
            mask=hq_ok, other=0.0,
        ).to(tl.float32)  # fmt: skip
    else:
        c = tl.where(hq_ok, scale, 0.0)
    dot_rows = (
        g * stride_dg + offs_h[:, None, None] * stride_dh
        + offs_q[None, :, None].to(tl.int64) * stride_dq
    )  # fmt: skip
    t_rows = g * stride_tg + offs_q[:, None].to(tl.int64) * stride_tq
    # walk 1: online log-sum-exp of the logits over the candidates, the target's sums
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc_t = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)  # the target's sums, reduced after the walk
    acc_tl = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
    acc_tlogt = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        candidate = (offs_n[None, :] >= cs[:, None]) & (offs_n[None, :] < ce[:, None])
        _, logits = _logits(
            dots_ptr, dot_rows + offs_n[None, None, :], c,
            hq_ok[:, :, None] & candidate[None, :, :],
        )  # fmt: skip
        t = tl.load(t_ptr + t_rows + offs_n[None, :], mask=candidate, other=0.0)
        acc_t += t
        acc_tl += t * logits  # t is 0 off the candidates
        acc_tlogt += t * tl.log(tl.where(t > 0, t, 1.0))
        logits = tl.where(candidate, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - shift) + tl.sum(tl.exp(logits - shift[:, None]), axis=1)
        m_i = m_new
    sum_t = tl.sum(acc_t, axis=1)
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), 0.0)
    kl = tl.sum(acc_tlogt, axis=1) - tl.sum(acc_tl, axis=1) + lse * sum_t
    kl = tl.where(sum_t > 0, kl, 0.0) * weight
    tl.store(kl_ptr + g * rows + offs_q, kl, mask=q_ok)
    if BACKWARD:
        # walk 2, over every unit of the tile: the dots become d_dot (0 off the candidates)
        d_w = tl.zeros([BLOCK_H, BLOCK_Q], tl.float32)
        for n0 in range(0, units, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            candidate = (offs_n[None, :] >= cs[:, None]) & (offs_n[None, :] < ce[:, None])
            inside = hq_ok[:, :, None] & (offs_n < units)[None, None, :]
            dots, logits = _logits(
                dots_ptr, dot_rows + offs_n[None, None, :], c, inside & candidate[None, :, :]
            )
            t = tl.load(t_ptr + t_rows + offs_n[None, :], mask=candidate, other=0.0)
            p = tl.where(candidate, tl.exp(logits - lse[:, None]), 0.0)
            d_logit = (p - t) * weight[:, None]
            if WANT_W:
                d_w += tl.sum(tl.maximum(dots, 0.0) * d_logit[None, :, :], axis=2)
            d_dots = tl.where(dots > 0, d_logit[None, :, :] * c[:, :, None], 0.0)
            tl.store(dots_ptr + dot_rows + offs_n[None, None, :], d_dots, mask=inside)
        if WANT_W:
            dw_ptrs = (
                dw_ptr + offs_q[None, :].to(tl.int64) * stride_dwq + g * stride_dwg
                + offs_h[:, None] * stride_dwh
            )  # fmt: skip
            tl.store(dw_ptrs, d_w + tl.load(dw_ptrs, mask=hq_ok, other=0.0), mask=hq_ok)


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
) -> torch.Tensor:
    """The weighted KL sum of one dense warm-up tile, its gradients added on the way.

    Args (one tile: `rows` queries, `G` groups, `units` units):
        index_queries: [rows, G, Hi, Di] floating; index_weights: [rows, G, Hi] or None (every head's
            coefficient `scale`); unit_keys: [units, Di] floating.
        target: float32 [G, rows, units], L1-normalised over each row's candidates, 0 elsewhere.
        candidate_start, candidate_stop: int32 [rows], the candidate units `[start, stop)` (tile-local).
        row_weight: float32 [G, rows], the weight of each (group, query)'s KL (0: no loss).
        d_queries: float32 [rows, G, Hi, Di], d_weights: float32 [rows, G, Hi] and d_keys: float32
            [units, Di], the gradients added to them; None where not wanted.
    Returns:
        float32 scalar `Σ row_weight · KL(target || softmax(logits))`.
    """
    rows, groups, index_heads, _ = index_queries.shape
    units = unit_keys.shape[0]
    queries = index_queries.float().permute(1, 2, 0, 3).contiguous()  # [G, Hi, rows, Di]
    keys = unit_keys.float()
    dots = torch.matmul(queries, keys.t())  # [G, Hi, rows, units]
    target, row_weight = target.contiguous(), row_weight.contiguous()
    kl = torch.empty(groups, rows, dtype=torch.float32, device=target.device)
    # placeholder pointers where HAS_WEIGHTS / WANT_W is off (never read)
    weights = index_weights if index_weights is not None else target
    dw = d_weights if d_weights is not None else kl.new_zeros(1, 1, 1)
    backward = any(g is not None for g in (d_queries, d_weights, d_keys))
    _dense_kl_kernel[(triton.cdiv(rows, _BLOCK_Q), groups)](
        dots, weights, target, candidate_start, candidate_stop, row_weight, kl, dw,
        dots.stride(0), dots.stride(1), dots.stride(2),
        *(weights.stride() if index_weights is not None else (0, 0, 0)),
        target.stride(0), target.stride(1), *dw.stride(),
        rows, units, index_heads, float(scale),
        HAS_WEIGHTS=index_weights is not None, BACKWARD=backward,
        WANT_W=d_weights is not None, BLOCK_Q=_BLOCK_Q,
        BLOCK_H=triton.next_power_of_2(index_heads), BLOCK_N=_BLOCK_N, num_warps=_WARPS,
    )  # fmt: skip
    if d_queries is not None:  # dots now hold d_dot
        d_queries += torch.matmul(dots, keys).permute(2, 0, 1, 3)
    if d_keys is not None:
        d_keys += dots.view(-1, units).t() @ queries.view(-1, queries.shape[-1])
    return kl.sum()
