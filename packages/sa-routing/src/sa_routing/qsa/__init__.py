"""QSA: the Qwen-style compressed-block indexer and its token route selection (SEMANTICS §2, §5)."""

from .config import QSAIndexerConfig
from .context_parallel import QSAContextParallel
from .indexer import QSAIndexer, QSARMSNorm
from .lengths import packed_block_starts, right_padded_sequence_lengths
from .rope import apply_qsa_rope, rotary_table
from .selection import select_qsa_token_ids

__all__ = [
    "QSAContextParallel",
    "QSAIndexer",
    "QSAIndexerConfig",
    "QSARMSNorm",
    "apply_qsa_rope",
    "packed_block_starts",
    "right_padded_sequence_lengths",
    "rotary_table",
    "select_qsa_token_ids",
]
