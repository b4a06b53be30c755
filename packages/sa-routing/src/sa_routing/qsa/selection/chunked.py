"""The fast paths of QSA route selection: chunked, causal-trimmed, no full sort.

Rows come in segments (a run of query rows of one batch row or one packed document, with
consecutive document positions and one block range). Per segment, dense rows (`v <= budget/c`)
are written arithmetically without scoring; sparse rows are scored in chunks against only the
blocks the chunk's last row can see, and the top `budget/c` blocks come from
`sa_kernels.stable_topk` (score descending, block id ascending; no sort of a row), ascending.

Two scorers (SEMANTICS §2 says block scores are FP32):
- "triton" (CUDA by default): `triton_kernels.qsa_block_scores_triton`, FP32 accumulation of BF16/FP32
  operands with the causal mask in the kernel, the precision of the reference models. Its routes
  equal the FP64 oracle's except at near-ties (blocks whose exact scores differ by FP32 rounding).
- "reference" (CPU by default): `reference.qsa_block_scores`, the oracle's own order-independent FP64
  arithmetic rounded once to FP32, so the routes equal the oracle's bit for bit.
Either way a (row, block) score never depends on the chunk, so chunking never changes the routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sa_kernels import stable_topk
from sa_kernels.backend import resolve_backend
from sa_kernels.stable_topk import stable_topk_workspace_bytes

from .reference import qsa_block_scores

SCORE_TEMP_BUDGET_BYTES = 256 * 1024 * 1024
"""Bound on a chunk's score temporaries (bytes)."""

_TEMP_BYTES_PER_SCORE = 24
"""Upper bound of the temporaries alive per scored (row, block): FP64 sum and head product while
scoring (16), then FP32 scores, int32 top-k keys and a boolean mask while selecting (< 16)."""


def triton_bytes_per_score(columns: int, device: torch.device) -> int:
    """Temporary bytes per scored (row, block) on the Triton path for rows of `columns` blocks: the
    FP32 score, plus whatever `stable_topk` allocates to select from it."""
    return 4 + stable_topk_workspace_bytes(columns, torch.float32, device)


_TEMP_BYTES_PER_KEPT = 32
"""Per row and kept block: the top-k values, indices and sorted indices (plus `8 * c` for the
expanded token ids and their concatenation with the tail)."""


@dataclass(frozen=True)
class RouteSegment:
    """A run of query rows that share one document and one block range.

    Attributes:
        row_start: flat index (`batch * queries + row`) of the first row.
        rows: rows in the run.
        first_position: document position `p` of the first row (the next rows follow on).
        block_start: flat index of the document's block 0 in the flattened keys.
        token_start: added to every emitted id (the document start in packed sequences).
    """

    row_start: int
    rows: int
    first_position: int
    block_start: int
    token_start: int


def padded_segments(
    lengths: list[int], rows: int, position_offset: int, blocks_per_batch: int
) -> tuple[RouteSegment, ...]:
    """One segment per batch row: rows whose global position is below the row's length."""
    segments = []
    for b, length in enumerate(lengths):
        count = min(max(length - position_offset, 0), rows)
        if count:
            segments.append(RouteSegment(b * rows, count, position_offset, b * blocks_per_batch, 0))
    return tuple(segments)


def packed_segments(
    cu_seqlens: tuple[int, ...], rows: int, position_offset: int, block_starts: tuple[int, ...]
) -> tuple[RouteSegment, ...]:
    """One segment per document that meets the local rows `[offset, offset + rows)` of a packed sequence."""
    segments = []
    stop_rows = position_offset + rows
    for d in range(len(cu_seqlens) - 1):
        start, stop = max(cu_seqlens[d], position_offset), min(cu_seqlens[d + 1], stop_rows)
        if start < stop:
            segments.append(
                RouteSegment(
                    start - position_offset,
                    stop - start,
                    start - cu_seqlens[d],
                    block_starts[d],
                    cu_seqlens[d],
                )
            )
    return tuple(segments)


def _dense_rows(position: torch.Tensor, token_start: int, width: int) -> torch.Tensor:
    slots = torch.arange(width, dtype=torch.int32, device=position.device)
    return torch.where(slots <= position[:, None], slots + token_start, -1)


def _top_blocks(scores: torch.Tensor, visible: torch.Tensor, kept: int) -> torch.Tensor:
    """Ascending ids of the `kept` best visible blocks per row (score descending, id ascending)."""
    columns = torch.arange(scores.shape[1], device=scores.device)
    scores.masked_fill_(columns >= visible[:, None], float("-inf"))
    return stable_topk(scores, kept)


def _chunk_rows(columns: int, kept: int, c: int, bytes_per_score: int) -> int:
    """Rows per chunk that keep one chunk's score temporaries within `SCORE_TEMP_BUDGET_BYTES`."""
    per_row = columns * bytes_per_score + kept * (_TEMP_BYTES_PER_KEPT + 8 * c)
    return max(1, SCORE_TEMP_BUDGET_BYTES // per_row)


def _sparse_rows(
    blocks: torch.Tensor, position: torch.Tensor, token_start: int, c: int
) -> torch.Tensor:
    """Expand ascending blocks to tokens, then append the tail `v*c … p`, then -1."""
    rows, kept = blocks.shape
    tokens = (
        blocks.to(torch.int32)[:, :, None] * c
        + torch.arange(c, dtype=torch.int32, device=blocks.device)
    ).view(rows, kept * c)
    tail_start = (position + 1) // c * c
    tail = tail_start[:, None] + torch.arange(c - 1, dtype=torch.int32, device=blocks.device)
    tail = torch.where(tail <= position[:, None], tail + token_start, -1)
    return torch.cat((tokens + token_start, tail), dim=1)


def select_segments(
    queries_for: Callable[[int, int], torch.Tensor],
    keys: torch.Tensor,
    segments: tuple[RouteSegment, ...],
    out: torch.Tensor,
    *,
    token_budget: int,
    compress_ratio: int,
    query_chunk_size: int | None = None,
    backend: str = "auto",
) -> None:
    """Write every segment's routes into `out`; rows outside the segments are left as they are.

    Args:
        queries_for: `(flat_start, flat_stop) -> [rows, heads, dim]` index queries of those flat rows
            (a slice, or computed on demand so that no full query tensor exists).
        keys: [blocks, dim], flattened over batch rows or documents.
        out: int32 [flat rows, token_budget + compress_ratio - 1], already -1 where no segment writes.
        query_chunk_size: rows per chunk; `None` keeps the score temporaries within 256 MiB.
        backend: the scorer: "auto" (Triton on CUDA, FP64 reference on CPU), "triton" (on CPU through
            Triton's interpreter, `TRITON_INTERPRET=1`) or "reference".
    """
    c = compress_ratio
    kept = token_budget // c
    width = token_budget + c - 1
    dense_limit = (kept + 1) * c - 1  # positions below it see at most `kept` blocks
    device = out.device
    use_triton = resolve_backend("select_qsa_token_ids", backend, keys, out) == "triton"
    if use_triton:
        from .triton_kernels import qsa_block_scores_triton, score_dtype

        operand = None  # the kernel's operand dtype, fixed by the first chunk's queries
    else:
        keys = keys.double()  # once, not per chunk (qsa_block_scores scores in FP64)
    dense_chunk = query_chunk_size or max(1, SCORE_TEMP_BUDGET_BYTES // (width * 8))
    for seg in segments:
        dense = min(max(dense_limit - seg.first_position, 0), seg.rows)
        for start in range(0, dense, dense_chunk):
            stop = min(start + dense_chunk, dense)
            position = seg.first_position + torch.arange(
                start, stop, dtype=torch.int32, device=device
            )
            out[seg.row_start + start : seg.row_start + stop] = _dense_rows(
                position, seg.token_start, width
            )
        if dense == seg.rows:
            continue
        most_visible = (seg.first_position + seg.rows) // c
        bytes_per_score = (
            triton_bytes_per_score(most_visible, device) if use_triton else _TEMP_BYTES_PER_SCORE
        )
        chunk = query_chunk_size or _chunk_rows(most_visible, kept, c, bytes_per_score)
        for start in range(dense, seg.rows, chunk):
            stop = min(start + chunk, seg.rows)
            position = seg.first_position + torch.arange(
                start, stop, dtype=torch.int32, device=device
            )
            columns = (seg.first_position + stop) // c  # blocks the chunk's last row can see
            queries = queries_for(seg.row_start + start, seg.row_start + stop)
            window = keys[seg.block_start : seg.block_start + columns]
            if use_triton:
                if operand is None:
                    operand = score_dtype(queries, keys)
                    keys = keys.to(operand).contiguous()
                    window = keys[seg.block_start : seg.block_start + columns]
                scores = qsa_block_scores_triton(
                    queries.to(operand).contiguous(), window, seg.first_position + start, c
                )
                del queries
                blocks = stable_topk(scores, kept)  # the kernel already masked invisible blocks
                del scores
            else:
                # handed over, not kept: _top_blocks masks the scores in place and frees them
                blocks = _top_blocks(qsa_block_scores(queries, window), (position + 1) // c, kept)
                del queries
            out[seg.row_start + start : seg.row_start + stop] = _sparse_rows(
                blocks, position, seg.token_start, c
            )
