"""Step-5 CSA routing: region metadata, the learned indexer and region selection (SEMANTICS §1.2–§1.3)."""

from .config import Step5SparseConfig
from .indexer import Step5SparseIndexer
from .layouts import CausalDocumentLayout, RegionMetadata, RegionSelection
from .metadata import region_metadata
from .norms import Step5IndexerLayerNorm, Step5IndexerRMSNorm
from .projection import Step5IndexerWeightProjection
from .rotary import Step5IndexerRotaryEmbedding
from .selection import select_regions
from .summaries import gather_region_payload, region_summaries

__all__ = [
    "CausalDocumentLayout",
    "RegionMetadata",
    "RegionSelection",
    "Step5IndexerLayerNorm",
    "Step5IndexerRMSNorm",
    "Step5IndexerRotaryEmbedding",
    "Step5IndexerWeightProjection",
    "Step5SparseConfig",
    "Step5SparseIndexer",
    "gather_region_payload",
    "region_metadata",
    "region_summaries",
    "select_regions",
]
