"""Sequence collectives over any torch.distributed group (gloo on CPU, NCCL on GPU).

`group=None` is the single-rank group (every collective is the identity), as in `ContextParallelLayout`;
pass `torch.distributed.group.WORLD` for the default group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import group_rank_and_size as _world
from .layout import sequence_dim

_MAX_DIMS = 8


# Every dtype this torch knows, in one order on every rank (same build): a dtype's code is its index.
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))


def _check_same_shape(x: torch.Tensor, group: dist.ProcessGroup | None, op: str) -> None:
    """Raise the same ValueError on every rank when shards differ in shape or dtype (one small
    collective + sync): a dtype of the same byte size would otherwise be gathered as raw bits."""
    _, size = _world(group)
    if x.dim() > _MAX_DIMS:
        raise ValueError(
            f"{op}: at most {_MAX_DIMS} dims are supported; got shape {tuple(x.shape)}"
        )
    fingerprint = torch.full((_MAX_DIMS + 2,), -1, dtype=torch.int64, device=x.device)
    fingerprint[: x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    fingerprint[-2] = _DTYPES.index(x.dtype)
    fingerprint[-1] = x.dim()
    everyone = [torch.empty_like(fingerprint) for _ in range(size)]
    dist.all_gather(everyone, fingerprint, group=group)
    shapes = [tuple(f[: int(f[-1])].tolist()) for f in everyone]
    dtypes = [str(_DTYPES[int(f[-2])]) for f in everyone]
    if len(set(shapes)) > 1 or len(set(dtypes)) > 1:
        raise ValueError(
            f"{op}: every rank must pass the same shape and dtype; got {shapes}, {dtypes} "
            "(rank order)"
        )


def _all_gather(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    dim: int,
    op: str,
    validate_shapes: bool = False,
) -> torch.Tensor:
    _, size = _world(group)
    if size == 1:
        return x
    if validate_shapes:
        _check_same_shape(x, group, op)
    shards = [torch.empty_like(x) for _ in range(size)]
    try:
        dist.all_gather(shards, x.contiguous(), group=group)
    except RuntimeError as error:
        raise RuntimeError(
            f"{op}: all_gather failed; every rank must pass the same shape and dtype "
            f"(this rank: {tuple(x.shape)} {x.dtype}): {error}"
        ) from error
    return torch.cat(shards, dim=dim)


def _sum_own_shard(grad: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Each rank's shard of the sum over ranks of `grad` (a reduce-scatter along `dim`)."""
    rank, size = _world(group)
    if size == 1:
        return grad
    local = grad.size(dim) // size
    if dist.get_backend(group) == "nccl":
        chunks = grad.movedim(dim, 0).contiguous()
        out = chunks.new_empty((local, *chunks.shape[1:]))
        dist.reduce_scatter_tensor(out, chunks, group=group)
        return out.movedim(0, dim)
    # gloo has no reduce-scatter: all-reduce, then keep this rank's slice.
    total = grad.contiguous()
    dist.all_reduce(total, group=group)
    return total.narrow(dim, rank * local, local)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, group: dist.ProcessGroup | None, dim: int, validate: bool
    ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim, "gather_sequence", validate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_own_shard(grad, ctx.group, ctx.dim), None, None, None


def gather_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 1,
    *,
    validate_shapes: bool = False,
) -> torch.Tensor:
    """All-gather contiguous shards along the sequence, with autograd.

    Args:
        x: [..., local_length, ...] along `dim`; the same shape on every rank.
        validate_shapes: first compare every rank's shape and dtype and raise ValueError on a
            mismatch (costs one small collective and a host sync; a mismatch without it can abort the
            gloo process, or gather another dtype's bits).
    Returns:
        [..., size * local_length, ...], rank order. Backward reduce-scatters: each rank's shard receives
        the sum of every rank's gradient for it.
    """
    dim = sequence_dim("gather_sequence", x, dim)
    if _world(group)[1] == 1:
        return x
    return _GatherSequence.apply(x, group, dim, validate_shapes)


def gather_no_grad(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 1,
    *,
    validate_shapes: bool = False,
) -> torch.Tensor:
    """`gather_sequence` without autograd, for metadata and frozen indexer keys (returns a detached tensor)."""
    dim = sequence_dim("gather_no_grad", x, dim)
    with torch.no_grad():
        return _all_gather(x.detach(), group, dim, "gather_no_grad", validate_shapes)


def _exchange_with_neighbours(
    send_next: torch.Tensor | None,
    recv_prev: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    reverse: bool,
) -> None:
    """Send to the next rank and receive from the previous one (or the other way round when `reverse`)."""
    rank, size = _world(group)
    to_rank, from_rank = (rank - 1, rank + 1) if reverse else (rank + 1, rank - 1)
    ops = []
    if send_next is not None and 0 <= to_rank < size:
        ops.append(
            dist.P2POp(
                dist.isend,
                send_next,
                dist.get_global_rank(group, to_rank) if group else to_rank,
                group,
            )
        )
    if recv_prev is not None and 0 <= from_rank < size:
        ops.append(
            dist.P2POp(
                dist.irecv,
                recv_prev,
                dist.get_global_rank(group, from_rank) if group else from_rank,
                group,
            )
        )
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


class _GatherHalo(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, halo: int, group: dist.ProcessGroup | None, dim: int
    ) -> torch.Tensor:
        ctx.halo, ctx.group, ctx.dim = halo, group, dim
        tail = x.narrow(dim, x.size(dim) - halo, halo).contiguous()
        received = torch.zeros_like(tail)
        _exchange_with_neighbours(tail, received, group, reverse=False)
        return torch.cat([received, x], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        halo, dim = ctx.halo, ctx.dim
        grad_halo = grad.narrow(dim, 0, halo).contiguous()
        grad_x = grad.narrow(dim, halo, grad.size(dim) - halo).clone()
        returned = torch.zeros_like(grad_halo)
        _exchange_with_neighbours(grad_halo, returned, ctx.group, reverse=True)
        grad_x.narrow(dim, grad_x.size(dim) - halo, halo).add_(returned)
        return grad_x, None, None, None


def gather_halo(
    x: torch.Tensor, halo: int, group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    """Prepend the previous rank's last `halo` tokens (zeros on rank 0), for sliding-window layers.

    Args:
        x: [..., local_length, ...] along `dim`, with `0 <= halo <= local_length`.
    Returns:
        [..., halo + local_length, ...]. Backward sends the halo's gradient back to its owner.
    """
    dim = sequence_dim("gather_halo", x, dim)
    if isinstance(halo, bool) or not isinstance(halo, int) or not 0 <= halo <= x.size(dim):
        raise ValueError(
            f"gather_halo: halo must be an int in [0, x.size({dim})={x.size(dim)}]; got {halo!r}"
        )
    if halo == 0:
        return x
    if _world(group)[1] == 1:
        zeros_shape = list(x.shape)
        zeros_shape[dim] = halo
        return torch.cat([x.new_zeros(zeros_shape), x], dim=dim)
    return _GatherHalo.apply(x, halo, group, dim)
