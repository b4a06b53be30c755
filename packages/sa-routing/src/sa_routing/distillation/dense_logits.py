"""The dense warm-up's indexer side on CUDA: three FP32 GEMMs and one fused Triton kernel per tile.

The indexer's logit of query q, route group g and unit u is `Σ_h c_h · relu(q_h · key_u)` over the
index heads h (`c_h` the head weight, or one scale for all). The PyTorch path of
`blockwise.distillation_sum` runs four FP32 matmuls per head and tile (the dots twice) and a dozen
elementwise passes over `[G, rows, units]` tensors. Here, per tile:

1. `dots = q · keysᵀ`, FP32 `[G, Hi, rows, units]`, one batched GEMM over every (group, head);
2. `_dense_kl_kernel`, one program per (query block, group), every tensor `[BLOCK_Q, BLOCK_N]` (one
   index head at a time): a first walk over the block's candidate units keeps the online
   log-sum-exp of the logits and the sums `Σ t`, `Σ t · logit` and `Σ t · log t` of the target t,
   from which each query's KL is `Σ t log t − Σ t · logit + lse · Σ t`; a second walk forms
   `d_logit = (softmax − t) · w` (w the query's loss weight), the head weights' gradient
   `Σ_u d_logit · relu(dot)` and overwrites the dots with `d_dot = d_logit · c_h · [dot > 0]` (0
   off the candidates);
3. the index queries' gradient `d_dot · keys` and the unit keys' gradient `Σ_{g, h, q} d_dotᵀ · q_h`,
   two more GEMMs.

Precision: where PyTorch's CUDA FP32 matmuls may use TF32
(`torch.backends.cuda.matmul.fp32_precision` "tf32", e.g. after
`torch.set_float32_matmul_precision("high")`) the GEMMs run once in TF32, as any FP32 matmul of
PyTorch does. Otherwise ("highest", PyTorch's default) CUDA GEMMs run as three TF32 products on the
tensor cores instead of FP32 FMA ("3xTF32": each FP32 operand `x ≈ hi + lo`, `hi` its nearest TF32
value and `lo` that of `x − hi`, and `a · b ≈ a_hi · b_hi + a_hi · b_lo + a_lo · b_hi`): each operand
keeps 22 of its 24 significant bits and the dropped `a_lo · b_lo` is as small, so a product's error
is a few FP32 roundings. One Triton pass writes an operand's parts side by side, in the order its
GEMM reads them (`_split_rows`); the KL kernel writes `d_dot` already split. The unit dimension of
the dots is padded to a multiple of `_UNIT_ALIGN` (zero keys, zero dots) so that every GEMM operand
is 16-byte aligned. The largest temporaries are the `[G, Hi, rows, units]` dots and, with 3xTF32,
their low parts.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from sa_kernels.backend import cuda_matmuls_use_tf32, triton_interpret

_BLOCK_Q = 16  # queries per program
_BLOCK_N = 64  # units per step
_WARPS = 4
_UNIT_ALIGN = 8  # the dots' unit dimension is padded to a multiple (16-byte aligned rows)
_TF32_HI = -8192  # int32 0xFFFFE000: the sign, exponent and 10 mantissa bits of an FP32
_TF32_HALF = 4096  # half a TF32 unit in the last place, in the FP32 bit pattern
_HI, _LO, _NONE = 0, 1, -1  # the parts `_split_rows` writes
_SPLIT_ROWS, _SPLIT_COLS = 32, 64  # one program's block of `_split_rows_kernel`


@triton.jit
def _nearest_tf32(x):
    """The nearest TF32 value of finite FP32 `x` (ties away from zero; the truncation where rounding
    up would overflow), as FP32; inf and NaN stay as they are."""
    bits = x.to(tl.int32, bitcast=True)
    nearest = ((bits + 4096) & -8192).to(tl.float32, bitcast=True)
    truncated = (bits & -8192).to(tl.float32, bitcast=True)
    finite = tl.abs(x) < float("inf")
    return tl.where(
        finite & (tl.abs(nearest) < float("inf")), nearest, tl.where(finite, truncated, x)
    )


@triton.jit
def _tf32_split(x):
    """(hi, lo) of FP32 `x` as `_tf32_parts`: hi its nearest TF32 value, lo that of `x − hi` (0
    where x is inf or NaN)."""
    hi = _nearest_tf32(x)
    return hi, tl.where(tl.abs(x) < float("inf"), _nearest_tf32(x - hi), 0.0)


@triton.jit
def _store_part(out, hi, lo, mask, PART: tl.constexpr):
    """Stores `hi` (PART 0, `_HI`), `lo` (1, `_LO`) or nothing (-1, `_NONE`) at `out`."""
    if PART == 0:
        tl.store(out, hi, mask=mask)
    elif PART == 1:
        tl.store(out, lo, mask=mask)


@triton.jit
def _split_rows_kernel(
    x_ptr, out_ptr, rows, cols, stride_x, stride_o,
    PART0: tl.constexpr, PART1: tl.constexpr, PART2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One block of `out [rows, parts · cols]`: part j of x's TF32 split (`PARTj` 0: hi, 1: lo,
    -1: none) in columns `j · cols …`, from one read of x."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    hi, lo = _tf32_split(x)
    out = out_ptr + r[:, None] * stride_o + c[None, :]
    _store_part(out, hi, lo, mask, PART0)
    _store_part(out + cols, hi, lo, mask, PART1)
    _store_part(out + 2 * cols, hi, lo, mask, PART2)


@triton.jit
def _coefficient(iw_ptr, q_rows, head, q_ok, scale, HAS_WEIGHTS: tl.constexpr):
    """[BLOCK_Q] float32 coefficient c_h of index head `head` for the block's queries."""
    if HAS_WEIGHTS:
        c = tl.load(iw_ptr + q_rows + head, mask=q_ok, other=0.0).to(tl.float32)
    else:
        c = tl.where(q_ok, scale, 0.0)
    return c


@triton.jit
def _logits(dots_ptr, dot_offsets, stride_dh, iw_ptr, iw_rows, stride_iwh, q_ok, ok, scale,
            HEADS: tl.constexpr, HAS_WEIGHTS: tl.constexpr):  # fmt: skip
    """[BLOCK_Q, BLOCK_N] logits `Σ_h c_h · relu(dot_h)` at `dot_offsets` (masked `ok`: 0)."""
    logits = tl.zeros(dot_offsets.shape, tl.float32)
    for h in tl.static_range(HEADS):
        dots = tl.load(dots_ptr + dot_offsets + h * stride_dh, mask=ok, other=0.0)
        c = _coefficient(iw_ptr, iw_rows, h * stride_iwh, q_ok, scale, HAS_WEIGHTS)
        logits += tl.maximum(dots, 0.0) * c[:, None]
    return logits


@triton.jit
def _dense_kl_kernel(
    dots_ptr, lo_ptr, iw_ptr, t_ptr, cs_ptr, ce_ptr, w_ptr, kl_ptr, dw_ptr,
    stride_dg, stride_dh, stride_dq,
    stride_iwq, stride_iwg, stride_iwh,
    stride_tg, stride_tq,
    stride_dwq, stride_dwg, stride_dwh,
    rows, units, width, scale,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    BACKWARD: tl.constexpr, WANT_W: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    g = tl.program_id(1)
    offs_q = pid * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = offs_q < rows
    cs = tl.load(cs_ptr + offs_q, mask=q_ok, other=0)
    ce = tl.load(ce_ptr + offs_q, mask=q_ok, other=0)
    weight = tl.load(w_ptr + g * rows + offs_q, mask=q_ok, other=0.0)
    lo = tl.min(tl.where(q_ok & (ce > cs), cs, units))
    hi = tl.max(tl.where(q_ok, ce, 0))
    iw_rows = offs_q.to(tl.int64) * stride_iwq + g * stride_iwg
    dot_rows = g * stride_dg + offs_q[:, None].to(tl.int64) * stride_dq  # [BLOCK_Q, 1]
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
        logits = _logits(
            dots_ptr, dot_rows + offs_n[None, :], stride_dh, iw_ptr, iw_rows, stride_iwh, q_ok,
            candidate, scale, HEADS, HAS_WEIGHTS,
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
        # walk 2, over every (padded) unit column: the dots become d_dot (0 off the candidates)
        offs_h = tl.arange(0, BLOCK_H)
        d_w = tl.zeros([BLOCK_Q, BLOCK_H], tl.float32)
        for n0 in range(0, width, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            candidate = (offs_n[None, :] >= cs[:, None]) & (offs_n[None, :] < ce[:, None])
            inside = q_ok[:, None] & (offs_n < width)[None, :]
            at = dot_rows + offs_n[None, :]
            logits = _logits(
                dots_ptr, at, stride_dh, iw_ptr, iw_rows, stride_iwh, q_ok, candidate, scale,
                HEADS, HAS_WEIGHTS,
            )  # fmt: skip
            t = tl.load(t_ptr + t_rows + offs_n[None, :], mask=candidate, other=0.0)
            p = tl.where(candidate, tl.exp(logits - lse[:, None]), 0.0)
            d_logit = (p - t) * weight[:, None]
            for h in tl.static_range(HEADS):
                dots = tl.load(dots_ptr + at + h * stride_dh, mask=candidate, other=0.0)
                c = _coefficient(iw_ptr, iw_rows, h * stride_iwh, q_ok, scale, HAS_WEIGHTS)
                if WANT_W:
                    part = tl.sum(tl.maximum(dots, 0.0) * d_logit, axis=1)
                    d_w += tl.where(offs_h[None, :] == h, part[:, None], 0.0)
                d_dots = tl.where(dots > 0, d_logit * c[:, None], 0.0)
                if SPLIT:  # 3xTF32: the TF32 part in place, the rest beside it
                    d_dots, low = _tf32_split(d_dots)
                    tl.store(lo_ptr + at + h * stride_dh, low, mask=inside)
                tl.store(dots_ptr + at + h * stride_dh, d_dots, mask=inside)
        if WANT_W:
            dw_ptrs = (
                dw_ptr + offs_q[:, None].to(tl.int64) * stride_dwq + g * stride_dwg
                + offs_h[None, :] * stride_dwh
            )  # fmt: skip
            dw_ok = q_ok[:, None] & (offs_h < HEADS)[None, :]
            tl.store(dw_ptrs, d_w + tl.load(dw_ptrs, mask=dw_ok, other=0.0), mask=dw_ok)


@contextlib.contextmanager
def _tf32_matmuls():
    """CUDA FP32 matmuls in TF32 inside (`torch.backends.cuda.matmul.fp32_precision = "tf32"`), the
    setting restored after. The setting is the process's: another thread's CUDA FP32 matmuls issued
    meanwhile run in TF32 as well."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def _nearest_tf32_values(x: torch.Tensor) -> torch.Tensor:
    """The nearest TF32 value of every finite element of FP32 `x` (ties away from zero; the TF32
    truncation where rounding up would overflow), as FP32; inf and NaN stay as they are."""
    bits = x.view(torch.int32)
    nearest = ((bits + _TF32_HALF) & _TF32_HI).view(torch.float32)
    truncated = (bits & _TF32_HI).view(torch.float32)
    finite = x.isfinite()
    return torch.where(finite & nearest.isfinite(), nearest, torch.where(finite, truncated, x))


def _tf32_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo), both TF32 values in FP32: `hi` nearest to `x`, `lo` nearest to `x − hi`
    (`|x − hi − lo| <= 2⁻²² |x|` for normal `x`); inf and NaN in `hi`, 0 in `lo`."""
    hi = _nearest_tf32_values(x)
    return hi, torch.where(x.isfinite(), _nearest_tf32_values(x - hi), 0.0)


def _split_rows(x: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """FP32 [rows, len(parts) · cols]: the TF32 parts of FP32 `x [rows, cols]` side by side, part j
    `_HI` or `_LO` of `_tf32_parts(x)`. On CUDA (and under the Triton interpreter) one kernel reads
    x once and writes every part; otherwise (CPU tests that force the split) `_tf32_parts` and a
    concatenation."""
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, cols = x.shape
    if not (x.is_cuda or triton_interpret()):
        split = _tf32_parts(x)
        return torch.cat([split[part] for part in parts], dim=1)
    out = torch.empty(rows, len(parts) * cols, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    padded = tuple(parts) + (_NONE,) * (3 - len(parts))
    grid = (triton.cdiv(rows, _SPLIT_ROWS), triton.cdiv(cols, _SPLIT_COLS))
    _split_rows_kernel[grid](
        x, out, rows, cols, x.stride(0), out.stride(0), *padded,
        BLOCK_R=_SPLIT_ROWS, BLOCK_C=_SPLIT_COLS,
    )  # fmt: skip
    return out


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
    rows, groups, index_heads, dim = index_queries.shape
    units = unit_keys.shape[0]
    width = -(-units // _UNIT_ALIGN) * _UNIT_ALIGN
    queries = index_queries.float().permute(1, 2, 0, 3).contiguous()  # [G, Hi, rows, Di]
    keys = unit_keys.float()
    if width != units:  # zero keys: zero dots, zero gradients
        keys = torch.cat((keys, keys.new_zeros(width - units, dim)))
    split = _three_tf32(queries)
    dots = _matmul_keys(queries, keys, split)  # [G, Hi, rows, width]
    target, row_weight = target.contiguous(), row_weight.contiguous()
    kl = torch.empty(groups, rows, dtype=torch.float32, device=target.device)
    backward = any(g is not None for g in (d_queries, d_weights, d_keys))
    wanted = d_queries is not None or d_keys is not None  # the GEMMs that read d_dot
    low = torch.empty_like(dots) if wanted and split else None
    # placeholder pointers where HAS_WEIGHTS / WANT_W / SPLIT is off (never read)
    weights = index_weights if index_weights is not None else target
    dw = d_weights if d_weights is not None else kl.new_zeros(1, 1, 1)
    _dense_kl_kernel[(triton.cdiv(rows, _BLOCK_Q), groups)](
        dots, dots if low is None else low, weights, target, candidate_start, candidate_stop,
        row_weight, kl, dw,
        dots.stride(0), dots.stride(1), dots.stride(2),
        *(weights.stride() if index_weights is not None else (0, 0, 0)),
        target.stride(0), target.stride(1), *dw.stride(),
        rows, units, width, float(scale),
        HEADS=index_heads, BLOCK_H=triton.next_power_of_2(index_heads),
        HAS_WEIGHTS=index_weights is not None, BACKWARD=backward,
        WANT_W=d_weights is not None, SPLIT=low is not None,
        BLOCK_Q=_BLOCK_Q, BLOCK_N=_BLOCK_N, num_warps=_WARPS,
    )  # fmt: skip
    if d_queries is None and d_keys is None:
        return kl.sum()
    flat = dots.view(-1, width)  # d_dot (its TF32 part with 3xTF32)
    flat_low = None if low is None else low.view(-1, width)
    if d_queries is not None:
        part = _matmul_split_left(flat, flat_low, keys)  # [G * Hi * rows, Di]
        d_queries += part.view(groups, index_heads, rows, dim).permute(2, 0, 1, 3)
    if d_keys is not None:
        flat_q = queries.view(-1, dim)
        d_keys += _matmul_split_left(flat.t(), None if flat_low is None else flat_low.t(), flat_q)[
            :units
        ]
    return kl.sum()


def _three_tf32(tensor: torch.Tensor) -> bool:
    """Whether the GEMMs on `tensor`'s device run as 3xTF32: CUDA without TF32 allowed."""
    return tensor.is_cuda and not cuda_matmuls_use_tf32()


def _matmul_keys(a: torch.Tensor, keys: torch.Tensor, split: bool) -> torch.Tensor:
    """FP32 `a @ keysᵀ` (a [..., Di] contiguous, keys [units, Di]); with `split` as 3xTF32: one TF32
    GEMM over the parts side by side, `[a_hi | a_hi | a_lo] · [k_hi | k_lo | k_hi]ᵀ`."""
    if not split:
        return torch.matmul(a, keys.t())
    dim = a.shape[-1]
    left = _split_rows(a.reshape(-1, dim), (_HI, _HI, _LO)).view(*a.shape[:-1], 3 * dim)
    right = _split_rows(keys, (_HI, _LO, _HI))
    with _tf32_matmuls():
        return torch.matmul(left, right.t())


def _matmul_split_left(
    a_hi: torch.Tensor, a_lo: torch.Tensor | None, b: torch.Tensor
) -> torch.Tensor:
    """FP32 `(a_hi + a_lo) @ b` for 2D operands; `a_lo` None: plain `a_hi @ b` (TF32 where allowed),
    else 3xTF32 with `a_hi` already TF32: `a_hi · [b_hi | b_lo]` summed, plus `a_lo · b_hi`."""
    if a_lo is None:
        return a_hi @ b
    dim = b.shape[1]
    parts = _split_rows(b, (_HI, _LO))  # [b_hi | b_lo]
    with _tf32_matmuls():
        both = a_hi @ parts
        out = both[:, :dim] + both[:, dim:]
        return out.addmm_(a_lo, parts[:, :dim])
