"""Contiguous context-parallel shards: rank r owns global positions [r*L, (r+1)*L) (SEMANTICS §5)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .groups import group_rank_and_size


@dataclass(frozen=True)
class ContextParallelLayout:
    """This rank's contiguous shard of a sequence.

    Attributes:
        rank: this rank's index in the context-parallel group.
        size: ranks in the group.
        global_length: tokens in the unpadded global sequence.
        local_length: tokens per shard (`L`), a multiple of `multiple_of`.
        multiple_of: the compression unit every shard length must be a multiple of.
        group: the process group the shards live on (`None`: a layout planned without one).
    """

    rank: int
    size: int
    global_length: int
    local_length: int
    multiple_of: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("rank", "size", "global_length", "local_length", "multiple_of"):
            _check_int(f"ContextParallelLayout: {name}", getattr(self, name))
        if self.size < 1:
            raise ValueError(f"ContextParallelLayout: size must be >= 1; got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(
                f"ContextParallelLayout: rank must be in [0, {self.size}); got {self.rank}"
            )
        if self.global_length < 1:
            raise ValueError(
                f"ContextParallelLayout: global_length must be >= 1; got {self.global_length}"
            )
        if self.multiple_of < 1:
            raise ValueError(
                f"ContextParallelLayout: multiple_of must be >= 1; got {self.multiple_of}"
            )
        if self.local_length < 1 or self.local_length % self.multiple_of:
            raise ValueError(
                f"ContextParallelLayout: local_length must be a positive multiple of multiple_of="
                f"{self.multiple_of}; got {self.local_length}"
            )
        if self.padded_length < self.global_length:
            raise ValueError(
                f"ContextParallelLayout: size * local_length ({self.padded_length}) must cover "
                f"global_length ({self.global_length})"
            )

    def __reduce__(self):
        # A process group belongs to one process: a pickled layout travels without it.
        return (
            type(self),
            (self.rank, self.size, self.global_length, self.local_length, self.multiple_of),
        )

    @classmethod
    def create(
        cls,
        global_length: int,
        group: dist.ProcessGroup | None = None,
        multiple_of: int = 1,
        *,
        pad: bool = False,
        rank: int | None = None,
        size: int | None = None,
    ) -> ContextParallelLayout:
        """The layout of `global_length` tokens over `group` (single rank without a group).

        Args:
            global_length: tokens in the global sequence.
            group: the context-parallel process group; `None` is the single-rank layout unless
                `rank`/`size` are given (to plan a layout without a process group).
            multiple_of: every shard length must be a multiple of this (region size, compress ratio).
            pad: allow a global length that does not split evenly; shards then cover
                `padded_length >= global_length` and the caller pads the tail.
        Raises:
            ValueError: the length does not split into `size` shards that are multiples of
                `multiple_of` (and `pad` is False), the rank is out of range, sizes are not positive.
        """
        for name, value in (("global_length", global_length), ("multiple_of", multiple_of)):
            _check_int(f"ContextParallelLayout.create: {name}", value)
        group_rank, group_size = group_rank_and_size(group)
        if group is not None and (
            (rank is not None and rank != group_rank) or (size is not None and size != group_size)
        ):
            raise ValueError(
                "ContextParallelLayout.create: rank/size plan a layout without a process group; with "
                f"a group they come from it (rank {group_rank}, size {group_size}); got rank={rank}, size={size}"
            )
        rank = group_rank if rank is None else rank
        size = group_size if size is None else size
        _check_int("ContextParallelLayout.create: rank", rank)
        _check_int("ContextParallelLayout.create: size", size)
        if size < 1:
            raise ValueError(f"ContextParallelLayout.create: size must be >= 1; got {size}")
        if multiple_of < 1:
            raise ValueError(
                f"ContextParallelLayout.create: multiple_of must be >= 1; got {multiple_of}"
            )
        unit = size * multiple_of
        if global_length % unit and not pad:
            raise ValueError(
                f"ContextParallelLayout.create: global_length ({global_length}) must be divisible by "
                f"size * multiple_of ({size} * {multiple_of} = {unit}); pass pad=True to pad the tail"
            )
        local_length = -(-global_length // unit) * multiple_of
        return cls(rank, size, global_length, local_length, multiple_of, group)

    @property
    def padded_length(self) -> int:
        """`size * local_length`: the global length the shards cover, padding included."""
        return self.size * self.local_length

    @property
    def local_start(self) -> int:
        """Global position of this rank's first token."""
        return self.rank * self.local_length

    @property
    def local_stop(self) -> int:
        return self.local_start + self.local_length


def sequence_dim(fn: str, x: torch.Tensor, dim: int) -> int:
    """`dim` as a non-negative index of x's dims; raises rather than wrapping an out-of-range one."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        got = "a 0-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{fn}: x must be a tensor with at least one dim; got {got}")
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{fn}: dim must be an int; got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{fn}: dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
            f"{tuple(x.shape)}; got {dim!r}"
        )
    return int(dim) % x.dim()


def _check_int(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int; got {value!r}")


def shard_sequence(
    x: torch.Tensor, layout: ContextParallelLayout, dim: int = 1, pad_value: float | bool = 0
) -> torch.Tensor:
    """This rank's shard of a global tensor.

    Args:
        x: [..., global_length or padded_length, ...] along `dim`.
        pad_value: fills the tail when `x` holds `global_length < padded_length` tokens
            (positions and padding masks need a value of their own, e.g. `True` for a padding mask).
    Returns:
        [..., local_length, ...]: a view when no padding is needed.
    """
    if not isinstance(layout, ContextParallelLayout):
        raise TypeError(
            f"shard_sequence: layout must be a ContextParallelLayout; got {type(layout).__name__}"
        )
    dim = sequence_dim("shard_sequence", x, dim)
    if not x.is_floating_point() and not x.is_complex():
        try:  # the value the padding would hold, compared with the one asked for (on the host:
            # a CUDA scalar read back here would cost a device sync per call)
            stored = torch.full((), pad_value, dtype=x.dtype).item()
        except (RuntimeError, TypeError, ValueError, OverflowError):
            stored = None
        if stored is None or stored != pad_value:
            raise ValueError(
                f"shard_sequence: pad_value {pad_value!r} is not a {x.dtype} value (it would be "
                f"stored as {stored!r})"
            )
    length = x.size(dim)
    if length not in (layout.global_length, layout.padded_length):
        raise ValueError(
            f"shard_sequence: x.size({dim}) must be global_length ({layout.global_length}) or "
            f"padded_length ({layout.padded_length}); got shape {tuple(x.shape)}"
        )
    if length < layout.padded_length:
        pad_shape = list(x.shape)
        pad_shape[dim] = layout.padded_length - length
        x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
    return x.narrow(dim, layout.local_start, layout.local_length)
