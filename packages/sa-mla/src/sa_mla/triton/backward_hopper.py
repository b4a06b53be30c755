"""The backward's dq kernel for Hopper in Gluon: the math of `backward.py`'s dq kernel, with the two
warpgroups given different work so that the key tiles can be double-buffered.

With q (72 KiB) and dO (64 KiB) resident, shared memory holds one 64-slot key tile (72 KiB) and no
second one, so the portable kernel waits for every gather. Here the slots come in blocks of 32, two
stages of them, gathered by a producer partition of two warps; and the score dots, whose 32 columns
are too few to split between two warpgroups, are not split:
- the score warpgroup computes S = q kᵀ (all 576 dims), p = exp2(S − lse2) and, once dP arrives,
  ds = scale · p · (dP − delta); it writes p and ds for the dkv kernel and adds ds · k to dq's value
  dims 0–255;
- the dP warpgroup computes dP = dO vᵀ (512 dims), hands it over in shared memory, and adds ds · k
  to dq's value dims 256–511 and the rope dims.
Both warpgroups run about the same number of MMA steps per block (576 + 256 against 512 + 256 + 64).
The outputs are those of the portable kernel: dq, delta (for every token) and p/ds for the `length`
slots of the token's sorted row.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sa_mla.triton.forward_hopper import async_gather, cta_barrier
from sa_mla.triton.forward_hopper import mbarrier_arrive_after_copies as copies_arrive

BLOCK_H = 64
BLOCK_K = 32
STAGES = 2
PRODUCER_WARPS = 2
VALUE_DIM = 512


@gluon.jit
def _dq_producer(
    KV,
    IDX,
    kn_smem,
    kr_smem,
    ready,
    free,
    local_t,
    length,
    keys,
    stride_kvt,
    stride_it,
    DV: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):
    nope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    idx_row = IDX + local_t * stride_it
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, nope_layout))
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, nope_layout))
    if D_ROPE > 0:
        rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        rope_cols = DV + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rope_layout))
        rope_rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, rope_layout))
    for i in range(gl.cdiv(length, BLOCK_K)):
        stage = i % STAGES
        mbarrier.wait(free.index(stage), ((i // STAGES) & 1) ^ 1)
        slots = i * BLOCK_K + rows
        ids = gl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys)
        base = KV + ids.to(gl.int64) * stride_kvt
        async_gather(kn_smem.index(stage), base[:, None] + cols[None, :], mask=valid[:, None])
        if D_ROPE > 0:
            rope_slots = i * BLOCK_K + rope_rows
            rope_ids = gl.load(idx_row + rope_slots, mask=rope_slots < length, other=-1)
            rope_valid = (rope_ids >= 0) & (rope_ids < keys)
            rope_base = KV + rope_ids.to(gl.int64) * stride_kvt
            async_gather(
                kr_smem.index(stage),
                rope_base[:, None] + rope_cols[None, :],
                mask=rope_valid[:, None],
            )
        copies_arrive(ready.index(stage))


@gluon.jit
def _dq_score_warpgroup(
    IDX,
    P,
    DS,
    qn_smem,
    qr_smem,
    kn_smem,
    kr_smem,
    dp_smem,
    ds_smem,
    p_smem,
    ready,
    free,
    dp_ready,
    ds_ready,
    lse2,
    delta,
    hb,
    local_t,
    length,
    keys,
    heads,
    stride_it,
    stride_pt,
    scale,
    scale_log2,
    DV: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV // 2, 16]
    )
    # p and ds go to memory as [slots, heads] rows: read back transposed from shared memory.
    tile_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    tile_slots = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, tile_layout))
    tile_heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, tile_layout))
    p_tile = P + local_t * stride_pt
    ds_tile = DS + local_t * stride_pt
    idx_row = IDX + local_t * stride_it
    slot_offsets = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    zero_scores = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
    dq = gl.zeros([BLOCK_H, DV // 2], gl.float32, layout=acc_layout)
    for i in range(gl.cdiv(length, BLOCK_K)):
        stage = i % STAGES
        slots = i * BLOCK_K + slot_offsets
        ids = gl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        keys_nope = kn_smem.index(stage)
        s = warpgroup_mma(
            qn_smem, keys_nope.permute((1, 0)), zero_scores, use_acc=False, is_async=True
        )
        if D_ROPE > 0:
            s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        p = gl.exp2(s * scale_log2 - lse2[:, None])
        p = gl.where(valid[None, :], p, 0.0)
        mbarrier.wait(dp_ready, i & 1)
        dp = dp_smem.load(s_layout)
        ds = (p * (dp - delta[:, None]) * scale).to(gl.bfloat16)
        ds_smem.store(ds)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(ds_ready)
        dq = warpgroup_mma(ds_smem, keys_nope.slice(0, DV // 2, dim=1), dq, is_async=True)
        tile_rows = i * BLOCK_K + tile_slots
        at = tile_rows[:, None] * heads + tile_heads[None, :]
        written = (tile_rows < length)[:, None] & (tile_heads < heads)[None, :]
        gl.store(p_tile + at, p_smem.permute((1, 0)).load(tile_layout), mask=written)
        gl.store(ds_tile + at, ds_smem.permute((1, 0)).load(tile_layout), mask=written)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        # Every thread is past its reads of p and ds before the next block overwrites them.
        cta_barrier()
        mbarrier.arrive(free.index(stage))
    return (dq,)  # a tuple: `warp_specialize` flattens the default partition's results


@gluon.jit
def _dq_dp_warpgroup(
    DQ,
    do_smem,
    kn_smem,
    kr_smem,
    dp_smem,
    ds_smem,
    ready,
    free,
    dp_ready,
    ds_ready,
    hb,
    t,
    length,
    heads,
    stride_dqt,
    stride_dqh,
    DV: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV // 2, 16]
    )
    rope_width: gl.constexpr = D_ROPE if D_ROPE > 0 else 64
    rope_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rope_width, 16]
    )
    zero_scores = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
    dq = gl.zeros([BLOCK_H, DV // 2], gl.float32, layout=acc_layout)
    dq_rope = gl.zeros([BLOCK_H, rope_width], gl.float32, layout=rope_layout)
    for i in range(gl.cdiv(length, BLOCK_K)):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        keys_nope = kn_smem.index(stage)
        dp = warpgroup_mma(
            do_smem, keys_nope.permute((1, 0)), zero_scores, use_acc=False, is_async=True
        )
        dp = warpgroup_mma_wait(0, deps=(dp,))
        # The score warpgroup read the previous block's dP before it signalled that block's ds,
        # which this warpgroup waited for: the buffer is free.
        dp_smem.store(dp)
        cta_barrier()
        mbarrier.arrive(dp_ready)
        mbarrier.wait(ds_ready, i & 1)
        dq = warpgroup_mma(ds_smem, keys_nope.slice(DV // 2, DV // 2, dim=1), dq, is_async=True)
        if D_ROPE > 0:
            dq_rope = warpgroup_mma(ds_smem, kr_smem.index(stage), dq_rope, is_async=True)
        dq, dq_rope = warpgroup_mma_wait(0, deps=(dq, dq_rope))
        mbarrier.arrive(free.index(stage))
    rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, acc_layout))
    cols = DV // 2 + gl.arange(0, DV // 2, layout=gl.SliceLayout(0, acc_layout))
    dq_row = DQ + t * stride_dqt + rows[:, None] * stride_dqh
    gl.store(dq_row + cols[None, :], dq.to(DQ.dtype.element_ty), mask=(rows < heads)[:, None])
    if D_ROPE > 0:
        rope_rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_layout))
        rope_cols = DV + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rope_layout))
        gl.store(
            DQ + t * stride_dqt + rope_rows[:, None] * stride_dqh + rope_cols[None, :],
            dq_rope.to(DQ.dtype.element_ty),
            mask=(rope_rows < heads)[:, None],
        )


@gluon.jit
def _sparse_mla_bwd_dq_hopper_kernel(
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
    D_ROPE: gl.constexpr,
    DV: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
):
    head_blocks = gl.cdiv(heads, BLOCK_H)
    hb = gl.program_id(0) % head_blocks
    local_t = (gl.program_id(0) // head_blocks).to(gl.int64)
    t = t0 + local_t

    row_major: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16)
    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DV], row_major)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DV], row_major)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, DV], row_major)
    rope_width: gl.constexpr = D_ROPE if D_ROPE > 0 else 64
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, rope_width], row_major)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, rope_width], row_major)
    narrow: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], narrow)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], narrow)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    dp_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, BLOCK_K], plain)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dp_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(free.index(s), count=2)  # one arrival per consumer warpgroup
    mbarrier.init(dp_ready, count=1)
    mbarrier.init(ds_ready, count=1)

    # q, dO and delta = rowsum(dO * O), 128 columns at a time (the default partition's 4 warps).
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, load_layout))
    row_ok = (rows < heads)[:, None]
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, load_layout))
    delta = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, load_layout))
    for c in gl.static_range(DV // 128):
        at = c * 128 + cols[None, :]
        qn_smem.slice(c * 128, 128, dim=1).store(
            gl.load(Q + t * stride_qt + rows[:, None] * stride_qh + at, mask=row_ok, other=0.0)
        )
        do = gl.load(
            DOUT + t * stride_dot + rows[:, None] * stride_doh + at, mask=row_ok, other=0.0
        )
        do_smem.slice(c * 128, 128, dim=1).store(do)
        out = gl.load(OUT + t * stride_ot + rows[:, None] * stride_oh + at, mask=row_ok, other=0.0)
        delta += gl.sum(do.to(gl.float32) * out.to(gl.float32), axis=1)
    gl.store(DELTA + t * heads + rows, delta, mask=rows < heads)
    if D_ROPE > 0:
        rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        rope_rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_layout))
        rope_cols = DV + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rope_layout))
        qr_smem.store(
            gl.load(
                Q + t * stride_qt + rope_rows[:, None] * stride_qh + rope_cols[None, :],
                mask=(rope_rows < heads)[:, None],
                other=0.0,
            )
        )
    fence_async_shared()
    cta_barrier()

    # A token whose heads all have no valid slot walks no slots (its p and ds are never read); a head
    # block with no valid slot in a token that has some walks them (p = 0), as the dkv kernel's head
    # blocks may be larger and read them.
    lowest = float("inf")
    for h0 in range(0, heads, BLOCK_H):
        every = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, load_layout))
        lse2_all = gl.load(LSE2 + t * heads + every, mask=every < heads, other=float("inf"))
        lowest = gl.minimum(lowest, gl.min(lse2_all, axis=0))
    length = gl.where(lowest == float("inf"), 0, gl.load(LENGTHS + local_t))

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_K, 16]
    )
    lse2 = gl.load(LSE2 + t * heads + rows, mask=rows < heads, other=float("inf"))
    lse2 = gl.convert_layout(lse2, gl.SliceLayout(1, s_layout))
    delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))

    results = gl.warp_specialize(
        [
            (
                _dq_score_warpgroup,
                (
                    IDX,
                    P,
                    DS,
                    qn_smem,
                    qr_smem,
                    kn_smem,
                    kr_smem,
                    dp_smem,
                    ds_smem,
                    p_smem,
                    ready,
                    free,
                    dp_ready,
                    ds_ready,
                    lse2,
                    delta,
                    hb,
                    local_t,
                    length,
                    keys,
                    heads,
                    stride_it,
                    stride_pt,
                    scale,
                    scale_log2,
                    DV,
                    D_ROPE,
                    BLOCK_H,
                    BLOCK_K,
                    STAGES,
                ),
            ),
            (
                _dq_dp_warpgroup,
                (
                    DQ,
                    do_smem,
                    kn_smem,
                    kr_smem,
                    dp_smem,
                    ds_smem,
                    ready,
                    free,
                    dp_ready,
                    ds_ready,
                    hb,
                    t,
                    length,
                    heads,
                    stride_dqt,
                    stride_dqh,
                    DV,
                    D_ROPE,
                    BLOCK_H,
                    BLOCK_K,
                    STAGES,
                ),
            ),
            (
                _dq_producer,
                (
                    KV,
                    IDX,
                    kn_smem,
                    kr_smem,
                    ready,
                    free,
                    local_t,
                    length,
                    keys,
                    stride_kvt,
                    stride_it,
                    DV,
                    D_ROPE,
                    BLOCK_K,
                    STAGES,
                ),
            ),
        ],
        [4, PRODUCER_WARPS],
        [232, 48],
    )
    dq = results[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV // 2, 16]
    )
    out_rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, DV // 2, layout=gl.SliceLayout(0, acc_layout))
    gl.store(
        DQ + t * stride_dqt + out_rows[:, None] * stride_dqh + out_cols[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=(out_rows < heads)[:, None],
    )


def launch_dq_hopper(
    q: torch.Tensor,
    kv: torch.Tensor,
    chunk_ids: torch.Tensor,
    lengths: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse2: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    p: torch.Tensor,
    ds: torch.Tensor,
    t0: int,
    tokens: int,
    softmax_scale: float,
    scale_log2: float,
) -> None:
    """The dq kernel over tokens [t0, t0 + tokens): same arguments and outputs as the portable dq
    kernel's launch in `backward.py` (bf16 q, kv, dout, out; chunk_ids [tokens, W] int32 sorted rows
    with `lengths` [tokens] int32 valid ids; p, ds [tokens, W, H] bf16)."""
    heads, head_dim = q.shape[1:]
    _sparse_mla_bwd_dq_hopper_kernel[(triton.cdiv(heads, BLOCK_H) * tokens,)](
        q,
        kv,
        chunk_ids,
        lengths,
        dout,
        out,
        lse2,
        delta,
        dq,
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
        dq.stride(0),
        dq.stride(1),
        p.stride(0),
        t0,
        heads,
        kv.shape[0],
        softmax_scale,
        scale_log2,
        D_ROPE=head_dim - VALUE_DIM,
        DV=VALUE_DIM,
        BLOCK_H=BLOCK_H,
        BLOCK_K=BLOCK_K,
        STAGES=STAGES,
        PRODUCER_WARPS=PRODUCER_WARPS,
        num_warps=4,
    )
