"""Sparse MLA forward in Triton: one program per (head block, query token), online softmax in base 2.

Layout (validated by the caller): q [T, H, D] and kv [T_kv, D] with unit last stride, ids [T, W] int32,
D = 512 (values only) or 576 (512 value dims + 64 rope dims). A program streams its token's top-k slots
in blocks of BLOCK_K, gathers the latent rows they name (a duplicated id counts once per slot) and writes
the output and the natural-log lse (sink excluded, +inf when the row has no valid slot).

On Hopper, bf16 inputs go to the warp-specialised Gluon kernel of `gluon_forward.py` instead (same
outputs; on the H200 the kernel alone takes 6.01 ms at the issue's shape against 8.05 for this
one). A launch config given explicitly always runs this kernel.
"""

import torch
import triton
import triton.language as tl

from sa_kernels.backend import device_capability, triton_interpret

from .triton_chain_break import chain_break
from .triton_launch import LaunchConfig, _launch, forward_arguments, forward_configs

try:
    from .gluon_forward import sparse_mla_forward_hopper
except (ImportError, AttributeError):  # no Gluon Hopper ops in this Triton: the portable kernel
    sparse_mla_forward_hopper = None


@triton.jit
def _sparse_mla_fwd_kernel(
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
    HAS_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    D_ROPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    UNCHAIN: tl.constexpr,
):
    # A 1-D grid, a token's head blocks next to each other (they gather the same keys): grid y and
    # z stop at 65535, fewer than the tokens of a long sequence.
    hb = tl.program_id(0) % tl.cdiv(heads, BLOCK_H)
    t = (tl.program_id(0) // tl.cdiv(heads, BLOCK_H)).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < heads
    offs_v = tl.arange(0, DV)
    q_row = Q + t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=hmask[:, None], other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
    if D_ROPE > 0:
        offs_r = DV + tl.arange(0, D_ROPE)
        q_rope = tl.load(q_row + offs_r[None, :], mask=hmask[:, None], other=0.0)
        if UPCAST:
            q_rope = q_rope.to(tl.float32)
    length = width
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), width)
    idx_row = IDX + t * stride_it

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    # Each block's ids are loaded one block ahead: the pipelined key gathers then start a block
    # earlier (H200: 8.04 ms at the goal's shape, 8.19 with the ids loaded in the block).
    next_ids = tl.load(
        idx_row + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < length, other=-1
    )
    for start in range(0, length, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        ids = next_ids
        following = slots + BLOCK_K
        next_ids = tl.load(idx_row + following, mask=following < length, other=-1)
        valid = (ids >= 0) & (ids < keys) & (slots < length)
        kv_row = KV + ids.to(tl.int64) * stride_kvt
        k_nope = tl.load(kv_row[:, None] + offs_v[None, :], mask=valid[:, None], other=0.0)
        if UPCAST:
            k_nope = k_nope.to(tl.float32)
        # The rope dot has its own accumulator, scaled before the sum: Triton folds `x + dot` into a
        # dot accumulating onto x, which would chain the two score dots.
        s = tl.dot(q_nope, tl.trans(k_nope)) * scale_log2
        if D_ROPE > 0:
            k_rope = tl.load(kv_row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_rope = k_rope.to(tl.float32)
            s += tl.dot(q_rope, tl.trans(k_rope)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # The scores reach the value dot through p and alpha: break both links (see `chain_break`).
        p = chain_break(p, start < length, UNCHAIN)
        alpha = chain_break(alpha, start >= 0, UNCHAIN)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope)
        m_i = m_new

    nonempty = l_i > 0.0
    denominator = l_i
    if HAS_SINK:
        sink = tl.load(SINK + offs_h, mask=hmask, other=float("-inf")).to(tl.float32)
        denominator += tl.exp2(sink * 1.4426950408889634 - tl.where(nonempty, m_i, 0.0))
    scale = tl.where(nonempty, 1.0 / tl.where(nonempty, denominator, 1.0), 0.0)
    out = acc * scale[:, None]
    o_row = OUT + t * stride_ot + offs_h[:, None].to(tl.int64) * stride_oh
    tl.store(o_row + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=hmask[:, None])
    lse = tl.where(
        nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("inf")
    )
    tl.store(LSE + t * heads + offs_h, lse, mask=hmask)


def hopper_forward_applies(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether `sparse_mla_forward` runs the Gluon Hopper kernel for these inputs: bf16 q and kv on
    an NVIDIA (not ROCm) SM90 GPU, for which the kernel is written (warpgroup MMA, 227 KiB of shared
    memory); kv with unit last stride, a 16-byte aligned data pointer and a row stride that is a
    multiple of 16 elements (its gathers copy 16 bytes, which Triton must be able to prove aligned);
    Gluon importable; not under Triton's interpreter, which does not run Gluon."""
    return (
        sparse_mla_forward_hopper is not None
        and q.is_cuda
        and torch.version.hip is None
        and not triton_interpret()
        and q.dtype == kv.dtype == torch.bfloat16
        and kv.stride(-1) == 1
        and kv.stride(0) % 16 == 0
        and kv.data_ptr() % 16 == 0
        and device_capability(q.device.index)[0] == 9
    )


def sparse_mla_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    ids: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], kv [T_kv, D], ids [T, W] int32 -> (out [T, H, 512] q.dtype, lse [T, H] fp32 natural log).

    `config` (a launch of the portable kernel) is for benchmarks and tests; without it, inputs that
    `hopper_forward_applies` to go to the Gluon Hopper kernel.
    """
    if config is None and hopper_forward_applies(q, kv):
        return sparse_mla_forward_hopper(q, kv, ids, softmax_scale, topk_length, attn_sink)
    tokens, heads, head_dim = q.shape
    out, lse, args, constexprs = forward_arguments(
        q, kv, ids, softmax_scale, topk_length, attn_sink
    )
    if tokens == 0:
        return out, lse
    configs = [config] if config is not None else forward_configs(heads)
    key = (
        None
        if config is not None
        else ("fwd", heads, head_dim, q.dtype, topk_length is not None, attn_sink is not None)
    )
    grid_of = lambda c: (triton.cdiv(heads, c.block_h) * tokens,)
    _launch(_sparse_mla_fwd_kernel, key, configs, grid_of, *args, **constexprs)
    return out, lse
