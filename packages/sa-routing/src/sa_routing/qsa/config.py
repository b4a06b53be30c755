"""`QSAIndexerConfig`: the frozen QSA indexer's geometry and routing budget (SEMANTICS §2)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class QSAIndexerConfig:
    """Geometry of the QSA compressed-block indexer.

    Attributes:
        hidden_size: model width feeding the fused index projection.
        indexer_n_heads: index query heads (`H_idx`).
        indexer_head_dim: index head dim (`D_idx`); scores are divided by its square root.
        indexer_kv_heads: index key heads; must be 1.
        indexer_budget: tokens routed per sparse query (before the tail); a multiple of the ratio.
        indexer_compress_ratio: tokens per compressed block (`c`), > 1.
        rms_norm_eps: epsilon of the query and key RMSNorms.
        query_chunk_size: query rows scored at once; `None` sizes chunks so that the score
            temporaries stay within 256 MiB. Never changes the routes.
    """

    hidden_size: int
    indexer_n_heads: int = 4
    indexer_head_dim: int = 128
    indexer_kv_heads: int = 1
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    rms_norm_eps: float = 1e-6
    query_chunk_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "indexer_n_heads", "indexer_head_dim", "indexer_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"QSAIndexerConfig: {name} must be a positive int; got {value!r}")
        if self.indexer_kv_heads != 1:
            raise ValueError(
                f"QSAIndexerConfig: indexer_kv_heads must be 1 (one shared key head); got {self.indexer_kv_heads!r}"
            )
        ratio = self.indexer_compress_ratio
        if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio <= 1:
            raise ValueError(
                f"QSAIndexerConfig: indexer_compress_ratio must be an int > 1; got {ratio!r}"
            )
        if self.indexer_budget % ratio:
            raise ValueError(
                f"QSAIndexerConfig: indexer_budget ({self.indexer_budget}) must be divisible by "
                f"indexer_compress_ratio ({ratio})"
            )
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise ValueError(
                f"QSAIndexerConfig: rms_norm_eps must be a finite float > 0; got {eps!r}"
            )
        chunk = self.query_chunk_size
        if chunk is not None and (
            not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0
        ):
            raise ValueError(
                f"QSAIndexerConfig: query_chunk_size must be None or a positive int; got {chunk!r}"
            )

    @property
    def route_width(self) -> int:
        """Slots per query row: `budget + c - 1` (the budget plus the partial tail block)."""
        return self.indexer_budget + self.indexer_compress_ratio - 1

    @property
    def dense_positions(self) -> int:
        """Positions `p < (budget/c + 1)·c − 1` route densely to `0 … p` (2051 with defaults)."""
        return (
            self.indexer_budget // self.indexer_compress_ratio + 1
        ) * self.indexer_compress_ratio - 1
