"""sa_layers: Step-5 and QSA attention layers, decoder layers and models on the sa packages."""

from .mlp import ClampedSwiGLUMLP
from .moe import Step5MLP, Step5MoE
from .norm import Step5RMSNorm, ZeroCenteredRMSNorm
from .output import CausalLMOutput
from .qsa import (
    QSAAttention,
    QSABatch,
    QSAConfig,
    QSADecoderLayer,
    QSAModel,
    dense_causal_attention,
)
from .rotary import rotary_table
from .routes import TokenRoutes, token_routes
from .step5 import (
    RegionRoutes,
    Step5Attention,
    Step5Batch,
    Step5Config,
    Step5DecoderLayer,
    Step5Model,
    region_routes,
)

__all__ = [
    "CausalLMOutput",
    "ClampedSwiGLUMLP",
    "QSAAttention",
    "QSABatch",
    "QSAConfig",
    "QSADecoderLayer",
    "QSAModel",
    "RegionRoutes",
    "Step5Attention",
    "Step5Batch",
    "Step5Config",
    "Step5DecoderLayer",
    "Step5MLP",
    "Step5MoE",
    "Step5Model",
    "Step5RMSNorm",
    "TokenRoutes",
    "ZeroCenteredRMSNorm",
    "dense_causal_attention",
    "region_routes",
    "rotary_table",
    "token_routes",
]
