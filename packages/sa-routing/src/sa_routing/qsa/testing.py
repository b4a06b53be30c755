"""Builders shared by the QSA tests and benchmarks: rotary tables, packed positions, small indexers."""

from __future__ import annotations

import itertools

import torch

from sa_routing import QSAIndexer, QSAIndexerConfig


def rotary_table(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """`cat(cos, sin)` [..., rotary_dim] FP32 at integer `positions` [...]."""
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = positions.to(torch.float64)[..., None] * inv
    return torch.cat((angle.cos(), angle.sin()), dim=-1).float()


def document_positions(cu_seqlens: tuple[int, ...], total: int) -> torch.Tensor:
    """Document-relative positions [total] of a packed sequence (padding tail counts on from 0)."""
    parts = [torch.arange(stop - start) for start, stop in itertools.pairwise(cu_seqlens)]
    parts.append(torch.arange(total - cu_seqlens[-1]))
    return torch.cat(parts)


def small_indexer(dtype: torch.dtype, seed: int = 0, **overrides) -> QSAIndexer:
    """A randomly initialised indexer with non-power-of-two geometry."""
    fields = dict(
        hidden_size=40,
        indexer_n_heads=3,
        indexer_head_dim=16,
        indexer_budget=12,
        indexer_compress_ratio=3,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    indexer = QSAIndexer(QSAIndexerConfig(**fields))
    indexer.init_weights(init_std=0.2)
    with torch.no_grad():
        indexer.q_norm.weight.uniform_(0.5, 1.5)
        indexer.k_norm.weight.uniform_(0.5, 1.5)
    return indexer.to(dtype)
