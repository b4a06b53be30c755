"""sa_layers: Step-5 and QSA attention layers, decoder layers and models on the sa packages."""

from .mlp import ClampedSwiGLUMLP
from .norm import Step5RMSNorm, ZeroCenteredRMSNorm
from .qsa import (
    CausalLMOutput,
    QSAAttention,
    QSABatch,
    QSAConfig,
    QSADecoderLayer,
    QSAModel,
    dense_causal_attention,
)
from .rotary import rotary_table
from .routes import TokenRoutes, token_routes

__all__ = [
    "CausalLMOutput",
    "ClampedSwiGLUMLP",
    "QSAAttention",
    "QSABatch",
    "QSAConfig",
    "QSADecoderLayer",
    "QSAModel",
    "Step5RMSNorm",
    "TokenRoutes",
    "ZeroCenteredRMSNorm",
    "dense_causal_attention",
    "rotary_table",
    "token_routes",
]
