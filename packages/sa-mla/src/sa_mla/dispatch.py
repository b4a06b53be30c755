"""`sparse_mla_attention`: one entry point over the fused (FlashMLA + cuDNN), Triton and reference paths."""

import torch

from sa_kernels.backend import resolve_backend
from sa_mla.cudnn_flashmla import cudnn_sparse_attention, unavailable_reason
from sa_mla.reference import sparse_mla_reference
from sa_mla.triton import sparse_mla_triton
from sa_mla.validation import check_sparse_mla_arguments

BACKENDS = ("auto", "cudnn", "triton", "reference")
ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


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
    """Sparse latent attention through the best path that can run (same arguments as `cudnn_sparse_attention`).

    Args:
        q, kv_latent, topk_indices, softmax_scale, topk_length, all_rows_nonempty, valid_row_indices,
        attn_sink: as in `cudnn_sparse_attention` (q [tokens, heads, 512 | 576], kv_latent
            [keys, 1, head_dim], topk_indices [tokens, 1, width] int, attn_sink [heads] fp32).
        backend: "auto" (FlashMLA + cuDNN when both import, the GPU is SM90/SM100 and q is bf16; else
            Triton on CUDA; else the oracle on CPU), "cudnn", "triton" or "reference".
    Returns:
        [tokens, heads, 512] in q's dtype.
    Raises:
        RuntimeError: the requested backend cannot run here (the message says why).
        TypeError, ValueError: as `cudnn_sparse_attention`; or an unknown backend (ValueError).
    """
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
    check_sparse_mla_arguments("sparse_mla_attention", *args, allowed_dtypes=ALL_DTYPES)
    chosen = select_backend(backend, q, kv_latent, topk_indices)
    if chosen == "cudnn":
        return cudnn_sparse_attention(*args)
    if chosen == "triton":
        return sparse_mla_triton(*args)
    return sparse_mla_reference(*args)
