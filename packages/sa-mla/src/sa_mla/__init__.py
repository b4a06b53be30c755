"""sa_mla: sparse latent (MLA) attention — FlashMLA forward + cuDNN backward, a portable Triton path, the oracle.

One op, one folder: `sa_mla/sparse_mla/` (see its `__init__.py`).
"""

from sa_mla.sparse_mla import (
    cudnn_sparse_attention,
    is_cudnn_sparse_attention_available,
    sparse_mla_attention,
    sparse_mla_reference,
    sparse_mla_triton,
)

__all__ = [
    "cudnn_sparse_attention",
    "is_cudnn_sparse_attention_available",
    "sparse_mla_attention",
    "sparse_mla_reference",
    "sparse_mla_triton",
]
