"""`select_qsa_token_ids`: top-k compressed blocks per query, expanded to token ids (SEMANTICS §2).

`reference.py` is the oracle: FP64 block scores rounded once to FP32, a full stable sort per row;
it defines the exact selection. `chunked.py` is the path every call takes (causal-trimmed chunks,
`sa_kernels.stable_topk`, no sort of a row) with one of two scorers:
- CUDA (`backend="auto"`/`"triton"`): the Triton kernel of `triton_kernels.py`, FP32 accumulation as
  SEMANTICS §2 and the reference models score. Its routes equal the oracle's except at near-ties:
  a block may differ only where its exact score is within FP32 rounding of the k-th best score.
- CPU (`"auto"`/`"reference"`): the oracle's FP64 scores, so the routes equal the oracle's bit for bit.
**SEMANTICS deviation (documented):** §2 says block scores are FP32; the oracle scores in FP64 (the
exact selection, independent of summation order), the GPU path in FP32 (the reference models'
precision); they agree except at near-ties.
"""

from __future__ import annotations

import torch

from ..lengths import packed_block_starts, validate_cu_seqlens
from .chunked import (
    SCORE_TEMP_BUDGET_BYTES,
    RouteSegment,
    packed_segments,
    padded_segments,
    select_segments,
)

__all__ = [
    "SCORE_TEMP_BUDGET_BYTES",
    "RouteSegment",
    "select_qsa_token_ids",
    "validate_route_arguments",
]

_OP = "select_qsa_token_ids"


def validate_route_arguments(
    op: str, token_budget: int, compress_ratio: int, query_chunk_size: int | None
) -> None:
    """The budget/ratio/chunk rules shared by the public entry points."""
    for name, value in (("token_budget", token_budget), ("compress_ratio", compress_ratio)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be an int; got {type(value).__name__}")
    if compress_ratio <= 1:
        raise ValueError(f"{op}: compress_ratio must be > 1; got {compress_ratio}")
    if token_budget <= 0 or token_budget % compress_ratio:
        raise ValueError(
            f"{op}: token_budget must be a positive multiple of compress_ratio ({compress_ratio}); got {token_budget}"
        )
    if query_chunk_size is not None and (
        not isinstance(query_chunk_size, int)
        or isinstance(query_chunk_size, bool)
        or query_chunk_size <= 0
    ):
        raise ValueError(
            f"{op}: query_chunk_size must be None or a positive int; got {query_chunk_size!r}"
        )


def select_qsa_token_ids(
    index_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    sequence_lengths: torch.Tensor | list[int] | tuple[int, ...] | None,
    *,
    token_budget: int,
    compress_ratio: int,
    query_chunk_size: int | None = None,
    query_position_offset: int = 0,
    global_sequence_length: int | None = None,
    cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Top `token_budget / compress_ratio` compressed blocks per query, expanded to token ids.

    Row `i` is the query at global position `p = query_position_offset + i`; it sees `v = (p + 1) // c`
    complete blocks. Dense rows (`v <= budget / c`) take every visible block; sparse rows take the best
    `budget / c` blocks by `Σ_h relu(q_h · k_b) / sqrt(D)`, ties to the lower block id. Blocks are
    emitted ascending, each as tokens `b*c … b*c + c − 1`, then the tail tokens `v*c … p`; the rest is -1.
    A dense row is exactly `0 … p`. Rows at or past their row's length are all -1.

    Scores: on CUDA a Triton kernel accumulates in FP32 (bf16/fp16 operands when queries and keys
    share that dtype, FP32 otherwise), so rows may differ from the FP64 oracle
    (`reference.select_qsa_token_ids_reference`) at near-ties only; on CPU the scores are the
    oracle's FP64 ones rounded to FP32 and the routes equal the oracle's bit for bit.

    Args:
        index_queries: [batch, local_queries, index_heads, index_dim] floating, normalised and rotated.
        compressed_keys: [batch, blocks, 1, index_dim] floating. Packed: batch 1 and each document's
            blocks in document order (document d's first block is `Σ_{e<d} len_e // c`).
        sequence_lengths: int [batch] logical lengths in global positions (right padding), as a tensor
            (read back once) or a host list/tuple (no synchronisation), or `None`
            (every row has `global_sequence_length` tokens). Must be `None` with `cu_seqlens`.
        token_budget: tokens per sparse row before the tail; a multiple of `compress_ratio`.
        compress_ratio: tokens per block (`c`), > 1.
        query_chunk_size: rows scored at once; `None` keeps score temporaries within 256 MiB.
            Never changes the result.
        query_position_offset: global position of row 0 (context parallelism: `rank * local_length`).
        global_sequence_length: length of the global (padded) sequence; defaults to
            `query_position_offset + local_queries`.
        cu_seqlens: packed documents (batch 1), global boundaries `0 = cu[0] < … <= global length`:
            every document is routed on its own, positions and blocks restart at its start, and its ids
            are offset by its start, so routes never leave their document.
        backend: the block scorer: "auto" (Triton on CUDA, the FP64 scores on CPU), "triton" (on CPU
            through Triton's interpreter, needs `TRITON_INTERPRET=1`) or "reference" (FP64 on any device).
    Returns:
        int32 [batch, local_queries, token_budget + compress_ratio - 1]: global token ids, valid ids
        first (ascending), then -1.
    Raises:
        ValueError: shapes disagree, `token_budget % compress_ratio != 0`, `compress_ratio <= 1`,
            lengths outside `[0, global_sequence_length]`, too few blocks for the longest row
            (`blocks < max(length // c)`), inconsistent offset/global length, bad `cu_seqlens`
            (not increasing, batch != 1, given with `sequence_lengths`), an unknown `backend`.
        TypeError: non-floating queries or keys, non-integer lengths or budget.
        RuntimeError: backend="triton" on CPU tensors without TRITON_INTERPRET=1.
    """
    validate_route_arguments(_OP, token_budget, compress_ratio, query_chunk_size)
    if index_queries.dim() != 4:
        raise ValueError(
            f"{_OP}: index_queries must be [batch, queries, heads, dim]; got shape {tuple(index_queries.shape)}"
        )
    batch, rows, heads, dim = index_queries.shape
    if heads < 1 or dim < 1:  # no head or no channel: every score 0 or NaN, routes meaningless
        raise ValueError(
            f"{_OP}: index_queries needs at least one head and one dim; got shape "
            f"{tuple(index_queries.shape)}"
        )
    if (
        compressed_keys.dim() != 4
        or compressed_keys.shape[0] != batch
        or compressed_keys.shape[2] != 1
        or compressed_keys.shape[3] != dim
    ):
        raise ValueError(
            f"{_OP}: compressed_keys must be [batch, blocks, 1, dim] with batch == {batch} and dim == "
            f"index_queries.shape[-1] ({dim}); got {tuple(compressed_keys.shape)}"
        )
    if not index_queries.is_floating_point() or not compressed_keys.is_floating_point():
        raise TypeError(
            f"{_OP}: index_queries and compressed_keys must be floating point; got "
            f"{index_queries.dtype} and {compressed_keys.dtype}"
        )
    if index_queries.device != compressed_keys.device:
        raise ValueError(
            f"{_OP}: index_queries and compressed_keys must be on one device; got "
            f"{index_queries.device} and {compressed_keys.device}"
        )
    offset = query_position_offset
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"{_OP}: query_position_offset must be a non-negative int; got {offset!r}")
    total = offset + rows if global_sequence_length is None else global_sequence_length
    if not isinstance(total, int) or isinstance(total, bool) or total < offset + rows:
        raise ValueError(
            f"{_OP}: global_sequence_length must be an int >= query_position_offset + queries "
            f"({offset} + {rows}); got {global_sequence_length!r}"
        )
    blocks = compressed_keys.shape[1]
    c = compress_ratio

    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"{_OP}: cu_seqlens (packed documents) needs batch 1; got batch {batch}"
            )
        if sequence_lengths is not None:
            raise ValueError(f"{_OP}: pass either cu_seqlens or sequence_lengths, not both")
        bounds = validate_cu_seqlens(_OP, cu_seqlens, total)
        block_starts = packed_block_starts(bounds, c)
        if blocks < block_starts[-1]:
            raise ValueError(
                f"{_OP}: compressed_keys holds {blocks} blocks; the packed documents need {block_starts[-1]} "
                "(Σ document_length // compress_ratio)"
            )
        segments = packed_segments(bounds, rows, offset, block_starts)
    else:
        if sequence_lengths is None:
            lengths = [total] * batch
        elif isinstance(sequence_lengths, (list, tuple)):  # host lengths: no synchronisation
            if len(sequence_lengths) != batch or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in sequence_lengths
            ):
                raise ValueError(
                    f"{_OP}: sequence_lengths must hold {batch} ints (one per batch row); got {sequence_lengths!r}"
                )
            lengths = list(sequence_lengths)
        else:
            if (
                not isinstance(sequence_lengths, torch.Tensor)
                or sequence_lengths.is_floating_point()
                or sequence_lengths.is_complex()
                or sequence_lengths.dtype == torch.bool
            ):
                raise TypeError(
                    f"{_OP}: sequence_lengths must be an integer tensor, a list of ints or None"
                )
            if tuple(sequence_lengths.shape) != (batch,):
                raise ValueError(
                    f"{_OP}: sequence_lengths must be [batch] = ({batch},); got {tuple(sequence_lengths.shape)}"
                )
            lengths = [int(x) for x in sequence_lengths.tolist()]  # the one host synchronisation
        bad = [x for x in lengths if not 0 <= x <= total]
        if bad:
            raise ValueError(
                f"{_OP}: sequence_lengths must lie in [0, {total}] (the global length); got {bad[:4]}"
            )
        needed = max(lengths, default=0) // c
        if blocks < needed:
            raise ValueError(
                f"{_OP}: compressed_keys holds {blocks} blocks; the longest row ({max(lengths)} tokens) needs "
                f"{needed} (length // compress_ratio)"
            )
        segments = padded_segments(lengths, rows, offset, blocks)

    width = token_budget + c - 1
    out = torch.full((batch * rows, width), -1, dtype=torch.int32, device=index_queries.device)
    flat_queries = index_queries.reshape(batch * rows, *index_queries.shape[2:])
    select_segments(
        lambda start, stop: flat_queries[start:stop],
        compressed_keys.reshape(batch * blocks, dim),
        segments,
        out,
        token_budget=token_budget,
        compress_ratio=c,
        query_chunk_size=query_chunk_size,
        backend=backend,
    )
    return out.view(batch, rows, width)
