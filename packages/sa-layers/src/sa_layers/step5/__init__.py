"""Step-5 layers and model: SWA and CSA gated GQA attention, decoder layer and model (SEMANTICS §1, §4, §5)."""

from .attention import RegionRoutes, Step5Attention, apply_rotary, masked_attention, region_routes
from .config import Step5Config
from .layout import Step5Batch
from .model import Step5DecoderLayer, Step5Model

__all__ = [
    "RegionRoutes",
    "Step5Attention",
    "Step5Batch",
    "Step5Config",
    "Step5DecoderLayer",
    "Step5Model",
    "apply_rotary",
    "masked_attention",
    "region_routes",
]
