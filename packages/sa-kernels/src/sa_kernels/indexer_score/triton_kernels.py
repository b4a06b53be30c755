"""The fused scoring kernel: a GEMM whose M rows are (query, head) pairs of one tile and group.

Each program multiplies `BLOCK_M = BLOCK_Q * HP` query-head rows by `BLOCK_R` summaries over D, then applies relu, scales
by the head weights and sums each query's heads in registers before storing `[BLOCK_Q, BLOCK_R]` scores.
`HP` is heads_per_group rounded up to a power of two; padded heads load zeros and weight 0.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import triton_interpret


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
    pid_r = tl.program_id(0)
    pid_q = tl.program_id(1)
    bg = tl.program_id(2)
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
    weighted = tl.maximum(acc, 0.0) * w[:, None]
    score = tl.sum(tl.reshape(weighted, [BLOCK_Q, HP, BLOCK_R]), axis=1)
    oq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    out_rows = out_ptr + ((b * G + g) * n_q + oq.to(tl.int64)) * R
    tl.store(out_rows[:, None] + rs[None, :], score, mask=(oq < n_q)[:, None] & r_ok[None, :])


# One fixed launch config (no autotuning, so the summation order, hence every bit, is the same on every run).
# `bench_indexer_score.py --sweep` times SWEEP_CONFIGS on the H200 and prints the best; it becomes the default.
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_R": 128, "BLOCK_D": 64, "num_warps": 8, "num_stages": 3}
SWEEP_CONFIGS = [
    {"BLOCK_M": m, "BLOCK_R": r, "BLOCK_D": d, "num_warps": w, "num_stages": st}
    for m, r, d, w, st in [
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 2),
        (128, 128, 128, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (256, 128, 64, 8, 4),
        (64, 128, 64, 4, 3),
        (64, 256, 64, 4, 3),
        (64, 256, 64, 8, 4),
        (128, 64, 64, 4, 3),
        (128, 64, 128, 4, 3),
        (256, 64, 64, 8, 3),
        (512, 64, 64, 8, 2),
    ]
]


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
    """Writes `out` [B, G, stop − start, R]. `_config` (a SWEEP_CONFIGS entry) is for the benchmark sweep."""
    batch, _, groups, heads, dim = query.shape
    regions = summary.shape[1]
    n_q = stop - start
    if out.numel() == 0:
        return out
    hp = triton.next_power_of_2(heads)
    interpret = triton_interpret()
    precision = "ieee" if query.dtype == torch.float32 or interpret else "tf32"
    if _config is not None:
        cfg = dict(_config)
    elif interpret:
        cfg = {"BLOCK_M": 32, "BLOCK_R": 32, "BLOCK_D": 32, "num_warps": 4, "num_stages": 1}
    else:
        cfg = dict(DEFAULT_CONFIG)
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
    return out
