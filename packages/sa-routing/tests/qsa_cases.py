"""Test support for the QSA tests (not part of the package): packed positions, small indexers,
random selection inputs and the selection-equals-oracle check."""

from __future__ import annotations

import itertools

import torch

from sa_routing import QSAIndexer, QSAIndexerConfig, select_qsa_token_ids
from sa_routing.qsa.selection.reference import select_qsa_token_ids_reference


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


def selection_inputs(
    kind: str,
    batch: int,
    rows: int,
    heads: int,
    dim: int,
    blocks: int,
    dtype: torch.dtype,
    seed: int,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries [batch, rows, heads, dim] and compressed keys [batch, blocks, 1, dim] in `dtype`
    on `device`, drawn from a CPU generator seeded with `seed`. `kind`:

    - "normal": standard normal;
    - "tied": normal, then a third of the keys repeat one key (equal scores) and every fifth query
      row is all -1, so it scores the blocks made non-negative (every seventh, among others) exactly 0;
    - "integer": integers in [-2, 2], every fourth key repeated: every product, dot and head sum is
      exact in FP32 and scores tie often.
    """
    generator = torch.Generator().manual_seed(seed)
    if kind == "integer":
        queries = torch.randint(-2, 3, (batch, rows, heads, dim), generator=generator)
        keys = torch.randint(-2, 3, (batch, blocks, 1, dim), generator=generator)
        keys[:, 3::4] = keys[:, 1:2]
    elif kind in ("normal", "tied"):
        queries = torch.randn(batch, rows, heads, dim, generator=generator)
        keys = torch.randn(batch, blocks, 1, dim, generator=generator)
        if kind == "tied":
            keys[:, 2::3] = keys[:, 1:2]
            queries[:, ::5] = -1.0
            keys[:, ::7] = keys[:, ::7].abs()
    else:
        raise ValueError(f"selection_inputs: kind must be normal, tied or integer; got {kind!r}")
    return queries.to(dtype).to(device), keys.to(dtype).to(device)


def assert_routes_equal_oracle(
    queries: torch.Tensor,
    keys: torch.Tensor,
    lengths: list[int] | None,
    *,
    token_budget: int,
    compress_ratio: int,
    query_position_offset: int = 0,
    chunk_sizes: tuple[int | None, ...] = (None,),
    **options,
) -> torch.Tensor:
    """Assert that `select_qsa_token_ids` (with `options`, e.g. backend) equals the oracle bit for bit
    for every `query_chunk_size` in `chunk_sizes`, the global length being offset + rows; return the
    routes."""
    seq = None if lengths is None else torch.tensor(lengths, device=queries.device)
    expected = select_qsa_token_ids_reference(
        queries,
        keys,
        seq,
        token_budget=token_budget,
        compress_ratio=compress_ratio,
        query_position_offset=query_position_offset,
    )
    for chunk in chunk_sizes:
        routes = select_qsa_token_ids(
            queries,
            keys,
            seq,
            token_budget=token_budget,
            compress_ratio=compress_ratio,
            query_chunk_size=chunk,
            query_position_offset=query_position_offset,
            global_sequence_length=query_position_offset + queries.shape[1],
            **options,
        )
        assert torch.equal(routes, expected), f"query_chunk_size={chunk}"
    return routes
