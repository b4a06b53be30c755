"""sa_mla: sparse latent (MLA) attention — FlashMLA forward + cuDNN backward, a portable Triton path, the oracle."""

from sa_mla.cudnn_flashmla import cudnn_sparse_attention, is_cudnn_sparse_attention_available
from sa_mla.dispatch import sparse_mla_attention
from sa_mla.reference import sparse_mla_reference
from sa_mla.triton import sparse_mla_triton

__all__ = [
    "cudnn_sparse_attention",
    "is_cudnn_sparse_attention_available",
    "sparse_mla_attention",
    "sparse_mla_reference",
    "sparse_mla_triton",
]
