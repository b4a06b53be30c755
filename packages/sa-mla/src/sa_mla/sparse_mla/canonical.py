"""What `cudnn_sparse_attention` does around its two kernels (SEMANTICS §3), independent of the kernels.

The kernels arrive as a `FusedKernels` object, so this logic runs on CPU with fake kernels in tests:
- ids: valid ids (in `[0, keys)`) compacted into an ascending prefix with a per-row `topk_length` when the
  caller gave none (with one, it is clamped to `[0, width]` and the ids pass through), then padded with
  -1 to a multiple of `id_multiple` (512);
- heads: split into chunks the forward kernel accepts (FlashMLA: 64 or 128 heads), each padded with zero
  queries and -inf sinks, outputs sliced back;
- empty rows (no valid id): zero output (FlashMLA writes zeros and lse = +inf), skipped in backward;
- the sink gradient from the forward's lse: `d_sink = -sum_q sigmoid(sink - lse) * sum_d dO * O`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .reference import ascending_valid_ids_reference, valid_slots
from .triton_backward import sparse_mla_delta

ForwardKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BackwardKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FusedKernels:
    """The two kernels and the shapes they accept.

    forward(q [T, Hp, D], kv [T_kv, 1, D], ids [T, 1, Wp] int32, scale, sink [Hp] fp32 | None,
            lengths [T] int32) -> (out [T, Hp, 512], lse [T, Hp] fp32, natural log, sink excluded)
    backward(q [R, Hb, D], kv [T_kv, D], out [R, Hb, 512], dout [R, Hb, 512], lse [R, Hb] fp32,
             sink [Hb] fp32 (-inf for none), ids [R, Wp] int32, scale, lengths [R] int32)
             -> (dq [R, Hb, D], dkv [T_kv, D])
    """

    forward: ForwardKernel
    backward: BackwardKernel
    forward_heads: tuple[int, ...] = (64, 128)
    backward_head_multiple: int = 16
    id_multiple: int = 512


@dataclass(frozen=True)
class HeadChunk:
    """Heads `[start, stop)` of the caller's q, run as one forward call padded to `padded` heads."""

    start: int
    stop: int
    padded: int


def forward_head_chunks(heads: int, supported: tuple[int, ...]) -> tuple[HeadChunk, ...]:
    """Split `heads` into chunks of at most max(supported), each padded up to the next supported count."""
    largest = max(supported)
    chunks = []
    for start in range(0, heads, largest):
        stop = min(heads, start + largest)
        chunks.append(HeadChunk(start, stop, min(s for s in supported if s >= stop - start)))
    return tuple(chunks)


def ids_as_int32(topk_indices: torch.Tensor, keys: int) -> torch.Tensor:
    """int32 ids with every invalid id (< 0 or >= keys) as -1, judged on the caller's dtype first so that
    an int64 id such as 2**32 + 3 cannot wrap into a valid int32 id."""
    valid = (topk_indices >= 0) & (topk_indices < keys)
    return torch.where(valid, topk_indices.to(torch.int32), -1)


def canonical_topk(
    topk_indices: torch.Tensor, keys: int, topk_length: torch.Tensor | None, multiple: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, W] -> (ids int32 [T, W'] with W' a multiple of `multiple`, lengths int32 [T]).

    Without `topk_length`, the valid ids of each row move to an ascending prefix of length `lengths`,
    the rest become -1 (duplicates stay: each slot counts). With it, lengths = topk_length clamped to
    `[0, W]` and the ids are kept (both kernels ignore invalid ids inside the prefix).
    """
    width = topk_indices.shape[-1]
    if topk_length is None:
        ordered, lengths = ascending_valid_ids_reference(topk_indices, keys, None)
        ids = ordered.masked_fill(ordered == keys, -1)
    else:  # the kernels skip invalid ids inside the prefix: only a wrapping int64 id needs mapping
        ids = (
            topk_indices if topk_indices.dtype == torch.int32 else ids_as_int32(topk_indices, keys)
        )
        lengths = topk_length.clamp(0, width).to(torch.int32)
    padded = -(-width // multiple) * multiple
    if padded != width:
        ids = torch.nn.functional.pad(ids, (0, padded - width), value=-1)
    return ids.contiguous(), lengths.contiguous()


def pad_heads(tensor: torch.Tensor, heads: int, value: float) -> torch.Tensor:
    """Pad dim 1 (or dim 0 of a 1-D tensor) to `heads` entries filled with `value`."""
    dim = 0 if tensor.dim() == 1 else 1
    missing = heads - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


def row_dot(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """FP32 [T, H]: sum over value dims of dout * out (a Triton kernel on CUDA, no FP32 copies)."""
    if out.is_cuda:
        return sparse_mla_delta(out.contiguous(), dout.contiguous())
    compute = torch.promote_types(out.dtype, torch.float32)
    return (out.to(compute) * dout.to(compute)).sum(dim=-1)


def sink_gradient(attn_sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d_sink [H] = -sum_q sigmoid(sink - lse) * delta, delta [T, H] = sum_d dO * O, lse [T, H] the keys'
    natural-log lse (sink excluded); rows with lse = +inf (no valid id) add nothing."""
    compute = torch.promote_types(lse.dtype, torch.float32)
    weight = torch.sigmoid(attn_sink.to(compute)[None, :] - lse.to(compute))
    weight = torch.where(torch.isposinf(lse), 0.0, weight)
    return -(weight * delta.to(compute)).sum(dim=0).to(attn_sink.dtype)


def sink_gradient_from_lse(
    attn_sink: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, dout: torch.Tensor
) -> torch.Tensor:
    """`sink_gradient` with delta computed from the output and its gradient."""
    return sink_gradient(attn_sink, lse, row_dot(out, dout))


def backward_rows(
    nonempty: torch.Tensor, all_rows_nonempty: bool, valid_row_indices: torch.Tensor | None
) -> torch.Tensor | None:
    """The rows the backward kernel runs on (int64), or None for all rows.

    The caller's promise (`all_rows_nonempty`, `valid_row_indices`) avoids the host synchronisation that
    finding the non-empty rows otherwise costs.
    """
    if all_rows_nonempty:
        return None
    if valid_row_indices is not None:
        rows = valid_row_indices.long()
        return None if rows.numel() == nonempty.shape[0] else rows
    rows = torch.nonzero(nonempty).flatten()
    return None if rows.numel() == nonempty.shape[0] else rows


_NO_GRADIENTS = (None,) * 5  # ids, lengths, rows_spec, softmax_scale, kernels


class _FusedSparseMla(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv_latent, attn_sink, ids, lengths, rows_spec, softmax_scale, kernels):
        tokens, heads, _ = q.shape
        outs, lses = [], []
        for chunk in forward_head_chunks(heads, kernels.forward_heads):
            q_part = pad_heads(q[:, chunk.start : chunk.stop], chunk.padded, 0.0)
            sink_part = None
            if attn_sink is not None:
                sink_part = pad_heads(
                    attn_sink[chunk.start : chunk.stop], chunk.padded, float("-inf")
                ).contiguous()
            out, lse = kernels.forward(
                q_part, kv_latent, ids[:, None, :], softmax_scale, sink_part, lengths
            )
            width = chunk.stop - chunk.start
            outs.append(out[:, :width])
            lses.append(lse[:, :width])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
        out = out.contiguous()
        lse = lse.contiguous()
        ctx.save_for_backward(q, kv_latent, attn_sink, ids, lengths, out, lse)
        ctx.rows_spec = rows_spec
        ctx.softmax_scale = softmax_scale
        ctx.kernels = kernels
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv_latent, attn_sink, ids, lengths, out, lse = ctx.saved_tensors
        kernels: FusedKernels = ctx.kernels
        nonempty, all_rows_nonempty, valid_row_indices = ctx.rows_spec
        dout = dout.contiguous()
        tokens, heads, _ = q.shape
        d_sink = None
        if attn_sink is not None and ctx.needs_input_grad[2]:
            d_sink = sink_gradient_from_lse(attn_sink, lse, out, dout)
        rows = backward_rows(nonempty, all_rows_nonempty, valid_row_indices)
        take = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        padded = -(-heads // kernels.backward_head_multiple) * kernels.backward_head_multiple
        sink = (
            attn_sink.float()
            if attn_sink is not None
            else q.new_full((heads,), float("-inf"), dtype=torch.float32)
        )
        kv = kv_latent[:, 0]
        if rows is not None and rows.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(kv_latent), d_sink, *_NO_GRADIENTS
        dq_rows, dkv = kernels.backward(
            pad_heads(take(q), padded, 0.0).contiguous(),
            kv.contiguous(),
            pad_heads(take(out), padded, 0.0).contiguous(),
            pad_heads(take(dout), padded, 0.0).contiguous(),
            pad_heads(take(lse), padded, float("inf")).contiguous(),
            pad_heads(sink, padded, float("-inf")).contiguous(),
            take(ids).contiguous(),
            ctx.softmax_scale,
            take(lengths).contiguous(),
        )
        dq_rows = dq_rows[:, :heads]
        if rows is None:
            dq = dq_rows.contiguous()
        else:
            dq = torch.zeros_like(q).index_copy_(0, rows, dq_rows.to(q.dtype))
        return dq, dkv.to(kv_latent.dtype).view(kv_latent.shape), d_sink, *_NO_GRADIENTS


def fused_sparse_mla(
    kernels: FusedKernels,
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    all_rows_nonempty: bool,
    valid_row_indices: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonicalise the inputs, run `kernels`, return (out [T, H, 512], lse [T, H]). Inputs already validated."""
    keys = kv_latent.shape[0]
    ids, lengths = canonical_topk(topk_indices[:, 0], keys, topk_length, kernels.id_multiple)
    nonempty = lengths > 0 if topk_length is None else valid_slots(ids, keys, lengths).any(dim=-1)
    if q.stride(-1) != 1:
        q = q.contiguous()
    rows_spec = (nonempty, all_rows_nonempty, valid_row_indices)
    sink = attn_sink.contiguous() if attn_sink is not None else None
    return _FusedSparseMla.apply(
        q, kv_latent, sink, ids, lengths, rows_spec, float(softmax_scale), kernels
    )
