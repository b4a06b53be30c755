"""Deterministic top-k: the k best entries by (score descending, position ascending), without a full sort."""

import torch

from sa_kernels.backend import (
    check_out,
    device_capability,
    gluon_module,
    has_triton,
    resolve_backend,
    triton_interpret,
)

from .limits import TRITON_MAX_ROW

__all__ = [
    "TRITON_MAX_ROW",
    "gluon_kernel_applies",
    "stable_topk",
    "stable_topk_workspace_bytes",
]

_TIE_BASE = 2**30
"""Tie keys are `_TIE_BASE - position`: distinct, positive and below `_INT32_MAX` for every position."""
_INT32_MAX = torch.iinfo(torch.int32).max
_INT32_MIN = torch.iinfo(torch.int32).min


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_PATH_BYTES_PER_ENTRY = 12
"""The PyTorch path's temporaries per score entry: int32 tie keys (4), a boolean mask (1), and room
for the scratch of its two `torch.topk` passes."""


def _runs_kernel(resolved: str, dtype: torch.dtype, n: int) -> bool:
    """Whether the Triton kernel (not the PyTorch path) takes rows of n entries of dtype."""
    return resolved == "triton" and dtype in _TRITON_DTYPES and n <= TRITON_MAX_ROW


def stable_topk_workspace_bytes(n: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """Temporary bytes per score entry that `stable_topk` (backend "auto") allocates for rows of `n`
    entries of `dtype` on `device`: 0 on the Triton kernel path (it reads the scores in place), else
    the PyTorch path's int32 keys, mask and top-k scratch. For callers that size chunks of scores.
    Per row (not per entry) the result takes k positions, and with `out=` the kernels' 2k int32
    slots. With `lengths` and not `masked_tail`, every path but the Gluon kernels' also takes a
    masked copy of the scores (a score and a mask byte more per entry), which this does not count."""
    resolved = "triton" if torch.device(device).type == "cuda" and has_triton() else "reference"
    return 0 if _runs_kernel(resolved, dtype, n) else _TORCH_PATH_BYTES_PER_ENTRY


def stable_topk(
    scores: torch.Tensor,
    k: int,
    dim: int = -1,
    *,
    lengths: torch.Tensor | None = None,
    masked_tail: bool = False,
    out: torch.Tensor | None = None,
    offset: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Positions of the `k` best entries along `dim`, ties broken towards the lower position.

    The chosen set is exactly the first `k` positions of a stable descending sort
    (`reference.stable_topk`), so it never depends on how `torch.topk` orders equal values. `-0.0`
    ties with `+0.0` and `-inf` is an ordinary (lowest) score, as in `torch.sort`. No full sort, no
    host sync. Not differentiable.

    Two paths, same result:
    - "triton" (auto on CUDA for float32/bfloat16/float16 rows of at most 32768 entries): one program
      per row (by default), radix select of the k-th best score then a prefix sum (`triton_kernels`;
      rows of 8192 entries or more are streamed and first narrowed to the scores above a bound from
      strided group maxima); reads the scores one to three times, no workspace beyond the output.
      On SM90 GPUs the same algorithm written in Gluon runs rows of 2049 to 32768 entries where
      `k <= 512` (narrowed) and the other rows of 1024 to 4095 entries (held whole): `gluon_kernels`,
      `gluon_kernel_applies`.
    - "reference" (CPU, float64, longer rows): a float `torch.topk` gives the k-th best score `t`;
      every entry above `t` is kept, and among entries equal to `t` an int32 `torch.topk` over the
      keys `2**30 - position` keeps the lowest positions (every winner of both calls is distinct, so
      neither call's tie order matters). Two top-k passes, one int32 key tensor of `scores`' shape.

    Args:
        scores: [..., n, ...] float16/bfloat16/float32/float64 on any device, without NaN (a NaN
            makes the result unspecified); `n = scores.shape[dim] < 2**30`.
        k: how many positions to keep, `0 <= k <= n`.
        dim: the dimension to select along.
        lengths: optional int32/int64 row lengths, `scores`' shape without `dim`, any strides (an
            expanded view too): a row's entries at or past its length count as -inf, whatever they
            hold (a negative length counts as 0, one past n as n; below k, the lowest positions
            past it fill the row's k). The Gluon kernels do not load those entries; the other
            paths take a masked copy of the scores, unless `masked_tail`.
        masked_tail: the caller's promise that every row's entries at or past its length already
            hold -inf. `lengths` then only lets the Gluon kernels skip loading them, the other paths
            ignore it (no copy), and every path returns what the call without `lengths` returns, so
            a caller may always pass `lengths` (where a row breaks the promise, its result is either
            of the two calls'). No effect without `lengths`.
        out: int32 or int64 [..., k] (`scores`' shape with `k` along the last dim, which `dim` must
            be), last-dim stride 1, no two elements in the same memory, its other dims viewable as
            at most two with any strides, not overlapping `scores`; written in place (e.g. the first
            slots of a larger row), or None. The Triton kernels then take an int32 scratch of 2k
            slots per row (`stable_topk_workspace_bytes` does not count it).
        offset: int added to every position written (e.g. the first id of a chunk of candidates);
            `offset` and `offset + n` must lie in int32's range.
        backend: "auto", "triton" (on CPU through `TRITON_INTERPRET=1`) or "reference".
    Returns:
        `out`, or a new int64 [..., k, ...] (`scores`' shape with `k` along `dim`): the chosen
        positions along `dim` plus `offset`, in ascending order.
    Raises:
        TypeError: scores is not a floating-point tensor; k or dim is not an int; masked_tail is
            not a bool.
        ValueError: dim out of range, `k` outside `[0, n]`, `n >= 2**30`; backend="triton" with a
            float64 tensor or rows longer than 32768; `out` of another shape, dtype or device, with
            a last-dim stride other than 1, overlapping elements or more than two other dims that
            cannot be merged, or with `dim` not the last; `offset + n` beyond int32; `lengths` of
            another shape, dtype or device (TypeError: not a tensor).
        RuntimeError: backend="triton" on CPU without `TRITON_INTERPRET=1`.
    """
    fn = "stable_topk"
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise TypeError(f"{fn}: scores must be a floating-point tensor; got {got}")
    for name, value in (("k", k), ("dim", dim)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{fn}: {name} must be an int; got {type(value).__name__}")
    if not isinstance(masked_tail, bool):
        raise TypeError(f"{fn}: masked_tail must be a bool; got {type(masked_tail).__name__}")
    if scores.dim() == 0 or not -scores.dim() <= dim < scores.dim():
        raise ValueError(
            f"{fn}: dim must lie in [-{scores.dim()}, {scores.dim()}) for scores of shape "
            f"{tuple(scores.shape)}; got {dim}"
        )
    n = scores.shape[dim]
    if not 0 <= k <= n:
        raise ValueError(f"{fn}: k must lie in [0, {n}] (scores.shape[{dim}]); got {k}")
    if n >= _TIE_BASE:
        raise ValueError(f"{fn}: scores.shape[{dim}] must be < 2**30; got {n}")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"{fn}: offset must be an int; got {type(offset).__name__}")
    if not _INT32_MIN <= offset <= _INT32_MAX - n:  # the kernels add it in int32
        raise ValueError(
            f"{fn}: offset and offset + n must lie in int32's range; got offset {offset}, n {n}"
        )
    addressing = None if out is None else _out_rows(fn, out, scores, dim, k)
    if lengths is not None:
        rows_shape = (*scores.shape[: dim % scores.dim()], *scores.shape[dim % scores.dim() + 1 :])
        _check_lengths(fn, lengths, rows_shape, scores)
    resolved = resolve_backend(fn, backend, scores)
    use_triton = _runs_kernel(resolved, scores.dtype, n)
    if backend == "triton" and not use_triton:
        raise ValueError(
            f"{fn}: backend='triton' needs float32/bfloat16/float16 rows of at most {TRITON_MAX_ROW} "
            f"entries; got {scores.dtype} rows of {n}"
        )
    with torch.no_grad():
        last = scores.detach().movedim(dim, -1)
        if k == 0:
            if out is not None:
                return out
            shape = (*last.shape[:-1], 0)
            return torch.empty(shape, dtype=torch.int64, device=scores.device).movedim(-1, dim)
        if use_triton:
            rows = last.reshape(-1, n)
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            if gluon_kernel_applies(rows, k):
                from .gluon_kernels import stable_topk_rows

                lengths_addressing = None
                if lengths is not None:
                    lengths_addressing = _merged_rows(lengths.shape, lengths.stride())
                    if lengths_addressing is None:  # dims that do not merge: a small copy
                        lengths = lengths.reshape(-1)
                        lengths_addressing = (lengths.numel(), 0, 1)
                chosen = stable_topk_rows(
                    rows,
                    k,
                    out=out,
                    addressing=addressing,
                    offset=offset,
                    lengths=lengths,
                    lengths_addressing=lengths_addressing,
                )
            else:
                from .triton_kernels import stable_topk_rows

                if lengths is not None and not masked_tail:
                    rows = _masked_past(rows, lengths.reshape(-1))
                chosen = stable_topk_rows(rows, k, out=out, addressing=addressing, offset=offset)
            return out if out is not None else chosen.view(*last.shape[:-1], k).movedim(-1, dim)
        if lengths is not None and not masked_tail:
            last = _masked_past(last, lengths)
        chosen = _threshold_topk(last, k)
        if out is not None:
            out.copy_(chosen + offset)
            return out
        return (chosen + offset if offset else chosen).movedim(-1, dim)


def _out_rows(fn: str, out: object, scores: torch.Tensor, dim: int, k: int) -> tuple[int, int, int]:
    """Check `out`; where the kernels write row r of the flattened rows: `(inner, stride_outer,
    stride_inner)`, row r at `(r // inner) * stride_outer + (r % inner) * stride_inner`. The dims
    are merged from the strides (no trial views: a failed `view` raises, which costs about 0.1 ms
    of host time per call)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn}: out must be a tensor or None; got {type(out).__name__}")
    if dim % scores.dim() != scores.dim() - 1:
        raise ValueError(f"{fn}: out needs dim to be the last dim; got dim={dim}")
    if out.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: out must be int32 or int64; got {out.dtype}")
    # rows that overlap would be written by several programs at once
    check_out(fn, out, (*scores.shape[:-1], k), out.dtype, scores.device, padded_rows=True)
    addressing = _merged_rows(out.shape[:-1], out.stride()[:-1])
    if addressing is None:
        raise ValueError(
            f"{fn}: out's leading dims must be viewable as at most two dims; got strides {out.stride()}"
        )
    return addressing


def _merged_rows(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int, int] | None:
    """`(inner, stride_outer, stride_inner)` addressing row r of the dims `shape` with `strides`
    at `(r // inner) * stride_outer + (r % inner) * stride_inner`: adjacent dims merged from their
    strides (stride-0 dims of an expanded view too); None where more than two are left."""
    merged: list[list[int]] = []  # [size, stride], adjacent dims merged
    for size, stride in zip(shape, strides, strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        return None
    (_, stride_outer), (inner, stride_inner) = [[1, 0]] * (2 - len(merged)) + merged
    return inner, stride_outer, stride_inner


def _check_lengths(
    fn: str, lengths: object, rows_shape: tuple[int, ...], scores: torch.Tensor
) -> None:
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{fn}: lengths must be a tensor or None; got {type(lengths).__name__}")
    if (
        lengths.dtype not in (torch.int32, torch.int64)
        or tuple(lengths.shape) != rows_shape
        or lengths.device != scores.device
    ):
        raise ValueError(
            f"{fn}: lengths must be int32 or int64 of shape {rows_shape} (scores' shape without "
            f"dim) on {scores.device}; got {lengths.dtype} {tuple(lengths.shape)} on {lengths.device}"
        )


def _masked_past(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A copy of scores [..., n] with -inf at the positions at or past each row's length (lengths
    [...], scores' leading shape)."""
    positions = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(positions >= lengths.unsqueeze(-1), float("-inf"))


def gluon_kernel_applies(rows: torch.Tensor, k: int) -> bool:
    """Whether `stable_topk` runs `gluon_kernels` (not `triton_kernels`) on these [rows, n] CUDA
    float32/bfloat16/float16 scores: an SM90 GPU (where it was measured), a Triton with Gluon, not
    the interpreter, and rows the Gluon kernels take (`gluon_kernels.applies`: 2049 to 32768
    entries narrowed where `2k <= 1024`, the other rows of 1024 to 4095 entries held whole)."""
    if not rows.is_cuda or triton_interpret() or torch.version.hip is not None:
        return False
    if rows.dtype not in _TRITON_DTYPES or device_capability(rows.device.index)[0] != 9:
        return False
    gluon_kernels = gluon_module("sa_kernels.stable_topk.gluon_kernels")
    return gluon_kernels is not None and gluon_kernels.applies(rows.shape[-1], k)


def _threshold_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`stable_topk` along the last dim, `1 <= k <= n`."""
    threshold = torch.topk(scores, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    positions = torch.arange(scores.shape[-1], dtype=torch.int32, device=scores.device)
    keys = torch.empty(scores.shape, dtype=torch.int32, device=scores.device)
    keys.copy_(_TIE_BASE - positions)
    keys.masked_fill_(scores > threshold, _INT32_MAX)  # fewer than k: all kept
    keys.masked_fill_(scores < threshold, _INT32_MIN)  # at least k entries are >= t: none kept
    chosen = torch.topk(keys, k, dim=-1, sorted=False).indices
    return torch.sort(chosen, dim=-1).values
