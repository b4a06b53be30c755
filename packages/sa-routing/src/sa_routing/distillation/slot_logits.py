"""Triton kernels of the sparse stage's indexer side: the FP32 logits of the selected slots and their
gradients, without gathering the slots' unit keys into memory.

The indexer's logit of query q, route group g and slot k (unit `u = slot_units[g, q, k]`) is
`Σ_h c_h · relu(q_h · key_u)` over the index heads h (`c_h` the head weight, or one scale for all).
The PyTorch path of `slots.slot_distillation_sum` gathers `[G, rows, K, Di]` unit keys per tile (a
256 MiB tensor at the tile budget, written and read again by each product); here one program per
(query, group) reads its slots' unit keys `BLOCK_K` at a time from the `[U, Di]` table (a few MiB,
resident in L2) and keeps the index queries in registers:

- `_slot_logits_kernel`: logits `[G, rows, K]` (0 where a slot is not valid);
- `_slot_grads_kernel`: from `d_logits [G, rows, K]` (the caller's `softmax − target`, weighted), the
  index queries' and head weights' gradients of its rows (plain stores: a (query, group) belongs to
  one program) and the unit keys' gradient, FP32 atomic adds per slot (the summation order of a
  unit's slots varies between runs).

Products are exact FP32, as the PyTorch path's FP32 matmuls. With few index heads (at most 8; the
QSA and Step-5 indexers have 4) they are broadcast products summed in registers (`DOT` off), since a
dot would pad the heads to its least M of 16 rows and run IEEE FP32 dots on the FMA units anyway;
with more heads they are `fp32_dot`s with IEEE FP32 operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sa_kernels.triton_dot import fp32_dot

_BLOCK_K = 32  # slots per step of the dot form, and the most of the broadcast form
# elements of one step's [heads, slots, index_dim] product (broadcast form), by kernel, and warps per
# program by form (DOT). The broadcast form's programs are latency-bound gathers from L2: one warp,
# so that more programs share an SM, and these products (of 2048–32768) are the fastest on the H200
# at 32k tokens (CSA: logits 16.5 ms and grads 34 ms, 29 and 56 with 2 and 4 warps and 8192 each;
# QSA: 2.7 and 5.7 ms, 5.8 and 10 with those; grads with 8192 take 32 and 8.0 ms). The dot form's
# grads hold q, keys and both gradients' FP32 tiles in registers.
_PRODUCT_ELEMENTS = {"logits": 8192, "grads": 4096}
_WARPS = {False: {"logits": 1, "grads": 1}, True: {"logits": 4, "grads": 8}}


@triton.jit
def _slot_tile(
    iq_ptr, iw_ptr, keys_ptr, units_ptr, valid_ptr, row, g, start,
    stride_iqq, stride_iqg, stride_iqh, stride_iqd,
    stride_iwq, stride_iwg, stride_iwh,
    stride_kn, stride_kd,
    stride_ug, stride_uq, stride_uk,
    slots, count, index_heads, index_dim, scale,
    HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DI: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """(q [BLOCK_H, BLOCK_DI], keys [BLOCK_K, BLOCK_DI], dots [BLOCK_H, BLOCK_K], coefficients
    [BLOCK_H], slot validity [BLOCK_K], unit ids [BLOCK_K]) of slots start … start + BLOCK_K − 1."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_k = start + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_DI)
    h_ok = offs_h < index_heads
    d_ok = offs_d < index_dim
    row64 = row.to(tl.int64)
    q = tl.load(
        iq_ptr + row64 * stride_iqq + g * stride_iqg + offs_h[:, None] * stride_iqh
        + offs_d[None, :] * stride_iqd,
        mask=h_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    if HAS_WEIGHTS:
        coefficient = tl.load(
            iw_ptr + row64 * stride_iwq + g * stride_iwg + offs_h * stride_iwh, mask=h_ok, other=0.0
        ).to(tl.float32)
    else:
        coefficient = tl.where(h_ok, scale, 0.0)
    slot = g * stride_ug + row64 * stride_uq + offs_k * stride_uk
    in_row = offs_k < slots
    valid = tl.load(valid_ptr + slot, mask=in_row, other=0) != 0
    unit = tl.load(units_ptr + slot, mask=valid, other=0)
    unit = tl.minimum(unit, count - 1).to(tl.int64)
    keys = tl.load(
        keys_ptr + unit[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=valid[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    if DOT:
        dots = fp32_dot(q, tl.trans(keys), True, False)
    else:
        dots = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)
    return q, keys, dots, coefficient, valid, unit


@triton.jit
def _slot_logits_kernel(
    iq_ptr, iw_ptr, keys_ptr, units_ptr, valid_ptr, out_ptr,
    stride_iqq, stride_iqg, stride_iqh, stride_iqd,
    stride_iwq, stride_iwg, stride_iwh,
    stride_kn, stride_kd,
    stride_ug, stride_uq, stride_uk,
    stride_og, stride_oq,
    slots, count, index_heads, index_dim, scale,
    HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DI: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)  # g · stride_ug passes 2**31 at long lengths
    for start in range(0, slots, BLOCK_K):
        _, _, dots, coefficient, valid, _ = _slot_tile(
            iq_ptr, iw_ptr, keys_ptr, units_ptr, valid_ptr, row, g, start,
            stride_iqq, stride_iqg, stride_iqh, stride_iqd, stride_iwq, stride_iwg, stride_iwh,
            stride_kn, stride_kd, stride_ug, stride_uq, stride_uk,
            slots, count, index_heads, index_dim, scale,
            HAS_WEIGHTS, BLOCK_H, BLOCK_K, BLOCK_DI, DOT,
        )  # fmt: skip
        logits = tl.sum(tl.maximum(dots, 0.0) * coefficient[:, None], axis=0)
        offs_k = start + tl.arange(0, BLOCK_K)
        tl.store(
            out_ptr + g * stride_og + row.to(tl.int64) * stride_oq + offs_k,
            tl.where(valid, logits, 0.0),
            mask=offs_k < slots,
        )


@triton.jit
def _slot_grads_kernel(
    iq_ptr, iw_ptr, keys_ptr, units_ptr, valid_ptr, dl_ptr, dq_ptr, dw_ptr, dk_ptr,
    stride_iqq, stride_iqg, stride_iqh, stride_iqd,
    stride_iwq, stride_iwg, stride_iwh,
    stride_kn, stride_kd,
    stride_ug, stride_uq, stride_uk,
    stride_dlg, stride_dlq,
    stride_dqq, stride_dqg, stride_dqh, stride_dqd,
    stride_dwq, stride_dwg, stride_dwh,
    stride_dkn, stride_dkd,
    slots, count, index_heads, index_dim, scale,
    HAS_WEIGHTS: tl.constexpr, WANT_Q: tl.constexpr, WANT_W: tl.constexpr, WANT_K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DI: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)  # g · stride_ug passes 2**31 at long lengths
    row64 = row.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_DI)
    hd_ok = (offs_h < index_heads)[:, None] & (offs_d < index_dim)[None, :]
    d_q = tl.zeros([BLOCK_H, BLOCK_DI], tl.float32)
    d_w = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, slots, BLOCK_K):
        q, keys, dots, coefficient, valid, unit = _slot_tile(
            iq_ptr, iw_ptr, keys_ptr, units_ptr, valid_ptr, row, g, start,
            stride_iqq, stride_iqg, stride_iqh, stride_iqd, stride_iwq, stride_iwg, stride_iwh,
            stride_kn, stride_kd, stride_ug, stride_uq, stride_uk,
            slots, count, index_heads, index_dim, scale,
            HAS_WEIGHTS, BLOCK_H, BLOCK_K, BLOCK_DI, DOT,
        )  # fmt: skip
        offs_k = start + tl.arange(0, BLOCK_K)
        d_logits = tl.load(
            dl_ptr + g * stride_dlg + row64 * stride_dlq + offs_k, mask=valid, other=0.0
        )
        if WANT_W:
            d_w += tl.sum(tl.maximum(dots, 0.0) * d_logits[None, :], axis=1)
        d_dots = tl.where(dots > 0, d_logits[None, :] * coefficient[:, None], 0.0)
        if WANT_Q:
            if DOT:
                d_q += fp32_dot(d_dots, keys, True, False)
            else:
                d_q += tl.sum(d_dots[:, :, None] * keys[None, :, :], axis=1)
        if WANT_K:
            if DOT:
                d_keys = fp32_dot(tl.trans(d_dots), q, True, False)  # [BLOCK_K, BLOCK_DI]
            else:
                d_keys = tl.sum(d_dots[:, :, None] * q[:, None, :], axis=0)
            tl.atomic_add(
                dk_ptr + unit[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
                d_keys,
                mask=valid[:, None] & (offs_d < index_dim)[None, :],
                sem="relaxed",
            )
    if WANT_Q:
        dq_rows = dq_ptr + row64 * stride_dqq + g * stride_dqg + offs_h[:, None] * stride_dqh
        tl.store(dq_rows + offs_d[None, :] * stride_dqd, d_q, mask=hd_ok)
    if WANT_W:
        dw_rows = dw_ptr + row64 * stride_dwq + g * stride_dwg + offs_h * stride_dwh
        tl.store(dw_rows, d_w, mask=offs_h < index_heads)


def _launch(index_queries, index_weights, unit_keys, slot_units, slot_valid, scale, count, kernel):
    """Grid, shared arguments and constexprs of `kernel` ("logits" or "grads") for one tile.

    index_queries [rows, G, Hi, Di], index_weights [rows, G, Hi] or None, unit_keys [U', Di],
    slot_units int32 / slot_valid bool [G, rows, K]; unit ids read as at most count − 1."""
    rows, groups, index_heads, index_dim = index_queries.shape
    slots = slot_units.shape[-1]
    if slot_valid.stride() != slot_units.stride():  # the kernels read both with one set of strides
        slot_units, slot_valid = slot_units.contiguous(), slot_valid.contiguous()
    weights = index_weights if index_weights is not None else index_queries
    args = (
        index_queries.stride(0), index_queries.stride(1), index_queries.stride(2),
        index_queries.stride(3),
        weights.stride(0), weights.stride(1), weights.stride(2),
        unit_keys.stride(0), unit_keys.stride(1),
        slot_units.stride(0), slot_units.stride(1), slot_units.stride(2),
    )  # fmt: skip
    tail = (slots, count, index_heads, index_dim, float(scale))
    block_h, block_di = triton.next_power_of_2(index_heads), triton.next_power_of_2(index_dim)
    dot = block_h > 8
    if dot:  # the dots' least M, N and K
        block_h, block_di, block_k = max(16, block_h), max(16, block_di), _BLOCK_K
    else:
        block_k = min(_BLOCK_K, max(1, _PRODUCT_ELEMENTS[kernel] // (block_h * block_di)))
    meta = {
        "HAS_WEIGHTS": index_weights is not None,
        "BLOCK_H": block_h,
        "BLOCK_K": block_k,
        "BLOCK_DI": block_di,
        "DOT": dot,
    }
    pointers = (index_queries, weights, unit_keys, slot_units, slot_valid.view(torch.uint8))
    return (rows, groups), pointers, args, tail, meta


def slot_logits(
    index_queries: torch.Tensor,
    index_weights: torch.Tensor | None,
    scale: float,
    unit_keys: torch.Tensor,
    slot_units: torch.Tensor,
    slot_valid: torch.Tensor,
    *,
    count: int,
) -> torch.Tensor:
    """float32 [G, rows, K] indexer logits of one tile's slots (0 where not valid).

    index_queries: [rows, G, Hi, Di] floating; index_weights: [rows, G, Hi] or None (coefficient
    `scale`); unit_keys: [U', Di] floating; slot_units: int32 [G, rows, K], ids above count − 1
    read as count − 1 (count ≤ U', as the PyTorch path); slot_valid: bool [G, rows, K]."""
    grid, pointers, args, tail, meta = _launch(
        index_queries, index_weights, unit_keys, slot_units, slot_valid, scale, count, "logits"
    )
    out = torch.empty(slot_units.shape, dtype=torch.float32, device=slot_units.device)
    _slot_logits_kernel[grid](
        *pointers, out, *args, out.stride(0), out.stride(1), *tail, **meta,
        num_warps=_WARPS[meta["DOT"]]["logits"],
    )  # fmt: skip
    return out


def slot_grads(
    index_queries: torch.Tensor,
    index_weights: torch.Tensor | None,
    scale: float,
    unit_keys: torch.Tensor,
    slot_units: torch.Tensor,
    slot_valid: torch.Tensor,
    d_logits: torch.Tensor,
    d_queries: torch.Tensor | None,
    d_weights: torch.Tensor | None,
    d_keys: torch.Tensor | None,
    *,
    count: int,
) -> None:
    """Writes one tile's gradients from `d_logits` (float32 [G, rows, K], 0 off the valid slots):
    d_queries [rows, G, Hi, Di] and d_weights [rows, G, Hi] float32 (overwritten: the tile's rows),
    d_keys [U', Di] float32 (added to); None for a gradient not wanted (d_weights also when
    index_weights is None). Other arguments as `slot_logits`."""
    grid, pointers, args, tail, meta = _launch(
        index_queries, index_weights, unit_keys, slot_units, slot_valid, scale, count, "grads"
    )
    d_logits = d_logits.contiguous()
    dq = d_queries if d_queries is not None else d_logits.new_zeros(1, 1, 1, 1)
    dw = d_weights if d_weights is not None else d_logits.new_zeros(1, 1, 1)
    dk = d_keys if d_keys is not None else d_logits.new_zeros(1, 1)
    _slot_grads_kernel[grid](
        *pointers, d_logits, dq, dw, dk, *args,
        d_logits.stride(0), d_logits.stride(1), *dq.stride(), *dw.stride(), *dk.stride(),
        *tail,
        WANT_Q=d_queries is not None, WANT_W=d_weights is not None, WANT_K=d_keys is not None,
        **meta, num_warps=_WARPS[meta["DOT"]]["grads"],
    )  # fmt: skip
