"""`QSAContextParallel`: what a QSA indexer needs to know about its context-parallel shard (SEMANTICS §5).

Built once per model forward and passed to every QSA layer. Host tuples hold the global padding
lengths and packed boundaries so that the indexer needs no synchronisation of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sa_cp import ContextParallelLayout, group_rank_and_size

from .lengths import _is_int, _right_padded_lengths_host, validate_cu_seqlens

_OP = "QSAContextParallel"


@dataclass(frozen=True)
class QSAContextParallel:
    """This rank's contiguous query shard and the global facts its routes depend on.

    Attributes:
        layout: the shard (`sa_cp.ContextParallelLayout`: group, rank, size, local_start, local_length,
            global_length = real tokens in the global sequence, padded_length).
        sequence_lengths: global per-batch-row lengths (right padding), or `None` (every row has
            `global_length` tokens).
        cu_seqlens: global packed-document boundaries (batch 1), or `None`.
    """

    layout: ContextParallelLayout
    sequence_lengths: tuple[int, ...] | None = None
    cu_seqlens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ContextParallelLayout):
            raise TypeError(
                f"{_OP}: layout must be an sa_cp.ContextParallelLayout; got {type(self.layout).__name__}"
            )
        if self.sequence_lengths is not None and self.cu_seqlens is not None:
            raise ValueError(
                f"{_OP}: give either sequence_lengths (padding) or cu_seqlens (packing), not both"
            )
        if self.sequence_lengths is not None:
            if isinstance(self.sequence_lengths, (str, bytes, torch.Tensor)) or not all(
                _is_int(x) for x in self.sequence_lengths
            ):
                raise TypeError(
                    f"{_OP}: sequence_lengths must be a tuple of ints (one per batch row); "
                    f"got {self.sequence_lengths!r}"
                )
            object.__setattr__(
                self, "sequence_lengths", tuple(int(x) for x in self.sequence_lengths)
            )
            bad = [x for x in self.sequence_lengths if not 0 <= x <= self.global_length]
            if bad:
                raise ValueError(
                    f"{_OP}: sequence_lengths must lie in [0, {self.global_length}]; got {bad[:4]}"
                )
        if self.cu_seqlens is not None:  # kept as the validated host tuple
            bounds = validate_cu_seqlens(_OP, self.cu_seqlens, self.global_length)
            object.__setattr__(self, "cu_seqlens", bounds)

    group = property(lambda self: self.layout.group)
    rank = property(lambda self: self.layout.rank)
    size = property(lambda self: self.layout.size)
    local_start = property(lambda self: self.layout.local_start)
    local_length = property(lambda self: self.layout.local_length)
    global_length = property(lambda self: self.layout.global_length)
    padded_length = property(lambda self: self.layout.padded_length)

    @classmethod
    def create(
        cls,
        local_length: int,
        *,
        group: Any | None = None,
        global_length: int | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
    ) -> QSAContextParallel:
        """The context of this rank in `group` (`None`: a single rank; `dist.group.WORLD`: every rank).

        Args:
            local_length: tokens per shard.
            global_length: real global tokens; defaults to `size * local_length`.
            attention_mask: the GLOBAL right-padding mask [batch, global_length or padded_length] (0/1).
            cu_seqlens: GLOBAL packed-document boundaries (batch 1).
        Raises:
            ValueError: the shard does not cover the global length, or the mask is not a right-padded
                binary mask, or the boundaries are invalid.
        """
        rank, size = group_rank_and_size(group)
        total = size * local_length if global_length is None else global_length
        layout = ContextParallelLayout(rank, size, total, local_length, group=group)
        return cls.from_layout(layout, attention_mask=attention_mask, cu_seqlens=cu_seqlens)

    @classmethod
    def from_layout(
        cls,
        layout: ContextParallelLayout,
        *,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
    ) -> QSAContextParallel:
        """The context of an `sa_cp.ContextParallelLayout` (its group is the one keys are gathered on)."""
        lengths = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[1] not in (
                layout.global_length,
                layout.padded_length,
            ):
                raise ValueError(
                    f"{_OP}.create: attention_mask must be the global [batch, {layout.global_length}] padding "
                    f"mask; got shape {tuple(attention_mask.shape)}"
                )
            host = _right_padded_lengths_host(
                f"{_OP}.create", attention_mask, *attention_mask.shape
            )
            lengths = tuple(min(x, layout.global_length) for x in host)
        bounds = (
            None
            if cu_seqlens is None
            else validate_cu_seqlens(f"{_OP}.create", cu_seqlens, layout.global_length)
        )
        return cls(layout, lengths, bounds)

    def check_compress_ratio(self, op: str, compress_ratio: int) -> None:
        """Raise unless every shard holds whole compressed blocks."""
        if self.local_length % compress_ratio:
            raise ValueError(
                f"{op}: under context parallelism the local length ({self.local_length}) must be a multiple "
                f"of the compress ratio ({compress_ratio})"
            )
