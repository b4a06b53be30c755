"""`QSABatch`: what every layer of one QSA model call shares, computed once in the model's forward."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from sa_routing import QSAContextParallel

from ..rotary import rotary_table

_OP = "QSAModel.forward"


@dataclass(frozen=True)
class QSABatch:
    """Lengths, documents, the CP shard and the rotary table of one model call.

    Attributes:
        cp: this rank's shard and the global lengths / packed boundaries (`QSAContextParallel`; a
            single rank without context parallelism). Every QSA layer's indexer reads it, so no
            layer reads a mask back from the device.
        freqs: float32 [batch or 1, local_length, rotary_dim], `cat(cos, sin)` at each local token's
            position (document-relative when packed), shared by attention and indexer.
        key_documents: int64 [batch, global_length]: document of every key token, −1 for padding.
        plain_causal: True when there is no padding, no packing and one rank (dense layers then run
            plain causal SDPA).
        dense_mask: bool [batch, 1, local_length, global_length], what a dense layer's query sees
            (`dense_visibility`), built once per call for every dense layer and the dense warm-up;
            None when `plain_causal` (SDPA's causal path needs no mask) or when the model has no
            dense attention (`QSABatch.create(dense_mask=False)`).
    """

    cp: QSAContextParallel
    freqs: torch.Tensor
    key_documents: torch.Tensor
    plain_causal: bool
    dense_mask: torch.Tensor | None = None

    batch_size = property(lambda self: self.key_documents.shape[0])
    local_length = property(lambda self: self.cp.local_length)

    @property
    def query_documents(self) -> torch.Tensor:
        """int64 [batch, local_length]: the document of every local query, −1 for padding."""
        start = self.cp.local_start
        return self.key_documents[:, start : start + self.cp.local_length]

    def sparse_query_count(self, dense_positions: int) -> int:
        """Queries of the whole (global) batch past the dense prefix of their document: those that
        carry an indexer loss. From host lengths, no sync."""
        cp = self.cp
        if cp.cu_seqlens is not None:
            lengths = [b - a for a, b in itertools.pairwise(cp.cu_seqlens)]
        else:
            lengths = cp.sequence_lengths or (cp.global_length,) * self.batch_size
        return sum(max(0, n - dense_positions) for n in lengths)

    @classmethod
    @torch.compiler.disable  # host validation and layout, once per call: eager under torch.compile
    def create(
        cls,
        input_ids: torch.Tensor,
        *,
        rotary_dim: int,
        rope_theta: float,
        compress_ratio: int,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
        cp_context: QSAContextParallel | None = None,
        dense_mask: bool = True,
    ) -> QSABatch:
        """Validate a batch at the model boundary and lay it out (at most one host sync).

        Args:
            input_ids: int [batch, local_length] (this rank's shard under context parallelism).
            attention_mask: [batch, length] right padding (1 = token), or None; not with cp_context.
            cu_seqlens: int [documents + 1] packed boundaries of a batch of one row, ending at the
                length; not with attention_mask or cp_context.
            cp_context: the shard (`QSAContextParallel.create(local_length, group=..., attention_mask=
                global_mask or cu_seqlens=global_bounds)`).
            dense_mask: build `dense_mask` (unless the batch is plain causal); False when no layer
                attends densely.
        Raises:
            TypeError: input_ids is not an integer tensor; cp_context is not a QSAContextParallel.
            ValueError: shapes, a mask that is not right-padded binary, cu_seqlens that do not increase
                or do not end at the length, two of mask / cu_seqlens / cp_context at once, a shard
                length that is not a multiple of the compress ratio.
        """
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.is_floating_point()
            or input_ids.is_complex()
            or input_ids.dtype == torch.bool
        ):
            got = (
                input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            )
            raise TypeError(
                f"{_OP}: input_ids must be an integer tensor [batch, sequence]; got {got}"
            )
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(
                f"{_OP}: input_ids must be [batch, sequence] with at least one token; got shape "
                f"{tuple(input_ids.shape)}"
            )
        batch, rows = input_ids.shape
        given = [
            n
            for n, v in (
                ("attention_mask", attention_mask),
                ("cu_seqlens", cu_seqlens),
                ("cp_context", cp_context),
            )
            if v is not None
        ]
        if len(given) > 1:
            hint = (
                " (under context parallelism pass the global mask or cu_seqlens to QSAContextParallel.create)"
                if "cp_context" in given
                else ""
            )
            raise ValueError(f"{_OP}: {' and '.join(given)} exclude each other; got both{hint}")
        if cp_context is None:
            if cu_seqlens is not None and batch != 1:
                raise ValueError(
                    f"{_OP}: cu_seqlens (packed documents) needs batch 1; got batch {batch}"
                )
            try:
                cp_context = QSAContextParallel.create(
                    rows, attention_mask=attention_mask, cu_seqlens=cu_seqlens
                )
            except ValueError as error:  # name the model boundary, not the helper
                raise ValueError(str(error).replace("QSAContextParallel.create", _OP)) from None
            if cp_context.cu_seqlens is not None and cp_context.cu_seqlens[-1] != rows:
                raise ValueError(
                    f"{_OP}: cu_seqlens must end at the sequence length {rows}; got {cp_context.cu_seqlens[-1]}"
                )
        elif not isinstance(cp_context, QSAContextParallel):
            raise TypeError(
                f"{_OP}: cp_context must be a QSAContextParallel; got {type(cp_context).__name__}"
            )
        if rows != cp_context.local_length:
            raise ValueError(
                f"{_OP}: input_ids holds {rows} tokens per row; cp_context.local_length is {cp_context.local_length}"
            )
        if cp_context.size > 1:
            cp_context.check_compress_ratio(f"{_OP}: cp_context", compress_ratio)
        if cp_context.cu_seqlens is not None and batch != 1:
            raise ValueError(
                f"{_OP}: cu_seqlens (packed documents) needs batch 1; got batch {batch}"
            )

        device = input_ids.device
        total = cp_context.padded_length
        index = torch.arange(total, device=device)
        if cp_context.cu_seqlens is not None:
            bounds = cp_context.cu_seqlens
            documents = torch.full((total,), -1, dtype=torch.int64, device=device)
            positions = index.clone()
            for doc, (start, stop) in enumerate(itertools.pairwise(bounds)):
                documents[start:stop] = doc
                positions[start:stop] -= start
            documents = documents[None]
        else:
            lengths = cp_context.sequence_lengths or (cp_context.global_length,) * batch
            if len(lengths) != batch:
                raise ValueError(
                    f"{_OP}: cp_context.sequence_lengths has {len(lengths)} rows; input_ids has {batch}"
                )
            limit = torch.tensor(lengths, device=device)[:, None]
            documents = torch.where(index < limit, 0, -1)
            positions = index
        local = slice(cp_context.local_start, cp_context.local_start + rows)
        freqs = rotary_table(positions[local], rotary_dim, rope_theta)[None]
        plain = (
            cp_context.size == 1
            and cp_context.cu_seqlens is None
            and (cp_context.sequence_lengths is None or min(cp_context.sequence_lengths) == rows)
        )
        key_documents = documents.expand(batch, total)
        mask = None
        if dense_mask and not plain:
            mask = dense_visibility(key_documents, cp_context.local_start, rows)
        return cls(cp_context, freqs, key_documents, plain, mask)


def dense_visibility(key_documents: torch.Tensor, query_start: int, rows: int) -> torch.Tensor:
    """What each query of a dense (causal, in-document) layer sees.

    Args:
        key_documents: int64 [batch, global_length], document of every key, −1 for padding.
        query_start: global position of the first local query; rows: local queries.
    Returns:
        bool [batch, 1, rows, global_length]: key k is visible to query q iff both lie in one
        document and k <= q. A padding query sees only its own key, so that its softmax is defined
        (its output is zeroed).
    """
    device = key_documents.device
    own = torch.arange(query_start, query_start + rows, device=device)
    queries = key_documents[:, query_start : query_start + rows]
    causal = torch.arange(key_documents.shape[1], device=device) <= own[:, None]
    visible = (queries[:, :, None] == key_documents[:, None, :]) & (queries >= 0)[:, :, None]
    visible &= causal
    visible[:, torch.arange(rows, device=device), own] |= queries < 0
    return visible[:, None]
