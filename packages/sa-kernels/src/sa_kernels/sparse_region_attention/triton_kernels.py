"""Gather kernels over selected regions: each program is one (batch, query, KV group) and the group's
query heads, which share the query's region list (the heads are the rows of every dot: 16 at the
CSA geometry). Programs do not stack several queries: neighbouring queries select different
regions, so a query block would share no K/V loads and only pad the dots with masked rows.

Routes come canonical (`sparse_gqa.routes.canonical_routes` with the region count as sentinel): per
row its `count` distinct valid region ids ascending, then the sentinel. A step of the loop takes
`BLOCK_W // BLOCK_RS` *virtual slots*; a virtual slot is one region (or, when the region is longer
than BLOCK_RS, one BLOCK_RS-long chunk of it), whose key rows the kernel reads from `region_sources`
and then loads from K and V. A key is masked where its source is -1 or outside [0, kv_length), and
above the query's global row (causal). Only those rows are loaded; region ids are never expanded to
token ids in memory.

Rows of a head dim that is not a power of two are two tiles (`head_split`: 192 = 128 + 64), so no
load lane or dot works on padding columns. Scores, softmax and accumulators are FP32; the forward
saves the log-sum-exp. The backward recomputes
P from it and keeps dQ in registers. dK and dV come one of two ways (the backward config's "DKV"):
"key_major" (the default where `key_major.fits`: 16-key regions at head_dim 256) leaves them to per-region
programs over the inverse routes, and this kernel stores the rows' delta for them; "atomic"
scatters them into FP32 buffers with FP32 atomics (one add per visible key and column; no key
repeats inside a program, regions being disjoint). The key-major way is the faster one at the
Step-5 geometry on the H200 (`bench_sparse_region_attention.py --sweep-gather bwd` times both).
For the atomic way, as in `sparse_gqa`'s gather backward, when the keys' FP32 accumulators outgrow
the L2 cache it runs in
passes over region ranges (`REGION_SPLIT` regions each; region ids number the key rows in order, so a
region range is a key range): a program (query, group, pass) visits only its slots inside the range
(bounds found by binary search on the ascending routes), programs are numbered pass-major, and dQ is
summed over the passes with FP32 atomics.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.head_split import head_split, load_split, write_split
from sa_kernels.sparse_gqa.triton_kernels import (
    LOG2E,
    PASS_ACCUMULATOR_ELEMENTS,
    backward_buffers,
    dot_flags,
    group_blocks,
)
from sa_kernels.triton_dot import fp32_dot

from .key_major import fits as key_major_fits
from .key_major import region_dkdv_key_major

MAX_HEAD_DIM = 256


@triton.jit
def _region_keys(
    route_base, src_base, start, stop, offs_w, row, regions, kv_length, stride_sn,
    REGION_SIZE: tl.constexpr, BLOCK_RS: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """Key rows (int64, 0 where masked) and visibility of virtual slots start … start + BLOCK_W //
    BLOCK_RS − 1 (of those below `stop`): slot v is chunk v % CHUNKS of route slot v // CHUNKS."""
    v = start + offs_w // BLOCK_RS
    if CHUNKS == 1:
        slot = v
        j = offs_w % BLOCK_RS
    else:
        slot = v // CHUNKS
        j = (v % CHUNKS) * BLOCK_RS + offs_w % BLOCK_RS
    rid = tl.load(route_base + slot, mask=v < stop, other=regions)
    live = (rid < regions) & (j < REGION_SIZE)
    src = tl.load(src_base + rid.to(tl.int64) * stride_sn + j, mask=live, other=-1)
    visible = (src >= 0) & (src <= row) & (src < kv_length)
    return tl.where(visible, src, 0).to(tl.int64), visible


@triton.jit
def _region_fwd_kernel(
    q_ptr, k_ptr, v_ptr, routes_ptr, counts_ptr, src_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_rb, stride_rh, stride_rq,
    stride_cb, stride_ch,
    stride_sb, stride_sn,
    stride_ob, stride_oq, stride_oh,
    stride_lb, stride_lh,
    kv_heads, kv_length, regions, query_start, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, REGION_SIZE: tl.constexpr, CHUNKS: tl.constexpr,
    D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_RS: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    q_idx = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    offs_g = tl.arange(0, BLOCK_G)
    offs_w = tl.arange(0, BLOCK_W)
    g_mask = offs_g < GROUP
    b64 = b.to(tl.int64)
    q64 = q_idx.to(tl.int64)
    h64 = h.to(tl.int64)
    heads = h64 * GROUP + offs_g  # int64: head-major views have large head strides
    row = query_start + q_idx
    q_hi, q_lo = load_split(
        q_ptr, b64 * stride_qb + q64 * stride_qq + heads * stride_qh, g_mask,
        HEAD_DIM, D_HI, D_LO, HAS_LO,
    )  # fmt: skip
    route_base = routes_ptr + b64 * stride_rb + h64 * stride_rh + q64 * stride_rq
    stop = tl.load(counts_ptr + b64 * stride_cb + h64 * stride_ch + q_idx) * CHUNKS
    src_base = src_ptr + b64 * stride_sb
    k_base = k_ptr + b64 * stride_kb + h64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + h64 * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, D_HI], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, D_LO], tl.float32)
    for start in range(0, stop, BLOCK_W // BLOCK_RS):
        ids, w_mask = _region_keys(
            route_base, src_base, start, stop, offs_w, row, regions, kv_length, stride_sn,
            REGION_SIZE, BLOCK_RS, CHUNKS,
        )  # fmt: skip
        k_hi, k_lo = load_split(k_base, ids * stride_ks, w_mask, HEAD_DIM, D_HI, D_LO, HAS_LO)
        v_hi, v_lo = load_split(v_base, ids * stride_vs, w_mask, HEAD_DIM, D_HI, D_LO, HAS_LO)
        s = fp32_dot(q_hi, tl.trans(k_hi), IEEE, UPCAST)
        if HAS_LO:
            s += fp32_dot(q_lo, tl.trans(k_lo), IEEE, UPCAST)
        s = tl.where(w_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(v_hi.dtype)
        acc_hi = acc_hi * alpha[:, None] + fp32_dot(p, v_hi, IEEE, UPCAST)
        if HAS_LO:
            acc_lo = acc_lo * alpha[:, None] + fp32_dot(p, v_lo, IEEE, UPCAST)
        m_i = m_new
    nonempty = l_i > 0
    denom = tl.where(nonempty, l_i, 1.0)[:, None]
    write_split(
        out_ptr, b64 * stride_ob + q64 * stride_oq + heads * stride_oh, g_mask,
        acc_hi / denom, acc_lo / denom, HEAD_DIM, D_HI, D_LO, HAS_LO, False,
    )  # fmt: skip
    # Log-sum-exp in the exp2 domain of the scaled scores; +inf marks a row with no visible key.
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + q_idx, lse, mask=g_mask)


@triton.jit
def _region_bwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, routes_ptr, counts_ptr, bounds_ptr, src_ptr,
    dq_ptr, dk_ptr, dv_ptr, delta_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oq, stride_oh,
    stride_dob, stride_doq, stride_doh,
    stride_lb, stride_lh,
    stride_rb, stride_rh, stride_rq,
    stride_cb, stride_ch,
    stride_sb, stride_sn,
    stride_dqb, stride_dqq, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    queries, kv_heads, passes, kv_length, regions, query_start, scale, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, REGION_SIZE: tl.constexpr, CHUNKS: tl.constexpr,
    SPLIT: tl.constexpr, DKV: tl.constexpr,
    D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_RS: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """DKV: also scatter dK, dV (FP32 atomics); else dQ only, and the rows' delta (rowsum of dO·O,
    lse's layout) stored to `delta_ptr` for the key-major dK/dV."""
    q_idx = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    b64 = b.to(tl.int64)
    q64 = q_idx.to(tl.int64)
    h64 = h.to(tl.int64)
    if SPLIT:  # this pass's route slots [first, stop); bounds [B, kv_heads, Q, passes + 1]
        bound = bounds_ptr + ((b64 * kv_heads + h64) * queries + q64) * (passes + 1)
        first = tl.load(bound + tl.program_id(2)) * CHUNKS
        stop = tl.load(bound + tl.program_id(2) + 1) * CHUNKS
    else:
        first = tl.zeros([], dtype=tl.int32)
        stop = tl.load(counts_ptr + b64 * stride_cb + h64 * stride_ch + q_idx) * CHUNKS
    # dq starts zeroed: a program with no slots in its range leaves its rows as they are
    if stop > first:
        row = query_start + q_idx
        offs_g = tl.arange(0, BLOCK_G)
        offs_w = tl.arange(0, BLOCK_W)
        g_mask = offs_g < GROUP
        heads = h64 * GROUP + offs_g  # int64: head-major views have large head strides
        q_rows = b64 * stride_qb + q64 * stride_qq + heads * stride_qh
        do_rows = b64 * stride_dob + q64 * stride_doq + heads * stride_doh
        o_rows = b64 * stride_ob + q64 * stride_oq + heads * stride_oh
        q_hi, q_lo = load_split(q_ptr, q_rows, g_mask, HEAD_DIM, D_HI, D_LO, HAS_LO)
        do_hi, do_lo = load_split(do_ptr, do_rows, g_mask, HEAD_DIM, D_HI, D_LO, HAS_LO)
        o_hi, o_lo = load_split(o_ptr, o_rows, g_mask, HEAD_DIM, D_HI, D_LO, HAS_LO)
        delta = tl.sum(do_hi.to(tl.float32) * o_hi.to(tl.float32), axis=1)
        if HAS_LO:
            delta += tl.sum(do_lo.to(tl.float32) * o_lo.to(tl.float32), axis=1)
        lse = tl.load(lse_ptr + b64 * stride_lb + heads * stride_lh + q64, mask=g_mask, other=0.0)
        if not DKV:
            tl.store(delta_ptr + b64 * stride_lb + heads * stride_lh + q64, delta, mask=g_mask)
        route_base = routes_ptr + b64 * stride_rb + h64 * stride_rh + q64 * stride_rq
        src_base = src_ptr + b64 * stride_sb
        k_base = k_ptr + b64 * stride_kb + h64 * stride_kh
        v_base = v_ptr + b64 * stride_vb + h64 * stride_vh
        dk_base = dk_ptr + b64 * stride_dkb + h64 * stride_dkh
        dv_base = dv_ptr + b64 * stride_dkb + h64 * stride_dkh
        dq_hi = tl.zeros([BLOCK_G, D_HI], tl.float32)
        dq_lo = tl.zeros([BLOCK_G, D_LO], tl.float32)
        for start in range(first, stop, BLOCK_W // BLOCK_RS):
            ids, w_mask = _region_keys(
                route_base, src_base, start, stop, offs_w, row, regions, kv_length, stride_sn,
                REGION_SIZE, BLOCK_RS, CHUNKS,
            )  # fmt: skip
            k_hi, k_lo = load_split(k_base, ids * stride_ks, w_mask, HEAD_DIM, D_HI, D_LO, HAS_LO)
            v_hi, v_lo = load_split(v_base, ids * stride_vs, w_mask, HEAD_DIM, D_HI, D_LO, HAS_LO)
            s = fp32_dot(q_hi, tl.trans(k_hi), IEEE, UPCAST)
            dp = fp32_dot(do_hi, tl.trans(v_hi), IEEE, UPCAST)
            if HAS_LO:
                s += fp32_dot(q_lo, tl.trans(k_lo), IEEE, UPCAST)
                dp += fp32_dot(do_lo, tl.trans(v_lo), IEEE, UPCAST)
            p = tl.exp2(s * scale_log2 - lse[:, None])  # lse = +inf (no visible key): p = 0
            p = tl.where(w_mask[None, :] & g_mask[:, None], p, 0.0)
            ds = (p * (dp - delta[:, None])).to(k_hi.dtype)
            dq_hi += fp32_dot(ds, k_hi, IEEE, UPCAST)
            if HAS_LO:
                dq_lo += fp32_dot(ds, k_lo, IEEE, UPCAST)
            if DKV:
                ds_t = tl.trans(ds)
                p_t = tl.trans(p.to(do_hi.dtype))
                dk_hi = fp32_dot(ds_t, q_hi, IEEE, UPCAST) * scale
                dv_hi = fp32_dot(p_t, do_hi, IEEE, UPCAST)
                dk_lo = dk_hi
                dv_lo = dv_hi
                if HAS_LO:
                    dk_lo = fp32_dot(ds_t, q_lo, IEEE, UPCAST) * scale
                    dv_lo = fp32_dot(p_t, do_lo, IEEE, UPCAST)
                write_split(
                    dk_base, ids * stride_dks, w_mask, dk_hi, dk_lo,
                    HEAD_DIM, D_HI, D_LO, HAS_LO, True,
                )  # fmt: skip
                write_split(
                    dv_base, ids * stride_dks, w_mask, dv_hi, dv_lo,
                    HEAD_DIM, D_HI, D_LO, HAS_LO, True,
                )  # fmt: skip
        dq_rows = b64 * stride_dqb + q64 * stride_dqq + heads * stride_dqh
        write_split(
            dq_ptr, dq_rows, g_mask, dq_hi * scale, dq_lo * scale,
            HEAD_DIM, D_HI, D_LO, HAS_LO, SPLIT,
        )  # fmt: skip


def default_config(head_dim: int, backward: bool, element_size: int = 2) -> dict:
    """Keys per step (`BLOCK_W`), warps and pipeline stages of one launch; for the backward also the
    dK/dV way (`DKV`) and, for the atomic way, the keys per pass (`KEY_SPLIT`; 0 = one pass; None:
    PASS_ACCUMULATOR_ELEMENTS // head_dim, which the launcher turns into regions). Both are the
    fastest launches of `bench_sparse_region_attention.py --sweep-gather` on the H200 at the Step-5
    geometry (CSA routes, 32k tokens, D 192, split into 128 + 64 lane tiles): the forward streams
    128 keys a step with 4 warps (50.7 ms against 59.0 ms for 32 keys with 2 warps), and so does
    the dQ launch at D above 128 (the whole backward 192.5 ms against 203.6 ms for 32 keys with 2
    warps). FP32 inputs (`element_size` 4) keep 32 keys a step: 128 of them at D above 192 need
    more shared memory than an SM90 block has."""
    wide = element_size <= 2
    if backward:
        return {
            "BLOCK_W": 128 if head_dim > 128 and wide else 32,
            "num_warps": 4,
            "num_stages": 2,
            "KEY_SPLIT": None,
            "DKV": "key_major",
        }
    return {"BLOCK_W": 128 if wide else 32, "num_warps": 4, "num_stages": 2}


# Candidates `bench_sparse_region_attention.py --sweep-gather` times against the defaults.
SWEEP_FORWARD_CONFIGS = [
    {"BLOCK_W": w, "num_warps": warps, "num_stages": stages}
    for w in (16, 32, 64)
    for warps in (2, 4, 8)
    for stages in (1, 2, 3)
] + [{"BLOCK_W": 128, "num_warps": warps, "num_stages": 2} for warps in (4, 8)]
SWEEP_BACKWARD_CONFIGS = [
    {"BLOCK_W": 32, "num_warps": 4, "num_stages": 3, "KEY_SPLIT": None, "DKV": "atomic"},
] + [
    {
        "BLOCK_W": 128, "num_warps": 4, "num_stages": 2, "DKV": "key_major",
        "KEY_MAJOR_ROWS": rows, "KEY_MAJOR_WARPS": warps, "KEY_MAJOR_STAGES": stages,
    }
    for rows in (32, 64, 128)
    for warps in (2, 4, 8)
    for stages in (1, 2)
] + [
    {"BLOCK_W": w, "num_warps": warps, "num_stages": stages, "DKV": "key_major"}
    for w, warps, stages in (
        (16, 2, 2), (16, 4, 3), (32, 2, 1), (32, 2, 2), (32, 4, 1), (32, 8, 2), (64, 4, 2),
        (64, 4, 1), (64, 8, 2), (128, 4, 1), (128, 4, 2), (128, 8, 2),
    )
]  # fmt: skip


# backward config keys of the key-major launch: region_dkdv_key_major's arguments
_KEY_MAJOR_OPTIONS = {
    "QUERY_CHUNK": "chunk",
    "KEY_MAJOR_ROWS": "rows",
    "KEY_MAJOR_WARPS": "num_warps",
    "KEY_MAJOR_STAGES": "num_stages",
}


def _blocks(group: int, head_dim: int, region_size: int, block_w: int) -> dict:
    """The tile constexprs of a launch: BLOCK_G, the head dim's split (`head_split`), BLOCK_RS (key
    rows of one virtual slot) and CHUNKS (virtual slots per region)."""
    block_rs = min(triton.next_power_of_2(region_size), block_w)
    d_hi, d_lo, has_lo = head_split(head_dim)
    return {
        "BLOCK_G": group_blocks(group, head_dim)[0],
        "D_HI": d_hi,
        "D_LO": d_lo,
        "HAS_LO": has_lo,
        "BLOCK_RS": block_rs,
        "CHUNKS": triton.cdiv(region_size, block_rs),
    }


def region_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    routes: torch.Tensor,
    counts: torch.Tensor,
    region_sources: torch.Tensor,
    query_start: int,
    scale: float,
    *,
    _config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Q, H, D] (query dtype) and lse FP32 [B, H, Q] (log2 domain of scale·scores).

    routes: int32 [B, G, Q, W] canonical (sentinel `regions`), counts int32 [B, G, Q],
    region_sources int32 [B, regions, region_size] with unit last stride. `_config` ({"BLOCK_W",
    "num_warps", "num_stages"}) overrides the launch (benchmark sweeps)."""
    batch, queries, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    group = heads // kv_heads
    regions, region_size = region_sources.shape[1:]
    out = torch.empty_like(query)
    lse = torch.empty(batch, heads, queries, dtype=torch.float32, device=query.device)
    config = _config or default_config(head_dim, False, query.element_size())
    blocks = _blocks(group, head_dim, region_size, config["BLOCK_W"])
    grid = (queries, batch * kv_heads)
    _region_fwd_kernel[grid](
        query, key, value, routes, counts, region_sources, out, lse,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        routes.stride(0), routes.stride(1), routes.stride(2),
        counts.stride(0), counts.stride(1),
        region_sources.stride(0), region_sources.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        kv_heads, key.shape[1], regions, query_start, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, REGION_SIZE=region_size, BLOCK_W=config["BLOCK_W"],
        **blocks, **dot_flags(query),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return out, lse


def region_split(config: dict, head_dim: int, region_size: int) -> int:
    """Regions per backward pass (0: one pass) of a backward `config`; KEY_SPLIT None means
    PASS_ACCUMULATOR_ELEMENTS // head_dim keys."""
    keys = config.get("KEY_SPLIT")
    if keys is None:
        keys = PASS_ACCUMULATOR_ELEMENTS // head_dim
    return max(1, keys // region_size) if keys else 0


def region_attention_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    routes: torch.Tensor,
    counts: torch.Tensor,
    region_sources: torch.Tensor,
    query_start: int,
    scale: float,
    *,
    _config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (query dtype), dk, dv (key/value dtype), accumulated in FP32. `_config` as for the forward
    (the dQ launch) plus "DKV" ("key_major" or "atomic"; regions `key_major.fits` refuses take
    "atomic"); for "atomic", "KEY_SPLIT" (keys per pass, 0: one pass, None: the default); for
    "key_major", "QUERY_CHUNK" (None: `key_major.query_chunk`), "KEY_MAJOR_ROWS",
    "KEY_MAJOR_WARPS" and "KEY_MAJOR_STAGES" of its launch.

    dK and dV are FP32 atomic sums (per pair, or per region and query chunk), so their last bits
    can differ between runs; with more than one pass, dq too (summed over the passes in an FP32
    buffer of the query's shape)."""
    batch, queries, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    group = heads // kv_heads
    regions, region_size = region_sources.shape[1:]
    config = _config or default_config(head_dim, True, query.element_size())
    blocks = _blocks(group, head_dim, region_size, config["BLOCK_W"])
    key_major = config.get("DKV") == "key_major" and key_major_fits(region_size, head_dim)
    lse = lse.contiguous()  # delta takes its layout
    if key_major:  # this launch: dQ and delta; dK, dV after it
        split, passes = 0, 1
        bounds, dq, delta = counts, torch.zeros_like(query), torch.empty_like(lse)
        dk = dv = dq  # not written (DKV off)
    else:
        split = region_split(config, head_dim, region_size)
        passes = triton.cdiv(regions, split) if split else 1
        bounds, dq, dk, dv = backward_buffers(query, key, routes, counts, regions, split, passes)
        delta = lse  # not written (DKV on)
    grid = (queries, batch * kv_heads, passes)
    _region_bwd_kernel[grid](
        query, key, value, out, grad_out, lse, routes, counts, bounds, region_sources,
        dq, dk, dv, delta,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        lse.stride(0), lse.stride(1),
        routes.stride(0), routes.stride(1), routes.stride(2),
        counts.stride(0), counts.stride(1),
        region_sources.stride(0), region_sources.stride(1),
        dq.stride(0), dq.stride(1), dq.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        queries, kv_heads, passes, key.shape[1], regions, query_start, scale, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, REGION_SIZE=region_size, BLOCK_W=config["BLOCK_W"],
        SPLIT=passes > 1, DKV=not key_major,
        **blocks, **dot_flags(query),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    if key_major:  # its launch options where the config names them, else its defaults
        options = {arg: config[name] for name, arg in _KEY_MAJOR_OPTIONS.items() if name in config}
        dk, dv = region_dkdv_key_major(
            query, key, value, grad_out, lse, delta, routes, counts, region_sources, query_start,
            scale, dot_flags(query), **options,
        )  # fmt: skip
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
