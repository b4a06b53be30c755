"""sa_routing: see the package README."""

from sa_routing.distillation import (
    IndexerTraining,
    csa_indexer_distillation_loss,
    qsa_indexer_distillation_loss,
)
from sa_routing.qsa import (
    QSAContextParallel,
    QSAIndexer,
    QSAIndexerConfig,
    apply_qsa_rope,
    right_padded_sequence_lengths,
    rotary_table,
    select_qsa_token_ids,
)
from sa_routing.step5 import (
    CausalDocumentLayout,
    RegionMetadata,
    RegionSelection,
    Step5IndexerLayerNorm,
    Step5IndexerRMSNorm,
    Step5IndexerRotaryEmbedding,
    Step5IndexerWeightProjection,
    Step5SparseConfig,
    Step5SparseIndexer,
    gather_region_payload,
    region_metadata,
    region_summaries,
    select_regions,
)

__all__: list[str] = [
    # Step-5 CSA (sa_routing.step5)
    "CausalDocumentLayout",
    "IndexerTraining",
    "QSAContextParallel",
    "QSAIndexer",
    "QSAIndexerConfig",
    "RegionMetadata",
    "RegionSelection",
    "Step5IndexerLayerNorm",
    "Step5IndexerRMSNorm",
    "Step5IndexerRotaryEmbedding",
    "Step5IndexerWeightProjection",
    "Step5SparseConfig",
    "Step5SparseIndexer",
    "apply_qsa_rope",
    "csa_indexer_distillation_loss",
    "gather_region_payload",
    "qsa_indexer_distillation_loss",
    "region_metadata",
    "region_summaries",
    "right_padded_sequence_lengths",
    "rotary_table",
    "select_qsa_token_ids",
    "select_regions",
]
