"""Sparse MLA backward in Triton: per chunk of tokens, the chunk's ids sorted (each row's valid ids
ascending, padded with `keys`; the count of valid ids is the row's length: `ascending_valid_ids`)
and two kernels.

1. dq: delta = rowsum(dO * O) for its head block (also stored, for the sink gradient); recomputes
   the scores from the saved lse (log2 domain, sink included) and dP, forms
   ds = p * (dP - delta) * scale and adds ds · k to the head block's dq rows, kept in registers
   (3 MMAs per slot). It also writes p and ds to two buffers [tokens, width, heads] in q's dtype,
   which is what the MMAs read anyway.
2. dkv[id] += ds^T q + p^T dO (2 MMAs) from those buffers, added with FP32 atomics (a key may be named
   by many queries, and twice by one query); all head dims in one launch, so a token's rope dims
   read its ds tile from L2 next to its value dims (their p dot, against zero dO columns, adds
   nothing: one MMA in 18 at D 576 that the FLOP count does not include).
Five MMAs in all, as the FLOP count assumes (recomputing the scores and dP in the dkv kernel would
take seven). The buffers hold at most SCORE_BUFFER_BYTES, so long inputs run in chunks of tokens, on
two streams. The H200 figures are in docs/results/sparse_mla.json.
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .triton_chain_break import chain_break
from .triton_launch import LOG2E, VALUE_DIM, LaunchConfig, _launch, dkv_configs, dq_configs
from .triton_sorted_ids import ascending_valid_ids


@triton.jit
def _sparse_mla_delta_kernel(OUT, DOUT, DELTA, rows, DV: tl.constexpr, BLOCK_R: tl.constexpr):
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < rows
    offs_v = tl.arange(0, DV)
    o = tl.load(OUT + offs_r[:, None] * DV + offs_v[None, :], mask=rmask[:, None], other=0.0).to(
        tl.float32
    )
    do = tl.load(DOUT + offs_r[:, None] * DV + offs_v[None, :], mask=rmask[:, None], other=0.0).to(
        tl.float32
    )
    tl.store(DELTA + offs_r, tl.sum(o * do, axis=1), mask=rmask)


@triton.jit
def _head_rows(ptr, t, stride_t, offs_h, stride_h, offs_d, rows_ok, cols_ok, UPCAST: tl.constexpr):
    """Token t's rows offs_h, columns offs_d ([BLOCK_H, len(offs_d)]; zeros outside rows_ok x
    cols_ok), widened to FP32 under UPCAST."""
    rows = tl.load(
        ptr + t * stride_t + offs_h[:, None].to(tl.int64) * stride_h + offs_d[None, :],
        mask=rows_ok[:, None] & cols_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        rows = rows.to(tl.float32)
    return rows


@triton.jit
def _load_query_block(
    Q,
    DOUT,
    OUT,
    LSE2,
    DELTA,
    t,
    hb,
    stride_qt,
    stride_qh,
    stride_dot,
    stride_doh,
    stride_ot,
    stride_oh,
    heads,
    BLOCK_H: tl.constexpr,
    DV: tl.constexpr,
    D_ROPE: tl.constexpr,
    DR: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The head block's q (value and rope columns), dO and log2-domain lse; and its delta =
    rowsum(dO * O) (FP32), which it also stores to DELTA for the sink gradient."""
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    offs_v = tl.arange(0, DV)
    every_v = offs_v < DV  # all true: `_head_rows` takes a column mask
    q_nope = _head_rows(Q, t, stride_qt, offs_h, stride_qh, offs_v, hmask, every_v, UPCAST)
    rope = tl.arange(0, DR)  # columns DV + rope
    q_rope = _head_rows(Q + DV, t, stride_qt, offs_h, stride_qh, rope, hmask, rope < D_ROPE, UPCAST)
    do = _head_rows(DOUT, t, stride_dot, offs_h, stride_doh, offs_v, hmask, every_v, UPCAST)
    out = _head_rows(OUT, t, stride_ot, offs_h, stride_oh, offs_v, hmask, every_v, UPCAST)
    delta = tl.sum(out.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + t * heads + offs_h, delta, mask=hmask)
    # lse2: log2-domain lse including the sink, +inf for rows with no valid slot (their p is then 0).
    lse2 = tl.load(LSE2 + t * heads + offs_h, mask=hmask, other=float("inf"))
    return offs_h, hmask, q_nope, q_rope, do, lse2, delta


@triton.jit
def _slot_length(LENGTHS, local_t, empty):
    """The slots to walk: the row's count of valid ids (they lead the sorted row); 0 where `empty`."""
    return tl.where(empty, 0, tl.load(LENGTHS + local_t))


@triton.jit
def _token_is_empty(LSE2, t, heads, BLOCK_H: tl.constexpr):
    """Whether no head of token t has a valid slot (every lse2 is +inf)."""
    lowest = float("inf")
    for h0 in range(0, heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        lse2 = tl.load(LSE2 + t * heads + offs_h, mask=offs_h < heads, other=float("inf"))
        lowest = tl.minimum(lowest, tl.min(lse2, axis=0))
    return lowest == float("inf")


@triton.jit
def _sparse_mla_bwd_dq_kernel(
    Q,
    KV,
    IDX,
    LENGTHS,
    DOUT,
    OUT,
    LSE2,
    DELTA,
    DQ,
    P,
    DS,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_dot,
    stride_doh,
    stride_ot,
    stride_oh,
    stride_dqt,
    stride_dqh,
    stride_pt,
    t0,
    heads,
    keys,
    scale,
    scale_log2,
    D_ROPE: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    UNCHAIN: tl.constexpr,
):
    """dq[t, h] = sum_j ds_j k_j with ds_j = scale * p_j (dO . v_j - delta) over the token's valid
    slots, for one token (from t0) and one head block, whose whole dq rows stay in
    registers. Also writes p and ds (in P's dtype) to P/DS[t − t0, slot, head] for the `length`
    slots of the token's sorted row (all of them valid ids), for the dkv kernel (nothing for a token
    whose heads are all empty), and DELTA[t, head] for every token, empty ones included (the sink
    gradient reads it).
    """
    hb = tl.program_id(0) % tl.cdiv(heads, BLOCK_H)  # 1-D grid, as in the forward kernel
    t = t0 + (tl.program_id(0) // tl.cdiv(heads, BLOCK_H)).to(tl.int64)
    offs_h, hmask, q_nope, q_rope, do, lse2, delta = _load_query_block(
        Q,
        DOUT,
        OUT,
        LSE2,
        DELTA,
        t,
        hb,
        stride_qt,
        stride_qh,
        stride_dot,
        stride_doh,
        stride_ot,
        stride_oh,
        heads,
        BLOCK_H,
        DV,
        D_ROPE,
        DR,
        UPCAST,
    )
    # A head block whose heads are all empty still writes its p and ds (zeros: lse2 is +inf) when
    # other heads of the token are not, as the dkv kernel's head blocks may be larger and read them.
    length = _slot_length(LENGTHS, t - t0, _token_is_empty(LSE2, t, heads, BLOCK_H))
    offs_v = tl.arange(0, DV)
    offs_r = DV + tl.arange(0, DR)
    idx_row = IDX + (t - t0) * stride_it
    # This token's [width, heads] tiles of P and DS; 32-bit offsets within them.
    p_tile = P + (t - t0) * stride_pt
    ds_tile = DS + (t - t0) * stride_pt
    dq_nope = tl.zeros([BLOCK_H, DV], tl.float32)
    dq_rope = tl.zeros([BLOCK_H, DR], tl.float32)
    # Each block's ids are loaded one block ahead, so the key gather need not wait for them (H200:
    # the dq kernel 13.88 ms at the goal's shape, 14.40 with the ids loaded in the block).
    next_ids = tl.load(
        idx_row + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < length, other=-1
    )
    for start in range(0, length, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        ids = next_ids
        following = slots + BLOCK_K
        next_ids = tl.load(idx_row + following, mask=following < length, other=-1)
        # The sorted rows hold only valid ids below `length`; the id tests are a guard for callers
        # of the kernels who pass unsorted rows.
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        kv_row = KV + ids.to(tl.int64) * stride_kvt
        k_nope = tl.load(kv_row[:, None] + offs_v[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            k_nope = k_nope.to(tl.float32)
        # Scores transposed ([slots, heads]): q and dO are the MMAs' shared-memory B operands, and
        # the tiles are already in the layout of P and DS. The rope dot has its own accumulator, as
        # in the forward kernel.
        st = tl.dot(k_nope, tl.trans(q_nope)) * scale_log2
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            st += tl.dot(k_rope, tl.trans(q_rope)) * scale_log2
        pt = tl.exp2(st - lse2[None, :])
        pt = tl.where(valid[:, None], pt, 0.0)
        dpt = tl.dot(k_nope, tl.trans(do))
        dst = (pt * (dpt - delta[None, :]) * scale).to(P.dtype.element_ty)
        # The scores and dP reach the dq dots through ds only (see `chain_break`).
        dst = chain_break(dst, start < length, UNCHAIN)
        at = slots[:, None] * heads + offs_h[None, :]
        written = (slots < length)[:, None] & hmask[None, :]
        tl.store(p_tile + at, pt.to(P.dtype.element_ty), mask=written)
        tl.store(ds_tile + at, dst, mask=written)
        ds = tl.trans(dst.to(k_nope.dtype))
        dq_nope += tl.dot(ds, k_nope)
        if D_ROPE > 0:
            dq_rope += tl.dot(ds, k_rope)
    dq_row = DQ + t * stride_dqt + offs_h[:, None].to(tl.int64) * stride_dqh
    tl.store(dq_row + offs_v[None, :], dq_nope.to(DQ.dtype.element_ty), mask=hmask[:, None])
    if D_ROPE > 0:
        tl.store(dq_row + offs_r[None, :], dq_rope.to(DQ.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _sparse_mla_bwd_dkv_kernel(
    Q,
    DOUT,
    IDX,
    LENGTHS,
    LSE2,
    P,
    DS,
    DKV,
    stride_qt,
    stride_qh,
    stride_it,
    stride_dot,
    stride_doh,
    stride_pt,
    stride_dkvt,
    t0,
    heads,
    keys,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOT_CHUNK: tl.constexpr,
    UPCAST: tl.constexpr,
    UNCHAIN: tl.constexpr,
):
    """dkv[id_j, d] += ds_j^T q[:, d] + p_j^T dO[:, d] (the second term for the DV value dims only)
    for the BLOCK_D dims d_block * BLOCK_D + [0, BLOCK_D) of the D head dims, added atomically per
    slot (FP32), for one head block of one token (from t0) and one range of SLOT_CHUNK slots (0: the
    whole row). The block's q and dO columns are loaded once and stay in shared memory as the B
    operands; the slot blocks' p and ds tiles stream through (the dim blocks of one token and head
    block, rope dims included, are neighbours in the grid, so they find those tiles in L2)."""
    # Grid x: a token's dim blocks, then its head blocks, next to each other (tokens never on y or
    # z, which stop at 65535); grid y, launched last: the slot ranges.
    dim_blocks = tl.cdiv(D, BLOCK_D)
    d_block = tl.program_id(0) % dim_blocks
    rest = tl.program_id(0) // dim_blocks
    hb = rest % tl.cdiv(heads, BLOCK_H)
    t = t0 + (rest // tl.cdiv(heads, BLOCK_H)).to(tl.int64)
    slot_range = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    in_dims = offs_d < D
    q_part = _head_rows(Q, t, stride_qt, offs_h, stride_qh, offs_d, hmask, in_dims, UPCAST)
    # dO has DV columns: zeros in the rope dims, where the p dot then adds nothing (masking off a
    # rope block's p loads as well is slower on the H200: 12.02 ms of dkv kernel against 11.59).
    do_part = _head_rows(
        DOUT, t, stride_dot, offs_h, stride_doh, offs_d, hmask, offs_d < DV, UPCAST
    )
    lse2 = tl.load(LSE2 + t * heads + offs_h, mask=hmask, other=float("inf"))
    length = _slot_length(LENGTHS, t - t0, tl.min(lse2, axis=0) == float("inf"))
    idx_row = IDX + (t - t0) * stride_it
    # This token's [width, heads] tiles of P and DS; 32-bit offsets within them.
    p_tile = P + (t - t0) * stride_pt
    ds_tile = DS + (t - t0) * stride_pt
    first = 0
    end = length
    if SLOT_CHUNK > 0:
        first = slot_range * SLOT_CHUNK
        end = tl.minimum(length, first + SLOT_CHUNK)
    for start in range(first, end, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        at = slots[:, None] * heads + offs_h[None, :]
        written = (slots < length)[:, None] & hmask[None, :]
        ds_t = tl.load(ds_tile + at, mask=written, other=0.0)
        p_t = tl.load(p_tile + at, mask=written, other=0.0)
        if UPCAST:
            ds_t = ds_t.to(tl.float32)
            p_t = p_t.to(tl.float32)
        # This dot's result is the next one's accumulator: not a chain (see `chain_break`).
        dkv = chain_break(tl.dot(ds_t, q_part), start < length, UNCHAIN)
        dkv = tl.dot(p_t, do_part, dkv)
        dkv_row = DKV + ids.to(tl.int64) * stride_dkvt
        tl.atomic_add(
            dkv_row[:, None] + offs_d[None, :],
            dkv,
            mask=valid[:, None] & in_dims[None, :],
            sem="relaxed",
        )


def sparse_mla_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """FP32 [T, H]: sum over the 512 value dims of dout * out (both contiguous [T, H, 512]). For the
    fused cuDNN path's sink gradient (`canonical.row_dot`); this backward computes it in its dq
    kernel."""
    tokens, heads, _ = out.shape
    delta = torch.empty(tokens, heads, dtype=torch.float32, device=out.device)
    rows = tokens * heads
    if rows == 0:
        return delta
    block_r = 16
    _sparse_mla_delta_kernel[(triton.cdiv(rows, block_r),)](
        out, dout, delta, rows, DV=VALUE_DIM, BLOCK_R=block_r
    )
    return delta


def _dkv_launch_config(config: LaunchConfig, dims: int, width: int) -> LaunchConfig:
    """`config` for a dkv launch over `dims` dims of rows `width` slots wide: block_d the config's (64
    where it names none), at most the power of two that covers `dims` (the kernel masks the dims
    beyond); slot ranges widened, in whole slot blocks, until at most 65535 of them cover the row
    (CUDA's limit on grid y); none for an empty row."""
    block_d = min(config.block_d or 64, triton.next_power_of_2(dims))
    slot_chunk = config.slot_chunk
    if slot_chunk is not None:
        fewest = triton.cdiv(triton.cdiv(width, 65535), config.block_k) * config.block_k
        slot_chunk = max(slot_chunk, fewest) if width > 0 else None
    return replace(config, block_d=block_d, slot_chunk=slot_chunk)


# The p and ds buffers ([tokens, width, heads] each, in q's dtype) hold at most this many bytes
# together, split between two lanes of token chunks (512 tokens per chunk at width 2048, 128 heads,
# bf16); longer inputs run in several chunks.
SCORE_BUFFER_BYTES = 1 << 30

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device, caller: torch.cuda.Stream) -> torch.cuda.Stream:
    """A second stream on `device`, other than `caller`'s. Kept from call to call: the chunk
    temporaries allocated on it go back to its own pool of the caching allocator, where the next
    call finds them. (torch hands out streams from a pool of 32 in turn, so the one kept may be the
    caller's own: then the next one is drawn.)"""
    if device not in _SIDE_STREAMS or _SIDE_STREAMS[device] == caller:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def sparse_mla_backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    ids: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse_total: torch.Tensor,
    dq_config: LaunchConfig | None = None,
    dkv_config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq [T, H, D] q.dtype, dkv [T_kv, D] fp32, delta [T, H] fp32 = rowsum(dO * O)).

    q [T, H, D], kv [T_kv, D], dout and out [T, H, 512] (unit last stride), ids [T, W] int,
    topk_length [T] int or None; lse_total [T, H] fp32 is the natural-log lse including the sink
    (+inf for empty rows). The configs (tests and sweeps) replace the launch lists of
    `triton_launch`.

    Token chunks alternate between two lanes, each with its own p/ds buffers and, on CUDA, its own
    stream (the caller's and a second one), so one chunk's dkv kernel fills the tail of the other
    chunk's dq wave instead of leaving SMs idle at every kernel boundary.
    """
    tokens, heads, head_dim = q.shape
    width = ids.shape[1]
    dkv_base = [dkv_config] if dkv_config is not None else dkv_configs(heads)
    flags = (heads, head_dim, q.dtype)
    work = _Backward(
        q=q,
        kv=kv,
        ids=ids,
        softmax_scale=float(softmax_scale),
        topk_length=topk_length,
        dout=dout,
        out=out,
        lse2=(lse_total * LOG2E).contiguous(),
        dq=torch.empty_like(q),
        dkv=torch.zeros(kv.shape, dtype=torch.float32, device=kv.device),
        delta=torch.empty(tokens, heads, dtype=torch.float32, device=q.device),
        dq_configs=[dq_config] if dq_config is not None else dq_configs(heads),
        dq_key=None if dq_config is not None else ("dq", *flags),
        dkv_configs=[_dkv_launch_config(c, head_dim, width) for c in dkv_base],
        dkv_key=None if dkv_config is not None else ("dkv", *flags),
    )
    if tokens == 0:
        return work.dq, work.dkv, work.delta
    token_bytes = 2 * width * heads * q.element_size()
    # At most 2**20 tokens per chunk keeps the grids' x axes (at most 9 dim blocks per head block
    # and token) far below CUDA's 2**31 - 1 programs; the dkv grid's y axis (slot ranges) is kept
    # within 65535 by `_dkv_launch_config`.
    chunk = max(1, min(tokens, SCORE_BUFFER_BYTES // 2 // max(1, token_bytes), 1 << 20))
    starts = range(0, tokens, chunk)
    buffers = []
    for _ in range(min(2, len(starts))):
        p = torch.empty(chunk, width, heads, dtype=q.dtype, device=q.device)
        buffers.append((p, torch.empty_like(p)))
    streams = [None] * len(buffers)
    if q.is_cuda and len(buffers) == 2:
        caller = torch.cuda.current_stream(q.device)
        streams = [caller, _side_stream(q.device, caller)]
        streams[1].wait_stream(caller)
    try:
        for i, t0 in enumerate(starts):
            lane = i % len(buffers)
            with torch.cuda.stream(streams[lane]):
                work.run_chunk(t0, min(chunk, tokens - t0), *buffers[lane])
    finally:
        # Joined even when a launch raises: the buffers (from the caller's pool) must not be
        # handed out again while the second stream may still use them.
        if streams[0] is not None:
            streams[0].wait_stream(streams[1])
    return work.dq, work.dkv, work.delta


@dataclass(frozen=True)
class _Backward:
    """What every token chunk of one backward shares: its inputs, its outputs (dq, dkv and delta,
    written chunk by chunk) and the launch lists."""

    q: torch.Tensor
    kv: torch.Tensor
    ids: torch.Tensor
    softmax_scale: float
    topk_length: torch.Tensor | None
    dout: torch.Tensor
    out: torch.Tensor
    lse2: torch.Tensor  # log2-domain lse_total
    dq: torch.Tensor
    dkv: torch.Tensor
    delta: torch.Tensor
    dq_configs: list[LaunchConfig]
    dq_key: tuple | None
    dkv_configs: list[LaunchConfig]
    dkv_key: tuple | None

    def run_chunk(self, t0: int, n: int, p: torch.Tensor, ds: torch.Tensor) -> None:
        """Tokens [t0, t0 + n), on the current stream: their ids sorted, then the dq kernel (writing
        p, ds and delta) and the dkv kernel."""
        q, kv, dout, out = self.q, self.kv, self.dout, self.out
        heads, head_dim = q.shape[1:]
        width = self.ids.shape[1]
        topk_length = None if self.topk_length is None else self.topk_length[t0 : t0 + n]
        chunk_ids, lengths = ascending_valid_ids(self.ids[t0 : t0 + n], kv.shape[0], topk_length)
        stride_pt = width * heads
        _launch(
            _sparse_mla_bwd_dq_kernel,
            self.dq_key,
            self.dq_configs,
            lambda c: (triton.cdiv(heads, c.block_h) * n,),
            q,
            kv,
            chunk_ids,
            lengths,
            dout,
            out,
            self.lse2,
            self.delta,
            self.dq,
            p,
            ds,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            chunk_ids.stride(0),
            dout.stride(0),
            dout.stride(1),
            out.stride(0),
            out.stride(1),
            self.dq.stride(0),
            self.dq.stride(1),
            stride_pt,
            t0,
            heads,
            kv.shape[0],
            self.softmax_scale,
            self.softmax_scale * LOG2E,
            D_ROPE=head_dim - VALUE_DIM,
            DR=64,
            DV=VALUE_DIM,
        )
        _launch(
            _sparse_mla_bwd_dkv_kernel,
            self.dkv_key,
            self.dkv_configs,
            lambda c: (
                triton.cdiv(head_dim, c.block_d) * triton.cdiv(heads, c.block_h) * n,
                triton.cdiv(width, c.slot_chunk) if c.slot_chunk else 1,
            ),
            q,
            dout,
            chunk_ids,
            lengths,
            self.lse2,
            p,
            ds,
            self.dkv,
            q.stride(0),
            q.stride(1),
            chunk_ids.stride(0),
            dout.stride(0),
            dout.stride(1),
            stride_pt,
            self.dkv.stride(0),
            t0,
            heads,
            kv.shape[0],
            D=head_dim,
            DV=VALUE_DIM,
        )
