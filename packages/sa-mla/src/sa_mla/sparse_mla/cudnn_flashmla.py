"""The fused path's kernels: FlashMLA's sparse prefill forward + the cuDNN frontend's DSA backward.

Neither runtime is a hard dependency. The cuDNN frontend comes with the `cudnn` extra
(`nvidia-cudnn-frontend>=1.32`, with its CuTe DSL runtime). FlashMLA must be built from its source
(github.com/deepseek-ai/FlashMLA; the PyPI name `flash-mla` holds only an old placeholder); commit
9241ae3 still carries the SM90 sparse prefill that later releases dropped.
"""

import importlib
from functools import cache

import torch

from sa_kernels.backend import device_capability

from .canonical import FusedKernels, fused_sparse_mla
from .reference import VALUE_DIM


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
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    major, minor = device_capability(index)
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


def cudnn_fused_attention(q: torch.Tensor, kv_latent: torch.Tensor, *rest) -> torch.Tensor:
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
