"""Attention distillation: the KL losses that train the QSA and Step-5 CSA indexers.

DeepSeek-V3.2's indexer objective, on our indexers' units. Per query, the target is the main
attention's softmax probabilities summed over the heads that share one route (QSA: every head; CSA:
the heads of each KV group) and over the key tokens of each unit (QSA compressed block, CSA region),
L1-normalised over the candidate units; the indexer's distribution is the softmax of its FP32 logits
over the same candidates; the loss is `KL(target || indexer)`, averaged over the queries that the
indexer routes (sparse queries; a query with G route groups counts the mean of its G KLs).

Two modes (`IndexerTraining`):
- "dense_warmup": the main attention is dense; candidates are every unit the selection could pick
  (QSA: the complete blocks before the query, `[0, (p + 1) // c)`; CSA: the historical regions of
  its document, `[first, current)`), the per-head softmax runs over every visible key.
- "sparse": the main attention runs over the routes; candidates are the selected units (QSA: the
  route's blocks; CSA: the selection minus the current region), the per-head softmax runs over the
  keys the sparse attention attends (the selected units plus the QSA tail / the CSA current region).

Both exclude what the selection never scores: the QSA tail tokens `v*c … p` and the CSA current
region, which every route takes anyway (the current region's summary also pools tokens after the
query). Their attention mass leaves the target before normalisation. Dense-prefix queries (QSA
`(p + 1) // c <= budget // c`, CSA `metadata.sparse_queries` False) and padding carry no loss.

The main attention's query and key are read under `no_grad` (detached), so the loss trains only the
indexer in both modes; the indexer tensors come from its `training_*` methods (FP32, no checkpoint
roundings), which detach their hidden-state input by default.

Dense warm-up (`blockwise`): tiles of `query_block` queries against streamed blocks of `key_block`
keys. The largest temporaries are one FP32 `[heads, query_block, key_block]` score block (128 MiB at
64 heads and the defaults) and a few FP32 `[groups, query_block, tile units]` unit rows (tile units:
the blocks / regions its queries can see). The target costs two FP32 passes of `Q · Kᵀ` over the
causal keys of the sparse queries (one when `lse` is given); the matmuls follow
`torch.backends.cuda.matmul.allow_tf32`. On CUDA the target comes from Triton kernels: one LSE pass
over the visible keys of every query (skipped when `lse` is given), then per tile one pass over the
keys of the candidate units that sums `exp(s − lse)` over each group's heads and each unit's keys in
registers. The indexer side (logits, KL, gradients) then runs per tile three FP32 GEMMs (3xTF32 on
the tensor cores under PyTorch's default FP32 matmul precision, TF32 when allowed) and one fused
Triton kernel (`dense_logits`), whose largest temporary is the FP32 dots of every index head,
`index_heads` times the target's size (twice that with 3xTF32: the low parts of `d_dot`); the
automatic tiles merge while the target and the dots stay within 160M FP32 elements (640 MiB: a
128 MiB target at 4 index heads; 1.1 GiB with the low parts).

Sparse stage (`slots`): everything lives in the slot layout `[groups, queries, K]` of the selection
(QSA: the route's `token_budget // c` blocks; CSA: the `topk + 1` region ids, the current region
dropped), sorted per row so that a repeated unit counts once; no tensor is indexed by all units. Per
(query, group, slot) the target is the attention mass `Σ_{h in group} Σ_{keys of the unit visible to
the query} exp(scale · q_h · k − lse_h)`, L1-normalised over the query's slots, with `lse` over exactly
the keys the sparse attention attends (the distinct selected units' visible keys and the suffix: the
QSA tail, the CSA current region's tokens up to the query). On CUDA one Triton program per (query,
group) reads the slots' keys through the unit table (a second pass first when `lse` is not given); on
CPU the PyTorch path gathers them per (group, KV head). The indexer logits are computed for the
selected units only, from the unit keys / summaries gathered per slot; softmax, KL and gradients run
over the valid slots. Tiles of query rows keep the largest gathered tensor (`[G, rows, K, index_dim]`
unit keys; on the PyTorch path also `[rows, K · unit size, head_dim]` main keys) within 64M elements
(256 MiB FP32) or one query row. Cost: the target reads `Q · K · unit size` keys per KV head of a
group — the key traffic and `Q · Kᵀ` FLOPs of the sparse attention forward's score pass (twice when
`lse` is not given, then it equals that forward's `Q · Kᵀ` plus `P · V` FLOPs), and the indexer side
`O(Q · G · K · index_heads · index_dim)`.

In both modes the gradients of the indexer tensors are computed in the forward, tile by tile (the
loss is their only consumer), and scaled by the incoming gradient in the backward: the autograd graph
holds gradients the size of the indexer tensors, nothing per (query, key). Double backward is not
supported. The target is a constant of the loss (computed under `no_grad` from detached inputs): no
gradient reaches the main attention, and the kernels have no backward. The Triton path is checked
against the float64 oracle and the PyTorch path under Triton's interpreter.

`lse` (optional, either mode): float32 `[batch, local_queries, heads]`, the natural-log log-sum-exp
of the main attention's scaled scores per query head, over exactly the keys that attention attends
(every visible key in "dense_warmup"; the route's keys in "sparse"); a non-finite entry means the
row attends nothing. FlashAttention-style forwards return it (PyTorch's flash SDPA as `[B, H, S]`:
transpose it).

Context parallelism: each rank passes its shard's queries (`query_start` / `metadata.query_start`)
and the global keys: the main keys as the attention gathers them; the indexer keys with gradient
(`QSAIndexer.training_keys(..., cp_context=...)` gathers them itself; gather the outputs of
`Step5SparseIndexer.training_keys` with `sa_cp.gather_sequence` before `training_summaries`), so
that their gradients reduce-scatter back to the rank that projected them.
`reduction="mean"` is the mean over the rank's own sparse queries; for the exact global mean pass
`reduction="sum"` and divide by the global count of sparse queries (QSA: `Σ max(0, L − dense_positions)`
over rows or packed documents of length L, `QSAIndexerConfig.dense_positions`; CSA: the all-reduced
`metadata.sparse_queries.sum()`), then let the data-parallel gradient reduction add the ranks' parts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from sa_kernels.backend import has_triton, triton_interpret

from ..qsa.lengths import _is_int, packed_block_starts, validate_cu_seqlens
from ..step5.layouts import RegionMetadata, RegionSelection
from .blockwise import DistillationProblem, distillation_sum, merge_tiles
from .slots import SlotProblem, slot_distillation_sum, slot_tiles
from .units import csa_problem, qsa_problem

__all__ = [
    "Backend",
    "IndexerTraining",
    "csa_indexer_distillation_loss",
    "qsa_indexer_distillation_loss",
]

IndexerTraining = Literal["dense_warmup", "sparse"]
"""The distillation modes; a model's `indexer_training` switch adds "off" (no loss)."""

Backend = Literal["auto", "triton", "torch"]
"""How the target is computed: Triton kernels or the blockwise PyTorch loop ("auto": by device)."""

_MODES = ("dense_warmup", "sparse")
_REDUCTIONS = ("mean", "sum")
_BACKENDS = ("auto", "triton", "torch")
_QUERY_BLOCK = 256  # queries per tile when query_block is None
# the Triton path's merged tiles: FP32 target and index dots, G * (1 + Hi) * rows * units at most
_TILE_ELEMENTS = 5 << 25


class _DistillationLoss(torch.autograd.Function):
    """Loss of (index_queries, index_weights, unit_keys); gradients computed in the forward."""

    @staticmethod
    def forward(
        ctx,
        index_queries: torch.Tensor,
        index_weights: torch.Tensor | None,
        unit_keys: torch.Tensor,
        problem: DistillationProblem | SlotProblem,
        index_scale: float,
        reduction: str,
    ) -> torch.Tensor:
        loss_sum = slot_distillation_sum if isinstance(problem, SlotProblem) else distillation_sum
        total, grads = loss_sum(
            problem, index_queries, index_weights, index_scale, unit_keys, ctx.needs_input_grad[:3]
        )
        if reduction == "mean":
            count = problem.loss_rows.sum().clamp_min(1).to(torch.float32)
            total = total / count
            for g in grads:
                if g is not None:
                    g.div_(count)
        inputs = (index_queries, index_weights, unit_keys)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in inputs)
        ctx.present = tuple(g is not None for g in grads)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        out = [
            (grad * next(saved)).to(dtype) if present else None
            for present, dtype in zip(ctx.present, ctx.dtypes, strict=True)
        ]
        return (*out, None, None, None)


def qsa_indexer_distillation_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    index_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    *,
    token_budget: int,
    compress_ratio: int,
    mode: IndexerTraining,
    routes: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sequence_lengths: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
    query_start: int = 0,
    lse: torch.Tensor | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    query_block: int | None = None,
    key_block: int = 2048,
    backend: Backend = "auto",
) -> torch.Tensor:
    """KL distillation loss of the QSA indexer's block logits to the main attention (SEMANTICS §2).

    Local row `i` is the query at global position `query_start + i` (document position `p`, packed);
    its units are its document's complete blocks `b` (tokens `[b*c, (b+1)*c)`); it carries a loss iff
    `(p + 1) // c > token_budget // c`. Indexer logits: `Σ_h relu(q_h · k_b) / sqrt(index_dim)`.
    The target sums all `heads` main heads (QSA routes every head alike). See the module docstring
    for the modes, memory and context parallelism.

    Args:
        query: [batch, local_queries, heads, head_dim] main-attention queries (normalised, rotated;
            bf16/fp16/fp32). Read without gradient.
        key: [batch, global_length, kv_heads, head_dim] main-attention keys of the whole sequence,
            heads % kv_heads == 0. Read without gradient.
        index_queries: [batch, local_queries, index_heads, index_dim] floating, from
            `QSAIndexer.training_queries` (FP32); receives the gradient.
        compressed_keys: [batch, blocks, 1, index_dim] floating, from `QSAIndexer.training_keys`
            (global; packed: batch 1, documents' blocks in order); receives the gradient.
        token_budget: the indexer's budget, a multiple of `compress_ratio`.
        compress_ratio: tokens per block `c`, > 1.
        mode: "dense_warmup" or "sparse".
        routes: "sparse" only: int [batch, local_queries, token_budget + c − 1], the global token ids
            `QSAIndexer.forward` / `select_qsa_token_ids` returned for these queries.
        softmax_scale: the main attention's scale; None: `head_dim ** -0.5`.
        sequence_lengths: right padding: int [batch] global lengths (a tensor is read back once) or
            None (every row has `global_length` tokens).
        cu_seqlens: packed documents (batch 1): global boundaries `0 = cu[0] < … <= global_length`;
            not with `sequence_lengths`.
        query_start: global row of local query 0 (context parallelism: `rank * local_length`).
        lse: float [batch, local_queries, heads] natural log-sum-exp of the main attention's scaled
            scores, as its forward returns it (over every visible key in "dense_warmup", over the
            route's keys in "sparse"); None computes it (one more pass over the keys).
        reduction: "mean" over this call's sparse queries (0 when there are none) or "sum".
        query_block: queries per tile; None: "dense_warmup" 256, and on the Triton path adjacent
            tiles merged while a tile's FP32 `[rows, blocks]` target stays within 32M elements
            (128 MiB); "sparse" as many as the slot layout's tile bound allows (module docstring).
        key_block: keys per streamed block of the PyTorch "dense_warmup" path.
        backend: "auto" (Triton for CUDA tensors, the PyTorch loop on CPU), "triton" (on CPU only
            under `TRITON_INTERPRET=1`) or "torch" (the blockwise PyTorch loop).
    Returns:
        float32 scalar, differentiable with respect to `index_queries` and `compressed_keys`.
    Raises:
        ValueError: shapes or devices disagree, an unknown mode or reduction, routes missing in
            "sparse" or given in "dense_warmup", lengths outside `[0, global_length]`, too few blocks
            for the longest row or the packed documents, bad `cu_seqlens`, blocks that are not
            positive ints, `query_start + local_queries > global_length`.
        TypeError: non-floating tensors, non-integer routes or lengths.
    """
    fn = "qsa_indexer_distillation_loss"
    batch, queries, heads = _check_main(fn, query, key, query_start)
    total = key.shape[1]
    _check_choices(fn, mode, reduction, query_block, key_block)
    backend = _resolve_backend(fn, backend, query)
    for name, value in (("token_budget", token_budget), ("compress_ratio", compress_ratio)):
        if not _is_int(value):
            raise TypeError(f"{fn}: {name} must be an int; got {value!r}")
    if compress_ratio <= 1 or token_budget <= 0 or token_budget % compress_ratio:
        raise ValueError(
            f"{fn}: compress_ratio must be > 1 and token_budget a positive multiple of it; got "
            f"token_budget={token_budget}, compress_ratio={compress_ratio}"
        )
    if index_queries.dim() != 4 or tuple(index_queries.shape[:2]) != (batch, queries):
        raise ValueError(
            f"{fn}: index_queries must be [batch={batch}, local_queries={queries}, index_heads, "
            f"index_dim]; got {tuple(index_queries.shape)}"
        )
    index_dim = index_queries.shape[-1]
    if (
        compressed_keys.dim() != 4
        or compressed_keys.shape[0] != batch
        or compressed_keys.shape[2] != 1
        or compressed_keys.shape[3] != index_dim
    ):
        raise ValueError(
            f"{fn}: compressed_keys must be [batch={batch}, blocks, 1, index_dim={index_dim}]; got "
            f"{tuple(compressed_keys.shape)}"
        )
    _check_floating(fn, index_queries=index_queries, compressed_keys=compressed_keys)
    _check_device(fn, query, key, index_queries, compressed_keys, routes, lse)
    c = compress_ratio
    blocks = compressed_keys.shape[1]
    lengths = bounds = None
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"{fn}: cu_seqlens (packed documents) needs batch 1; got batch {batch}"
            )
        if sequence_lengths is not None:
            raise ValueError(f"{fn}: pass either cu_seqlens or sequence_lengths, not both")
        bounds = validate_cu_seqlens(fn, cu_seqlens, total)
        needed = packed_block_starts(bounds, c)[-1]
    else:
        lengths = _host_lengths(fn, sequence_lengths, batch, total)
        needed = max(lengths) // c
    if blocks < needed:
        raise ValueError(
            f"{fn}: compressed_keys holds {blocks} blocks; the sequence needs {needed} "
            "(length // compress_ratio per row, or per packed document)"
        )
    if mode == "sparse":
        width = token_budget + c - 1
        _check_ids(
            fn,
            "routes",
            routes,
            (batch, queries, width),
            "[batch, local_queries, token_budget + c - 1]",
        )
    elif routes is not None:
        raise ValueError(
            f"{fn}: routes are read in mode 'sparse' only; got routes with mode {mode!r}"
        )
    _check_lse(fn, lse, batch, queries, heads)
    problem = qsa_problem(
        query.detach(),
        key.detach(),
        compress_ratio=c,
        token_budget=token_budget,
        lengths=lengths,
        bounds=bounds,
        query_start=query_start,
        routes=routes if mode == "sparse" else None,
        softmax_scale=_scale(fn, softmax_scale, query),
        lse=None if lse is None else lse.detach(),
        query_block=query_block or _QUERY_BLOCK,
        key_block=key_block,
        backend=backend,
    )
    problem = _tiled(problem, query_block, 1, index_queries.shape[2], index_dim)
    return _DistillationLoss.apply(
        index_queries.unsqueeze(2),
        None,
        compressed_keys[:, :, 0],
        problem,
        1.0 / math.sqrt(index_dim),
        reduction,
    )


def csa_indexer_distillation_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    index_queries: torch.Tensor,
    index_weights: torch.Tensor,
    region_summaries: torch.Tensor,
    metadata: RegionMetadata,
    *,
    mode: IndexerTraining,
    selection: RegionSelection | torch.Tensor | None = None,
    softmax_scale: float | None = None,
    lse: torch.Tensor | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    query_block: int | None = None,
    key_block: int = 2048,
    backend: Backend = "auto",
) -> torch.Tensor:
    """KL distillation loss of the Step-5 indexer's region scores to the main attention (SEMANTICS §1.2).

    Per provider group g and sparse query q (`metadata.sparse_queries`), the target sums the main
    heads of KV group g (heads `[g * heads / G, (g + 1) * heads / G)`) over the visible key tokens of
    each candidate region; the indexer logits are `Σ_{h in g} w_h(q) · relu(q_h · s_r)`. A query's
    loss is the mean over its G groups. The current region is never a candidate (the selection
    always adds it; its summary pools tokens after the query). See the module docstring for the
    modes, memory and context parallelism.

    Args:
        query: [batch, local_queries, heads, head_dim] main-attention queries (bf16/fp16/fp32), heads a
            multiple of G. Read without gradient.
        key: [batch, global_length, kv_heads, head_dim] main-attention keys of the whole sequence,
            heads % kv_heads == 0. Read without gradient.
        index_queries: [batch, local_queries, G, index_heads_per_group, proxy_dim] floating, from
            `Step5SparseIndexer.training_queries`; receives the gradient.
        index_weights: [batch, local_queries, G, index_heads_per_group] floating, from the same call;
            receives the gradient.
        region_summaries: [batch, region_count, proxy_dim] floating, from
            `Step5SparseIndexer.training_summaries` (global regions); receives the gradient.
        metadata: the forward's `region_metadata(...)` for these queries.
        mode: "dense_warmup" or "sparse".
        selection: "sparse" only: the layer's `RegionSelection`, or its `region_ids` int
            [batch, G, local_queries, topk + 1] (ascending, unused slots `region_count`).
        softmax_scale: the main attention's scale; None: `head_dim ** -0.5`.
        lse: float [batch, local_queries, heads] natural log-sum-exp of the main attention's scaled
            scores, as its forward returns it (over every visible key in "dense_warmup", over the
            selected regions' visible keys in "sparse"); None computes it.
        reduction: "mean" over this shard's sparse queries (0 when there are none) or "sum".
        query_block: queries per tile (the metadata's score tiles, merged or split); None:
            "dense_warmup" 256, and on the Triton path tiles merged while a tile's FP32
            `[G, rows, regions]` target stays within 32M elements (128 MiB); "sparse" as many as the
            slot layout's tile bound allows (module docstring).
        key_block: keys per streamed block of the PyTorch "dense_warmup" path.
        backend: "auto" (Triton for CUDA tensors, the PyTorch loop on CPU), "triton" (on CPU only
            under `TRITON_INTERPRET=1`) or "torch" (the blockwise PyTorch loop).
    Returns:
        float32 scalar, differentiable with respect to `index_queries`, `index_weights` and
        `region_summaries`.
    Raises:
        ValueError: shapes or devices disagree with each other or with `metadata`, an unknown mode or
            reduction, a selection missing in "sparse" or given in "dense_warmup", blocks that are not
            positive ints.
        TypeError: non-floating tensors, non-integer region ids, metadata of another type.
    """
    fn = "csa_indexer_distillation_loss"
    if not isinstance(metadata, RegionMetadata):
        raise TypeError(f"{fn}: metadata must be a RegionMetadata; got {type(metadata).__name__}")
    batch, queries, heads = _check_main(fn, query, key, metadata.query_start)
    _check_choices(fn, mode, reduction, query_block, key_block)
    backend = _resolve_backend(fn, backend, query)
    want = (metadata.batch_size, metadata.queries, metadata.global_length)
    if (batch, queries, key.shape[1]) != want:
        raise ValueError(
            f"{fn}: query [batch, local_queries] and key's global_length must match metadata "
            f"(batch, queries, global_length) = {want}; got {(batch, queries, key.shape[1])}"
        )
    if index_queries.dim() != 5 or tuple(index_queries.shape[:2]) != (batch, queries):
        raise ValueError(
            f"{fn}: index_queries must be [batch={batch}, local_queries={queries}, G, heads_per_group, "
            f"proxy_dim]; got {tuple(index_queries.shape)}"
        )
    groups, index_heads, index_dim = index_queries.shape[2:]
    if heads % groups:
        raise ValueError(
            f"{fn}: the main heads ({heads}) must be a multiple of the provider groups G = "
            f"index_queries.shape[2] ({groups})"
        )
    if tuple(index_weights.shape) != (batch, queries, groups, index_heads):
        raise ValueError(
            f"{fn}: index_weights must be [batch, local_queries, G, heads_per_group] = "
            f"{(batch, queries, groups, index_heads)}; got {tuple(index_weights.shape)}"
        )
    summary_shape = (batch, metadata.region_count, index_dim)
    if tuple(region_summaries.shape) != summary_shape:
        raise ValueError(
            f"{fn}: region_summaries must be [batch, region_count, proxy_dim] = {summary_shape}; got "
            f"{tuple(region_summaries.shape)}"
        )
    _check_floating(
        fn,
        index_queries=index_queries,
        index_weights=index_weights,
        region_summaries=region_summaries,
    )
    region_ids = selection.region_ids if isinstance(selection, RegionSelection) else selection
    _check_device(fn, query, key, index_queries, index_weights, region_summaries, region_ids, lse)
    if mode == "sparse":
        shape = (batch, groups, queries, metadata.topk + 1)
        _check_ids(
            fn, "selection", region_ids, shape, "region_ids [batch, G, local_queries, topk + 1]"
        )
    elif selection is not None:
        raise ValueError(
            f"{fn}: selection is read in mode 'sparse' only; got a selection with mode {mode!r}"
        )
    _check_lse(fn, lse, batch, queries, heads)
    problem = csa_problem(
        query.detach(),
        key.detach(),
        metadata,
        groups=groups,
        region_ids=region_ids if mode == "sparse" else None,
        softmax_scale=_scale(fn, softmax_scale, query),
        lse=None if lse is None else lse.detach(),
        query_block=query_block or _QUERY_BLOCK,
        key_block=key_block,
        backend=backend,
    )
    problem = _tiled(problem, query_block, groups, index_heads, index_dim)
    return _DistillationLoss.apply(
        index_queries, index_weights, region_summaries, problem, 1.0, reduction
    )


# -- validation ---------------------------------------------------------------------------------------


def _check_main(
    fn: str, query: torch.Tensor, key: torch.Tensor, query_start: int
) -> tuple[int, int, int]:
    if query.dim() != 4 or 0 in query.shape:
        raise ValueError(
            f"{fn}: query must be a non-empty [batch, local_queries, heads, head_dim]; got "
            f"{tuple(query.shape)}"
        )
    batch, queries, heads, dim = query.shape
    if key.dim() != 4 or key.shape[0] != batch or key.shape[3] != dim or key.shape[2] < 1:
        raise ValueError(
            f"{fn}: key must be [batch={batch}, global_length, kv_heads, head_dim={dim}]; got "
            f"{tuple(key.shape)}"
        )
    if heads % key.shape[2]:
        raise ValueError(
            f"{fn}: heads ({heads}) must be a multiple of key's kv_heads ({key.shape[2]})"
        )
    _check_floating(fn, query=query, key=key)
    if not _is_int(query_start) or query_start < 0 or query_start + queries > key.shape[1]:
        raise ValueError(
            f"{fn}: query_start must be an int >= 0 with query_start + local_queries ({queries}) <= "
            f"global_length ({key.shape[1]}); got {query_start!r}"
        )
    return batch, queries, heads


def _check_choices(
    fn: str, mode: str, reduction: str, query_block: int | None, key_block: int
) -> None:
    if mode not in _MODES:
        raise ValueError(f"{fn}: mode must be one of {_MODES}; got {mode!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {_REDUCTIONS}; got {reduction!r}")
    if query_block is not None and (not _is_int(query_block) or query_block < 1):
        raise ValueError(f"{fn}: query_block must be a positive int or None; got {query_block!r}")
    if not _is_int(key_block) or key_block < 1:
        raise ValueError(f"{fn}: key_block must be a positive int; got {key_block!r}")


def _resolve_backend(fn: str, backend: str, query: torch.Tensor) -> str:
    """The path for `backend` on `query`'s device ("triton" or "torch"), or raise saying why not."""
    if backend not in _BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {_BACKENDS}; got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if query.is_cuda and has_triton() else "torch"
    if not has_triton():
        raise RuntimeError(
            f"{fn}: backend='triton' needs the triton package, which is not installed"
        )
    if not query.is_cuda and not triton_interpret():
        raise RuntimeError(
            f"{fn}: backend='triton' on {query.device.type} tensors needs TRITON_INTERPRET=1 "
            "(Triton's interpreter); use CUDA tensors or backend='torch'"
        )
    return "triton"


def _tiled(
    problem: DistillationProblem | SlotProblem,
    query_block: int | None,
    groups: int,
    index_heads: int,
    index_dim: int,
) -> DistillationProblem | SlotProblem:
    """The problem with its final tiles. Sparse stage: rows regrouped so that a tile's largest gathered
    tensor stays within `slots._SLOT_ELEMENTS`. Dense warm-up: tiles merged up to `_TILE_ELEMENTS`
    (Triton path, automatic tiles)."""
    if isinstance(problem, SlotProblem):
        slots = problem.slot_units.shape[-1]
        if problem.backend == "triton":  # a tile's ~8 FP32 [G, rows, K] (mass, target, logits, ...)
            per_row = 8 * groups * slots
        else:  # gathered unit keys and dots, main keys and scores of one (group, KV head)
            per_row = groups * slots * max(index_dim, index_heads)
            heads, dim = problem.query.shape[2:]
            keys = slots * problem.unit_rows.shape[-1] + problem.suffix_rows.shape[-1]
            per_row = max(per_row, keys * max(dim, heads // groups))
        return dataclasses.replace(problem, tiles=slot_tiles(problem.tiles, per_row, query_block))
    if query_block is not None or problem.backend != "triton":
        return problem
    width = groups * (1 + index_heads)  # the target and the dots of every index head
    return dataclasses.replace(problem, tiles=merge_tiles(problem.tiles, width, _TILE_ELEMENTS))


def _check_floating(fn: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{fn}: {name} must be a floating tensor; got {got}")


def _check_device(fn: str, *tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"{fn}: every tensor must be on one device; got {sorted(map(str, devices))}"
        )


def _check_ids(
    fn: str, name: str, ids: torch.Tensor | None, shape: tuple[int, ...], layout: str
) -> None:
    if ids is None:
        raise ValueError(f"{fn}: mode 'sparse' needs {name} ({layout}); got None")
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{fn}: {name} must be an integer tensor; got {got}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{fn}: {name} must be {layout} = {shape}; got {tuple(ids.shape)}")


def _check_lse(fn: str, lse: torch.Tensor | None, batch: int, queries: int, heads: int) -> None:
    if lse is None:
        return
    if not isinstance(lse, torch.Tensor) or not lse.is_floating_point():
        raise TypeError(f"{fn}: lse must be a floating tensor or None")
    if tuple(lse.shape) != (batch, queries, heads):
        raise ValueError(
            f"{fn}: lse must be [batch, local_queries, heads] = {(batch, queries, heads)}; got "
            f"{tuple(lse.shape)}"
        )


def _scale(fn: str, softmax_scale: float | None, query: torch.Tensor) -> float:
    if softmax_scale is None:
        return query.shape[-1] ** -0.5
    if (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, int | float)
        or not 0 < softmax_scale < math.inf
    ):
        raise ValueError(
            f"{fn}: softmax_scale must be a finite float > 0 or None; got {softmax_scale!r}"
        )
    return float(softmax_scale)


def _host_lengths(
    fn: str,
    sequence_lengths: torch.Tensor | list[int] | tuple[int, ...] | None,
    batch: int,
    total: int,
) -> list[int]:
    if sequence_lengths is None:
        return [total] * batch
    if isinstance(sequence_lengths, torch.Tensor):
        if sequence_lengths.is_floating_point() or sequence_lengths.dtype == torch.bool:
            raise TypeError(
                f"{fn}: sequence_lengths must be an integer tensor; got {sequence_lengths.dtype}"
            )
        if tuple(sequence_lengths.shape) != (batch,):
            raise ValueError(
                f"{fn}: sequence_lengths must be [batch] = ({batch},); got {tuple(sequence_lengths.shape)}"
            )
        lengths = [int(x) for x in sequence_lengths.tolist()]  # the one host synchronisation
    else:
        if isinstance(sequence_lengths, (str, bytes)) or not all(
            _is_int(x) for x in sequence_lengths
        ):
            raise TypeError(f"{fn}: sequence_lengths must hold ints; got {sequence_lengths!r}")
        lengths = [int(x) for x in sequence_lengths]
        if len(lengths) != batch:
            raise ValueError(f"{fn}: sequence_lengths must hold {batch} ints; got {len(lengths)}")
    bad = [x for x in lengths if not 0 <= x <= total]
    if bad:
        raise ValueError(
            f"{fn}: sequence_lengths must lie in [0, {total}] (global_length); got {bad[:4]}"
        )
    return lengths
