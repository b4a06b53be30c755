"""What both Triton scoring kernels share, per block of `BLOCK_Q` queries × `BLOCK_R` regions: which query-head
rows the block holds (`query_rows`), the queries' candidate windows (`query_bounds`, `window_blocks`), and the
epilogue that turns the GEMM's accumulator into stored scores (`weighted_head_sum_store`, or `store_masked_block`
where no window reaches). `gluon_kernels` writes the same steps again in Gluon, which cannot call these."""

import triton
import triton.language as tl


@triton.jit
def weighted_head_sum_store(
    acc,
    w,
    rs,
    r_ok,
    out_ptr,
    b,
    g,
    pid_q,
    n_q,
    so_b,
    so_g,
    so_q,
    first,
    past,
    HP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
):
    """relu, head weights, sum over each query's HP rows, store `[BLOCK_Q, BLOCK_R]` FP32 scores (out's
    strides so_b, so_g, so_q; regions contiguous); with
    HAS_BOUNDS, −inf outside each query's candidate regions `[first, past)` ([BLOCK_Q] each).

    The rows are ordered as `query_rows` lays them out, and the heads are summed in pairs, level by
    level ((h0 + h1) + (h2 + h3) ...): a sum of two is the same whichever thread adds it, so every
    kernel and layout gives the same bits, given that no product is fused into a sum
    (`triton_kernels.FP_FUSION`)."""
    Q_LO: tl.constexpr = BLOCK_Q if BLOCK_Q < 4 else 4
    H_LO: tl.constexpr = HP if HP < 2 else 2
    H_HI: tl.constexpr = HP // H_LO
    Q_HI: tl.constexpr = BLOCK_Q // Q_LO
    weighted = tl.maximum(acc, 0.0) * w[:, None]
    x = tl.sum(tl.reshape(weighted, [Q_HI, H_LO, H_HI, Q_LO, BLOCK_R]), axis=1)
    for level in tl.static_range(1, 7):  # H_HI <= 64: HP is at most 128
        if (H_HI >> level) >= 1:
            x = tl.sum(tl.reshape(x, [Q_HI, H_HI >> level, 2, Q_LO, BLOCK_R]), axis=2)
    score = tl.reshape(x, [BLOCK_Q, BLOCK_R])
    oq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if HAS_BOUNDS:
        candidate = (rs[None, :] >= first[:, None]) & (rs[None, :] < past[:, None])
        score = tl.where(candidate, score, float("-inf"))
    out_rows = out_ptr + b * so_b + g * so_g + oq.to(tl.int64) * so_q
    tl.store(out_rows[:, None] + rs[None, :], score, mask=(oq < n_q)[:, None] & r_ok[None, :])


@triton.jit
def store_masked_block(
    out_ptr,
    b,
    g,
    pid_q,
    pid_r,
    n_q,
    R,
    so_b,
    so_g,
    so_q,
    BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """−inf over a `[BLOCK_Q, BLOCK_R]` block that no query's candidate window reaches (no GEMM)."""
    oq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = out_ptr + b * so_b + g * so_g + oq.to(tl.int64) * so_q
    masked = tl.full([BLOCK_Q, BLOCK_R], float("-inf"), tl.float32)
    tl.store(rows[:, None] + rs[None, :], masked, mask=(oq < n_q)[:, None] & (rs < R)[None, :])


@triton.jit
def window_blocks(first, past, BLOCK_R: tl.constexpr):
    """The region blocks `[lo, hi)` that some query's window `[first, past)` of the block may reach
    (an empty window only widens it); blocks outside are all −inf."""
    return tl.min(first, axis=0) // BLOCK_R, tl.cdiv(tl.max(past, axis=0), BLOCK_R)


@triton.jit
def query_bounds(
    first_ptr, past_ptr, sb_b, b, pid_q, n_q, R, BLOCK_Q: tl.constexpr, HAS_BOUNDS: tl.constexpr
):
    """The block's candidate bounds `[first, past)` per query ([BLOCK_Q] int32; zeros without
    bounds), clamped to [0, R]: the same test for every region id in [0, R), in 32-bit compares
    (offline sm_90 SASS: 53 fewer compare instructions per tile than int64 bounds)."""
    oq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if HAS_BOUNDS:
        first = tl.load(first_ptr + b * sb_b + oq, mask=oq < n_q, other=0)
        past = tl.load(past_ptr + b * sb_b + oq, mask=oq < n_q, other=0)
        first = tl.minimum(tl.maximum(first, 0), R).to(tl.int32)
        past = tl.minimum(tl.maximum(past, 0), R).to(tl.int32)
    else:
        first = tl.zeros([BLOCK_Q], dtype=tl.int32)
        past = first
    return first, past


@triton.jit
def query_rows(
    q_ptr,
    b,
    g,
    pid_q,
    start,
    n_q,
    H,
    sq_b,
    sq_q,
    sq_g,
    sq_h,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """A block's query-head rows: (row pointers, global query positions, head of each row, valid rows).

    Row m holds query `q_hi * Q_LO + q_lo` and head `h_hi * H_LO + h_lo` for
    `m = ((q_hi * H_LO + h_lo) * H_HI + h_hi) * Q_LO + q_lo` (Q_LO = 4, H_LO = 2 where they fit).
    For the reference geometry's four heads, in the Hopper MMA layout of 8 warps (where a thread
    holds rows m and m + 8, and row m + 4 sits 16 lanes away), a query's heads 0 and 1 (and 2 and 3)
    are then one thread's two rows, summed without a shuffle, and the two sums one shuffle apart;
    query-major rows put the four heads in four lanes, two shuffle rounds over twice the values
    (offline sm_90a SASS: 338 instructions per tile against 513). Other head counts
    get the same pairwise sums, not measured."""
    BLOCK_Q: tl.constexpr = BLOCK_M // HP
    Q_LO: tl.constexpr = BLOCK_Q if BLOCK_Q < 4 else 4
    H_LO: tl.constexpr = HP if HP < 2 else 2
    H_HI: tl.constexpr = HP // H_LO
    m = tl.arange(0, BLOCK_M)
    q_lo = m % Q_LO
    h_hi = (m // Q_LO) % H_HI
    h_lo = (m // (Q_LO * H_HI)) % H_LO
    q_hi = m // (Q_LO * H_HI * H_LO)
    qi = pid_q * BLOCK_Q + q_hi * Q_LO + q_lo
    h = h_hi * H_LO + h_lo
    q_pos = (start + qi).to(tl.int64)
    return q_ptr + b * sq_b + q_pos * sq_q + g * sq_g + h * sq_h, q_pos, h, (qi < n_q) & (h < H)
