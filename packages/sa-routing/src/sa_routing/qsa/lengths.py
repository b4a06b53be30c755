"""Sequence lengths and packed-document boundaries: what the host must know before routing.

Right-padded masks become per-row lengths, packed `cu_seqlens` become host tuples; each is read back
from the device once (the one host synchronisation of a route selection).
"""

from __future__ import annotations

import numbers

import torch


def _right_padded_lengths_host(
    op: str, mask: torch.Tensor, batch_size: int, sequence_length: int
) -> list[int]:
    """Per-row lengths of a right-padded binary mask, read back in one synchronisation; raises if not one."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"{op}: attention_mask must be a torch.Tensor or None; got {type(mask).__name__}"
        )
    if tuple(mask.shape) != (batch_size, sequence_length):
        raise ValueError(
            f"{op}: attention_mask must be a [batch, sequence] = ({batch_size}, {sequence_length}) padding mask "
            f"(1 = token, 0 = right padding); got shape {tuple(mask.shape)} "
            "(4-D, additive or block masks are not accepted)"
        )
    if mask.is_complex():
        raise TypeError(f"{op}: attention_mask must be bool, integer or floating; got {mask.dtype}")
    ones = mask != 0
    lengths = ones.sum(dim=1)
    prefix = torch.arange(sequence_length, device=mask.device) < lengths[:, None]
    not_binary = (ones & (mask != 1)).any(dim=1)
    not_right_padded = (ones != prefix).any(dim=1)
    host = torch.cat((lengths, not_binary.long(), not_right_padded.long())).tolist()
    lengths_host = host[:batch_size]
    bad_values = [b for b in range(batch_size) if host[batch_size + b]]
    bad_layout = [b for b in range(batch_size) if host[2 * batch_size + b]]
    if bad_values:
        raise ValueError(
            f"{op}: attention_mask must be binary (0/1); rows {bad_values} hold other values "
            "(document-id or segment masks are not accepted: pack documents with cu_seqlens instead)"
        )
    if bad_layout:
        raise ValueError(
            f"{op}: attention_mask rows must be ones then zeros (right padding); rows {bad_layout} are "
            "left-padded or have holes (interior zeros)"
        )
    return lengths_host


def right_padded_sequence_lengths(
    mask: torch.Tensor | None, batch_size: int, sequence_length: int, device: torch.device | str
) -> torch.Tensor:
    """Per-row token counts of a right-padded `[batch, sequence]` mask.

    Args:
        mask: `None` (every row full) or [batch_size, sequence_length] bool/int/float holding only 0 and 1,
            each row ones then zeros.
        device: where the result lives.
    Returns:
        int64 [batch_size] on `device`.
    Raises:
        ValueError: the mask is not [batch, sequence], holds values other than 0/1 (e.g. document ids),
            or a row is left-padded or has interior zeros.
        TypeError: the mask is not a tensor or is complex.
    """
    for name, value in (("batch_size", batch_size), ("sequence_length", sequence_length)):
        if not _is_int(value):
            raise TypeError(f"right_padded_sequence_lengths: {name} must be an int; got {value!r}")
        if value < 0:
            raise ValueError(f"right_padded_sequence_lengths: {name} must be >= 0; got {value!r}")
    if mask is None:
        return torch.full((batch_size,), sequence_length, dtype=torch.int64, device=device)
    lengths = _right_padded_lengths_host(
        "right_padded_sequence_lengths", mask, batch_size, sequence_length
    )
    return torch.tensor(lengths, dtype=torch.int64, device=device)


def validate_cu_seqlens(
    op: str, cu_seqlens: torch.Tensor | list[int] | tuple[int, ...], total: int
) -> tuple[int, ...]:
    """Host tuple of packed document boundaries `0 = cu[0] < cu[1] < … <= total` (one read-back)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if (
            cu_seqlens.dim() != 1
            or cu_seqlens.is_floating_point()
            or cu_seqlens.is_complex()
            or cu_seqlens.dtype == torch.bool
        ):
            raise ValueError(
                f"{op}: cu_seqlens must be a 1-D integer tensor; got shape {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
            )
        bounds = tuple(int(x) for x in cu_seqlens.tolist())
    else:
        if isinstance(cu_seqlens, (str, bytes)) or not all(_is_int(x) for x in cu_seqlens):
            raise TypeError(
                f"{op}: cu_seqlens must be a 1-D integer tensor or a sequence of ints; got {cu_seqlens!r}"
            )
        bounds = tuple(int(x) for x in cu_seqlens)
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(
            f"{op}: cu_seqlens must start at 0 and hold at least one document; got {list(bounds)[:8]}"
        )
    steps = [i for i in range(1, len(bounds)) if bounds[i] <= bounds[i - 1]]
    if steps:
        i = steps[0]
        raise ValueError(
            f"{op}: cu_seqlens must be strictly increasing; cu_seqlens[{i}] = {bounds[i]} <= "
            f"cu_seqlens[{i - 1}] = {bounds[i - 1]}"
        )
    if bounds[-1] > total:
        raise ValueError(
            f"{op}: cu_seqlens[-1] ({bounds[-1]}) must be <= the (global) sequence length {total}"
        )
    return bounds


def packed_block_starts(cu_seqlens: tuple[int, ...], compress_ratio: int) -> tuple[int, ...]:
    """Index of each document's first compressed block when blocks restart at every document start.

    Document d holds blocks `[starts[d], starts[d + 1])`; `starts[-1]` is the total block count.
    Raises:
        ValueError: `compress_ratio` not an int >= 1; `cu_seqlens` not strictly increasing from 0.
    """
    if not _is_int(compress_ratio) or compress_ratio < 1:
        raise ValueError(
            f"packed_block_starts: compress_ratio must be an int >= 1; got {compress_ratio!r}"
        )
    cu_seqlens = validate_cu_seqlens(
        "packed_block_starts", cu_seqlens, cu_seqlens[-1] if len(cu_seqlens) else 0
    )
    starts = [0]
    for d in range(len(cu_seqlens) - 1):
        starts.append(starts[-1] + (cu_seqlens[d + 1] - cu_seqlens[d]) // compress_ratio)
    return tuple(starts)


def _is_int(value: object) -> bool:
    """A Python or NumPy integer or a 0-d integer tensor, not a bool (True would read as 1)."""
    if isinstance(value, torch.Tensor):
        return (
            value.dim() == 0
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype != torch.bool
        )
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
