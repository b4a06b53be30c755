"""The sparse MLA oracle: plain PyTorch, FP32 math (FP64 for FP64 inputs), autograd through the sink.

Each query attends over the latent rows its top-k slots name. A slot is valid when its id is in
`[0, keys)` and the slot lies before the query's `topk_length` (clamped to `[0, width]`). A duplicate
id counts once per slot, as FlashMLA and cuDNN count it. Keys are the full latent rows, values their
first 512 dims. With a sink, the softmax denominator gains `exp(attn_sink[h])` (the sink has no value).
A query with no valid slot outputs zeros and receives zero gradients, whatever its sink.

Queries run in chunks so the gathered FP32 keys stay within a fixed budget; under autograd each chunk
is checkpointed, so the memory held for backward is one chunk's worth too.

`sparse_mla_reference` (the folder's `__init__.py`) is this oracle behind the public argument checks.
"""

import torch
from torch.utils.checkpoint import checkpoint

VALUE_DIM = 512
HEAD_DIMS = (512, 576)  # 512 value dims, optionally followed by 64 rope dims
CHUNK_BYTES = 256 * 2**20
REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def valid_slots(
    topk_indices: torch.Tensor, keys: int, topk_length: torch.Tensor | None
) -> torch.Tensor:
    """bool [tokens, width]: the slots that name a key (id in `[0, keys)`, slot before `topk_length`)."""
    valid = (topk_indices >= 0) & (topk_indices < keys)
    if topk_length is not None:
        slots = torch.arange(topk_indices.shape[-1], device=topk_indices.device)
        valid &= slots < topk_length.clamp(min=0)[:, None]
    return valid


def ascending_valid_ids_reference(
    ids: torch.Tensor, keys: int, topk_length: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [n, width] (any integer dtype) -> (each row's valid ids ascending, padded with `keys`
    [n, width] int32; the counts of valid ids [n] int32). Valid: in [0, keys), judged before the
    cast to int32 (an int64 id such as 2**32 + 3 cannot wrap into a valid one), and with
    topk_length [n] among the row's first topk_length slots. Duplicates stay (each slot counts once).
    The definition behind `canonical.canonical_topk`'s compaction and the Triton backward's sorted
    rows (`triton_sorted_ids.ascending_valid_ids`)."""
    valid = (ids >= 0) & (ids < keys)
    if topk_length is not None:
        slots = torch.arange(ids.shape[1], device=ids.device)
        valid &= slots[None, :] < topk_length[:, None]
    ordered = torch.where(valid, ids, keys).to(torch.int32).sort(dim=1).values  # int32 sorts faster
    return ordered, valid.sum(dim=1, dtype=torch.int32)


def _attend_chunk(
    q: torch.Tensor,
    kv: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [C, H, D], kv [keys, D], ids/valid [C, W] -> (out [C, H, 512], lse [C, H]) in q's (compute) dtype."""
    keys = kv[ids.clamp(0, kv.shape[0] - 1)]  # [C, W, D]
    scores = torch.einsum("chd,cwd->chw", q, keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    nonempty = valid.any(dim=-1)[:, None]  # [C, 1]
    row_max = scores.amax(dim=-1).where(nonempty, 0.0).detach()  # [C, H]
    weights = torch.exp(scores - row_max[..., None])  # exactly 0 on invalid slots
    kv_sum = weights.sum(dim=-1)
    denominator = kv_sum
    if attn_sink is not None:
        denominator = denominator + torch.exp(attn_sink[None, :] - row_max)
    denominator = denominator.where(nonempty, 1.0)
    out = torch.einsum("chw,cwd->chd", weights, keys[..., :VALUE_DIM]) / denominator[..., None]
    lse = (row_max + torch.log(kv_sum.where(nonempty, 1.0))).where(nonempty, float("inf"))
    return out, lse


def sparse_mla_reference_with_lse(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle without validation, also returning lse [T, H] (natural log, sink excluded, +inf when empty).

    Output in q's dtype; lse in the compute dtype (FP32, or FP64 for FP64 inputs).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    tokens, heads, head_dim = q.shape
    kv = kv_latent[:, 0].to(compute)
    ids = topk_indices[:, 0].long()
    valid = valid_slots(ids, kv.shape[0], topk_length)
    sink = attn_sink.to(compute) if attn_sink is not None else None
    width = ids.shape[-1]
    per_row = width * (head_dim + 2 * heads) * torch.finfo(compute).bits // 8
    chunk = max(1, chunk_bytes // max(per_row, 1))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, kv_latent, attn_sink)
    )
    outs, lses = [], []
    for start in range(0, tokens, chunk):
        stop = min(tokens, start + chunk)
        args = (
            q[start:stop].to(compute),
            kv,
            ids[start:stop],
            valid[start:stop],
            sink,
            float(softmax_scale),
        )
        if needs_grad and tokens > chunk:
            out, lse = checkpoint(_attend_chunk, *args, use_reentrant=False)
        else:
            out, lse = _attend_chunk(*args)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros(0, heads, VALUE_DIM, dtype=compute)
    lse = torch.cat(lses) if lses else q.new_zeros(0, heads, dtype=compute)
    return out.to(q.dtype), lse
