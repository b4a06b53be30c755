"""The Triton sparse MLA path: forward and backward written for SM80+ GPUs (tested on SM90), or
Triton's interpreter on CPU; on SM90 with bf16 inputs the forward runs a Gluon kernel
(`forward_hopper.py`, same outputs)."""

import torch

from sa_kernels.backend import resolve_backend
from sa_mla.canonical import ids_as_int32, sink_gradient
from sa_mla.triton.backward import sparse_mla_backward
from sa_mla.triton.forward import sparse_mla_forward
from sa_mla.validation import check_sparse_mla_arguments

TRITON_DTYPES = (torch.bfloat16, torch.float32)


def lse_with_sink(lse: torch.Tensor, attn_sink: torch.Tensor | None) -> torch.Tensor:
    """Natural-log lse [T, H] of the keys and the sink together (+inf stays +inf for empty rows)."""
    if attn_sink is None:
        return lse
    return torch.logaddexp(lse, attn_sink.float()[None, :])


class _SparseMlaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv_latent, ids, softmax_scale, topk_length, attn_sink):
        kv = kv_latent[:, 0].contiguous()
        out, lse = sparse_mla_forward(q, kv, ids, softmax_scale, topk_length, attn_sink)
        ctx.save_for_backward(q, kv, ids, topk_length, attn_sink, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.kv_shape = kv_latent.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, ids, topk_length, attn_sink, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        lse_total = lse_with_sink(lse, attn_sink)
        dq, dkv, delta = sparse_mla_backward(
            q, kv, ids, ctx.softmax_scale, topk_length, dout, out, lse_total
        )
        d_sink = (
            sink_gradient(attn_sink, lse, delta)
            if attn_sink is not None and ctx.needs_input_grad[5]
            else None
        )
        dkv = dkv.to(q.dtype).view(ctx.kv_shape)
        return dq, dkv, None, None, None, d_sink


def sparse_mla_triton(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse latent attention through the Triton kernels (forward and backward).

    Runs on CUDA tensors (any SM80+ GPU, any head count and top-k width), or on CPU tensors through
    Triton's interpreter when `TRITON_INTERPRET=1`; on SM90 GPUs with bf16 inputs the forward is the
    Gluon kernel of `forward_hopper.py` (`forward.hopper_forward_applies`). Same function as
    `sparse_mla_reference`.
    Arguments, shapes and errors as `cudnn_sparse_attention` (q [tokens, heads, 512 | 576],
    kv_latent [keys, 1, head_dim], topk_indices [tokens, 1, width] int, topk_length [tokens] int,
    attn_sink [heads] fp32), except: q and kv_latent are bf16 or fp32 (fp32 dots may run in TF32 on
    GPU), and all_rows_nonempty/valid_row_indices are validated and otherwise unused.

    Returns:
        [tokens, heads, 512] in q's dtype; rows with no valid id are zero and get zero gradients.
    Raises:
        RuntimeError: CPU tensors without `TRITON_INTERPRET=1`, or Triton is not installed.
        TypeError, ValueError: as `cudnn_sparse_attention`.
    """
    check_sparse_mla_arguments(
        "sparse_mla_triton",
        q,
        kv_latent,
        topk_indices,
        softmax_scale,
        topk_length,
        all_rows_nonempty,
        valid_row_indices,
        attn_sink,
        allowed_dtypes=TRITON_DTYPES,
    )
    return _sparse_mla_triton(q, kv_latent, topk_indices, softmax_scale, topk_length, attn_sink)


def _sparse_mla_triton(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> torch.Tensor:
    """`sparse_mla_triton` on arguments already validated; raises its RuntimeError when Triton cannot run."""
    resolve_backend("sparse_mla_triton", "triton", q, kv_latent, topk_indices)
    if q.stride(-1) != 1:
        q = q.contiguous()
    ids = topk_indices[:, 0]
    if ids.dtype != torch.int32:
        # The kernels treat ids outside [0, keys) as invalid themselves; wider ids are judged
        # before they are narrowed (2**32 + 3 must not become 3).
        ids = ids_as_int32(ids, kv_latent.shape[0])
    ids = ids.contiguous()
    lengths = topk_length.to(torch.int32).contiguous() if topk_length is not None else None
    sink = attn_sink.contiguous() if attn_sink is not None else None
    return _SparseMlaTriton.apply(q, kv_latent, ids, float(softmax_scale), lengths, sink)
