"""`QSAConfig`: geometry of a QSA model (SEMANTICS §2); defaults are the reference checkpoint's."""

import math
from dataclasses import dataclass, field

from sa_routing import QSAIndexerConfig

from ..routes import ATTENTION_BACKENDS

LAYER_TYPES = ("qsa", "dense")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"QSAConfig: {name} must be a positive int; got {value!r}")


@dataclass(frozen=True)
class QSAConfig:
    """A QSA decoder: gated GQA attention routed by a frozen compressed-block indexer.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers: model sizes.
        num_attention_heads, num_key_value_heads, head_dim: the main attention (GQA, heads a multiple
            of KV heads). The query projection is `[heads, 2 · head_dim]`: query, then its gate.
        partial_rotary_factor: fraction of each head that RoPE rotates (`rotary_dim` dims, even).
            The indexer's queries and keys use the same rotary table (decision: one table per model
            forward), so `rotary_dim <= indexer_head_dim`.
        rope_theta: RoPE base.
        rms_norm_eps: epsilon of every RMSNorm (residual, q/k and indexer norms).
        layer_types: per layer "qsa" (routed) or "dense" (plain causal attention); default all "qsa".
        indexer_n_heads, indexer_head_dim, indexer_budget, indexer_compress_ratio,
            indexer_query_chunk_size: the indexer (`sa_routing.QSAIndexerConfig`); the budget is a
            multiple of the compress ratio.
        attn_backend: `sparse_gqa_attention` backend of the QSA layers: "auto", "flex", "gather",
            "fa4" or "reference".
        reuse_routes_on_recompute: under activation checkpointing, replay the forward's routes in
            the recompute instead of running the indexer again.
        initializer_range: std of the normal initialisation of projections and embeddings.
        tie_word_embeddings: share the LM head with the embedding.
    Raises:
        ValueError: at construction, naming the field: sizes that are not positive ints, heads not a
            multiple of KV heads, a budget not a multiple of the compress ratio, an unknown layer type
            or backend, a layer_types list of the wrong length, a rotary dim that is odd or too large.
    """

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 4
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    layer_types: tuple[str, ...] | None = None
    indexer_n_heads: int = 4
    indexer_head_dim: int = 128
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    indexer_query_chunk_size: int | None = None
    attn_backend: str = "auto"
    reuse_routes_on_recompute: bool = True
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    indexer: QSAIndexerConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            _positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"QSAConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        types = (
            ("qsa",) * self.num_hidden_layers
            if self.layer_types is None
            else tuple(self.layer_types)
        )
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"QSAConfig: layer_types must hold num_hidden_layers={self.num_hidden_layers} entries; "
                f"got {len(types)}"
            )
        unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
        if unknown:
            raise ValueError(f"QSAConfig: layer_types must be 'qsa' or 'dense'; got {unknown}")
        object.__setattr__(self, "layer_types", types)
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"QSAConfig: attn_backend must be one of {ATTENTION_BACKENDS}; got {self.attn_backend!r}"
            )
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"QSAConfig: partial_rotary_factor must be in (0, 1]; got {self.partial_rotary_factor!r}"
            )
        rotary = self.rotary_dim
        if rotary < 2 or rotary % 2 or rotary > min(self.head_dim, self.indexer_head_dim):
            raise ValueError(
                f"QSAConfig: rotary_dim = head_dim · partial_rotary_factor ({rotary}) must be even, >= 2 "
                f"and <= min(head_dim, indexer_head_dim) = {min(self.head_dim, self.indexer_head_dim)}"
            )
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < math.inf
            ):
                raise ValueError(f"QSAConfig: {name} must be a finite float > 0; got {value!r}")
        try:
            indexer = QSAIndexerConfig(
                hidden_size=self.hidden_size,
                indexer_n_heads=self.indexer_n_heads,
                indexer_head_dim=self.indexer_head_dim,
                indexer_budget=self.indexer_budget,
                indexer_compress_ratio=self.indexer_compress_ratio,
                rms_norm_eps=self.rms_norm_eps,
                query_chunk_size=self.indexer_query_chunk_size,
            )
        except ValueError as error:  # name the QSAConfig field
            raise ValueError(str(error).replace("QSAIndexerConfig: ", "QSAConfig: ")) from None
        object.__setattr__(self, "indexer", indexer)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)
