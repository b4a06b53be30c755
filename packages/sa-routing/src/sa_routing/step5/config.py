"""`Step5SparseConfig`: the geometry of one Step-5 CSA indexer (SEMANTICS §1.2)."""

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Step5SparseConfig:
    """Indexer geometry; defaults are the reference checkpoint's.

    Attributes:
        proxy_dim: indexer head dim `D` (queries, the key, the compression logits).
        index_heads: indexer query heads in all, split evenly into `num_provider_groups`.
        num_provider_groups: provider groups `G`, one per KV group of the main attention.
        rope_dim: leading dims of each head that RoPE rotates (NeoX half-split pairs).
        rope_theta: RoPE base; one float for every layer, or one per layer indexed by `layer_idx`.
        region_size: tokens per region `R`; regions restart at every document start.
        topk: historical regions kept per (query, group); the current region is added on top.
        norm_eps: epsilon of `q_norm` (RMSNorm) and `k_norm` (LayerNorm).
        hidden_size: width of the hidden states the projections read (the model's hidden size).
    """

    proxy_dim: int = 256
    index_heads: int = 16
    num_provider_groups: int = 4
    rope_dim: int = 32
    rope_theta: float | tuple[float, ...] = 10000.0
    region_size: int = 8
    topk: int = 512
    norm_eps: float = 1e-5
    hidden_size: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "proxy_dim",
            "index_heads",
            "num_provider_groups",
            "region_size",
            "topk",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Step5SparseConfig: {name} must be a positive int; got {value!r}")
        if self.index_heads % self.num_provider_groups:
            raise ValueError(
                "Step5SparseConfig: index_heads must be a multiple of num_provider_groups; "
                f"got index_heads={self.index_heads}, num_provider_groups={self.num_provider_groups}"
            )
        if (
            isinstance(self.rope_dim, bool)
            or not isinstance(self.rope_dim, int)
            or self.rope_dim < 0
            or self.rope_dim % 2
            or self.rope_dim > self.proxy_dim
        ):
            raise ValueError(
                f"Step5SparseConfig: rope_dim must be an even int in [0, proxy_dim={self.proxy_dim}]; "
                f"got {self.rope_dim!r}"
            )
        thetas = self.rope_theta if isinstance(self.rope_theta, Sequence) else (self.rope_theta,)
        if not thetas or any(
            isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < math.inf
            for t in thetas
        ):
            raise ValueError(
                f"Step5SparseConfig: rope_theta must be a positive float or a non-empty tuple of them; got {self.rope_theta!r}"
            )
        if (
            isinstance(self.norm_eps, bool)
            or not isinstance(self.norm_eps, int | float)
            or not 0 < self.norm_eps < math.inf
        ):
            raise ValueError(
                f"Step5SparseConfig: norm_eps must be a finite float > 0; got {self.norm_eps!r}"
            )

    @property
    def heads_per_group(self) -> int:
        """Indexer query heads per provider group `H`."""
        return self.index_heads // self.num_provider_groups

    def rope_theta_for(self, layer_idx: int) -> float:
        """The RoPE base of layer `layer_idx` (the single value, or the layer's entry of the tuple)."""
        if isinstance(self.rope_theta, Sequence):
            if not 0 <= layer_idx < len(self.rope_theta):
                raise ValueError(
                    f"Step5SparseConfig.rope_theta_for: layer_idx must be in [0, {len(self.rope_theta)}); got {layer_idx}"
                )
            return float(self.rope_theta[layer_idx])
        return float(self.rope_theta)
