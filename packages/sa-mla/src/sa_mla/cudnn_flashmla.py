"""`cudnn_sparse_attention`: FlashMLA's sparse prefill forward + the cuDNN frontend's DSA backward.

Neither runtime is a hard dependency. The cuDNN frontend comes with the `cudnn` extra
(`nvidia-cudnn-frontend>=1.32`, with its CuTe DSL runtime). FlashMLA must be built from its source
(github.com/deepseek-ai/FlashMLA; the PyPI name `flash-mla` holds only an old placeholder); commit
9241ae3 still carries the SM90 sparse prefill that later releases dropped.
"""

import importlib
from functools import cache

import torch

from sa_mla.canonical import FusedKernels, fused_sparse_mla
from sa_mla.validation import VALUE_DIM, check_sparse_mla_arguments


def _flash_mla_sparse_fwd():
    return importlib.import_module("flash_mla").flash_mla_sparse_fwd


def _cudnn_sparse_backward():
    return importlib.import_module("cudnn").DSA.sparse_attention_backward_wrapper


@cache
def _missing_runtime() -> str | None:
    """Why the fused path cannot run here (None when it can); the import attempts are cached."""
    reasons = []
    for name, load in (
        ("FlashMLA (flash_mla)", _flash_mla_sparse_fwd),
        ("cuDNN frontend (cudnn)", _cudnn_sparse_backward),
    ):
        try:
            load()
        except (
            Exception
        ) as error:  # an ImportError, or a runtime that imports but lacks the DSA API
            reasons.append(f"{name} is not usable: {type(error).__name__}: {error}")
    return "; ".join(reasons) or None


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why `cudnn_sparse_attention` cannot run on `device` (default: the current CUDA device), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if device is not None and device.type != "cuda":
        return f"tensors are on {device}, not CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"FlashMLA's sparse prefill needs SM90 or SM100; this GPU is SM{major}{minor}"
    return _missing_runtime()


def is_cudnn_sparse_attention_available() -> bool:
    """True when FlashMLA and the cuDNN frontend import and the current CUDA device is SM90/SM100."""
    return unavailable_reason() is None


def _forward(q, kv, ids, softmax_scale, attn_sink, lengths):
    out, _max_logits, lse = _flash_mla_sparse_fwd()(
        q, kv, ids, softmax_scale, VALUE_DIM, attn_sink, lengths
    )
    return out, lse


def _backward(q, kv, out, dout, lse, attn_sink, ids, softmax_scale, lengths):
    result = _cudnn_sparse_backward()(
        q, kv, out, dout, lse, attn_sink, ids, softmax_scale=softmax_scale, topk_length=lengths
    )
    return result["dq"], result["dkv"]


FLASHMLA_CUDNN = FusedKernels(forward=_forward, backward=_backward)
CUDNN_DTYPES = (torch.bfloat16,)


def cudnn_sparse_attention(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse latent attention: FlashMLA forward, cuDNN frontend backward (SM90/SM100, bf16).

    MQA over one latent head: keys are whole latent rows, values their first 512 dims. This is the
    contract (SEMANTICS §3) that `sparse_mla_triton`, `sparse_mla_reference` and `sparse_mla_attention`
    share; they differ in the dtypes they take and where they run.

    Args:
        q: [tokens, heads, 512 | 576] bf16, unit last stride. Any head count: heads run in chunks of
            128, each padded to 64 or 128 with zero queries (and -inf sinks) for FlashMLA.
        kv_latent: [keys, 1, head_dim] bf16.
        topk_indices: [tokens, 1, width] int32/int64; ids outside `[0, keys)` (e.g. -1) are ignored,
            a duplicate id counts once per slot. Without `topk_length`, valid ids are compacted into an
            ascending prefix; either way the width is padded with -1 to a multiple of 512.
        softmax_scale: > 0, multiplies q·k.
        topk_length: optional [tokens] int; slots at or past it are ignored (clamped to `[0, width]`).
        all_rows_nonempty: promise that every row has a valid id; the backward then skips finding the
            non-empty rows (a host synchronisation).
        valid_row_indices: optional [rows] int, exactly the rows with a valid id (same purpose).
        attn_sink: optional [heads] fp32 logits added to each head's softmax denominator; its gradient
            is `-sum_q sigmoid(sink - lse) * sum_d dO * O`.
    Returns:
        [tokens, heads, 512] bf16; rows with no valid id are zero and get zero gradients.
    Raises:
        RuntimeError: FlashMLA or the cuDNN frontend is missing, the tensors are not on CUDA, or the GPU
            is not SM90/SM100.
        TypeError: a dtype is not bf16/int/fp32 as listed, or softmax_scale is not a number.
        ValueError: shapes disagree, head_dim is not 512/576, softmax_scale <= 0, or the optional
            arguments contradict each other.
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
    check_sparse_mla_arguments("cudnn_sparse_attention", *args, allowed_dtypes=CUDNN_DTYPES)
    return _cudnn_sparse_attention(*args)


def _cudnn_sparse_attention(q: torch.Tensor, kv_latent: torch.Tensor, *rest) -> torch.Tensor:
    """`cudnn_sparse_attention` on arguments already validated (`rest`: topk_indices through attn_sink,
    in order); raises its RuntimeError when the fused path cannot run here."""
    reason = unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(
            f"cudnn_sparse_attention: cannot run: {reason}; "
            "use sparse_mla_triton or sparse_mla_reference instead"
        )
    if kv_latent.stride(-1) != 1:
        kv_latent = kv_latent.contiguous()
    out, _lse = fused_sparse_mla(FLASHMLA_CUDNN, q, kv_latent, *rest)
    return out
