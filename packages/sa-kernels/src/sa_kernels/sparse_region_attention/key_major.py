"""The key-major dK/dV of the gather backward: each program owns one selected region of one KV group
and a chunk of queries, and sums its keys' gradients in registers over the queries that selected the
region, so no key row takes an atomic add per (query, region) pair.

The query-major backward (`triton_kernels._region_bwd_kernel`) reads each selected region's K/V rows
once per query and scatters that query's dK/dV into FP32 buffers: at the Step-5 geometry (16 heads per
KV group, regions of 8 keys, D 192) the FP32 atomic adds are most of its time. Here the inverse routes
(`inverse_routes`: for every (batch, group, query chunk, region) the queries that selected the region,
as a CSR list) let a program hold the region's K/V rows and read the selecting queries' Q and dO rows
instead; its rows are (query, head) pairs, STEP_ROWS // (heads per group, rounded up to a power of
two) queries per step. Programs run region-fastest inside a (group, query chunk), so the programs
on the GPU at one time share that chunk's Q and dO rows in the L2 cache (`QUERY_CHUNK` queries:
CHUNK_BYTES of both at the default, and at most MAX_CHUNKS chunks, so that the CSR's segments grow
with the sequence, not its square). A region's sums over the chunks meet in FP32 buffers with one
atomic add per (region, chunk). dQ comes from the query-major kernel with its dK/dV part left out.

Memory: the CSR holds one int32 per route slot (the routes' own size) and one int64 per (batch,
group, chunk, region) segment. A program holds its region's K, V, dK and dV rows: regions up to
`fits`' bound (16 keys at head_dim 256) take this path, longer ones the atomic one.

Order within a CSR list follows atomic counters, so the FP32 sums of dK/dV may differ in their last
bits between runs (as the query-major atomics do).
"""

import torch
import triton
import triton.language as tl

from sa_kernels.head_split import head_split, load_split, write_split
from sa_kernels.sparse_gqa.triton_kernels import LOG2E
from sa_kernels.triton_dot import fp32_dot

# Q and dO bytes of one query chunk, per KV group, that the programs running together share in L2.
CHUNK_BYTES = 16 * 2**20
# Most query chunks per (batch, group): bounds the CSR's segments and the grid.
MAX_CHUNKS = 64
# Most elements of one program's [key rows, head_dim] tiles (K, V, dK, dV each).
MAX_TILE = 16 * 256
# (query, head) rows of one step.
STEP_ROWS = 64


@triton.jit
def _invert_routes_kernel(
    routes_ptr, counts_ptr, seg_ptr, list_ptr,
    stride_rb, stride_rh, stride_rq, stride_cb, stride_ch,
    kv_heads, regions, chunks,
    QUERY_CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """Program (query, batch·group). FILL False: add 1 to the counter of every (batch, group, chunk,
    region) segment the query's route selects; True: take a position from the segment's cursor and
    write the query there."""
    q_idx = tl.program_id(0)
    bh = tl.program_id(1)
    b64 = (bh // kv_heads).to(tl.int64)
    h64 = (bh % kv_heads).to(tl.int64)
    count = tl.load(counts_ptr + b64 * stride_cb + h64 * stride_ch + q_idx)
    route = routes_ptr + b64 * stride_rb + h64 * stride_rh + q_idx.to(tl.int64) * stride_rq
    first = (bh.to(tl.int64) * chunks + q_idx // QUERY_CHUNK) * regions
    offs = tl.arange(0, BLOCK_S)
    for start in range(0, count, BLOCK_S):
        live = start + offs < count
        rid = tl.load(route + start + offs, mask=live, other=0)
        live &= (rid >= 0) & (rid < regions)
        one = tl.full([BLOCK_S], 1, tl.int64)
        pos = tl.atomic_add(seg_ptr + first + rid, one, mask=live, sem="relaxed")
        if FILL:
            tl.store(list_ptr + pos, tl.full([BLOCK_S], 0, tl.int32) + q_idx, mask=live)


def _tile(region_size: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_D): a program's key rows (at least 16, the dots' least M) and columns."""
    return max(16, triton.next_power_of_2(region_size)), max(16, triton.next_power_of_2(head_dim))


def fits(region_size: int, head_dim: int) -> bool:
    """Whether a program's region tiles stay within MAX_TILE elements."""
    block_k, block_d = _tile(region_size, head_dim)
    return block_k * block_d <= MAX_TILE


def query_chunk(queries: int, group: int, head_dim: int, element_size: int) -> int:
    """Queries per chunk: the largest power of two whose Q and dO rows of one KV group fit
    CHUNK_BYTES, or more where the sequence would have more than MAX_CHUNKS chunks."""
    per_query = group * head_dim * element_size * 2
    chunk = 1 << max(0, (CHUNK_BYTES // per_query).bit_length() - 1)
    return max(chunk, triton.cdiv(queries, MAX_CHUNKS))


def inverse_routes(
    routes: torch.Tensor, counts: torch.Tensor, regions: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of the selections by (batch, group, query chunk, region) segment.

    routes: int32 [B, G, Q, W] canonical (each row's `counts` distinct region ids first; ids outside
    [0, regions) are skipped). Returns ends int64 [B·G·chunks·regions] and queries int32 [at least
    the selections]: segment s holds queries[start:ends[s]], start = ends[s − 1] (0 for s = 0), in
    no particular order."""
    batch, kv_heads, queries, width = routes.shape
    chunks = triton.cdiv(queries, chunk)
    segments = torch.zeros(batch * kv_heads * chunks * regions + 1, dtype=torch.int64,
                           device=routes.device)  # fmt: skip
    block_s = min(128, triton.next_power_of_2(max(width, 16)))
    grid = (queries, batch * kv_heads)
    common = (
        routes.stride(0), routes.stride(1), routes.stride(2), counts.stride(0), counts.stride(1),
        kv_heads, regions, chunks,
    )  # fmt: skip
    _invert_routes_kernel[grid](
        routes, counts, segments[1:], segments, *common,
        QUERY_CHUNK=chunk, BLOCK_S=block_s, FILL=False,
    )  # fmt: skip
    # segments[s] is now the start of segment s; the fill moves each start to its end (= the next
    # start), so that segments[:-1] ends as the ends, in place
    segments.cumsum_(0)
    # sized by the route slots, not the selections: no host sync to read their count
    selections = torch.empty(max(1, routes.numel()), dtype=torch.int32, device=routes.device)
    _invert_routes_kernel[grid](
        routes, counts, segments, selections, *common,
        QUERY_CHUNK=chunk, BLOCK_S=block_s, FILL=True,
    )  # fmt: skip
    return segments[:-1], selections


@triton.jit
def _region_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, ends_ptr, list_ptr, src_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_doq, stride_doh,
    stride_lb, stride_lh,
    stride_sb, stride_sn,
    stride_dkb, stride_dks, stride_dkh,
    kv_heads, kv_length, regions, chunks, query_start, scale, scale_log2,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, REGION_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr, D_HI: tl.constexpr, D_LO: tl.constexpr, HAS_LO: tl.constexpr,
    BLOCK_R: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Program (region, query chunk, batch·group): dK, dV of the region's keys over the chunk's
    queries that selected it; rows of a step are BLOCK_R // GROUP_P queries × GROUP_P heads."""
    region = tl.program_id(0)
    bh = tl.program_id(2)
    seg = (bh.to(tl.int64) * chunks + tl.program_id(1)) * regions + region
    lo = tl.load(ends_ptr + seg - 1, mask=seg > 0, other=0)
    hi = tl.load(ends_ptr + seg)
    if hi > lo:
        b64 = (bh // kv_heads).to(tl.int64)
        h64 = (bh % kv_heads).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        offs_r = tl.arange(0, BLOCK_R)
        src = tl.load(
            src_ptr + b64 * stride_sb + region.to(tl.int64) * stride_sn + offs_k,
            mask=offs_k < REGION_SIZE,
            other=-1,
        )
        key_ok = (src >= 0) & (src < kv_length)
        ids = tl.where(key_ok, src, 0).to(tl.int64)
        k_rows = b64 * stride_kb + h64 * stride_kh + ids * stride_ks
        v_rows = b64 * stride_vb + h64 * stride_vh + ids * stride_vs
        k_hi, k_lo = load_split(k_ptr, k_rows, key_ok, HEAD_DIM, D_HI, D_LO, HAS_LO)
        v_hi, v_lo = load_split(v_ptr, v_rows, key_ok, HEAD_DIM, D_HI, D_LO, HAS_LO)
        head_in_group = offs_r % GROUP_P
        heads = h64 * GROUP + head_in_group  # int64: head-major views
        dk_hi = tl.zeros([BLOCK_K, D_HI], tl.float32)
        dv_hi = tl.zeros([BLOCK_K, D_HI], tl.float32)
        dk_lo = tl.zeros([BLOCK_K, D_LO], tl.float32)
        dv_lo = tl.zeros([BLOCK_K, D_LO], tl.float32)
        for start in range(lo, hi, BLOCK_R // GROUP_P):
            pick = start + offs_r // GROUP_P
            row_ok = (pick < hi) & (head_in_group < GROUP)
            query = tl.load(list_ptr + pick, mask=row_ok, other=0).to(tl.int64)
            q_rows = b64 * stride_qb + query * stride_qq + heads * stride_qh
            do_rows = b64 * stride_dob + query * stride_doq + heads * stride_doh
            q_hi, q_lo = load_split(q_ptr, q_rows, row_ok, HEAD_DIM, D_HI, D_LO, HAS_LO)
            do_hi, do_lo = load_split(do_ptr, do_rows, row_ok, HEAD_DIM, D_HI, D_LO, HAS_LO)
            stat = b64 * stride_lb + heads * stride_lh + query
            lse = tl.load(lse_ptr + stat, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
            visible = (
                row_ok[:, None] & key_ok[None, :] & (src[None, :] <= query_start + query[:, None])
            )
            s = fp32_dot(q_hi, tl.trans(k_hi), IEEE, UPCAST)
            dp = fp32_dot(do_hi, tl.trans(v_hi), IEEE, UPCAST)
            if HAS_LO:
                s += fp32_dot(q_lo, tl.trans(k_lo), IEEE, UPCAST)
                dp += fp32_dot(do_lo, tl.trans(v_lo), IEEE, UPCAST)
            p = tl.where(visible, tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
            ds_t = tl.trans((p * (dp - delta[:, None])).to(q_hi.dtype))
            p_t = tl.trans(p.to(do_hi.dtype))
            dv_hi += fp32_dot(p_t, do_hi, IEEE, UPCAST)
            dk_hi += fp32_dot(ds_t, q_hi, IEEE, UPCAST)
            if HAS_LO:
                dv_lo += fp32_dot(p_t, do_lo, IEEE, UPCAST)
                dk_lo += fp32_dot(ds_t, q_lo, IEEE, UPCAST)
        rows = b64 * stride_dkb + h64 * stride_dkh + ids * stride_dks
        write_split(
            dk_ptr, rows, key_ok, dk_hi * scale, dk_lo * scale, HEAD_DIM, D_HI, D_LO, HAS_LO, True
        )
        write_split(dv_ptr, rows, key_ok, dv_hi, dv_lo, HEAD_DIM, D_HI, D_LO, HAS_LO, True)


def region_dkdv_key_major(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    routes: torch.Tensor,
    counts: torch.Tensor,
    region_sources: torch.Tensor,
    query_start: int,
    scale: float,
    flags: dict,
    *,
    chunk: int | None = None,
    rows: int = STEP_ROWS,
    num_warps: int = 4,
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 dK, dV [B, S, G, D] of the gather backward.

    query, grad_out: [B, Q, H, D] (unit last stride); key, value: [B, S, G, D]; lse: FP32 [B, H, Q]
    (log2 domain of scale·scores, +inf for rows with no visible key); delta: FP32 [B, H, Q] (rowsum of
    dO·O), same strides as lse, unit last stride; routes int32 [B, G, Q, W] canonical with `counts`
    int32 [B, G, Q]; region_sources int32 [B, regions, region_size] (`fits(region_size, head_dim)`);
    `flags`: `dot_flags(query)`."""
    batch, queries, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    group = heads // kv_heads
    regions, region_size = region_sources.shape[1:]
    chunk = chunk or query_chunk(queries, group, head_dim, query.element_size())
    ends, selections = inverse_routes(routes, counts, regions, chunk)
    dk = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
    dv = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
    group_p = triton.next_power_of_2(group)
    block_r = max(rows, group_p)
    block_k = _tile(region_size, head_dim)[0]
    d_hi, d_lo, has_lo = head_split(head_dim)
    chunks = triton.cdiv(queries, chunk)
    grid = (regions, chunks, batch * kv_heads)
    _region_dkdv_kernel[grid](
        query, key, value, grad_out, lse, delta, ends, selections, region_sources, dk, dv,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        lse.stride(0), lse.stride(1),
        region_sources.stride(0), region_sources.stride(1),
        dk.stride(0), dk.stride(1), dk.stride(2),
        kv_heads, key.shape[1], regions, chunks, query_start, scale, scale * LOG2E,
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, REGION_SIZE=region_size,
        BLOCK_K=block_k, D_HI=d_hi, D_LO=d_lo, HAS_LO=has_lo, BLOCK_R=block_r,
        **flags,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return dk, dv
