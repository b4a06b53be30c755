"""`sparse_mla_attention`: one entry point over the fused (FlashMLA + cuDNN), Triton and reference paths."""

import torch

from sa_kernels.backend import resolve_backend
from sa_mla.cudnn_flashmla import CUDNN_DTYPES, _cudnn_sparse_attention, unavailable_reason
from sa_mla.reference import REFERENCE_DTYPES, sparse_mla_reference_with_lse
from sa_mla.triton import TRITON_DTYPES, _sparse_mla_triton
from sa_mla.validation import check_q_dtype, check_sparse_mla_arguments

BACKENDS = ("auto", "cudnn", "triton", "reference")
BACKEND_DTYPES = {"cudnn": CUDNN_DTYPES, "triton": TRITON_DTYPES, "reference": REFERENCE_DTYPES}


def select_backend(
    backend: str, q: torch.Tensor, kv_latent: torch.Tensor, topk_indices: torch.Tensor
) -> str:
    """Resolve `backend` to "cudnn", "triton" or "reference" (auto: fused when it can run, else Triton on
    CUDA, else the oracle); an explicit backend is returned as asked and raises later if it cannot run."""
    fn = "sparse_mla_attention"
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}; got {backend!r}")
    if backend != "auto":
        return backend
    if q.is_cuda and q.dtype == torch.bfloat16 and unavailable_reason(q.device) is None:
        return "cudnn"
    return resolve_backend(fn, "auto", q, kv_latent, topk_indices)


def sparse_mla_attention(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse latent attention through the best path that can run.

    Arguments as `cudnn_sparse_attention` (q [tokens, heads, 512 | 576], kv_latent [keys, 1, head_dim],
    topk_indices [tokens, 1, width] int, topk_length [tokens] int, attn_sink [heads] fp32), validated
    once here; q's dtype must suit the backend that runs (cudnn: bf16; triton: bf16 or fp32;
    reference: bf16, fp16, fp32 or fp64).

    Args:
        backend: "auto" (FlashMLA + cuDNN when both import, the GPU is SM90/SM100 and q is bf16; else
            Triton on CUDA; else the oracle on CPU), "cudnn", "triton" or "reference".
    Returns:
        [tokens, heads, 512] in q's dtype.
    Raises:
        RuntimeError: the requested backend cannot run here (the message says why).
        TypeError, ValueError: as `cudnn_sparse_attention`; or an unknown backend (ValueError).
    """
    fn = "sparse_mla_attention"
    args = (
        q,
        kv_latent,
        topk_indices,
        softmax_scale,
        topk_length,
        all_rows_nonempty,
        valid_row_indices,
        attn_sink,
    )
    check_sparse_mla_arguments(fn, *args, allowed_dtypes=REFERENCE_DTYPES)
    chosen = select_backend(backend, q, kv_latent, topk_indices)
    check_q_dtype(fn, q, BACKEND_DTYPES[chosen], chosen)
    if chosen == "cudnn":
        return _cudnn_sparse_attention(*args)
    if chosen == "triton":
        return _sparse_mla_triton(q, kv_latent, topk_indices, softmax_scale, topk_length, attn_sink)
    out, _lse = sparse_mla_reference_with_lse(
        q, kv_latent, topk_indices, softmax_scale, topk_length, attn_sink
    )
    return out
