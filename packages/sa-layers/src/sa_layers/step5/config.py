"""`Step5Config`: geometry of a Step-5 model (SEMANTICS §1.1); attention defaults are the reference's."""

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from sa_routing import Step5SparseConfig

from ..routes import ATTENTION_BACKENDS

LAYER_TYPES = ("swa", "csa", "dense")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Step5Config: {name} must be a positive int; got {value!r}")


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _per_layer(name: str, value: object, layers: int) -> tuple[float, ...]:
    """One float for every layer, or a sequence of `layers` floats, as a tuple of floats."""
    if _real(value):
        return (float(value),) * layers
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(
            f"Step5Config: {name} must be a float or a sequence of num_hidden_layers={layers} floats; "
            f"got {value!r}"
        )
    if len(value) != layers or not all(_real(v) for v in value):
        raise ValueError(
            f"Step5Config: {name} must hold num_hidden_layers={layers} floats; got {value!r}"
        )
    return tuple(float(v) for v in value)


@dataclass(frozen=True)
class Step5Config:
    """A Step-5 decoder: sliding-window (SWA) and compressed sparse (CSA) gated GQA layers.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers: model sizes (set them from
            the checkpoint; the defaults only make a valid config).
        num_attention_heads, num_attention_groups, head_dim: the main attention: query heads, KV
            groups (heads a multiple of groups), per-head width. `qkv_proj` is laid out
            `[groups, heads_per_group + 2, head_dim]` (the group's queries, its key, its value).
        sliding_window: SWA window `W`: key k is visible to query q iff `0 <= q - k < W`, same
            document.
        layer_types: per layer "swa", "csa" (routed by a `Step5SparseIndexer`) or "dense" (full
            causal attention within the document); default "csa" where `layer_idx % 4 == 3`, else
            "swa".
        rope_theta: RoPE base, one float or one per layer.
        partial_rotary_factor: fraction of each head RoPE rotates (NeoX half-split over the first
            `rotary_dim = int(head_dim · factor)` dims, even), one float or one per layer.
        rms_norm_eps: epsilon of the residual norms and the per-head q/k norms.
        swiglu_limits: clamp of the SwiGLU of every feed-forward (`<= 0` disables it), one float or
            one per layer.
        moe_layers: indices of the layers whose feed-forward is a `Step5MoE`; the others use
            `Step5MLP` of width `intermediate_size`. Default: none.
        num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size,
            routed_scaling_factor, norm_topk_prob: the MoE (read only when `moe_layers` is not
            empty; the shared width defaults to `moe_intermediate_size`).
        sparse_config: the CSA indexers' `Step5SparseConfig`; its `hidden_size` must be
            `hidden_size` and its `num_provider_groups` `num_attention_groups`; a per-layer
            `rope_theta` tuple holds `num_hidden_layers` entries.
        attn_backend: `sparse_region_attention` backend of the CSA layers: "auto", "flex",
            "gather", "fa4" or "reference" (the kernel refuses "fa4" with its reason). SWA and
            dense layers run FlexAttention on CUDA unless it is "reference", which runs the
            chunked masked-SDPA path there too (the only path on CPU).
        reuse_routes_on_recompute: under activation checkpointing, replay the forward's routes in
            the recompute instead of running the indexer again.
        initializer_range: std of the normal initialisation of projections and embeddings.
        tie_word_embeddings: share the LM head with the embedding.
    Raises:
        ValueError: at construction, naming the field: sizes that are not positive ints, heads not a
            multiple of groups, an unknown layer type or backend, per-layer lists of the wrong
            length, a rotary dim that is odd, zero or wider than the head, MoE layers out of range
            or repeated, a sparse_config of another width or group count.
        TypeError: sparse_config is not a `Step5SparseConfig`.
    """

    vocab_size: int = 128000
    hidden_size: int = 4096
    intermediate_size: int = 11264
    num_hidden_layers: int = 4
    num_attention_heads: int = 64
    num_attention_groups: int = 4
    head_dim: int = 192
    sliding_window: int = 512
    layer_types: tuple[str, ...] | None = None
    rope_theta: float | tuple[float, ...] = 10000.0
    partial_rotary_factor: float | tuple[float, ...] = 1.0
    rms_norm_eps: float = 1e-5
    swiglu_limits: float | tuple[float, ...] = 0.0
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 1024
    shared_expert_intermediate_size: int | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    sparse_config: Step5SparseConfig = field(default_factory=Step5SparseConfig)
    attn_backend: str = "auto"
    reuse_routes_on_recompute: bool = True
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_attention_groups",
            "head_dim",
            "sliding_window",
        ):
            _positive_int(name, getattr(self, name))
        layers = self.num_hidden_layers
        if self.num_attention_heads % self.num_attention_groups:
            raise ValueError(
                f"Step5Config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_attention_groups ({self.num_attention_groups})"
            )
        types = (
            tuple("csa" if i % 4 == 3 else "swa" for i in range(layers))
            if self.layer_types is None
            else tuple(self.layer_types)
        )
        if len(types) != layers:
            raise ValueError(
                f"Step5Config: layer_types must hold num_hidden_layers={layers} entries; got {len(types)}"
            )
        unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(
                f"Step5Config: layer_types must be one of {LAYER_TYPES}; got {unknown}"
            )
        object.__setattr__(self, "layer_types", types)
        if self.attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"Step5Config: attn_backend must be one of {ATTENTION_BACKENDS}; got {self.attn_backend!r}"
            )
        for name in ("rope_theta", "partial_rotary_factor", "swiglu_limits"):
            value = getattr(self, name)
            values = _per_layer(name, value, layers)
            object.__setattr__(self, name, float(value) if _real(value) else values)
            if name == "rope_theta" and not all(0 < v < math.inf for v in values):
                raise ValueError(f"Step5Config: rope_theta must be finite and > 0; got {value!r}")
            if name == "swiglu_limits" and any(math.isnan(v) for v in values):
                raise ValueError(f"Step5Config: swiglu_limits must not be NaN; got {value!r}")
        for i in range(layers):
            factor = self.partial_rotary_factor_for(i)
            rotary = self.rotary_dim_for(i)
            if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
                raise ValueError(
                    f"Step5Config: partial_rotary_factor of layer {i} ({factor}) must be in (0, 1] and give "
                    f"an even rotary_dim = int(head_dim · factor) >= 2; got rotary_dim {rotary}"
                )
        for name in ("rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if not _real(value) or not 0 < value < math.inf:
                raise ValueError(f"Step5Config: {name} must be a finite float > 0; got {value!r}")
        self._check_moe()
        self._check_sparse_config()

    def _check_moe(self) -> None:
        moe = self.moe_layers
        if isinstance(moe, str | bytes) or not isinstance(moe, Sequence):
            raise ValueError(
                f"Step5Config: moe_layers must be a tuple of layer indices; got {moe!r}"
            )
        moe = tuple(moe)
        bad = [
            i
            for i in moe
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hidden_layers
        ]
        if bad or len(set(moe)) != len(moe):
            raise ValueError(
                f"Step5Config: moe_layers must be distinct layer indices in [0, {self.num_hidden_layers}); "
                f"got {self.moe_layers!r}"
            )
        object.__setattr__(self, "moe_layers", moe)
        if not moe:
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            _positive_int(name, getattr(self, name))
        if self.shared_expert_intermediate_size is not None:
            _positive_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Step5Config: num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"num_experts ({self.num_experts})"
            )
        factor = self.routed_scaling_factor
        if not _real(factor) or not 0 < factor < math.inf:
            raise ValueError(
                f"Step5Config: routed_scaling_factor must be a finite float > 0; got {factor!r}"
            )

    def _check_sparse_config(self) -> None:
        sparse = self.sparse_config
        if not isinstance(sparse, Step5SparseConfig):
            raise TypeError(
                f"Step5Config: sparse_config must be a Step5SparseConfig; got {type(sparse).__name__}"
            )
        if sparse.hidden_size != self.hidden_size:
            raise ValueError(
                f"Step5Config: sparse_config.hidden_size ({sparse.hidden_size}) must equal hidden_size "
                f"({self.hidden_size})"
            )
        if sparse.num_provider_groups != self.num_attention_groups:
            raise ValueError(
                f"Step5Config: sparse_config.num_provider_groups ({sparse.num_provider_groups}) must equal "
                f"num_attention_groups ({self.num_attention_groups})"
            )
        theta = sparse.rope_theta
        if isinstance(theta, Sequence) and len(theta) != self.num_hidden_layers:
            raise ValueError(
                f"Step5Config: a per-layer sparse_config.rope_theta must hold num_hidden_layers="
                f"{self.num_hidden_layers} entries; got {len(theta)}"
            )

    # -- per-layer values ------------------------------------------------------------------------

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_attention_groups

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "csa")

    def rope_theta_for(self, layer_idx: int) -> float:
        return _per_layer("rope_theta", self.rope_theta, self.num_hidden_layers)[layer_idx]

    def partial_rotary_factor_for(self, layer_idx: int) -> float:
        factors = _per_layer(
            "partial_rotary_factor", self.partial_rotary_factor, self.num_hidden_layers
        )
        return factors[layer_idx]

    def rotary_dim_for(self, layer_idx: int) -> int:
        return int(self.head_dim * self.partial_rotary_factor_for(layer_idx))

    def swiglu_limit_for(self, layer_idx: int) -> float:
        return _per_layer("swiglu_limits", self.swiglu_limits, self.num_hidden_layers)[layer_idx]

    def rotary_keys(self) -> tuple[tuple[float, int], ...]:
        """The distinct `(rope_theta, rotary_dim)` pairs of the layers, in first-use order."""
        return tuple(
            dict.fromkeys(
                (self.rope_theta_for(i), self.rotary_dim_for(i))
                for i in range(self.num_hidden_layers)
            )
        )
