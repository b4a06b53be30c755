"""sa_kernels: see the package README."""

from sa_kernels.clamped_swiglu import clamped_swiglu
from sa_kernels.e4m3 import round_to_e4m3
from sa_kernels.indexer_score import indexer_score_tile
from sa_kernels.layer_norm import layer_norm_e2
from sa_kernels.norm_rope_e4m3 import rms_norm_rope_e4m3
from sa_kernels.region_bitmap import pack_region_bitmap
from sa_kernels.rms_norm import grouped_rms_norm, rms_norm, rms_norm_with_rstd
from sa_kernels.sparse_gqa import RouteBlockMask, build_route_block_mask, sparse_gqa_attention
from sa_kernels.sparse_region_attention import sparse_region_attention
from sa_kernels.stable_topk import stable_topk

__all__ = [
    "RouteBlockMask",
    "build_route_block_mask",
    "clamped_swiglu",
    "grouped_rms_norm",
    "indexer_score_tile",
    "layer_norm_e2",
    "pack_region_bitmap",
    "rms_norm",
    "rms_norm_rope_e4m3",
    "rms_norm_with_rstd",
    "round_to_e4m3",
    "sparse_gqa_attention",
    "sparse_region_attention",
    "stable_topk",
]
