"""QSA layers and model: gated GQA routed by a frozen compressed-block indexer (SEMANTICS §2)."""

from .attention import QSAAttention, dense_causal_attention
from .config import QSAConfig
from .layout import QSABatch
from .model import QSADecoderLayer, QSAModel

__all__ = [
    "QSAAttention",
    "QSABatch",
    "QSAConfig",
    "QSADecoderLayer",
    "QSAModel",
    "dense_causal_attention",
]
