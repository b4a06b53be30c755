"""The indexers' units as a `DistillationProblem`: QSA compressed blocks, CSA regions.

QSA: block `b` of a document is its tokens `[b*c, (b+1)*c)` (document-local); a trailing partial group
belongs to no block. A query at document position `p` sees `v = (p + 1) // c` complete blocks and
carries a loss iff `v > budget // c`. Its candidates are blocks `[0, v)` ("dense_warmup", a
`DistillationProblem`) or the blocks of its route ("sparse", a `SlotProblem`, whose attention also
takes the tail tokens `v*c … p`: the suffix).

CSA: units are `RegionMetadata`'s global regions. A query carries a loss iff it is sparse
(`metadata.sparse_queries`). Its candidates are the historical regions of its document
`[first region, current)` ("dense_warmup") or its selection minus the current region ("sparse",
whose attention also takes the visible tokens of the current region: the suffix).

Everything the host needs (the tiles) comes from host lengths, packed boundaries or the metadata's
score tiles; the CSA tiles' first key rows come back in one synchronisation.
"""

from __future__ import annotations

import itertools

import torch

from ..qsa.lengths import packed_block_starts
from ..qsa.selection.chunked import packed_segments, padded_segments
from ..step5.layouts import RegionMetadata
from .blockwise import DistillationProblem, DistillationTile, split_rows
from .slots import SlotProblem, sorted_slots


def qsa_problem(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    compress_ratio: int,
    token_budget: int,
    lengths: list[int] | None,
    bounds: tuple[int, ...] | None,
    query_start: int,
    routes: torch.Tensor | None,
    softmax_scale: float,
    lse: torch.Tensor | None,
    query_block: int,
    key_block: int,
    backend: str = "torch",
) -> DistillationProblem | SlotProblem:
    """The QSA problem of validated inputs (`lengths` for right padding or `bounds` for packing): a
    `SlotProblem` when `routes` are given ("sparse"), else a `DistillationProblem`."""
    batch, queries = query.shape[:2]
    total = key.shape[1]
    device = query.device
    c, kept = compress_ratio, token_budget // compress_ratio
    token = torch.arange(total, device=device)
    unit_count = total // c if bounds is None else packed_block_starts(bounds, c)[-1]
    if bounds is None:
        length = torch.tensor(lengths, device=device)[:, None]  # [B, 1]
        key_documents = torch.where(token < length, 0, -1)
        positions = token.expand(batch, total)
        key_units = torch.where(token < length // c * c, token // c, -1)
        document_first_block = torch.zeros(1, dtype=torch.int64, device=device)
        document_start = torch.zeros(1, dtype=torch.int64, device=device)
    else:
        sizes = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], device=device)
        documents = torch.repeat_interleave(
            torch.arange(len(sizes), device=device), sizes, output_size=bounds[-1]
        )  # output_size: no synchronisation
        documents = torch.cat(
            [documents, documents.new_full((total - bounds[-1],), -1)]
        )  # the tail past the last document is padding
        document_start = torch.tensor(bounds[:-1], device=device)
        document_first_block = torch.tensor(packed_block_starts(bounds, c)[:-1], device=device)
        own = documents.clamp_min(0)
        positions = token - document_start[own]
        complete = (positions < sizes[own] // c * c) & (documents >= 0)
        key_units = torch.where(complete, document_first_block[own] + positions // c, -1)
        key_documents, positions, key_units = documents[None], positions[None], key_units[None]
    rows = slice(query_start, query_start + queries)
    query_documents = key_documents[:, rows]
    own = query_documents.clamp_min(0)
    visible_blocks = (positions[:, rows] + 1) // c
    first_block = document_first_block[own]
    loss_rows = (query_documents >= 0) & (visible_blocks > kept)

    dense_limit = (kept + 1) * c - 1  # document positions below it route densely: no loss
    tiles: list[DistillationTile] = []
    if bounds is None:
        segments = padded_segments(lengths, queries, query_start, total // c)
    else:
        segments = packed_segments(bounds, queries, query_start, packed_block_starts(bounds, c))
    for seg in segments:
        b, first = divmod(seg.row_start, queries) if bounds is None else (0, seg.row_start)
        skip = max(dense_limit - seg.first_position, 0)
        if skip >= seg.rows:
            continue
        unit_base = 0 if bounds is None else seg.block_start
        position_of_row0 = seg.first_position - first  # document position of local row 0

        def ranges(q0: int, q1: int, unit_base=unit_base, p0=position_of_row0, seg=seg):
            last_position = p0 + q1 - 1
            return (
                unit_base,
                unit_base + (last_position + 1) // c,
                seg.token_start,
                query_start + q1,
            )

        tiles += split_rows(b, first + skip, first + seg.rows, query_block, ranges)
    start_row = torch.arange(query_start, query_start + queries, device=device)
    if routes is not None:
        starts = routes[..., : kept * c : c][:, None]  # [B, 1, Q, kept]: each block's first token
        unit_of_row = key_units.expand(batch, total)

        def units_of(rows: torch.Tensor) -> torch.Tensor:
            found = unit_of_row.gather(1, rows.clamp_min(0).long().flatten(1)).view_as(rows)
            return torch.where(rows >= 0, found, -1)

        slot_units, slot_valid = sorted_slots(starts, unit_count, lookup=units_of)
        suffix = (start_row - positions[:, rows] + visible_blocks * c).expand(batch, queries)
        width = 1 << max(c - 2, 0).bit_length()  # the tail holds at most c - 1 tokens
        tail = suffix[..., None] + torch.arange(width, device=device)
        live = (tail <= start_row[:, None]) & (query_documents >= 0).expand(batch, queries)[
            ..., None
        ]
        return SlotProblem(
            query=query,
            key=key,
            softmax_scale=softmax_scale,
            query_start=query_start,
            key_documents=key_documents.expand(batch, total),
            query_documents=query_documents.expand(batch, queries),
            loss_rows=loss_rows.expand(batch, queries),
            groups=1,
            slot_units=slot_units,
            slot_valid=slot_valid,
            unit_rows=_qsa_unit_rows(key_units, positions, c, unit_count).expand(batch, -1, -1),
            suffix_start=suffix,
            suffix_rows=torch.where(live, tail, -1).to(torch.int32),
            lse=lse,
            tiles=tuple(tiles),
            backend=backend,
        )
    document_start = unit_rows = None
    if backend == "triton":
        document_start = (start_row - positions[:, rows]).expand(batch, queries)
        unit_rows = _qsa_unit_rows(key_units, positions, c, unit_count)
    return DistillationProblem(
        query=query,
        key=key,
        softmax_scale=softmax_scale,
        query_start=query_start,
        key_documents=key_documents.expand(batch, total),
        query_documents=query_documents.expand(batch, queries),
        key_units=key_units.expand(batch, total),
        loss_rows=loss_rows.expand(batch, queries),
        groups=1,
        candidate_start=first_block.expand(batch, queries),
        candidate_stop=(first_block + visible_blocks).expand(batch, queries),
        lse=lse,
        tiles=tuple(tiles),
        key_block=key_block,
        backend=backend,
        document_start=document_start,
        unit_rows=unit_rows,
    )


def _qsa_unit_rows(
    key_units: torch.Tensor, positions: torch.Tensor, c: int, count: int
) -> torch.Tensor:
    """int32 [B, count, UNIT]: the key rows of each block (UNIT = c rounded up to a power of two, the
    extra slots -1), from each key's block and document position."""
    width = 1 << (c - 1).bit_length()
    batch, total = key_units.shape
    slot = torch.where(key_units >= 0, key_units, count) * width + positions % c
    rows = torch.arange(total, device=key_units.device, dtype=torch.int32).expand(batch, total)
    table = torch.full((batch, (count + 1) * width), -1, device=key_units.device, dtype=torch.int32)
    return table.scatter_(1, slot, rows).view(batch, count + 1, width)[:, :count]


def csa_problem(
    query: torch.Tensor,
    key: torch.Tensor,
    metadata: RegionMetadata,
    *,
    groups: int,
    region_ids: torch.Tensor | None,
    softmax_scale: float,
    lse: torch.Tensor | None,
    query_block: int,
    key_block: int,
    backend: str = "torch",
) -> DistillationProblem | SlotProblem:
    """The CSA problem of validated inputs: a `SlotProblem` when `region_ids` [B, G, Q, topk + 1]
    are given ("sparse"), else a `DistillationProblem`."""
    count = metadata.region_count
    current = metadata.current
    # the first key row of each query's current region (its document offset 0 is never padding)
    current_start = (
        metadata.region_sources[..., 0].long().gather(1, current.clamp_min(0))
        if count
        else torch.zeros_like(current)
    )

    # merge the score tiles of a batch row into tiles of at most query_block rows
    spans: list[list[int]] = []  # [batch, q0, q1, first_region, past_region]
    for b, q0, q1, first, past in metadata.score_tiles:
        if spans and spans[-1][0] == b and q1 - spans[-1][1] <= query_block:
            span = spans[-1]
            span[2], span[3], span[4] = q1, min(span[3], first), max(span[4], past)
        else:
            spans.append([b, q0, q1, first, past])
    tiles: list[DistillationTile] = []
    if spans:
        firsts = torch.tensor([[s[0], s[3]] for s in spans], device=key.device)
        key_starts = metadata.region_sources[firsts[:, 0], firsts[:, 1], 0].tolist()  # one sync
        for (b, q0, q1, first, past), k0 in zip(spans, key_starts, strict=True):
            tiles += split_rows(
                b,
                q0,
                q1,
                query_block,
                lambda _q0, a1, first=first, past=past, k0=k0: (
                    first,
                    past,
                    k0,
                    metadata.query_start + a1,
                ),
            )
    sources = metadata.region_sources
    width = 1 << (sources.shape[-1] - 1).bit_length()
    if region_ids is not None:
        # historical regions only: the current one is the suffix
        slot_units, slot_valid = sorted_slots(region_ids, count, exclude=current[:, None, :, None])
        # the suffix: the current region's tokens up to the query
        start_row = torch.arange(metadata.query_start, metadata.query_start + metadata.queries)
        start_row = start_row.to(current.device)
        if count:
            tail = sources.gather(
                1, current.clamp_min(0)[..., None].expand(-1, -1, sources.shape[-1])
            )
        else:
            tail = torch.full((*current.shape, sources.shape[-1]), -1, device=current.device)
        live = (tail >= 0) & (tail <= start_row[:, None]) & (current >= 0)[..., None]
        return SlotProblem(
            query=query,
            key=key,
            softmax_scale=softmax_scale,
            query_start=metadata.query_start,
            key_documents=metadata.documents,
            query_documents=metadata.query_documents,
            loss_rows=metadata.sparse_queries,
            groups=groups,
            slot_units=slot_units,
            slot_valid=slot_valid,
            unit_rows=torch.nn.functional.pad(sources, (0, width - sources.shape[-1]), value=-1).to(
                torch.int32
            ),
            suffix_start=current_start,
            suffix_rows=torch.where(live, tail, -1).to(torch.int32),
            lse=lse,
            tiles=tuple(tiles),
            backend=backend,
        )
    document_start = unit_rows = None
    if backend == "triton":
        unit_rows = torch.nn.functional.pad(sources, (0, width - sources.shape[-1]), value=-1)
        document_start = (
            sources[..., 0].long().gather(1, metadata.query_first_region.clamp_min(0))
            if count
            else torch.zeros_like(current)
        )
    return DistillationProblem(
        query=query,
        key=key,
        softmax_scale=softmax_scale,
        query_start=metadata.query_start,
        key_documents=metadata.documents,
        query_documents=metadata.query_documents,
        key_units=metadata.token_regions,
        loss_rows=metadata.sparse_queries,
        groups=groups,
        candidate_start=metadata.query_first_region,
        candidate_stop=current,
        lse=lse,
        tiles=tuple(tiles),
        key_block=key_block,
        backend=backend,
        document_start=document_start,
        unit_rows=unit_rows.to(torch.int32) if unit_rows is not None else None,
    )
