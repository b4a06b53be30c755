"""Sparse MLA forward for Hopper in Gluon: warp-specialised gathers, the math as in `triton_forward.py`.

The portable kernel (`triton_forward.py`) issues its key gathers from the same warps that run the dots, so
the tensor cores wait while the warps compute addresses and issue copies. Here a producer
partition of four warps gathers each slot block's latent rows into a ring of shared-memory stages
(asynchronous copies, signalled through mbarriers) while the eight consumer warps (two warpgroups)
run the score dot, the online softmax and the value dot with Hopper's warpgroup MMA. The math,
the masking and the outputs are those of `triton_forward.py`: one program per (head block of 64, query
token), slots in blocks of 64, online softmax in base 2, out [T, H, 512] and the natural-log lse.

Shared memory: q (64 × 576 bf16, 72 KiB), two key stages (2 × 72 KiB) and the bf16 probabilities
(8 KiB): 224 KiB of the H200's 227 (at D 512 the rope buffers go unused). Registers: Triton gives
the producer `PRODUCER_REGISTERS` per thread and the consumers the rest (offline, sm_90a: no spills
with Triton 3.6, 8 bytes with the lock file's 3.9, where 56 would give none; only 3.6 has run it).

Gluon has no interpreter: this kernel runs only on SM90 GPUs and is tested there (`gpu` tests against
the oracle and the portable kernel); elsewhere `triton_forward.py`'s kernel runs.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sa_kernels.gluon_compat import async_gather, cta_barrier

from .triton_launch import LOG2E, forward_arguments

# Constants inside the kernels (JIT code reads globals only as constexprs).
LOG2E_IN_KERNEL = gl.constexpr(LOG2E)
LN2_IN_KERNEL = gl.constexpr(0.6931471805599453)
BLOCK_H = 64
BLOCK_K = 64
STAGES = 2
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4
PRODUCER_REGISTERS = 64


@gluon.jit
def _gather_rows(smem, KV, idx_row, slots, cols, length, keys, stride_kvt):
    """Asynchronous copies of columns `cols` of the latent rows named by `slots` of the token's id row
    into `smem` ([len(slots), len(cols)]); zeros for invalid ids and slots at or past `length`."""
    ids = gl.load(idx_row + slots, mask=slots < length, other=-1)
    valid = (ids >= 0) & (ids < keys)
    base = KV + ids.to(gl.int64) * stride_kvt
    async_gather(smem, base[:, None] + cols[None, :], mask=valid[:, None])


@gluon.jit
def _producer(
    KV,
    IDX,
    kn_smem,
    kr_smem,
    ready,
    free,
    t,
    length,
    keys,
    stride_kvt,
    stride_it,
    DV: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):
    # 16-byte copies: a warp covers one row's 256 value dims per instruction.
    nope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    idx_row = IDX + t * stride_it
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, nope_layout))
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, nope_layout))
    if D_ROPE > 0:
        rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        rope_cols = DV + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rope_layout))
        rope_rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, rope_layout))
    blocks = gl.cdiv(length, BLOCK_K)
    for i in range(blocks):
        stage = i % STAGES
        # The first pass over the ring finds every stage free (parity 1 of a fresh barrier).
        mbarrier.wait(free.index(stage), ((i // STAGES) & 1) ^ 1)
        first = i * BLOCK_K
        _gather_rows(
            kn_smem.index(stage), KV, idx_row, first + rows, cols, length, keys, stride_kvt
        )
        if D_ROPE > 0:
            _gather_rows(
                kr_smem.index(stage),
                KV,
                idx_row,
                first + rope_rows,
                rope_cols,
                length,
                keys,
                stride_kvt,
            )
        # Every producer thread arrives once its own copies have landed.
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@gluon.jit
def _consumer(
    IDX,
    qn_smem,
    qr_smem,
    kn_smem,
    kr_smem,
    p_smem,
    ready,
    free,
    t,
    length,
    keys,
    stride_it,
    scale_log2,
    DV: gl.constexpr,
    D_ROPE: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):
    # Two warpgroups split the score columns (32 slots each) and the value dims (256 each).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    idx_row = IDX + t * stride_it
    slot_offsets = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_H, DV], gl.float32, layout=o_layout)
    zero_scores = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
    blocks = gl.cdiv(length, BLOCK_K)
    for i in range(blocks):
        stage = i % STAGES
        slots = i * BLOCK_K + slot_offsets
        ids = gl.load(idx_row + slots, mask=slots < length, other=-1)
        valid = (ids >= 0) & (ids < keys)
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        # The copies wrote through the generic proxy; the MMAs read through the async one.
        fence_async_shared()
        keys_nope = kn_smem.index(stage)
        s = warpgroup_mma(
            qn_smem, keys_nope.permute((1, 0)), zero_scores, use_acc=False, is_async=True
        )
        if D_ROPE > 0:
            s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        cta_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_smem, keys_nope, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        # Both warpgroups are past their value dot before the stage is handed back.
        cta_barrier()
        mbarrier.arrive(free.index(stage))
    return acc, m_i, l_i


@gluon.jit
def _sparse_mla_fwd_hopper_kernel(
    Q,
    KV,
    IDX,
    TOPK_LEN,
    SINK,
    OUT,
    LSE,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_it,
    stride_ot,
    stride_oh,
    heads,
    keys,
    width,
    scale_log2,
    HAS_LEN: gl.constexpr,
    HAS_SINK: gl.constexpr,
    D_ROPE: gl.constexpr,
    DV: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGISTERS: gl.constexpr,
):
    # A 1-D grid, a token's head blocks next to each other (they gather the same keys, which the
    # second then finds in L2); grid y and z stop at 65535, fewer than a long sequence's tokens.
    head_blocks = gl.cdiv(heads, BLOCK_H)
    hb = gl.program_id(0) % head_blocks
    t = (gl.program_id(0) // head_blocks).to(gl.int64)
    length = width
    if HAS_LEN:
        length = gl.minimum(gl.maximum(gl.load(TOPK_LEN + t).to(gl.int32), 0), width)

    q_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16)
    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DV], q_layout)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, DV], q_layout)
    rope_width: gl.constexpr = D_ROPE if D_ROPE > 0 else 64
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, rope_width], q_layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, rope_width], q_layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], q_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(free.index(s), count=1)

    # q into shared memory once, by all consumer warps.
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, load_layout))
    hmask = offs_h < heads
    q_row = Q + t * stride_qt + offs_h[:, None].to(gl.int64) * stride_qh
    offs_v = gl.arange(0, DV, layout=gl.SliceLayout(0, load_layout))
    qn_smem.store(gl.load(q_row + offs_v[None, :], mask=hmask[:, None], other=0.0))
    if D_ROPE > 0:
        rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        offs_hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rope_layout))
        offs_r = DV + gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rope_layout))
        q_rope = gl.load(
            Q + t * stride_qt + offs_hr[:, None].to(gl.int64) * stride_qh + offs_r[None, :],
            mask=(offs_hr < heads)[:, None],
            other=0.0,
        )
        qr_smem.store(q_rope)
    fence_async_shared()
    cta_barrier()

    acc, m_i, l_i = gl.warp_specialize(
        [
            (
                _consumer,
                (
                    IDX,
                    qn_smem,
                    qr_smem,
                    kn_smem,
                    kr_smem,
                    p_smem,
                    ready,
                    free,
                    t,
                    length,
                    keys,
                    stride_it,
                    scale_log2,
                    DV,
                    D_ROPE,
                    BLOCK_H,
                    BLOCK_K,
                    STAGES,
                ),
            ),
            (
                _producer,
                (
                    KV,
                    IDX,
                    kn_smem,
                    kr_smem,
                    ready,
                    free,
                    t,
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
        [PRODUCER_WARPS],
        [PRODUCER_REGISTERS],
    )

    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_layout)
    m_i = gl.convert_layout(m_i, row_layout)
    l_i = gl.convert_layout(l_i, row_layout)
    nonempty = l_i > 0.0
    denominator = l_i
    if HAS_SINK:
        sink = gl.load(SINK + rows, mask=rows < heads, other=float("-inf")).to(gl.float32)
        denominator += gl.exp2(sink * LOG2E_IN_KERNEL - gl.where(nonempty, m_i, 0.0))
    scale = gl.where(nonempty, 1.0 / gl.where(nonempty, denominator, 1.0), 0.0)
    out = acc * scale[:, None]
    # Through shared memory (q's buffer is free now) for coalesced 16-byte stores.
    qn_smem.store(out.to(gl.bfloat16))
    cta_barrier()
    o_row = OUT + t * stride_ot + offs_h[:, None].to(gl.int64) * stride_oh
    gl.store(o_row + offs_v[None, :], qn_smem.load(load_layout), mask=hmask[:, None])
    lse = gl.where(
        nonempty, (m_i + gl.log2(gl.where(nonempty, l_i, 1.0))) * LN2_IN_KERNEL, float("inf")
    )
    gl.store(LSE + t * heads + rows, lse, mask=rows < heads)


def sparse_mla_forward_hopper(
    q: torch.Tensor,
    kv: torch.Tensor,
    ids: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hopper forward: (out [T, H, 512] bf16, lse [T, H] fp32), as `triton_forward.sparse_mla_forward`.

    Args:
        q: [T, H, D] bf16, D 512 or 576, unit last stride.
        kv: [T_kv, D] bf16, unit last stride, row stride and data pointer 16-byte aligned (the
            gathers copy 16 bytes at a time); `triton_forward.hopper_forward_applies` checks all of this.
        ids: [T, W] int32; ids outside [0, T_kv) are invalid slots, a repeated id counts per slot.
        softmax_scale: the scores' scale (the kernel works in base 2).
        topk_length: [T] int32 or None: only the first `topk_length[t]` slots of row t count.
        attn_sink: [H] fp32 or None: a per-head logit in the softmax's denominator only.
    Returns:
        out (zero for rows without a valid slot) and the natural-log lse of the keys, sink excluded
        (+inf for rows without a valid slot).
    Raises:
        TypeError: q or kv is not bf16.
    """
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise TypeError(
            f"sparse_mla_forward_hopper: q and kv must be bfloat16; got {q.dtype} and {kv.dtype}"
        )
    tokens, heads, _ = q.shape
    out, lse, args, constexprs = forward_arguments(
        q, kv, ids, softmax_scale, topk_length, attn_sink
    )
    if tokens == 0:
        return out, lse
    _sparse_mla_fwd_hopper_kernel[(triton.cdiv(heads, BLOCK_H) * tokens,)](
        *args,
        **constexprs,
        BLOCK_H=BLOCK_H,
        BLOCK_K=BLOCK_K,
        STAGES=STAGES,
        PRODUCER_WARPS=PRODUCER_WARPS,
        PRODUCER_REGISTERS=PRODUCER_REGISTERS,
        num_warps=CONSUMER_WARPS,
    )
    return out, lse
