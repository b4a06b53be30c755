"""sa_layers: building blocks of Step-5 and QSA decoder layers (attention layers are not built yet)."""

from .mlp import ClampedSwiGLUMLP
from .norm import Step5RMSNorm

__all__ = ["ClampedSwiGLUMLP", "Step5RMSNorm"]
