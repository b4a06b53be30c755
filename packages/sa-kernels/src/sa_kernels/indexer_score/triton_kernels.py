"""The fused scoring kernels: a GEMM whose M rows are (query, head) pairs of one tile and group.

Each output tile multiplies `BLOCK_M = BLOCK_Q * HP` query-head rows by `BLOCK_R` summaries over D, then applies relu,
scales by the head weights and sums each query's heads in registers before storing `[BLOCK_Q, BLOCK_R]` scores.
`HP` is heads_per_group rounded up to a power of two; padded heads load zeros and weight 0.

Three kernels, picked by the launch config's "KERNEL" entry (never by autotuning):
- "tiles": one program per output tile, D walked in `BLOCK_D` steps; both operands reloaded for every tile.
- "persistent": the same tile code in a grid-stride loop over the tiles on a multiple of the SM count, optionally
  with the tile and D loops flattened into one software pipeline (next tile's loads during this tile's epilogue).
- "resident": a fixed number of programs (a multiple of the SM count), each walking a contiguous run of tiles in
  (batch·group, query block, region block) order. A program loads its `[BLOCK_M, D]` query rows once per query
  block and streams only the summaries (through a Hopper TMA descriptor when "TMA" is set and the strides allow it;
  "TMA_STORE" also writes the scores through one where R is a multiple of 4):
  at BLOCK_M 128 it reads half the bytes per FLOP of "tiles". One dot over all of D (padded to a power of two, at
  most 256; 2-byte queries on the GPU): the products are accumulated in the same k order as "tiles", and the
  epilogue is the same code.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import triton_interpret

try:  # Triton >= 3.4: host-side TMA descriptors (also run by the interpreter)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer path only
    TensorDescriptor = None


@triton.jit
def _weighted_head_sum(acc, w, HP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr):
    """`[BLOCK_Q * HP, BLOCK_R]` dot products → `[BLOCK_Q, BLOCK_R]` `Σ_h w · relu(dot)` in FP32."""
    weighted = tl.maximum(acc, 0.0) * w[:, None]
    return tl.sum(tl.reshape(weighted, [BLOCK_Q, HP, BLOCK_R]), axis=1)


@triton.jit
def _weighted_head_sum_store(
    acc,
    w,
    rs,
    r_ok,
    out_ptr,
    b,
    g,
    pid_q,
    n_q,
    R,
    G,
    HP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """relu, head weights, sum over each query's HP rows, store `[BLOCK_Q, BLOCK_R]` FP32 scores."""
    score = _weighted_head_sum(acc, w, HP, BLOCK_Q, BLOCK_R)
    oq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    out_rows = out_ptr + ((b * G + g) * n_q + oq.to(tl.int64)) * R
    tl.store(out_rows[:, None] + rs[None, :], score, mask=(oq < n_q)[:, None] & r_ok[None, :])


@triton.jit
def _score_tile(
    q_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    pid_r,
    pid_q,
    bg,
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
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One `[BLOCK_Q, BLOCK_R]` output tile, D walked in BLOCK_D steps (the "tiles" and "persistent" kernels)."""
    b = (bg // G).to(tl.int64)
    g = (bg % G).to(tl.int64)
    BLOCK_Q: tl.constexpr = BLOCK_M // HP
    m = tl.arange(0, BLOCK_M)
    qi = pid_q * BLOCK_Q + m // HP
    h = m % HP
    row_ok = (qi < n_q) & (h < H)
    q_pos = (start + qi).to(tl.int64)
    q_rows = q_ptr + b * sq_b + q_pos * sq_q + g * sq_g + h * sq_h
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
    _weighted_head_sum_store(
        acc, w, rs, r_ok, out_ptr, b, g, pid_q, n_q, R, G, HP, BLOCK_Q, BLOCK_R
    )


@triton.jit
def _indexer_score_kernel(
    q_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
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
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    _score_tile(
        q_ptr, w_ptr, s_ptr, out_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2),
        start, n_q, R, D, H, G, sq_b, sq_q, sq_g, sq_h, sw_b, sw_q, sw_g, sw_h, ss_b, ss_r,
        HP, BLOCK_M, BLOCK_R, BLOCK_D, DOT_FP32, PRECISION,
    )  # fmt: skip


@triton.jit(do_not_specialize=["start", "n_tiles", "programs"])
def _indexer_score_persistent_kernel(
    q_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    start,
    n_q,
    R,
    D,
    H,
    G,
    n_tiles,
    programs,
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
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FLATTEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # The tiles kernel's body over a grid-stride loop of tiles (region block fastest); with FLATTEN the compiler
    # fuses the tile and D loops into one software pipeline, so the next tile's loads overlap this tile's epilogue.
    n_r = tl.cdiv(R, BLOCK_R)
    n_m = tl.cdiv(n_q, BLOCK_M // HP)
    for t in tl.range(tl.program_id(0), n_tiles, programs, flatten=FLATTEN):
        row = t // n_r
        _score_tile(
            q_ptr, w_ptr, s_ptr, out_ptr, t % n_r, row % n_m, row // n_m,
            start, n_q, R, D, H, G, sq_b, sq_q, sq_g, sq_h, sw_b, sw_q, sw_g, sw_h, ss_b, ss_r,
            HP, BLOCK_M, BLOCK_R, BLOCK_D, DOT_FP32, PRECISION,
        )  # fmt: skip


@triton.jit(do_not_specialize=["start", "n_tiles", "tiles_per_program", "s_batch_rows"])
def _indexer_score_resident_kernel(
    q_ptr,
    w_ptr,
    s_ptr,
    s_desc,
    out_ptr,
    out_desc,
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
    ss_b,
    ss_r,
    HP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DP: tl.constexpr,
    TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // HP
    n_r = tl.cdiv(R, BLOCK_R)
    n_m = tl.cdiv(n_q, BLOCK_Q)
    t = tl.program_id(0) * tiles_per_program
    t_end = tl.minimum(t + tiles_per_program, n_tiles)
    m = tl.arange(0, BLOCK_M)
    h = m % HP
    d = tl.arange(0, DP)
    d_ok = d < D
    # One segment per (batch·group, query block) this program's run of tiles touches: load the query rows and
    # weights once, then stream the segment's region blocks.
    while t < t_end:
        row = t // n_r
        r_lo = t - row * n_r
        r_hi = tl.minimum(n_r, r_lo + (t_end - t))
        pid_q = row % n_m
        bg = row // n_m
        b = (bg // G).to(tl.int64)
        g = (bg % G).to(tl.int64)
        qi = pid_q * BLOCK_Q + m // HP
        row_ok = (qi < n_q) & (h < H)
        q_pos = (start + qi).to(tl.int64)
        q_rows = q_ptr + b * sq_b + q_pos * sq_q + g * sq_g + h * sq_h
        qt = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            qt = qt.to(tl.float32)
        w = tl.load(w_ptr + b * sw_b + q_pos * sw_q + g * sw_g + h * sw_h, mask=row_ok, other=0.0)
        s_row0 = (b * s_batch_rows).to(tl.int32)
        for pid_r in tl.range(r_lo, r_hi, num_stages=STAGES):
            rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
            r_ok = rs < R
            if TMA:
                # Rows past R (the next batch row or TMA's zero fill) only reach masked-out columns.
                st = s_desc.load([s_row0 + pid_r * BLOCK_R, 0])
            else:
                s_rows = s_ptr + b * ss_b + rs.to(tl.int64) * ss_r
                st = tl.load(
                    s_rows[:, None] + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0
                )
            if DOT_FP32:
                st = st.to(tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            acc = tl.dot(qt, tl.trans(st), acc, input_precision=PRECISION)
            if TMA_STORE:
                # out viewed as [B·G, n_q, R]: the descriptor clips query rows past n_q and regions past R.
                score = _weighted_head_sum(acc, w, HP, BLOCK_Q, BLOCK_R)
                out_desc.store(
                    [bg, pid_q * BLOCK_Q, pid_r * BLOCK_R], tl.reshape(score, [1, BLOCK_Q, BLOCK_R])
                )
            else:
                _weighted_head_sum_store(
                    acc, w, rs, r_ok, out_ptr, b, g, pid_q, n_q, R, G, HP, BLOCK_Q, BLOCK_R
                )
        t += r_hi - r_lo


# One fixed launch config (no autotuning, so the summation order, hence every bit, is the same on every run).
# `bench_indexer_score.py --sweep` times SWEEP_CONFIGS on the H200 and prints the best; it becomes the default.
# A config without "KERNEL" is a "tiles" config.
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_R": 128, "BLOCK_D": 64, "num_warps": 8, "num_stages": 3}
# What a "resident" config falls back to where that kernel cannot run (D > 256, or 4-byte query on the GPU).
_TILES_FALLBACK = dict(DEFAULT_CONFIG)
_INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_R": 32, "BLOCK_D": 32, "num_warps": 4, "num_stages": 1}
_TILES_SWEEP = [
    {"BLOCK_M": m, "BLOCK_R": r, "BLOCK_D": d, "num_warps": w, "num_stages": st}
    for m, r, d, w, st in [
        (128, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 2),
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (64, 256, 64, 4, 3),
        (128, 64, 64, 4, 3),
        (256, 64, 64, 8, 3),
    ]
]
# Resident configs: shared memory holds the query rows ([BLOCK_M, 256] bf16: 64 KiB at BLOCK_M 128) and
# `num_stages` summary blocks of [BLOCK_R, 256] (64 KiB at BLOCK_R 128). "PER_SM" 2 only where two programs fit
# one SM's 227 KiB and 64K registers (Triton 3.9 for sm_90a: 96–100 KiB and ≤ 128 registers at 128 × 64 × 1 stage,
# 128 × 32 × 2, 64 × 128 × 1), so that one program's epilogue overlaps the other's tensor-core work.
# Summary bytes read per FLOP: half the tiles kernel's at BLOCK_M 128, a quarter at 256, the same at 64.
_RESIDENT_SWEEP = [
    {
        "KERNEL": "resident",
        "BLOCK_M": m,
        "BLOCK_R": r,
        "TMA": tma,
        "TMA_STORE": store,
        "PER_SM": per_sm,
        "num_warps": w,
        "num_stages": st,
    }
    for m, r, tma, store, per_sm, w, st in [
        (128, 128, False, False, 1, 8, 2),
        (128, 128, True, False, 1, 8, 2),
        (128, 128, True, True, 1, 8, 2),
        (128, 64, True, False, 1, 8, 3),
        (128, 64, True, False, 1, 8, 4),
        (128, 64, True, False, 2, 8, 1),
        (128, 64, True, True, 2, 8, 1),
        (128, 32, True, False, 2, 8, 2),
        (128, 32, True, True, 2, 8, 2),
        (256, 64, True, False, 1, 8, 2),
        (64, 128, True, False, 2, 4, 1),
    ]
]
# Persistent configs: the tiles kernel's shared memory per program. Two 8-warp programs share an SM only at
# ≤ 128 registers a thread: the grid-stride loop takes 170–184 (Triton 3.9, sm_90a), so "PER_SM" 2 configs cap
# it with "maxnreg" 128 (no spills there at 128 × 128 × 64).
_PERSISTENT_SWEEP = [
    {
        "KERNEL": "persistent",
        "BLOCK_M": m,
        "BLOCK_R": r,
        "BLOCK_D": d,
        "FLATTEN": flatten,
        "PER_SM": per_sm,
        "num_warps": w,
        "num_stages": st,
        **({"maxnreg": 128} if per_sm == 2 else {}),
    }
    for m, r, d, flatten, per_sm, w, st in [
        (128, 128, 64, True, 2, 8, 3),
        (128, 128, 64, False, 2, 8, 3),
        (128, 128, 64, True, 1, 8, 4),
        (128, 256, 64, True, 1, 8, 3),
    ]
]
SWEEP_CONFIGS = _TILES_SWEEP + _RESIDENT_SWEEP + _PERSISTENT_SWEEP


def _summary_descriptor(summary: torch.Tensor, block_r: int, dp: int):
    """A 2-D TMA descriptor over summary's rows ([(B − 1)·batch_rows + R, D]) and the batch's row offset,
    or (None, 0) where TMA cannot address it (16-byte alignment of base and row stride, uniform batch stride)."""
    batch, regions, dim = summary.shape
    ss_b, ss_r, _ = summary.stride()
    esz = summary.element_size()
    if (
        TensorDescriptor is None
        or summary.data_ptr() % 16
        or ss_r < dim
        or (ss_r * esz) % 16
        or dim * esz < 16
        or (batch > 1 and (ss_b <= 0 or ss_b % ss_r))
    ):
        return None, 0
    batch_rows = ss_b // ss_r if batch > 1 else 0
    rows = (batch - 1) * batch_rows + regions
    return TensorDescriptor(summary, [rows, dim], [ss_r, 1], [block_r, dp]), batch_rows


def _out_descriptor(out: torch.Tensor, block_q: int, block_r: int):
    """A 3-D TMA descriptor over out as [B·G, n_q, R], or None where R·4 bytes is not a multiple of 16."""
    batch, groups, n_q, regions = out.shape
    if TensorDescriptor is None or out.data_ptr() % 16 or regions % 4:
        return None
    return TensorDescriptor(
        out, [batch * groups, n_q, regions], [n_q * regions, regions, 1], [1, block_q, block_r]
    )


def _launch_tiles(query, weights, summary, start, n_q, out, cfg, hp, interpret, precision):
    batch, _, groups, heads, dim = query.shape
    regions = summary.shape[1]
    # A program holds whole queries: at least one query's padded heads per block of rows.
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], hp)
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
        HP=hp,
        DOT_FP32=interpret,
        PRECISION=precision,
        **cfg,
    )


def _launch_resident(query, weights, summary, start, n_q, out, cfg, hp, interpret, precision):
    batch, _, groups, heads, dim = query.shape
    regions = summary.shape[1]
    block_m = max(cfg["BLOCK_M"], hp)
    block_r = cfg["BLOCK_R"]
    dp = max(16, triton.next_power_of_2(dim))
    n_tiles = batch * groups * triton.cdiv(n_q, block_m // hp) * triton.cdiv(regions, block_r)
    tiles_per_program = triton.cdiv(n_tiles, _programs(query, cfg, interpret))
    desc, batch_rows = (None, 0)
    if cfg.get("TMA", False):
        desc, batch_rows = _summary_descriptor(summary, block_r, dp)
    out_desc = None
    if cfg.get("TMA_STORE", False):
        out_desc = _out_descriptor(out, block_m // hp, block_r)
    _indexer_score_resident_kernel[(triton.cdiv(n_tiles, tiles_per_program),)](
        query,
        weights,
        summary,
        desc,
        out,
        out_desc,
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
        summary.stride(0),
        summary.stride(1),
        HP=hp,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        DP=dp,
        TMA=desc is not None,
        TMA_STORE=out_desc is not None,
        STAGES=cfg["num_stages"],
        DOT_FP32=interpret,
        PRECISION=precision,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _programs(query: torch.Tensor, cfg: dict, interpret: bool) -> int:
    """How many programs a persistent kernel launches: cfg["PROGRAMS"] (tests) or PER_SM per SM (3 when interpreted)."""
    if cfg.get("PROGRAMS") is not None:
        return cfg["PROGRAMS"]
    if interpret:
        return 3
    return torch.cuda.get_device_properties(query.device).multi_processor_count * cfg.get(
        "PER_SM", 1
    )


def _launch_persistent(query, weights, summary, start, n_q, out, cfg, hp, interpret, precision):
    batch, _, groups, heads, dim = query.shape
    regions = summary.shape[1]
    block_m = max(cfg["BLOCK_M"], hp)
    n_tiles = (
        batch * groups * triton.cdiv(n_q, block_m // hp) * triton.cdiv(regions, cfg["BLOCK_R"])
    )
    programs = min(n_tiles, _programs(query, cfg, interpret))
    _indexer_score_persistent_kernel[(programs,)](
        query,
        weights,
        summary,
        out,
        start,
        n_q,
        regions,
        dim,
        heads,
        groups,
        n_tiles,
        programs,
        *query.stride()[:4],
        *weights.stride(),
        summary.stride(0),
        summary.stride(1),
        HP=hp,
        BLOCK_M=block_m,
        BLOCK_R=cfg["BLOCK_R"],
        BLOCK_D=cfg["BLOCK_D"],
        FLATTEN=cfg.get("FLATTEN", False),
        DOT_FP32=interpret,
        PRECISION=precision,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg and not interpret else {}),
    )


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
    *,
    _config: dict | None = None,
) -> torch.Tensor:
    """Writes `out` [B, G, stop − start, R]. `_config` (a SWEEP_CONFIGS entry) is for the benchmark sweep.

    A "resident" config where that kernel cannot run (D > 256; float32 query on the GPU) runs the tiles kernel
    with `_TILES_FALLBACK`; "TMA" where the summary's strides do not allow it loads through pointers, and
    "TMA_STORE" where R is not a multiple of 4 stores through pointers.
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
        cfg = dict(DEFAULT_CONFIG)
    kernel = cfg.pop("KERNEL", "tiles")
    if kernel == "persistent":
        _launch_persistent(query, weights, summary, start, n_q, out, cfg, hp, interpret, precision)
        return out
    if kernel == "resident" and _resident_runs(query, interpret):
        _launch_resident(query, weights, summary, start, n_q, out, cfg, hp, interpret, precision)
        return out
    if kernel == "resident":
        cfg = dict(_INTERPRET_CONFIG if interpret else _TILES_FALLBACK)
    _launch_tiles(query, weights, summary, start, n_q, out, cfg, hp, interpret, precision)
    return out
