"""Triton kernels of the distillation target: the main attention's mass per indexer unit.

The target of query q and route group g on unit u is `Σ_{h in g} Σ_{k in u, k attended}
exp(s_hqk − lse_hq)`, `s = scale · q_h · k`, with the per-head natural log-sum-exp `lse` over the keys
the main attention attends. Three kernels compute it without an `[S, S]` tensor:

- `_dense_lse_kernel` ("dense_warmup" LSE, when the attention forward's is not given): rows are the
  flattened (query, head) pairs of one KV head (`BLOCK_M` of them share one K tile), streamed over the
  causally visible keys of their documents with an online max / sum (FlashAttention's forward
  without the `P · V` product).
- `_dense_mass_kernel`: one program owns `BLOCK_Q` queries × `HC` heads of one KV head (`HC` a power
  of two, `BLOCK_Q · HC` = 128 or 256 rows of the `Q · Kᵀ` tile, `_mass_rows`) and a run of
  `units_per_program` units; it walks the units `NU` at a time, gathers their keys through the unit
  table (`NU · UNIT` keys, `UNIT` the padded unit size), forms `exp2(s · log2e − lse · log2e)`,
  masks it to the query's candidates and visible keys, sums it over the `HC` heads (a reshape of the
  tile's rows) and over each unit's keys (a reshape of its columns) and adds the `[BLOCK_Q, NU]`
  result into the tile's `[G, rows, units]` output. A group's heads split into launches of
  power-of-two head chunks per KV head (QSA's 12 heads per KV head: 8 + 4), the later ones adding to
  what the earlier ones stored, so every output element is written by one program at a time: no
  atomics, deterministic.
- `_sparse_kernel` ("sparse"): one program per (query, route group); its selected units arrive sorted
  ascending (invalid ids last), so a repeat is its predecessor and counts once (set semantics). With
  `LSE_PASS` it computes the per-head LSE over the union of the selected units' visible keys and the
  suffix keys (QSA tail, CSA current region), read from a per-query table of key rows; without, it
  writes the mass of every selected slot in the slot layout `[G, rows, K]` (a unit's visible keys).

Scores accumulate in FP32 (`fp32_dot`: exact FP32 products for FP32 inputs unless TF32 is allowed;
BF16 × BF16 products are exact). Head dims that are not a power of two split into a power-of-two
part and a masked remainder (192 = 128 + 64), so no FLOPs go to padding beyond the remainder's
rounding. Key row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sa_kernels.backend import cuda_matmuls_use_tf32, triton_interpret
from sa_kernels.head_split import head_split
from sa_kernels.triton_dot import fp32_dot

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_ROWS = 128  # rows (query, head pairs) of one Q · Kᵀ tile
_KEYS = 64  # keys of one Q · Kᵀ tile
_SPARSE_KEYS = 128  # keys of one step of `_sparse_kernel`


def _sparse_launch(head_dim: int) -> dict:
    """Warps and stages of `_sparse_kernel`, with 128 keys a step: the fastest of 32–256 keys, 2–8
    warps and 1–3 stages on the H200 at the `bench_indexer_distillation` geometries, 32k tokens (CSA,
    D 192: 39 ms, 56 with 64 keys, 4 warps and 2 stages; QSA, D 256: 11 ms, 16 with those)."""
    return (
        {"num_warps": 2, "num_stages": 1} if head_dim <= 192 else {"num_warps": 4, "num_stages": 2}
    )


def _mass_rows(chunk: int) -> int:
    """Rows (query, head pairs) of one `_dense_mass_kernel` tile for `chunk` heads: 128 for 16 heads
    (CSA's heads per KV head), 256 for fewer (QSA's chunks of 8 and 4), the faster of the two on the
    H200 in `bench_indexer_distillation` at 32k tokens."""
    return 128 if chunk >= 16 else 256


@triton.jit
def _load_rows(ptr, rows, ok, offs, head_dim):
    """[R, BLOCK_D] of a row-major tensor: `rows` int64 element offsets [R], columns `offs`."""
    return tl.load(
        ptr + rows[:, None] + offs[None, :],
        mask=ok[:, None] & (offs[None, :] < head_dim),
        other=0.0,
    )


@triton.jit
def _load_lo(ptr, rows, ok, offs, head_dim, HAS_LO: tl.constexpr):
    """The head-dim remainder `offs` of the rows (zeros, never read, when there is none)."""
    if HAS_LO:
        out = _load_rows(ptr, rows, ok, offs, head_dim)
    else:
        out = tl.zeros([rows.shape[0], offs.shape[0]], dtype=ptr.dtype.element_ty)
    return out


@triton.jit
def _scores(
    q_hi, q_lo, k_ptr, k_rows, k_ok, offs_hi, offs_lo, head_dim,
    HAS_LO: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """q · kᵀ [R, N] in FP32 for keys at int64 element offsets `k_rows` [N] (masked by `k_ok`)."""
    kt = tl.load(
        k_ptr + k_rows[None, :] + offs_hi[:, None],
        mask=k_ok[None, :] & (offs_hi[:, None] < head_dim),
        other=0.0,
    )
    s = fp32_dot(q_hi, kt, IEEE, UPCAST)
    if HAS_LO:
        kt_lo = tl.load(
            k_ptr + k_rows[None, :] + offs_lo[:, None],
            mask=k_ok[None, :] & (offs_lo[:, None] < head_dim),
            other=0.0,
        )
        s += fp32_dot(q_lo, kt_lo, IEEE, UPCAST)
    return s


@triton.jit
def _online(m_i, l_i, s):
    """One online log-sum-exp step (base 2) of rows `s` [R, N] (masked entries −inf)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - shift) + tl.sum(tl.exp2(s - shift[:, None]), axis=1)
    return m_new, l_i


@triton.jit
def _natural_lse(m_i, l_i):
    """Natural log-sum-exp from the base-2 running max and sum (>= 1 once a key is attended); +inf
    where nothing was attended."""
    return tl.where(
        l_i > 0, (m_i + tl.log2(tl.maximum(l_i, 1.0))) * 0.6931471805599453, float("inf")
    )


@triton.jit
def _dense_lse_kernel(
    q_ptr, k_ptr, kdoc_ptr, qdoc_ptr, kstart_ptr, lse_ptr,
    stride_qb, stride_qq, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_db, stride_eb, stride_sb, stride_lb, stride_lq,
    queries, per_kv, query_start, head_dim, scale_log2,
    D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)  # head-major views: head offsets pass 2**31
    b = tl.program_id(2).to(tl.int64)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < queries * per_kv
    qi = (r // per_kv).to(tl.int64)
    head = kv * per_kv + r % per_kv
    qrow = query_start + qi
    qdoc = tl.load(qdoc_ptr + b * stride_eb + qi, mask=row_ok, other=-1)
    live = row_ok & (qdoc >= 0)
    kstart = tl.load(kstart_ptr + b * stride_sb + qi, mask=live, other=0)
    lo = tl.min(tl.where(live, kstart, 1073741824)).to(tl.int32)
    hi = tl.max(tl.where(live, qrow + 1, 0)).to(tl.int32)
    lo = lo // BLOCK_N * BLOCK_N
    q_rows = b * stride_qb + qi * stride_qq + head * stride_qh
    offs_hi = tl.arange(0, D_HI)
    offs_lo = D_HI + tl.arange(0, D_LO)
    q_hi = _load_rows(q_ptr, q_rows, live, offs_hi, head_dim)
    q_lo = _load_lo(q_ptr, q_rows, live, offs_lo, head_dim, HAS_LO)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        k_rows = b * stride_kb + n.to(tl.int64) * stride_ks + kv * stride_kh
        s = _scores(
            q_hi, q_lo, k_ptr, k_rows, n_ok, offs_hi, offs_lo, head_dim, HAS_LO, IEEE, UPCAST
        )
        kdoc = tl.load(kdoc_ptr + b * stride_db + n, mask=n_ok, other=-2)
        visible = (kdoc[None, :] == qdoc[:, None]) & (n[None, :] <= qrow[:, None]) & live[:, None]
        m_i, l_i = _online(m_i, l_i, tl.where(visible, s * scale_log2, float("-inf")))
    tl.store(lse_ptr + b * stride_lb + qi * stride_lq + head, _natural_lse(m_i, l_i), mask=row_ok)


@triton.jit
def _dense_mass_kernel(
    q_ptr, k_ptr, lse_ptr, units_ptr, kdoc_ptr, qdoc_ptr, cstart_ptr, cstop_ptr, out_ptr,
    stride_qq, stride_qh, stride_ks, stride_lq, stride_uu, stride_og, stride_or,
    q0, rows, u0, units, head0, kv_offset, g, query_start, head_dim, scale_log2, units_per_program,
    HC: tl.constexpr, BLOCK_Q: tl.constexpr, NU: tl.constexpr, UNIT: tl.constexpr,
    D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr, ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_q = tl.program_id(0)
    pid_u = tl.program_id(1)
    first = q0 + pid_q * BLOCK_Q
    # the tile's rows: query first // HC, head head0 + r % HC
    r = tl.arange(0, BLOCK_Q * HC)
    row_q = (first + r // HC).to(tl.int64)
    row_ok = row_q < q0 + rows
    q_rows = row_q * stride_qq + (head0 + r % HC).to(tl.int64) * stride_qh
    offs_hi = tl.arange(0, D_HI)
    offs_lo = D_HI + tl.arange(0, D_LO)
    q_hi = _load_rows(q_ptr, q_rows, row_ok, offs_hi, head_dim)
    q_lo = _load_lo(q_ptr, q_rows, row_ok, offs_lo, head_dim, HAS_LO)
    # per query
    qq = (first + tl.arange(0, BLOCK_Q)).to(tl.int64)
    q_ok = qq < q0 + rows
    heads = head0 + tl.arange(0, HC)
    lse2 = tl.load(
        lse_ptr + qq[:, None] * stride_lq + heads[None, :],
        mask=q_ok[:, None],
        other=float("inf"),
    ) * 1.4426950408889634  # fmt: skip
    cs = tl.load(cstart_ptr + qq, mask=q_ok, other=0)
    ce = tl.load(cstop_ptr + qq, mask=q_ok, other=0)
    qdoc = tl.load(qdoc_ptr + qq, mask=q_ok, other=-1)
    qrow = query_start + qq
    ua = u0 + pid_u * units_per_program
    ub = tl.minimum(ua + units_per_program, u0 + units)
    lo = tl.maximum(ua, tl.min(tl.where(q_ok, cs, 1073741824)).to(tl.int32))
    hi = tl.minimum(ub, tl.max(tl.where(q_ok, ce, 0)).to(tl.int32))
    slot = tl.arange(0, UNIT)
    for us in range(lo, hi, NU):
        u = us + tl.arange(0, NU)
        u_ok = u < hi
        unit_rows = tl.load(
            units_ptr + u[:, None].to(tl.int64) * stride_uu + slot[None, :],
            mask=u_ok[:, None],
            other=-1,
        )
        key_row = tl.reshape(unit_rows, (NU * UNIT,)).to(tl.int64)
        key_unit = tl.reshape(tl.broadcast_to(u[:, None], (NU, UNIT)), (NU * UNIT,))
        k_ok = key_row >= 0
        k_rows = key_row * stride_ks + kv_offset  # kv · stride on the host: int64 past 2**31
        s = _scores(
            q_hi, q_lo, k_ptr, k_rows, k_ok, offs_hi, offs_lo, head_dim, HAS_LO, IEEE, UPCAST
        )
        kdoc = tl.load(kdoc_ptr + key_row, mask=k_ok, other=-2)
        keep = (
            k_ok[None, :]
            & (key_unit[None, :] >= cs[:, None])
            & (key_unit[None, :] < ce[:, None])
            & (key_row[None, :] <= qrow[:, None])
            & (kdoc[None, :] == qdoc[:, None])
            & (qdoc[:, None] >= 0)
        )  # [BLOCK_Q, N]
        p = tl.exp2(tl.reshape(s, (BLOCK_Q, HC, NU * UNIT)) * scale_log2 - lse2[:, :, None])
        p = tl.where(keep[:, None, :], p, 0.0)
        mass = tl.sum(tl.reshape(tl.sum(p, axis=1), (BLOCK_Q, NU, UNIT)), axis=2)  # [BLOCK_Q, NU]
        o_ptr = out_ptr + g * stride_og + (qq - q0)[:, None] * stride_or + (u - u0)[None, :]
        o_mask = q_ok[:, None] & u_ok[None, :]
        if ACCUMULATE:
            mass += tl.load(o_ptr, mask=o_mask, other=0.0)
        tl.store(o_ptr, mass, mask=o_mask)


@triton.jit
def _sparse_keys(
    ids_ptr, units_ptr, kdoc_ptr, slot0, slots, unit_count, qrow, qdoc, stride_uu,
    NU: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """Key rows [NU * UNIT] of slots `[slot0, slot0 + NU)` of one sorted id row, whether each is
    attended (a first occurrence of a valid unit, causally visible, same document), and the slots."""
    s = slot0 + tl.arange(0, NU)
    s_ok = s < slots
    ids = tl.load(ids_ptr + s, mask=s_ok, other=-1)
    prev = tl.load(ids_ptr + s - 1, mask=s_ok & (s > 0), other=-1)
    valid = s_ok & (ids >= 0) & (ids < unit_count) & (ids != prev)
    unit_rows = tl.load(
        units_ptr + ids[:, None].to(tl.int64) * stride_uu + tl.arange(0, UNIT)[None, :],
        mask=valid[:, None],
        other=-1,
    )
    key_row = tl.reshape(unit_rows, (NU * UNIT,)).to(tl.int64)
    k_ok = key_row >= 0
    kdoc = tl.load(kdoc_ptr + key_row, mask=k_ok, other=-2)
    return key_row, k_ok & (key_row <= qrow) & (kdoc == qdoc) & (kdoc >= 0), s, s_ok


@triton.jit
def _sparse_kernel(
    q_ptr, k_ptr, lse_ptr, units_ptr, kdoc_ptr, qdoc_ptr, suffix_ptr, tail_ptr, ids_ptr, out_ptr,
    stride_qq, stride_qh, stride_ks, stride_kh, stride_lq, stride_uu, stride_tq, stride_ig,
    stride_iq, stride_og, stride_or,
    q0, slots, unit_count, tail_width, query_start, head_dim, per_kv, per_group, scale_log2,
    HP: tl.constexpr, NU: tl.constexpr, UNIT: tl.constexpr, BLOCK_S: tl.constexpr,
    D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr, LSE_PASS: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)  # g · stride_ig passes 2**31 at long lengths
    qi = (q0 + r).to(tl.int64)
    qrow = query_start + qi
    qdoc = tl.load(qdoc_ptr + qi)
    row_ids = ids_ptr + g * stride_ig + qi * stride_iq
    offs_hi = tl.arange(0, D_HI)
    offs_lo = D_HI + tl.arange(0, D_LO)
    hp = tl.arange(0, HP)
    # the group's heads [g * per_group, (g + 1) * per_group), one KV head's run at a time
    g_first = g * per_group
    g_stop = g_first + per_group
    kv_first = g_first // per_kv
    kv_stop = (g_stop - 1) // per_kv + 1
    if LSE_PASS:
        suffix = tl.load(suffix_ptr + qi).to(tl.int32)
        for kv in range(kv_first, kv_stop):
            h0 = tl.maximum(g_first, kv * per_kv)
            h_ok = h0 + hp < tl.minimum(g_stop, (kv + 1) * per_kv)
            q_rows = qi * stride_qq + (h0 + hp) * stride_qh
            q_hi = _load_rows(q_ptr, q_rows, h_ok, offs_hi, head_dim)
            q_lo = _load_lo(q_ptr, q_rows, h_ok, offs_lo, head_dim, HAS_LO)
            m_i = tl.full([HP], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([HP], dtype=tl.float32)
            for slot0 in range(0, slots, NU):
                key_row, keep, _, _ = _sparse_keys(
                    row_ids, units_ptr, kdoc_ptr, slot0, slots, unit_count, qrow, qdoc, stride_uu,
                    NU, UNIT,
                )  # fmt: skip
                keep = keep & (key_row < suffix)  # the suffix loop below takes the rest once
                k_rows = key_row * stride_ks + kv * stride_kh
                s = _scores(
                    q_hi, q_lo, k_ptr, k_rows, keep, offs_hi, offs_lo, head_dim, HAS_LO, IEEE, UPCAST
                )  # fmt: skip
                m_i, l_i = _online(m_i, l_i, tl.where(keep[None, :], s * scale_log2, float("-inf")))
            # the suffix: its table row holds the visible key rows (-1 none)
            t = tl.arange(0, BLOCK_S)
            key_row = tl.load(tail_ptr + qi * stride_tq + t, mask=t < tail_width, other=-1).to(
                tl.int64
            )
            keep = key_row >= 0
            k_rows = key_row * stride_ks + kv * stride_kh
            s = _scores(
                q_hi, q_lo, k_ptr, k_rows, keep, offs_hi, offs_lo, head_dim, HAS_LO, IEEE, UPCAST
            )  # fmt: skip
            m_i, l_i = _online(m_i, l_i, tl.where(keep[None, :], s * scale_log2, float("-inf")))
            tl.store(lse_ptr + qi * stride_lq + h0 + hp, _natural_lse(m_i, l_i), mask=h_ok)
    else:
        for slot0 in range(0, slots, NU):
            key_row, keep, s_idx, s_ok = _sparse_keys(
                row_ids, units_ptr, kdoc_ptr, slot0, slots, unit_count, qrow, qdoc, stride_uu,
                NU, UNIT,
            )  # fmt: skip
            mass = tl.zeros([NU], dtype=tl.float32)
            for kv in range(kv_first, kv_stop):
                h0 = tl.maximum(g_first, kv * per_kv)
                h_ok = h0 + hp < tl.minimum(g_stop, (kv + 1) * per_kv)
                q_rows = qi * stride_qq + (h0 + hp) * stride_qh
                q_hi = _load_rows(q_ptr, q_rows, h_ok, offs_hi, head_dim)
                q_lo = _load_lo(q_ptr, q_rows, h_ok, offs_lo, head_dim, HAS_LO)
                lse2 = tl.load(
                    lse_ptr + qi * stride_lq + h0 + hp, mask=h_ok, other=float("inf")
                ) * 1.4426950408889634  # fmt: skip
                k_rows = key_row * stride_ks + kv * stride_kh
                s = _scores(
                    q_hi, q_lo, k_ptr, k_rows, keep, offs_hi, offs_lo, head_dim, HAS_LO, IEEE, UPCAST
                )  # fmt: skip
                p = tl.where(keep[None, :], tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
                mass += tl.sum(tl.reshape(tl.sum(p, axis=0), (NU, UNIT)), axis=1)
            tl.store(out_ptr + g * stride_og + r * stride_or + s_idx, mass, mask=s_ok)


# -- launchers ----------------------------------------------------------------------------------------


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _precision(tensor: torch.Tensor) -> tuple[bool, bool]:
    """(IEEE, UPCAST) for `fp32_dot`."""
    wide = tensor.dtype == torch.float32
    ieee = wide and (tensor.device.type != "cuda" or not cuda_matmuls_use_tf32())
    return ieee, (not wide) and triton_interpret()


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _unit_geometry(unit_rows: torch.Tensor, keys: int = _KEYS) -> tuple[int, int]:
    """(UNIT, NU): the padded unit size and the units per step (`NU · UNIT` >= `keys`)."""
    unit = unit_rows.shape[-1]
    return unit, max(1, keys // unit)


def dense_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    key_documents: torch.Tensor,
    query_documents: torch.Tensor,
    document_start: torch.Tensor,
    *,
    query_start: int,
    softmax_scale: float,
) -> torch.Tensor:
    """float32 [B, Q, H] natural log-sum-exp of every query head over its visible keys (same
    document, key row <= query row); +inf for padding queries.

    Args:
        query: [B, Q, H, D]; key: [B, S, Hkv, D] (global); key_documents: int [B, S] (-1 padding);
        query_documents: int [B, Q] (-1 padding); document_start: int [B, Q], the first key row of
        each query's document.
    """
    query, key = _rows_last(query), _rows_last(key)
    batch, queries, heads, dim = query.shape
    kv_heads = key.shape[2]
    per_kv = heads // kv_heads
    lse = torch.empty(batch, queries, heads, device=query.device, dtype=torch.float32)
    if batch == 0 or queries == 0:
        return lse
    d_hi, d_lo, has_lo = head_split(dim)
    ieee, upcast = _precision(query)
    grid = (triton.cdiv(queries * per_kv, _ROWS), kv_heads, batch)
    _dense_lse_kernel[grid](
        query, key, key_documents, query_documents, document_start, lse,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        key_documents.stride(0), query_documents.stride(0), document_start.stride(0),
        lse.stride(0), lse.stride(1),
        queries, per_kv, query_start, dim, softmax_scale * LOG2E,
        D_HI=d_hi, D_LO=d_lo, HAS_LO=has_lo, BLOCK_M=_ROWS, BLOCK_N=_KEYS,
        IEEE=ieee, UPCAST=upcast,
        num_warps=8, num_stages=2,
    )  # fmt: skip
    return lse


def _head_runs(heads: int, kv_heads: int, groups: int) -> list[tuple[int, int, int, int]]:
    """(group, kv head, first head, HC) launches: each group's heads cut at KV-head boundaries, each
    run split into power-of-two chunks (largest first)."""
    per_kv, per_group = heads // kv_heads, heads // groups
    runs = []
    for g in range(groups):
        h, stop = g * per_group, (g + 1) * per_group
        while h < stop:
            kv = h // per_kv
            end = min(stop, (kv + 1) * per_kv)
            while h < end:
                chunk = 1 << ((end - h).bit_length() - 1)
                runs.append((g, kv, h, chunk))
                h += chunk
    return runs


def dense_mass(
    query: torch.Tensor,
    key: torch.Tensor,
    lse: torch.Tensor,
    unit_rows: torch.Tensor,
    key_documents: torch.Tensor,
    query_documents: torch.Tensor,
    candidate_start: torch.Tensor,
    candidate_stop: torch.Tensor,
    *,
    groups: int,
    rows: tuple[int, int],
    units: tuple[int, int],
    query_start: int,
    softmax_scale: float,
) -> torch.Tensor:
    """float32 [G, rows, units]: the attention mass of local queries `rows = (q0, q1)` of one batch row
    on its units `units = (u0, u1)`, summed over each group's heads, over the visible keys (same
    document, key row <= query row) of the query's candidate units (others 0).

    Args (one batch row):
        query: [Q, H, D]; key: [S, Hkv, D] (global rows).
        lse: float32 [Q, H] natural log-sum-exp (+inf: no mass), last dim contiguous.
        unit_rows: int32 [U, UNIT], the key row of each slot of each unit, -1 for none.
        key_documents: int [S]; query_documents: int [Q] (-1: padding).
        candidate_start, candidate_stop: int [Q], the candidate units `[start, stop)`.
    """
    query, key, unit_rows = _rows_last(query), _rows_last(key), _rows_last(unit_rows)
    key_documents, query_documents = _rows_last(key_documents), _rows_last(query_documents)
    candidate_start, candidate_stop = _rows_last(candidate_start), _rows_last(candidate_stop)
    (q0, q1), (u0, u1) = rows, units
    heads, dim = query.shape[1:]
    out = torch.zeros(groups, q1 - q0, u1 - u0, device=query.device, dtype=torch.float32)
    if q1 <= q0 or u1 <= u0:
        return out
    unit, nu = _unit_geometry(unit_rows)
    per_program = nu * 16
    d_hi, d_lo, has_lo = head_split(dim)
    ieee, upcast = _precision(query)
    written: set[int] = set()
    for g, kv, head0, chunk in _head_runs(heads, key.shape[1], groups):
        block_q = max(1, _mass_rows(chunk) // chunk)
        grid = (triton.cdiv(q1 - q0, block_q), triton.cdiv(u1 - u0, per_program))
        _dense_mass_kernel[grid](
            query, key, lse, unit_rows, key_documents, query_documents,
            candidate_start, candidate_stop, out,
            query.stride(0), query.stride(1), key.stride(0), lse.stride(0),
            unit_rows.stride(0), out.stride(0), out.stride(1),
            q0, q1 - q0, u0, u1 - u0, head0, kv * key.stride(1), g, query_start, dim,
            softmax_scale * LOG2E, per_program,
            HC=chunk, BLOCK_Q=block_q, NU=nu, UNIT=unit,
            D_HI=d_hi, D_LO=d_lo, HAS_LO=has_lo, ACCUMULATE=g in written,
            IEEE=ieee, UPCAST=upcast,
            num_warps=8 if block_q * chunk >= 128 else 4, num_stages=2,
        )  # fmt: skip
        written.add(g)
    return out


def sparse_mass(
    query: torch.Tensor,
    key: torch.Tensor,
    lse: torch.Tensor,
    unit_rows: torch.Tensor,
    key_documents: torch.Tensor,
    query_documents: torch.Tensor,
    suffix_start: torch.Tensor,
    suffix_rows: torch.Tensor,
    sorted_units: torch.Tensor,
    *,
    rows: tuple[int, int],
    query_start: int,
    softmax_scale: float,
    compute_lse: bool,
) -> torch.Tensor:
    """float32 [G, rows, K]: the attention mass of local queries `rows = (q0, q1)` of one batch row on
    each slot of their sorted selections, summed over each group's heads (repeats, invalid ids: 0).

    Args (one batch row; as `dense_mass` where not said):
        lse: float32 [Q, H]; with `compute_lse` its rows `q0 … q1` are overwritten first with the
            natural log-sum-exp over the selected units' visible keys at rows below `suffix_start`
            and the keys of `suffix_rows` (+inf: none).
        suffix_start: int [Q].
        suffix_rows: int [Q, W], the visible key rows attended besides the units, -1 for none.
        sorted_units: int32 [G, Q, K], each row ascending with every id outside `[0, U)` last.
    """
    query, key, unit_rows = _rows_last(query), _rows_last(key), _rows_last(unit_rows)
    key_documents, query_documents = _rows_last(key_documents), _rows_last(query_documents)
    suffix_start, sorted_units = _rows_last(suffix_start), _rows_last(sorted_units)
    suffix_rows = _rows_last(suffix_rows)
    q0, q1 = rows
    heads, dim = query.shape[1:]
    groups, slots = sorted_units.shape[0], sorted_units.shape[2]
    out = torch.zeros(groups, q1 - q0, slots, device=query.device, dtype=torch.float32)
    if q1 <= q0 or slots == 0:
        return out
    per_kv, per_group = heads // key.shape[1], heads // groups
    unit, nu = _unit_geometry(unit_rows, _SPARSE_KEYS)
    d_hi, d_lo, has_lo = head_split(dim)
    ieee, upcast = _precision(query)
    width = suffix_rows.shape[1]
    for lse_pass in (True, False) if compute_lse else (False,):
        _sparse_kernel[(q1 - q0, groups)](
            query, key, lse, unit_rows, key_documents, query_documents, suffix_start,
            suffix_rows, sorted_units, out,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), lse.stride(0),
            unit_rows.stride(0), suffix_rows.stride(0), sorted_units.stride(0),
            sorted_units.stride(1), out.stride(0), out.stride(1),
            q0, slots, unit_rows.shape[0], width, query_start, dim, per_kv, per_group,
            softmax_scale * LOG2E,
            HP=_pow2_at_least(min(per_kv, per_group), 16), NU=nu, UNIT=unit,
            BLOCK_S=_pow2_at_least(width, 16),
            D_HI=d_hi, D_LO=d_lo, HAS_LO=has_lo, LSE_PASS=lse_pass,
            IEEE=ieee, UPCAST=upcast,
            **_sparse_launch(dim),
        )  # fmt: skip
    return out
