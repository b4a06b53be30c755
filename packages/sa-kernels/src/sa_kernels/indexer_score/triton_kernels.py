"""The fused scoring kernels: a GEMM whose M rows are (query, head) pairs of one tile and group.

Each output tile multiplies `BLOCK_M = BLOCK_Q * HP` query-head rows by `BLOCK_R` summaries over D, then applies relu,
scales by the head weights and sums each query's heads in registers before storing `[BLOCK_Q, BLOCK_R]` scores.
`HP` is heads_per_group rounded up to a power of two; padded heads load zeros and weight 0.

Kernels, picked by the launch config's "KERNEL" entry (never by autotuning):
- "gluon" (the GPU default, GLUON_CONFIG): `gluon_kernels`, the resident kernel's tiles and bits in a
  warp-specialised Gluon kernel for SM90 GPUs; where it does not run, "resident".
- "resident" (DEFAULT_CONFIG): a fixed number of programs ("PER_SM" per
  SM), each walking a contiguous run of tiles in (batch·group, query block, region block) order. A program loads its `[BLOCK_M, D]` query rows once
  per query block and streams only the summaries through a Hopper TMA descriptor: at BLOCK_M 128 it reads half the
  bytes per FLOP of "tiles". One dot over all of D (padded to a power of two, at most 256; 2-byte queries on the GPU).
- "tiles": one program per output tile, D walked in `BLOCK_D` steps; both operands reloaded for every tile. It runs
  where "resident" cannot (D > 256, float32 query on the GPU, a summary layout TMA cannot address: 16-byte aligned
  base and row stride, a batch stride that is a whole number of rows) and under the interpreter.
The two Triton kernels accumulate the products in the same k order and share the epilogue (`blocks`); the
Gluon kernel copies it (a Gluon kernel cannot call `triton.jit` functions) and gave the resident kernel's bits
on the H200 at every shape tested. The two Triton kernels' bits were equal on the H200 where
D is a multiple of 64 (the gpu test `test_cuda_resident_configs_equal_the_tiles_kernel_bit_for_bit`), which matters
because which one runs depends on a call's size; at D 104 they differed by about one ulp.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import gluon_module, sm_count, triton_interpret
from sa_kernels.indexer_score.blocks import (
    query_bounds,
    query_rows,
    store_masked_block,
    weighted_head_sum_store,
    window_blocks,
)

try:  # Triton >= 3.4: host-side TMA descriptors (also run by the interpreter)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the tiles kernel only
    TensorDescriptor = None


# Out's strides are not specialised: told that a row stride is a multiple of 16, Triton widens the
# stores through a layout conversion in shared memory, which takes the Step-5 forward's scoring
# kernel from 18.4 to 23.0 ms on the H200. Unspecialised, the stores stay in the MMA layout.
@triton.jit(do_not_specialize=["so_b", "so_g", "so_q"])
def _indexer_score_kernel(
    q_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    first_ptr,
    past_ptr,
    start,
    n_q,
    R,
    D,
    H,
    G,
    sq_b,
    sq_q,
    sq_g,
    sq_h,
    sw_b,
    sw_q,
    sw_g,
    sw_h,
    ss_b,
    ss_r,
    sb_b,
    so_b,
    so_g,
    so_q,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # The "tiles" kernel: grid (region block, query block, batch·group).
    pid_r = tl.program_id(0)
    pid_q = tl.program_id(1)
    bg = tl.program_id(2)
    b = (bg // G).to(tl.int64)
    g = (bg % G).to(tl.int64)
    BLOCK_Q: tl.constexpr = BLOCK_M // HP
    q_rows, q_pos, h, row_ok = query_rows(
        q_ptr, b, g, pid_q, start, n_q, H, sq_b, sq_q, sq_g, sq_h, HP, BLOCK_M
    )
    first, past = query_bounds(first_ptr, past_ptr, sb_b, b, pid_q, n_q, R, BLOCK_Q, HAS_BOUNDS)
    if HAS_BOUNDS:
        lo, hi = window_blocks(first, past, BLOCK_R)
        if (pid_r < lo) | (pid_r >= hi):
            store_masked_block(
                out_ptr, b, g, pid_q, pid_r, n_q, R, so_b, so_g, so_q, BLOCK_Q, BLOCK_R
            )
            return
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < R
    s_rows = s_ptr + b * ss_b + rs.to(tl.int64) * ss_r
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        qt = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        st = tl.load(s_rows[:, None] + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            qt = qt.to(tl.float32)
            st = st.to(tl.float32)
        acc = tl.dot(qt, tl.trans(st), acc, input_precision=PRECISION)
    w = tl.load(w_ptr + b * sw_b + q_pos * sw_q + g * sw_g + h * sw_h, mask=row_ok, other=0.0)
    weighted_head_sum_store(
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
        HP,
        BLOCK_Q,
        BLOCK_R,
        HAS_BOUNDS,
    )


@triton.jit
def _segment(t, t_end, n_r, n_m, G):
    """The (batch·group, query block) segment holding tile t of a run ending at t_end, in
    (batch·group, query block, region block) order: its region blocks [r_lo, r_hi) within the run,
    its query block, batch and group."""
    row = t // n_r
    r_lo = t - row * n_r
    r_hi = tl.minimum(n_r, r_lo + (t_end - t))
    bg = row // n_m
    return r_lo, r_hi, row % n_m, (bg // G).to(tl.int64), (bg % G).to(tl.int64)


@triton.jit(
    do_not_specialize=[
        "start",
        "n_tiles",
        "tiles_per_program",
        "s_batch_rows",
        "so_b",
        "so_g",
        "so_q",
    ]
)
def _indexer_score_resident_kernel(
    q_ptr,
    w_ptr,
    s_desc,
    out_ptr,
    first_ptr,
    past_ptr,
    start,
    n_q,
    R,
    D,
    H,
    G,
    n_tiles,
    tiles_per_program,
    s_batch_rows,
    sq_b,
    sq_q,
    sq_g,
    sq_h,
    sw_b,
    sw_q,
    sw_g,
    sw_h,
    sb_b,
    so_b,
    so_g,
    so_q,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DP: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // HP
    n_r = tl.cdiv(R, BLOCK_R)
    n_m = tl.cdiv(n_q, BLOCK_Q)
    t = tl.program_id(0) * tiles_per_program
    t_end = tl.minimum(t + tiles_per_program, n_tiles)
    d = tl.arange(0, DP)
    d_ok = d < D
    # One segment per (batch·group, query block) this program's run of tiles touches: load the query rows and
    # weights once, then stream the segment's region blocks.
    while t < t_end:
        r_lo, r_hi, pid_q, b, g = _segment(t, t_end, n_r, n_m, G)
        q_rows, q_pos, h, row_ok = query_rows(
            q_ptr, b, g, pid_q, start, n_q, H, sq_b, sq_q, sq_g, sq_h, HP, BLOCK_M
        )
        qt = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            qt = qt.to(tl.float32)
        w = tl.load(w_ptr + b * sw_b + q_pos * sw_q + g * sw_g + h * sw_h, mask=row_ok, other=0.0)
        first, past = query_bounds(first_ptr, past_ptr, sb_b, b, pid_q, n_q, R, BLOCK_Q, HAS_BOUNDS)
        s_row0 = (b * s_batch_rows).to(tl.int32)
        # region blocks no query of the block can select: −inf without the GEMM (a merged call's
        # rectangle reaches past its early rows' windows: 4.5 % of the 128k forward's work)
        c_lo, c_hi = r_lo, r_hi
        if HAS_BOUNDS:
            lo, hi = window_blocks(first, past, BLOCK_R)
            c_lo = tl.minimum(tl.maximum(r_lo, lo), r_hi)
            c_hi = tl.maximum(tl.minimum(r_hi, hi), c_lo)
            for pid_r in range(r_lo, c_lo):
                store_masked_block(
                    out_ptr, b, g, pid_q, pid_r, n_q, R, so_b, so_g, so_q, BLOCK_Q, BLOCK_R
                )
            for pid_r in range(c_hi, r_hi):
                store_masked_block(
                    out_ptr, b, g, pid_q, pid_r, n_q, R, so_b, so_g, so_q, BLOCK_Q, BLOCK_R
                )
        for pid_r in tl.range(c_lo, c_hi, num_stages=STAGES):
            rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
            r_ok = rs < R
            # Rows past R (the next batch row or TMA's zero fill) only reach masked-out columns.
            st = s_desc.load([s_row0 + pid_r * BLOCK_R, 0])
            if DOT_FP32:
                st = st.to(tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            acc = tl.dot(qt, tl.trans(st), acc, input_precision=PRECISION)
            weighted_head_sum_store(
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
                HP,
                BLOCK_Q,
                BLOCK_R,
                HAS_BOUNDS,
            )
        t += r_hi - r_lo


def _resident(block_m: int, block_r: int, per_sm: int, warps: int, stages: int) -> dict:
    return {
        "KERNEL": "resident",
        "BLOCK_M": block_m,
        "BLOCK_R": block_r,
        "PER_SM": per_sm,
        "num_warps": warps,
        "num_stages": stages,
    }


# The Triton resident kernel's one fixed launch config (no autotuning, so the summation order, hence every bit,
# is the same on every run); the GPU default where the Gluon kernel does not run.
# The fastest of `bench_indexer_score.py --quick --sweep` on the H200 (torch 2.11, Triton 3.6, G4 H4 D256
# R16384): resident 128 × 64, 8 warps, 3 stages, 1 program per SM, TMA summary loads: 368.4 TFLOP/s at Q 128 and
# 457.7 at Q 2048, against 289 and 339.1 for the tiles kernel at 128 × 128 × 64 (1.31× over both shapes, same bits).
# Shared memory: the query rows ([128, 256] bf16, 64 KiB) and 3 summary blocks of [64, 256] (32 KiB each).
# It runs at every size: its host launch costs more (a TMA descriptor per call; eagerly, a Q 128 call takes
# 0.094 ms against 0.047 ms of GPU time on the H200), but in a training step the host runs ahead of the GPU,
# and at Q 128 its GPU time beats the tiles kernel's 0.060 ms, so calls are not routed by their FLOPs.
DEFAULT_CONFIG = _resident(128, 64, per_sm=1, warps=8, stages=3)
# The GPU default: the warp-specialised Gluon kernel (`gluon_kernels`: the same tiles and bits, 1.3-1.5x
# on the H200) where it runs (SM90, bfloat16, at most 4 heads per group, a TMA-addressable summary),
# DEFAULT_CONFIG elsewhere. "STAGES": summary blocks in flight (None: `gluon_kernels.STAGES`).
GLUON_CONFIG = {"KERNEL": "gluon", "STAGES": None}
# The tiles kernel's config on the GPU wherever "resident" does not run (see the module docstring).
_TILES_CONFIG = {"BLOCK_M": 128, "BLOCK_R": 128, "BLOCK_D": 64, "num_warps": 8, "num_stages": 3}


_INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_R": 32, "BLOCK_D": 32, "num_warps": 4, "num_stages": 1}


# The Gluon kernel, then DEFAULT_CONFIG and its closest rivals on the H200 (TFLOP/s at Q 128 / Q 2048), for
# `bench_indexer_score.py --sweep` to re-check on another GPU or Triton. All give DEFAULT_CONFIG's bits. (Left out as
# clear losers: the persistent grid-stride tiles kernel, TMA score stores, and other tile shapes; resident 128 × 32
# and 256 × 64 give other bits.)
SWEEP_CONFIGS = [
    GLUON_CONFIG,
    DEFAULT_CONFIG,
    _resident(128, 64, per_sm=1, warps=8, stages=4),  # 362.8 / 445.3
    _resident(128, 64, per_sm=2, warps=8, stages=1),  # 325.9 / 418.2: two programs share an SM
    _resident(128, 128, per_sm=1, warps=8, stages=2),  # 249.5 / 346.5
    dict(_TILES_CONFIG),  # 289 / 339.1: the tiles kernel
]


def tma_addressable(summary: torch.Tensor) -> bool:
    """Whether a 2-D TMA descriptor can address summary's rows: 16-byte aligned base and row stride,
    a row of at least 16 bytes, and a batch stride that is a whole number of rows."""
    batch, _, dim = summary.shape
    ss_b, ss_r, _ = summary.stride()
    esz = summary.element_size()
    return not (
        summary.data_ptr() % 16
        or ss_r < dim
        or (ss_r * esz) % 16
        or dim * esz < 16
        or (batch > 1 and (ss_b <= 0 or ss_b % ss_r))
    )


def summary_rows(summary: torch.Tensor) -> tuple[int, int]:
    """`(rows, batch_rows)` of summary seen as one 2-D matrix of rows, [(B − 1)·batch_rows + R, D]:
    batch b's region r is row `b · batch_rows + r` (TMA descriptors address it so)."""
    batch, regions, _ = summary.shape
    ss_b, ss_r, _ = summary.stride()
    batch_rows = ss_b // ss_r if batch > 1 else 0
    return (batch - 1) * batch_rows + regions, batch_rows


def _summary_descriptor(summary: torch.Tensor, block_r: int, dp: int):
    """A 2-D TMA descriptor over `summary_rows` and the batch's row offset, or (None, 0) where TMA
    cannot address them (`tma_addressable`)."""
    if TensorDescriptor is None or not tma_addressable(summary):
        return None, 0
    rows, batch_rows = summary_rows(summary)
    dim, row_stride = summary.shape[2], summary.stride(1)
    return TensorDescriptor(summary, [rows, dim], [row_stride, 1], [block_r, dp]), batch_rows


def bound_args(bounds, out) -> tuple:
    """The kernels' `first_ptr, past_ptr` and their one batch stride (the public call gives both
    bounds the same strides): the bounds, or `out` as an unread placeholder."""
    if bounds is None:
        return out, out, 0
    first, past = bounds
    return first, past, first.stride(0)


FP_FUSION = False
"""Every scoring kernel is compiled without FMA contraction (`enable_fp_fusion=FP_FUSION`): each head's
weighted score is rounded before the pairwise sums, as the oracle rounds each product. Contracted,
`w0 · x0 + w1 · x1` keeps one product unrounded, and which one depends on the compiler's reduction
order: the Gluon and the Triton resident kernel then give different bits at 2 heads per group on the
H200, though equal ones at 4."""

# CUDA's grid y (the tiles kernel's query blocks) stops at 65535 blocks.
MAX_QUERY_BLOCKS = 65535


def _launch_tiles(query, weights, summary, start, n_q, out, bounds, cfg, hp, interpret, precision):
    batch, _, groups, heads, dim = query.shape
    regions = summary.shape[1]
    # A program holds whole queries: at least one query's padded heads per block of rows.
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], hp)
    slice_queries = MAX_QUERY_BLOCKS * (cfg["BLOCK_M"] // hp)
    if n_q > slice_queries:
        # Longer calls (above 2M queries at 32 per block) run in slices of queries (the grid's
        # second dimension holds at most MAX_QUERY_BLOCKS), each into its rows of out.
        for q0 in range(0, n_q, slice_queries):
            n = min(slice_queries, n_q - q0)
            part_bounds = None if bounds is None else tuple(b[:, q0 : q0 + n] for b in bounds)
            args = (
                start + q0,
                n,
                out[:, :, q0 : q0 + n],
                part_bounds,
                cfg,
                hp,
                interpret,
                precision,
            )
            _launch_tiles(query, weights, summary, *args)
        return
    first, past, bounds_batch_stride = bound_args(bounds, out)
    grid = (
        triton.cdiv(regions, cfg["BLOCK_R"]),
        triton.cdiv(n_q, cfg["BLOCK_M"] // hp),
        batch * groups,
    )
    _indexer_score_kernel[grid](
        query,
        weights,
        summary,
        out,
        first,
        past,
        start,
        n_q,
        regions,
        dim,
        heads,
        groups,
        *query.stride()[:4],
        *weights.stride(),
        summary.stride(0),
        summary.stride(1),
        bounds_batch_stride,
        *out.stride()[:3],
        HP=hp,
        HAS_BOUNDS=bounds is not None,
        DOT_FP32=interpret,
        PRECISION=precision,
        enable_fp_fusion=FP_FUSION,
        **cfg,
    )


def _programs(query: torch.Tensor, cfg: dict, interpret: bool) -> int:
    """How many programs the resident kernel launches: cfg["PROGRAMS"] (tests) or PER_SM per SM (3 interpreted)."""
    if cfg.get("PROGRAMS") is not None:
        return cfg["PROGRAMS"]
    if interpret:
        return 3
    return sm_count(query.device.index) * cfg.get("PER_SM", 1)


def _launch_resident(
    query, weights, summary, start, n_q, out, bounds, cfg, hp, interpret, precision
) -> bool:
    """Runs the resident kernel, or returns False where TMA cannot address `summary`."""
    batch, _, groups, heads, dim = query.shape
    regions = summary.shape[1]
    block_m = max(cfg["BLOCK_M"], hp)
    block_r = cfg["BLOCK_R"]
    dp = max(16, triton.next_power_of_2(dim))
    n_tiles = batch * groups * triton.cdiv(n_q, block_m // hp) * triton.cdiv(regions, block_r)
    tiles_per_program = triton.cdiv(n_tiles, _programs(query, cfg, interpret))
    desc, batch_rows = _summary_descriptor(summary, block_r, dp)
    if desc is None:
        return False
    first, past, bounds_batch_stride = bound_args(bounds, out)
    _indexer_score_resident_kernel[(triton.cdiv(n_tiles, tiles_per_program),)](
        query,
        weights,
        desc,
        out,
        first,
        past,
        start,
        n_q,
        regions,
        dim,
        heads,
        groups,
        n_tiles,
        tiles_per_program,
        batch_rows,
        *query.stride()[:4],
        *weights.stride(),
        bounds_batch_stride,
        *out.stride()[:3],
        HP=hp,
        BLOCK_M=block_m,
        HAS_BOUNDS=bounds is not None,
        BLOCK_R=block_r,
        DP=dp,
        STAGES=cfg["num_stages"],
        DOT_FP32=interpret,
        PRECISION=precision,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=FP_FUSION,
    )
    return True


def default_config(query: torch.Tensor, summary: torch.Tensor) -> dict:
    """The launch config `indexer_score_tile` runs on these GPU inputs without `_config`:
    GLUON_CONFIG where the Gluon kernel applies, else DEFAULT_CONFIG (for the benchmarks' labels)."""
    return GLUON_CONFIG if _gluon_for(query, summary) is not None else DEFAULT_CONFIG


def _gluon_kernels():
    """`gluon_kernels`, or None where this Triton has no Gluon (or lacks a name it uses)."""
    return gluon_module("sa_kernels.indexer_score.gluon_kernels")


def _gluon_for(query: torch.Tensor, summary: torch.Tensor):
    """`gluon_kernels` where it scores these inputs (`gluon_kernels.applies`), else None."""
    gluon = _gluon_kernels()
    return gluon if gluon is not None and gluon.applies(query, summary) else None


def _resident_runs(query: torch.Tensor, interpret: bool) -> bool:
    """The resident kernel keeps all of D (≤ 256) in one block; on the GPU only 2-byte queries fit its shared memory."""
    return query.shape[-1] <= 256 and (interpret or query.element_size() == 2)


def indexer_score_tile(
    query: torch.Tensor,
    weights: torch.Tensor,
    summary: torch.Tensor,
    start: int,
    stop: int,
    out: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    _config: dict | None = None,
) -> torch.Tensor:
    """Writes `out` [B, G, stop − start, R]; `bounds` = the public `candidate_bounds` (int64 [B, stop − start]
    each, query stride 1) or None. `_config` (e.g. a SWEEP_CONFIGS entry) is for the sweep and tests.

    The GPU runs GLUON_CONFIG (DEFAULT_CONFIG where the Gluon kernel does not apply), the interpreter
    `_INTERPRET_CONFIG`. A "resident" config where that kernel
    cannot run (D > 256; float32 query on the GPU) runs the tiles kernel with `_TILES_CONFIG` (`_INTERPRET_CONFIG`
    when interpreted), and so does one whose summary TMA cannot address (the resident kernel loads summaries
    by TMA only).
    """
    n_q = stop - start
    if out.numel() == 0:
        return out
    hp = triton.next_power_of_2(query.shape[3])
    interpret = triton_interpret()
    precision = "ieee" if query.dtype == torch.float32 or interpret else "tf32"
    if _config is not None:
        cfg = dict(_config)
    elif interpret:
        cfg = dict(_INTERPRET_CONFIG)
    else:
        cfg = dict(GLUON_CONFIG)
    kernel = cfg.pop("KERNEL", "tiles")
    if kernel == "gluon":
        gluon = _gluon_for(query, summary)
        if gluon is not None:
            gluon.indexer_score_tile(
                query, weights, summary, start, n_q, out, bounds, stages=cfg.get("STAGES")
            )
            return out
        cfg = dict(DEFAULT_CONFIG)  # the Triton resident kernel where the Gluon one does not run
        kernel = cfg.pop("KERNEL")
    resident = kernel == "resident" and _resident_runs(query, interpret)
    if resident and _launch_resident(
        query, weights, summary, start, n_q, out, bounds, cfg, hp, interpret, precision
    ):
        return out
    if kernel == "resident":
        cfg = dict(_INTERPRET_CONFIG if interpret else _TILES_CONFIG)
    _launch_tiles(query, weights, summary, start, n_q, out, bounds, cfg, hp, interpret, precision)
    return out
