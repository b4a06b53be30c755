"""The resident scoring kernel for Hopper in Gluon: warp-specialised, with each warpgroup's next MMA
in flight during its epilogue. Same tiles, products, row order and head sums as the Triton resident
kernel (`triton_kernels`), so the same bits (a `gpu` test compares them).

Why: the Triton resident kernel runs every tile's dot and then its epilogue (relu, head weights, the
sum over a query's heads, the bounds, the store) with all eight warps in step, so the tensor cores
idle through each epilogue (ncu on the H200: tensor pipe about 50 % busy, two warps per scheduler
waiting on each other at a CTA barrier per tile). Here:
- one producer warp streams the summary blocks into a ring of STAGES shared-memory stages by TMA;
- two consumer warpgroups each take half of every tile's 128 query-head rows (16 queries at four
  heads), their query rows held in registers as the MMA's A operand (shared memory then carries
  only the summaries: half the bytes per tile);
- each consumer issues the MMA of tile i + 1 before the epilogue of tile i, in two accumulators
  used in turn (a register of an MMA in flight is never read or moved, or ptxas serialises the
  MMAs), and frees a stage with an mbarrier arrive, so the warpgroups drift apart instead of
  meeting at a barrier every tile.
On the H200 (Triton 3.6): 1.31-1.53x the Triton kernel on Step-5 score tiles, and the Step-5
forward's scoring kernels 13.0 ms at 131 072 tokens against 18.2 for the Triton kernel.

Gluon has no interpreter and these kernels use SM90 instructions: `applies` says where they run;
elsewhere the Triton kernels do. Gluon kernels cannot call `triton.jit` functions, so the tile walk,
the row order and the head sum are written again here (`blocks.py` holds the Triton ones).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sa_kernels.backend import device_capability, sm_count, triton_interpret
from sa_kernels.gluon_compat import tma_load
from sa_kernels.indexer_score.triton_kernels import (
    FP_FUSION,
    bound_args,
    summary_rows,
    tma_addressable,
)

BLOCK_M = 128
"""Query-head rows per tile (two warpgroups of 64)."""
BLOCK_R = 64
"""Regions per tile."""
STAGES = 4
"""Summary blocks in flight. H200, 2048 x 16384 Step-5 tile: 3 / 4 / 5 / 6 stages 0.418 / 0.385 /
0.384 / 0.383 ms."""
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40
"""Register budgets (setmaxnreg) of the worker partitions: the second consumer warpgroup and the
producer warp, which only walks the tiles and issues TMA copies. The default partition (the first
consumer) takes what is left: 256 in the offline PTX (Triton 3.6); 128 · 256 + 128 · 232 + 32 · 40
registers fit the SM's 65 536."""


@gluon.jit
def _segment(t, t_end, n_r, n_m, G):
    """As `triton_kernels._segment`: the (batch·group, query block) segment holding tile t of a run
    ending at t_end: its region blocks [r_lo, r_hi) within the run, query block, batch and group."""
    row = t // n_r
    r_lo = t - row * n_r
    r_hi = gl.minimum(n_r, r_lo + (t_end - t))
    bg = row // n_m
    return r_lo, r_hi, row % n_m, (bg // G).to(gl.int64), (bg % G).to(gl.int64)


@gluon.jit
def _clamped_bounds(first_ptr, past_ptr, sb_b, b, oq, n_q, R):
    """Queries oq's candidate windows [first, past) clamped to [0, R], int32 (queries past n_q: an
    empty window at 0), as `blocks.query_bounds`."""
    first = gl.load(first_ptr + b * sb_b + oq, mask=oq < n_q, other=0)
    past = gl.load(past_ptr + b * sb_b + oq, mask=oq < n_q, other=0)
    first = gl.minimum(gl.maximum(first, 0), R).to(gl.int32)
    past = gl.minimum(gl.maximum(past, 0), R).to(gl.int32)
    return first, past


@gluon.jit
def _segment_window(
    first_ptr, past_ptr, sb_b, b, pid_q, n_q, R, r_lo, r_hi, q_of_block,
    BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr, HAS_BOUNDS: gl.constexpr,
):  # fmt: skip
    """The region blocks [c_lo, c_hi) of a segment that some query of its block may select (the
    others get −inf without an MMA), as `blocks.window_blocks`."""
    c_lo = r_lo
    c_hi = r_hi
    if HAS_BOUNDS:
        first, past = _clamped_bounds(
            first_ptr, past_ptr, sb_b, b, pid_q * BLOCK_Q + q_of_block, n_q, R
        )
        c_lo = gl.minimum(gl.maximum(r_lo, gl.min(first, axis=0) // BLOCK_R), r_hi)
        c_hi = gl.maximum(gl.minimum(r_hi, gl.cdiv(gl.max(past, axis=0), BLOCK_R)), c_lo)
    return c_lo, c_hi


@gluon.jit
def _live_segment(
    t, t_end, n_r, n_m, G, first_ptr, past_ptr, sb_b, n_q, R, q_of_block,
    BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr, HAS_BOUNDS: gl.constexpr,
):  # fmt: skip
    """`_segment` of tile t and the region blocks [c_lo, c_hi) of it that need an MMA
    (`_segment_window`): the one walk the producer and both consumers share."""
    r_lo, r_hi, pid_q, b, g = _segment(t, t_end, n_r, n_m, G)
    c_lo, c_hi = _segment_window(
        first_ptr, past_ptr, sb_b, b, pid_q, n_q, R, r_lo, r_hi, q_of_block,
        BLOCK_Q, BLOCK_R, HAS_BOUNDS,
    )  # fmt: skip
    return r_lo, r_hi, pid_q, b, g, c_lo, c_hi


@gluon.jit
def _row_query_head(m, pid_q, HP: gl.constexpr, BLOCK_Q: gl.constexpr):
    """Row m's query (within the call) and head in a block of BLOCK_Q queries, in
    `blocks.query_rows`' order (a query's heads two rows of one thread and a shuffle apart)."""
    Q_LO: gl.constexpr = BLOCK_Q if BLOCK_Q < 4 else 4
    H_LO: gl.constexpr = HP if HP < 2 else 2
    H_HI: gl.constexpr = HP // H_LO
    q_lo = m % Q_LO
    h_hi = (m // Q_LO) % H_HI
    h_lo = (m // (Q_LO * H_HI)) % H_LO
    q_hi = m // (Q_LO * H_HI * H_LO)
    return pid_q * BLOCK_Q + q_hi * Q_LO + q_lo, h_hi * H_LO + h_lo


@gluon.jit
def _head_sum(weighted, HP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr):
    """[BLOCK_Q * HP, BLOCK_R] → [BLOCK_Q, BLOCK_R]: each query's heads summed in pairs, level by
    level, as `blocks.weighted_head_sum_store` (so the same bits)."""
    Q_LO: gl.constexpr = BLOCK_Q if BLOCK_Q < 4 else 4
    H_LO: gl.constexpr = HP if HP < 2 else 2
    H_HI: gl.constexpr = HP // H_LO
    Q_HI: gl.constexpr = BLOCK_Q // Q_LO
    x = gl.sum(gl.reshape(weighted, [Q_HI, H_LO, H_HI, Q_LO, BLOCK_R]), axis=1)
    for level in gl.static_range(1, 7):  # H_HI <= 64, as in the Triton kernels
        if (H_HI >> level) >= 1:
            x = gl.sum(gl.reshape(x, [Q_HI, H_HI >> level, 2, Q_LO, BLOCK_R]), axis=2)
    return gl.reshape(x, [BLOCK_Q, BLOCK_R])


@gluon.jit
def _producer(
    s_desc, s_smem, ready, free, first_ptr, past_ptr, sb_b, t_start, t_end, n_q, R, G, n_r, n_m,
    s_batch_rows, HP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_R: gl.constexpr,
    HAS_BOUNDS: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: the summary block of every tile that needs an MMA, in tile order, into the ring."""
    BLOCK_Q: gl.constexpr = BLOCK_M // HP
    q_of_block = gl.arange(0, BLOCK_Q, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    issued = t_start * 0
    t = t_start
    while t < t_end:
        r_lo, r_hi, pid_q, b, _, c_lo, c_hi = _live_segment(
            t, t_end, n_r, n_m, G, first_ptr, past_ptr, sb_b, n_q, R, q_of_block,
            BLOCK_Q, BLOCK_R, HAS_BOUNDS,
        )  # fmt: skip
        # rows past R (the next batch row or TMA's zero fill) only reach masked-out columns
        row0 = (b * s_batch_rows).to(gl.int32)
        for pid_r in range(c_lo, c_hi):
            stage = issued % STAGES
            # the first pass over the ring finds every stage free (parity 1 of a fresh barrier)
            mbarrier.wait(free.index(stage), ((issued // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), s_desc.block_type.nbytes)
            tma_load(s_desc, [row0 + pid_r * BLOCK_R, 0], ready.index(stage), s_smem.index(stage))
            issued += 1
        t += r_hi - r_lo


@gluon.jit
def _start(q_regs, s_smem, ready, consumed, zero, STAGES: gl.constexpr):
    """Issue (async) the MMA of the `consumed`-th summary block once it has landed."""
    stage = consumed % STAGES
    mbarrier.wait(ready.index(stage), (consumed // STAGES) & 1)
    return warpgroup_mma(
        q_regs, s_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True
    )


@gluon.jit
def _finish(
    acc, stage, free, w, out_rows, row_ok, cols, pid_r, R, first, past,
    OUTSTANDING: gl.constexpr, HP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr,
    HAS_BOUNDS: gl.constexpr,
):  # fmt: skip
    """Wait for `acc`'s MMA (OUTSTANDING later ones may run on), free its stage, then the epilogue:
    relu, head weights, each query's heads summed, −inf outside its window, the store."""
    done = warpgroup_mma_wait(OUTSTANDING, deps=(acc,))
    mbarrier.arrive(free.index(stage))
    score = _head_sum(gl.maximum(done, 0.0) * w[:, None], HP, BLOCK_Q, BLOCK_R)
    rs = pid_r * BLOCK_R + cols
    if HAS_BOUNDS:
        candidate = (rs[None, :] >= first[:, None]) & (rs[None, :] < past[:, None])
        score = gl.where(candidate, score, float("-inf"))
    gl.store(out_rows[:, None] + rs[None, :], score, mask=row_ok[:, None] & (rs < R)[None, :])


@gluon.jit
def _store_minus_inf(out_rows, row_ok, cols, r_from, r_to, R, layout: gl.constexpr):
    """−inf over region blocks [r_from, r_to) that no query's window reaches (no MMA)."""
    masked = gl.full([out_rows.shape[0], cols.shape[0]], float("-inf"), gl.float32, layout)
    for pid_r in range(r_from, r_to):
        rs = pid_r * cols.shape[0] + cols
        gl.store(out_rows[:, None] + rs[None, :], masked, mask=row_ok[:, None] & (rs < R)[None, :])


@gluon.jit
def _consumer(
    q_ptr, w_ptr, out_ptr, first_ptr, past_ptr, s_smem, ready, free, t_start, t_end,
    start, n_q, R, D, H, G, n_r, n_m,
    sq_b, sq_q, sq_g, sq_h, sw_b, sw_q, sw_g, sw_h, sb_b, so_b, so_g, so_q,
    HALF: gl.constexpr, HP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_R: gl.constexpr,
    DP: gl.constexpr, HAS_BOUNDS: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warpgroup: rows [HALF, HALF + 1) · BLOCK_M / 2 of every tile, i.e. the block's queries
    [HALF, HALF + 1) · BLOCK_Q / 2 (the row order keeps a query's heads within a half)."""
    BLOCK_Q: gl.constexpr = BLOCK_M // HP
    ROWS: gl.constexpr = BLOCK_M // 2
    QH: gl.constexpr = ROWS // HP
    WARPS: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_R, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    zero = gl.zeros([ROWS, BLOCK_R], gl.float32, layout=acc_layout)
    score_layout: gl.constexpr = _head_sum(zero, HP, QH, BLOCK_R).type.layout
    m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    m_load = gl.arange(0, ROWS, layout=gl.SliceLayout(1, load_layout))
    d_load = gl.arange(0, DP, layout=gl.SliceLayout(0, load_layout))
    q_of_half = gl.arange(0, QH, layout=gl.SliceLayout(1, score_layout))
    q_of_block = gl.arange(0, BLOCK_Q, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    cols = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, score_layout))
    consumed = t_start * 0
    t = t_start
    while t < t_end:
        r_lo, r_hi, pid_q, b, g, c_lo, c_hi = _live_segment(
            t, t_end, n_r, n_m, G, first_ptr, past_ptr, sb_b, n_q, R, q_of_block,
            BLOCK_Q, BLOCK_R, HAS_BOUNDS,
        )  # fmt: skip
        pid_h = pid_q * 2 + HALF  # this half as a block of QH queries
        qi, h = _row_query_head(m_load, pid_h, HP, QH)
        q_rows = q_ptr + b * sq_b + (start + qi).to(gl.int64) * sq_q + g * sq_g + h * sq_h
        ok = (qi < n_q) & (h < H)
        rows = gl.load(
            q_rows[:, None] + d_load[None, :], mask=ok[:, None] & (d_load < D)[None, :], other=0.0
        )
        q_regs = gl.convert_layout(rows, a_layout)
        qi, h = _row_query_head(m, pid_h, HP, QH)
        w = gl.load(
            w_ptr + b * sw_b + (start + qi).to(gl.int64) * sw_q + g * sw_g + h * sw_h,
            mask=(qi < n_q) & (h < H),
            other=0.0,
        )
        oq = pid_h * QH + q_of_half
        row_ok = oq < n_q
        out_rows = out_ptr + b * so_b + g * so_g + oq.to(gl.int64) * so_q
        if HAS_BOUNDS:
            first, past = _clamped_bounds(first_ptr, past_ptr, sb_b, b, oq, n_q, R)
            _store_minus_inf(out_rows, row_ok, cols, r_lo, c_lo, R, score_layout)
            _store_minus_inf(out_rows, row_ok, cols, c_hi, r_hi, R, score_layout)
        else:
            first = gl.zeros([QH], gl.int32, gl.SliceLayout(1, score_layout))
            past = first
        n_live = c_hi - c_lo
        if n_live > 0:
            # accumulators a and b in turn: tile k's MMA runs during tile k - 1's epilogue
            stage_a = consumed % STAGES
            acc_a = _start(q_regs, s_smem, ready, consumed, zero, STAGES)
            consumed += 1
            k = 1
            for _ in range(0, (n_live - 1) // 2):
                stage_b = consumed % STAGES
                acc_b = _start(q_regs, s_smem, ready, consumed, zero, STAGES)
                consumed += 1
                _finish(
                    acc_a, stage_a, free, w, out_rows, row_ok, cols, c_lo + k - 1, R, first, past,
                    1, HP, QH, BLOCK_R, HAS_BOUNDS,
                )  # fmt: skip
                stage_a = consumed % STAGES
                acc_a = _start(q_regs, s_smem, ready, consumed, zero, STAGES)
                consumed += 1
                _finish(
                    acc_b, stage_b, free, w, out_rows, row_ok, cols, c_lo + k, R, first, past,
                    1, HP, QH, BLOCK_R, HAS_BOUNDS,
                )  # fmt: skip
                k += 2
            if k < n_live:
                stage_b = consumed % STAGES
                acc_b = _start(q_regs, s_smem, ready, consumed, zero, STAGES)
                consumed += 1
                _finish(
                    acc_a, stage_a, free, w, out_rows, row_ok, cols, c_lo + k - 1, R, first, past,
                    1, HP, QH, BLOCK_R, HAS_BOUNDS,
                )  # fmt: skip
                _finish(
                    acc_b, stage_b, free, w, out_rows, row_ok, cols, c_lo + k, R, first, past,
                    0, HP, QH, BLOCK_R, HAS_BOUNDS,
                )  # fmt: skip
            else:
                _finish(
                    acc_a, stage_a, free, w, out_rows, row_ok, cols, c_lo + k - 1, R, first, past,
                    0, HP, QH, BLOCK_R, HAS_BOUNDS,
                )  # fmt: skip
        t += r_hi - r_lo


@gluon.jit(
    do_not_specialize=[
        "start", "n_tiles", "tiles_per_program", "s_batch_rows", "so_b", "so_g", "so_q",
    ]
)  # fmt: skip
def _indexer_score_hopper_kernel(
    q_ptr, w_ptr, s_desc, out_ptr, first_ptr, past_ptr,
    start, n_q, R, D, H, G, n_tiles, tiles_per_program, s_batch_rows,
    sq_b, sq_q, sq_g, sq_h, sw_b, sw_q, sw_g, sw_h, sb_b, so_b, so_g, so_q,
    HP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_R: gl.constexpr, DP: gl.constexpr,
    HAS_BOUNDS: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
):  # fmt: skip
    # A program walks a contiguous run of tiles in (batch·group, query block, region block) order,
    # as the Triton resident kernel does.
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_R, DP], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=2)  # one arrive per consumer warpgroup
    n_r = gl.cdiv(R, BLOCK_R)
    n_m = gl.cdiv(n_q, BLOCK_M // HP)
    t_start = gl.program_id(0) * tiles_per_program
    t_end = gl.minimum(t_start + tiles_per_program, n_tiles)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    q_ptr, w_ptr, out_ptr, first_ptr, past_ptr, s_smem, ready, free, t_start,
                    t_end, start, n_q, R, D, H, G, n_r, n_m, sq_b, sq_q, sq_g, sq_h, sw_b, sw_q,
                    sw_g, sw_h, sb_b, so_b, so_g, so_q, 0, HP, BLOCK_M, BLOCK_R, DP, HAS_BOUNDS,
                    STAGES,
                ),
            ),
            (
                _consumer,
                (
                    q_ptr, w_ptr, out_ptr, first_ptr, past_ptr, s_smem, ready, free, t_start,
                    t_end, start, n_q, R, D, H, G, n_r, n_m, sq_b, sq_q, sq_g, sq_h, sw_b, sw_q,
                    sw_g, sw_h, sb_b, so_b, so_g, so_q, 1, HP, BLOCK_M, BLOCK_R, DP, HAS_BOUNDS,
                    STAGES,
                ),
            ),
            (
                _producer,
                (
                    s_desc, s_smem, ready, free, first_ptr, past_ptr, sb_b, t_start, t_end, n_q,
                    R, G, n_r, n_m, s_batch_rows, HP, BLOCK_M, BLOCK_R, HAS_BOUNDS, STAGES,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip


MAX_HEADS = 4
"""Heads per group (padded to a power of two) this kernel takes. Offline (Triton 3.6, sm_90a) the
head sum of 8 padded heads spilled 152 bytes at dim 256, and 16 to 64 heads 220-652 bytes; 1, 2
and 4 heads do not spill."""


def applies(query: torch.Tensor, summary: torch.Tensor) -> bool:
    """Whether this kernel scores these inputs: CUDA on an SM90 GPU (not the interpreter), bfloat16
    query and summary, 16 <= dim <= 256, at most MAX_HEADS heads per group, and a summary TMA can
    address (`tma_addressable`)."""
    if not query.is_cuda or triton_interpret() or torch.version.hip is not None:
        return False
    _, _, _, heads, dim = query.shape
    return (
        tma_addressable(summary)
        and query.dtype == torch.bfloat16
        and summary.dtype == torch.bfloat16
        and 16 <= dim <= 256
        and triton.next_power_of_2(heads) <= MAX_HEADS
        and device_capability(query.device.index) == (9, 0)
    )


def _summary_descriptor(summary: torch.Tensor, dp: int) -> tuple[TensorDescriptor, int]:
    """Gluon's TMA descriptor over summary's rows and the batch's row offset (`summary_rows`; the
    caller has checked that TMA can address them)."""
    rows, batch_rows = summary_rows(summary)
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_R, dp], gl.bfloat16)
    row_stride = summary.stride(1)
    return TensorDescriptor(
        summary, [rows, summary.shape[2]], [row_stride, 1], [BLOCK_R, dp], layout
    ), batch_rows


def indexer_score_tile(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    start: int,
    n_q: int,
    out: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    stages: int | None = None,
    programs: int | None = None,
) -> None:
    """`triton_kernels.indexer_score_tile`'s work on inputs where `applies`: writes `out`
    [B, G, n_q, R] for query rows [start, start + n_q); `bounds` as there. `stages` (default
    STAGES) and `programs` (default one per SM) are for sweeps and tests; the results do not
    depend on them."""
    batch, _, groups, heads, dim = query.shape
    regions = summary.shape[1]
    hp = triton.next_power_of_2(heads)
    dp = max(64, triton.next_power_of_2(dim))
    n_tiles = batch * groups * triton.cdiv(n_q, BLOCK_M // hp) * triton.cdiv(regions, BLOCK_R)
    if programs is None:
        programs = sm_count(query.device.index)
    tiles_per_program = triton.cdiv(n_tiles, programs)
    desc, batch_rows = _summary_descriptor(summary, dp)
    first, past, bounds_batch_stride = bound_args(bounds, out)
    _indexer_score_hopper_kernel[(triton.cdiv(n_tiles, tiles_per_program),)](
        query, weights, desc, out, first, past,
        start, n_q, regions, dim, heads, groups, n_tiles, tiles_per_program, batch_rows,
        *query.stride()[:4], *weights.stride(), bounds_batch_stride, *out.stride()[:3],
        HP=hp, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, DP=dp, HAS_BOUNDS=bounds is not None,
        STAGES=STAGES if stages is None else stages, CONSUMER_REGISTERS=CONSUMER_REGISTERS,
        PRODUCER_REGISTERS=PRODUCER_REGISTERS, num_warps=4,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip


__all__ = ["MAX_HEADS", "applies", "indexer_score_tile"]
