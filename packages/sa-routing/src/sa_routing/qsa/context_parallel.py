"""`QSAContextParallel`: what a QSA indexer needs to know about its context-parallel shard (SEMANTICS §5).

Built once per model forward and passed to every QSA layer. Host tuples hold the global padding
lengths and packed boundaries so that the indexer needs no synchronisation of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .lengths import _right_padded_lengths_host, validate_cu_seqlens

_OP = "QSAContextParallel"


def _rank_and_size(group: Any | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError(
                f"{_OP}: a process group was given but torch.distributed is not initialised"
            )
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class QSAContextParallel:
    """This rank's contiguous query shard and the global facts its routes depend on.

    Attributes:
        group: the context-parallel process group (`None`: the default group, or a single rank when
            torch.distributed is not initialised).
        rank: this rank's index in `group`.
        size: ranks in `group`.
        local_start: global position of this rank's first token; must be `rank * local_length`.
        local_length: tokens per shard; a multiple of the indexer's compress ratio.
        global_length: real tokens in the global sequence (`<= size * local_length`; the rest is padding).
        sequence_lengths: global per-batch-row lengths (right padding), or `None` (every row has
            `global_length` tokens).
        cu_seqlens: global packed-document boundaries (batch 1), or `None`.
    """

    group: Any | None
    rank: int
    size: int
    local_start: int
    local_length: int
    global_length: int
    sequence_lengths: tuple[int, ...] | None = None
    cu_seqlens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"{_OP}: rank must lie in [0, size) with size >= 1; got rank {self.rank}, size {self.size}"
            )
        if self.local_length < 1:
            raise ValueError(f"{_OP}: local_length must be positive; got {self.local_length}")
        if self.local_start != self.rank * self.local_length:
            raise ValueError(
                f"{_OP}: shards must be contiguous and equal: local_start must be rank * local_length = "
                f"{self.rank} * {self.local_length} = {self.rank * self.local_length}; got {self.local_start}"
            )
        if not 0 < self.global_length <= self.padded_length:
            raise ValueError(
                f"{_OP}: global_length must lie in (0, size * local_length = {self.padded_length}]; got {self.global_length}"
            )
        if self.sequence_lengths is not None and self.cu_seqlens is not None:
            raise ValueError(
                f"{_OP}: give either sequence_lengths (padding) or cu_seqlens (packing), not both"
            )
        if self.sequence_lengths is not None:
            bad = [x for x in self.sequence_lengths if not 0 <= x <= self.global_length]
            if bad:
                raise ValueError(
                    f"{_OP}: sequence_lengths must lie in [0, {self.global_length}]; got {bad[:4]}"
                )
        if self.cu_seqlens is not None:
            validate_cu_seqlens(_OP, self.cu_seqlens, self.global_length)

    @property
    def padded_length(self) -> int:
        """`size * local_length`: the global length the shards cover, padding included."""
        return self.size * self.local_length

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
        """The context of this rank, read off `group`.

        Args:
            local_length: tokens per shard.
            group: the context-parallel group (see the class attributes).
            global_length: real global tokens; defaults to `size * local_length`.
            attention_mask: the GLOBAL right-padding mask [batch, global_length or padded_length] (0/1).
            cu_seqlens: GLOBAL packed-document boundaries (batch 1).
        Raises:
            ValueError: a rule of the class attributes fails, or the mask is not a right-padded binary mask.
        """
        rank, size = _rank_and_size(group)
        total = size * local_length if global_length is None else global_length
        lengths = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[1] not in (
                total,
                size * local_length,
            ):
                raise ValueError(
                    f"{_OP}.create: attention_mask must be the global [batch, {total}] padding mask; "
                    f"got shape {tuple(attention_mask.shape)}"
                )
            host = _right_padded_lengths_host(
                f"{_OP}.create", attention_mask, *attention_mask.shape
            )
            lengths = tuple(min(x, total) for x in host)
        bounds = (
            None if cu_seqlens is None else validate_cu_seqlens(f"{_OP}.create", cu_seqlens, total)
        )
        return cls(group, rank, size, rank * local_length, local_length, total, lengths, bounds)

    @classmethod
    def from_layout(
        cls,
        layout: Any,
        *,
        group: Any | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
    ) -> QSAContextParallel:
        """The context matching an `sa_cp.ContextParallelLayout` (fields rank, size, local_length, global_length)."""
        ctx = cls.create(
            layout.local_length,
            group=group,
            global_length=layout.global_length,
            attention_mask=attention_mask,
            cu_seqlens=cu_seqlens,
        )
        if (ctx.rank, ctx.size) != (layout.rank, layout.size):
            raise ValueError(
                f"{_OP}.from_layout: the layout's rank/size ({layout.rank}, {layout.size}) differ from the "
                f"group's ({ctx.rank}, {ctx.size})"
            )
        return ctx

    def check_compress_ratio(self, op: str, compress_ratio: int) -> None:
        """Raise unless every shard holds whole compressed blocks."""
        if self.local_length % compress_ratio:
            raise ValueError(
                f"{op}: under context parallelism the local length ({self.local_length}) must be a multiple "
                f"of the compress ratio ({compress_ratio})"
            )
