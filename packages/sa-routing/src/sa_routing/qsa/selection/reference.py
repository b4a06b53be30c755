"""The oracle of QSA route selection: plain PyTorch, one full sort per query row (SEMANTICS §2).

Scores every compressed block of the row's batch, masks the invisible ones, sorts with a stable
descending sort (so equal scores keep block-id order), keeps the first `min(v, budget/c)` blocks,
emits them ascending, expanded to tokens, then the tail. Chunked over query rows only so that it also
runs at benchmark lengths; the chunk size never changes the result.
"""

from __future__ import annotations

import itertools
import math

import torch


def qsa_block_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`Σ_h relu(q_h · k_b) / sqrt(D)`, returned in FP32.

    The dots, the head sum and the scale run in FP64 and are rounded to FP32 once **(decision)**:
    products of BF16 (or FP16) inputs are exact in FP64 and their sum over a head dim is exact for
    any realistic spread of magnitudes, so the score does not depend on the GEMM's summation order.
    That is what makes routes independent of the chunk size, of the matrix shapes a chunk produces
    (a one-row chunk runs a GEMV) and of the device, while being at least as accurate as FP32
    accumulation. Shared by the oracle and the CPU path. **SEMANTICS deviation:** §2 says FP32 scores;
    this FP64 arithmetic defines the exact selection, while the GPU path
    (`triton_kernels.qsa_block_scores_triton`) accumulates in FP32 like the reference models and agrees
    with it except at near-ties.

    Args:
        queries: [rows, heads, dim] floating.
        keys: [blocks, dim] floating.
    Returns:
        float32 [rows, blocks], every value >= 0.
    """
    keys64 = keys.double()
    scores = queries.new_zeros(queries.shape[0], keys.shape[0], dtype=torch.float64)
    for head in range(queries.shape[1]):
        scores.add_(torch.mm(queries[:, head].double(), keys64.t()).clamp_min_(0.0))
    return scores.div_(math.sqrt(queries.shape[-1])).float()


def select_qsa_token_ids_reference(
    index_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    sequence_lengths: torch.Tensor | None,
    *,
    token_budget: int,
    compress_ratio: int,
    query_position_offset: int = 0,
    query_chunk_size: int = 256,
) -> torch.Tensor:
    """Route token ids for right-padded batches, by full stable sort (no validation: the oracle).

    Args:
        index_queries: [batch, queries, heads, dim], normalised and rotated.
        compressed_keys: [batch, blocks, 1, dim].
        sequence_lengths: int [batch] logical lengths, or None (no padding).
    Returns:
        int32 [batch, queries, token_budget + compress_ratio - 1]; valid ids first, then -1.
    """
    batch, rows, _, _ = index_queries.shape
    blocks = compressed_keys.shape[1]
    c = compress_ratio
    kept = token_budget // c
    width = token_budget + c - 1
    device = index_queries.device
    lengths = (
        [query_position_offset + rows] * batch
        if sequence_lengths is None
        else sequence_lengths.tolist()
    )
    out = torch.full((batch, rows, width), -1, dtype=torch.int32, device=device)
    columns = torch.arange(blocks, device=device)
    slots = torch.arange(width, device=device)
    keys = compressed_keys[:, :, 0].float()
    for b in range(batch):
        for start in range(0, rows, query_chunk_size):
            stop = min(start + query_chunk_size, rows)
            position = query_position_offset + torch.arange(start, stop, device=device)
            visible = (position + 1) // c
            scores = qsa_block_scores(index_queries[b, start:stop].float(), keys[b])
            scores.masked_fill_(columns >= visible[:, None], float("-inf"))
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :kept]
            count = visible.clamp(max=kept)
            chosen = torch.where(
                torch.arange(order.shape[1], device=device) < count[:, None], order, blocks
            )
            chosen = torch.sort(chosen, dim=1).values
            tokens = (chosen[:, :, None] * c + torch.arange(c, device=device)).flatten(1)
            tokens = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]))
            block_slots = count[:, None] * c
            tail_slots = block_slots + (position + 1 - visible * c)[:, None]
            tail = visible[:, None] * c + slots - block_slots
            ids = torch.where(
                slots < block_slots, tokens, torch.where(slots < tail_slots, tail, -1)
            )
            ids = torch.where((position < lengths[b])[:, None], ids, -1)
            out[b, start:stop] = ids.to(torch.int32)
    return out


def select_qsa_token_ids_packed_reference(
    index_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    cu_seqlens: tuple[int, ...],
    *,
    token_budget: int,
    compress_ratio: int,
) -> torch.Tensor:
    """Packed (THD, batch 1) oracle: every document routed on its own, ids shifted by its start.

    Args:
        index_queries: [1, tokens, heads, dim] over the whole packed sequence.
        compressed_keys: [1, blocks, 1, dim]: each document's blocks in document order
            (document d's first block is `Σ_{e<d} len_e // c`).
        cu_seqlens: document boundaries; tokens at or past `cu_seqlens[-1]` get only -1.
    Returns:
        int32 [1, tokens, token_budget + compress_ratio - 1].
    """
    c = compress_ratio
    width = token_budget + c - 1
    out = torch.full(
        (1, index_queries.shape[1], width), -1, dtype=torch.int32, device=index_queries.device
    )
    first_block = 0
    for start, stop in itertools.pairwise(cu_seqlens):
        blocks = (stop - start) // c
        ids = select_qsa_token_ids_reference(
            index_queries[:, start:stop],
            compressed_keys[:, first_block : first_block + blocks],
            None,
            token_budget=token_budget,
            compress_ratio=c,
        )
        out[:, start:stop] = torch.where(ids >= 0, ids + start, -1)
        first_block += blocks
    return out


def rows_differing_beyond_near_ties(
    index_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    routes: torch.Tensor,
    expected: torch.Tensor,
    *,
    token_budget: int,
    compress_ratio: int,
    query_position_offset: int = 0,
    relative_tolerance: float = 1e-5,
) -> list[tuple[int, int]]:
    """(batch, row) of every row where `routes` differ from `expected` by more than near-ties.

    For right-padded (not packed) routes of the same queries and keys. A differing row is accepted
    only if it is sparse, its tail is the same, and every block in one selection but not the other
    has an exact (FP64, unrounded) score within `relative_tolerance` of the row's k-th best exact
    score: two scorers that round differently may only disagree there.

    Args:
        index_queries: [batch, queries, heads, dim]; compressed_keys: [batch, blocks, 1, dim].
        routes, expected: int32 [batch, queries, token_budget + compress_ratio - 1].
    Returns:
        The offending (batch, row) pairs; empty when the routes agree up to near-ties.
    """
    c, kept = compress_ratio, token_budget // compress_ratio
    bad = []
    differing = (routes != expected).any(dim=-1).nonzero().tolist()
    for b, i in differing:
        visible = (query_position_offset + i + 1) // c
        if visible <= kept or not torch.equal(routes[b, i, kept * c :], expected[b, i, kept * c :]):
            bad.append((b, i))
            continue
        got = set((routes[b, i, : kept * c : c] // c).tolist())
        want = set((expected[b, i, : kept * c : c] // c).tolist())
        queries = index_queries[b, i].double()
        keys = compressed_keys[b, :visible, 0].double()
        exact = (queries @ keys.t()).clamp_min(0.0).sum(dim=0) / math.sqrt(queries.shape[-1])
        kth = exact.topk(kept).values[-1]
        gap = (exact[sorted(got ^ want)] - kth).abs()
        if not bool((gap <= relative_tolerance * kth.abs()).all()):
            bad.append((b, i))
    return bad
