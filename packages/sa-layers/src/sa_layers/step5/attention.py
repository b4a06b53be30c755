"""`Step5Attention`: gated GQA attention of a Step-5 layer, sliding-window (SWA), compressed sparse (CSA)
or dense causal (SEMANTICS §1.1–§1.2, §5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from sa_cp import RecomputeReplay, gather_halo, gather_no_grad, gather_sequence
from sa_kernels import grouped_rms_norm, sparse_region_attention
from sa_kernels.sparse_gqa.flex import compiled_flex, flex_attend, flex_kernel_options
from sa_kernels.sparse_region_attention import RegionBlockMask, build_region_block_mask
from sa_kernels.sparse_region_attention.triton_kernels import MAX_HEAD_DIM
from sa_routing import (
    RegionMetadata,
    RegionSelection,
    Step5SparseIndexer,
    csa_indexer_distillation_loss,
)

from ..norm import ZeroCenteredRMSNorm
from ..routes import INDEXER_TRAINING
from .config import Step5Config
from .layout import Step5Batch

# Queries per chunk of the masked-SDPA path (its boolean mask is chunk × keys).
MASKED_QUERY_CHUNK = 1024
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RegionRoutes:
    """One CSA layer's selected regions and, for the fused backends, their block mask (what the
    recompute replays).

    Attributes:
        selection: the indexer's `RegionSelection` (region_ids int32 [B, G, L, topk + 1]).
        block_mask: `build_region_block_mask(region_ids, region_sources, kv_length, heads,
            query_start=...)` built once here, or None where the backend reads the ids (the
            reference, "auto" on CPU, "fa4", which the kernel refuses).
    """

    selection: RegionSelection
    block_mask: RegionBlockMask | None

    @property
    def region_ids(self) -> torch.Tensor:
        return self.selection.region_ids


def region_routes(
    selection: RegionSelection,
    metadata: RegionMetadata,
    kv_length: int,
    query_heads: int,
    head_dim: int,
    backend: str,
) -> RegionRoutes:
    """`RegionRoutes` of `selection` with the block mask `backend` needs ("gather": routes only;
    "flex": the Flex BlockMask; "auto" on CUDA: the tile statistics `auto` decides from, and the
    Flex mask when they favour it or head_dim is beyond the gather kernels)."""
    ids = selection.region_ids
    if backend in ("reference", "fa4") or (backend == "auto" and ids.device.type != "cuda"):
        return RegionRoutes(selection, None)
    build_flex = {"gather": False, "flex": True}.get(
        backend, True if head_dim > MAX_HEAD_DIM else None
    )
    mask = build_region_block_mask(
        ids,
        metadata.region_sources,
        kv_length,
        query_heads,
        query_start=metadata.query_start,
        build_flex=build_flex,
    )
    return RegionRoutes(selection, mask)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """NeoX half-split RoPE over the first `r` dims, in FP32, rounded once to x's dtype.

    Args:
        x: [B, L, heads, D]; table: float32 [B or 1, L, r] `cat(cos, sin)`, r <= D even.
    Returns:
        [B, L, heads, D] in x's dtype; dims from r on pass through.
    """
    rotary = table.shape[-1]
    half = rotary // 2
    cos, sin = table[..., None, :half], table[..., None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:rotary].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return rotated if rotary == x.shape[-1] else torch.cat((rotated, x[..., rotary:]), dim=-1)


class Step5Attention(nn.Module):
    """One Step-5 attention layer: fused per-group QKV, per-head zero-centred q/k norms, partial RoPE,
    attention of the layer's type, a sigmoid head gate and the output projection.

    `forward(hidden, batch)` takes the model's `Step5Batch` (built once per call) in place of the
    tensors `(positions, padding_mask, global_positions, global_padding, sparse_metadata)`: they
    are its `positions`, `padding`, `global_positions`, `global_padding` and `sparse_metadata`.

    Parameters: `qkv_proj` [G · (hpg + 2) · D, hidden] laid out `[G, hpg + 2, D]` (the group's hpg
    query heads, its key, its value), `g_proj` [heads, hidden], `o_proj` [hidden, heads · D],
    `q_norm` / `k_norm` [D] FP32 (shared by every head); CSA layers also hold the frozen `indexer`
    (`Step5SparseIndexer`, its FP32 weights stay FP32 under `.to(bf16)`). Routes are chosen once per
    call on the `routes` replay channel, so checkpointing with `Step5Model.checkpoint_context_fn()`
    replays them (with their block mask) in the recompute.

    `indexer_training` (CSA layers; set by `Step5Model.set_indexer_training`): "off" routes with the
    frozen indexer; "dense_warmup" attends densely (causal within the document) and returns the
    indexer's distillation loss over every historical region of the query's document; "sparse"
    attends over the routes and returns the loss over the selected regions. The loss's target is
    normalised by the log-sum-exp the main attention returned in the same call where it has one
    (the sparse attention's `return_lse=True`; in the warm-up, the dense Flex path's), so the loss
    runs no LSE pass of its own; the warm-up's masked-SDPA path (CPU, the reference backend)
    returns none and the loss computes it. The loss reads the attention's query and key without
    gradient and the hidden states detached, so it trains only the indexer.

    Args:
        config: the model's `Step5Config`.
        layer_idx: the layer (its type, RoPE and indexer RoPE base).
        dtype, device: of the parameters (the activation dtype; FP32 norms whatever it is).
    """

    def __init__(
        self,
        config: Step5Config,
        layer_idx: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, Step5Config):
            raise TypeError(
                f"Step5Attention: config must be a Step5Config; got {type(config).__name__}"
            )
        if (
            isinstance(layer_idx, bool)
            or not isinstance(layer_idx, int)
            or not 0 <= layer_idx < config.num_hidden_layers
        ):
            raise ValueError(
                f"Step5Attention: layer_idx must be in [0, {config.num_hidden_layers}); got {layer_idx!r}"
            )
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.backend = config.attn_backend
        self.rotary_key = (config.rope_theta_for(layer_idx), config.rotary_dim_for(layer_idx))
        self.scale = config.head_dim**-0.5
        hidden, heads, groups, dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_attention_groups,
            config.head_dim,
        )
        factory = {"bias": False, "dtype": dtype, "device": device}
        self.qkv_proj = nn.Linear(hidden, groups * (config.heads_per_group + 2) * dim, **factory)
        self.g_proj = nn.Linear(hidden, heads, **factory)
        self.o_proj = nn.Linear(heads * dim, hidden, **factory)
        self.q_norm = ZeroCenteredRMSNorm(dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(dim, config.rms_norm_eps)
        if device is not None:
            self.q_norm.to(device)
            self.k_norm.to(device)
        self.indexer = (
            Step5SparseIndexer(
                config.sparse_config,
                layer_idx,
                dtype or torch.get_default_dtype(),
                device=device,
            )
            if self.layer_type == "csa"
            else None
        )
        self.routes: RecomputeReplay[RegionRoutes] = RecomputeReplay(f"step5-routes-{layer_idx}")
        self.cp_group = None
        self.indexer_training = "off"

    def setup_cp_attention(self, cp_mesh_or_group) -> None:
        """Attach the context-parallel group (a process group, or a 1-D DeviceMesh's group); the
        model then shards over it by default, and a batch laid out over another group is refused."""
        group = (
            cp_mesh_or_group.get_group()
            if hasattr(cp_mesh_or_group, "get_group")
            else cp_mesh_or_group
        )
        self.cp_group = group

    def _apply(self, fn, recurse=True):
        # `.to(torch.bfloat16)` must not round the indexer's FP32 weights (w_proj, q_norm, k_norm):
        # where `fn` would give them a 16-bit dtype they only move device.
        if self.indexer is None or not recurse:
            return super()._apply(fn, recurse)
        fp32 = {id(m) for m in (self.indexer.w_proj, self.indexer.q_norm, self.indexer.k_norm)}

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if t.dtype == torch.float32 and out.dtype in _LOW_PRECISION:
                return t.to(device=out.device)
            return out

        for module in self.children():
            if module is self.indexer:
                for child in module.children():
                    child._apply(keep_fp32 if id(child) in fp32 else fn)
                module._apply(fn, recurse=False)
            else:
                module._apply(fn)
        return super()._apply(fn, recurse=False)

    # -- forward -----------------------------------------------------------------------------------

    def forward(
        self, hidden: torch.Tensor, batch: Step5Batch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [B, L, hidden_size] in the parameters' dtype → (output [B, L, hidden_size], the
        indexer's FP32 distillation loss, or None when indexer training is off or the layer has no
        indexer)."""
        self._check(hidden, batch)
        query, key, value = self.project(hidden, batch)
        mode = "off" if self.indexer is None else self.indexer_training
        routes = lse = None
        if self.layer_type == "swa":
            out = self.window_attention(query, key, value, batch)
        else:
            key, value = self._gather_kv(key, value, batch)
            if mode == "dense_warmup":
                out, lse = self.causal_attention_and_lse(query, key, value, batch)
            elif self.layer_type == "dense":
                out = self.causal_attention(query, key, value, batch)
            else:
                out, routes, lse = self.routed_attention(
                    hidden, query, key, value, batch, return_lse=mode == "sparse"
                )
        aux = (
            None
            if mode == "off"
            else self.indexer_loss(hidden, query, key, batch, mode, routes, lse)
        )
        gate = torch.sigmoid(self.g_proj(hidden)).unsqueeze(-1)  # [B, L, heads, 1]
        return self.o_proj((out * gate).flatten(-2)), aux

    def project(
        self, hidden: torch.Tensor, batch: Step5Batch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query [B, L, heads, D], key and value [B, L, G, D]: normalised on strided views of the
        fused QKV (no copy), rotated in FP32, in the activation dtype."""
        config = self.config
        groups, hpg, dim = config.num_attention_groups, config.heads_per_group, config.head_dim
        b, s, _ = hidden.shape
        qkv = self.qkv_proj(hidden).view(b * s * groups, hpg + 2, dim)
        dtype = qkv.dtype
        query = grouped_rms_norm(qkv[:, :hpg], self.q_norm.weight, self.q_norm.eps, dtype)
        key = grouped_rms_norm(qkv[:, hpg : hpg + 1], self.k_norm.weight, self.k_norm.eps, dtype)
        value = qkv[:, hpg + 1].view(b, s, groups, dim)
        table = batch.rotary[self.rotary_key]
        query = apply_rotary(query.view(b, s, groups * hpg, dim), table)
        key = apply_rotary(key.view(b, s, groups, dim), table)
        return query, key, value

    def window_attention(self, query, key, value, batch: Step5Batch) -> torch.Tensor:
        """Each query over the keys of its document in `[q − W + 1, q]`; under context parallelism
        the previous rank's last `W − 1` keys arrive by `gather_halo` (by an all-gather when that
        passes one shard)."""
        group, groups = batch.cp.group, self.config.num_attention_groups
        if batch.swa_halo != "none":
            both = torch.cat((key, value), dim=2)
            if batch.swa_halo == "halo":
                both = gather_halo(both, batch.window - 1, group)
            else:
                start = batch.swa_key_start
                both = gather_sequence(both, group).narrow(1, start, batch.cp.local_stop - start)
            key, value = both.split(groups, dim=2)
        mask = batch.flex_masks.get("swa")
        if mask is not None:
            return _flex(query, key, value, mask, self.scale, batch.capability)
        return masked_attention(
            query,
            key,
            value,
            batch.query_documents,
            batch.swa_key_documents,
            query_start=batch.local_start,
            key_start=batch.swa_key_start,
            window=batch.window,
            scale=self.scale,
        )

    def causal_attention(self, query, key, value, batch: Step5Batch) -> torch.Tensor:
        """Each query over every earlier key of its document; key, value: [B, S, G, D] global
        (all-gathered under CP)."""
        mask = batch.flex_masks.get("dense")
        if mask is not None:
            return _flex(query, key, value, mask, self.scale, batch.capability)
        return masked_attention(
            query,
            key,
            value,
            batch.query_documents,
            batch.documents,
            query_start=batch.local_start,
            key_start=0,
            window=None,
            scale=self.scale,
        )

    def causal_attention_and_lse(
        self, query, key, value, batch: Step5Batch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`causal_attention` and its log-sum-exp from the same call, for the indexer's warm-up →
        (out [B, L, heads, D], lse). lse: on the Flex path (the batch's "dense" mask, CUDA),
        Flex's float32 natural log-sum-exp [B, L, heads] (detached; −inf on padding rows); None
        on the masked-SDPA path, which returns none (SDPA has no portable LSE output)."""
        mask = batch.flex_masks.get("dense")
        if mask is not None:
            return _flex(query, key, value, mask, self.scale, batch.capability, return_lse=True)
        return self.causal_attention(query, key, value, batch), None

    @torch.compiler.disable
    def routed_attention(
        self, hidden, query, key, value, batch: Step5Batch, *, return_lse: bool = False
    ) -> tuple[torch.Tensor, RegionRoutes, torch.Tensor | None]:
        """Region selection (`select_routes`) and `sparse_attention` over it → (out [B, L, heads,
        D], the routes, with `return_lse` the attention's float32 natural log-sum-exp [B, L,
        heads] from the same call (detached), else None).

        Runs outside torch.compile's graph (one graph break per CSA layer): the indexer's top-k,
        the replay channel, the block-mask build and the backend's dispatch (Triton launches,
        compiled Flex) are host logic that Dynamo cannot or should not trace.
        """
        routes = self.select_routes(hidden, batch, key.shape[1])
        result = self.sparse_attention(query, key, value, routes, batch, return_lse=return_lse)
        out, lse = result if return_lse else (result, None)
        return out, routes, lse

    def sparse_attention(
        self, query, key, value, routes: RegionRoutes, batch: Step5Batch, *, return_lse=False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Each query over the causally visible keys of its KV group's selected regions; key, value:
        [B, S, G, D] global (all-gathered under CP); with `return_lse`, `(out, lse)` as
        `sparse_region_attention` returns them."""
        return sparse_region_attention(
            query,
            key,
            value,
            routes.region_ids,
            batch.sparse_metadata.region_sources,
            query_start=batch.local_start,
            softmax_scale=self.scale,
            backend=self.backend,
            block_mask=routes.block_mask,
            return_lse=return_lse,
        )

    @torch.compiler.disable  # the distillation loss's dispatch runs eagerly, like route selection
    def indexer_loss(
        self,
        hidden: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        batch: Step5Batch,
        mode: str,
        routes: RegionRoutes | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The indexer's KL distillation loss (`sa_routing.csa_indexer_distillation_loss`) as this
        shard's share of the global mean over sparse queries: `cp.size · Σ_local / N_global`, with
        `N_global = batch.sparse_query_count` (so the mean over the CP group is the global mean).

        Args:
            hidden: [B, L, hidden_size], the layer's input (detached inside the indexer's
                `training_*` projections).
            query: [B, L, heads, D], the attention's query; key: [B, S, G, D] its global keys.
            mode: "dense_warmup" or "sparse"; routes: the call's `RegionRoutes` in "sparse".
            lse: the main attention's float32 log-sum-exp [B, L, heads] over the keys it attended,
                from its forward, or None: the loss computes it.
        Returns:
            float32 scalar; gradients reach only the indexer's parameters.
        """
        if mode not in INDEXER_TRAINING[1:]:
            raise ValueError(
                f"Step5Attention: indexer_training must be one of {INDEXER_TRAINING}; got {mode!r}"
            )
        indexer, metadata, group = self.indexer, batch.sparse_metadata, batch.cp.group
        keys, logits = indexer.training_keys(hidden, batch.positions)
        # with gradient: the backward reduce-scatters each rank's key gradients to their shard
        keys, logits = gather_sequence(keys, group), gather_sequence(logits, group)
        total = csa_indexer_distillation_loss(
            query,
            key,
            *indexer.training_queries(hidden, batch.positions),
            indexer.training_summaries(keys, logits, metadata),
            metadata,
            mode=mode,
            selection=None if routes is None else routes.selection,
            softmax_scale=self.scale,
            lse=lse,
            reduction="sum",
        )
        return total * batch.cp.size / batch.sparse_query_count.clamp(min=1)

    @torch.compiler.disable
    def select_routes(
        self, hidden: torch.Tensor, batch: Step5Batch, kv_length: int
    ) -> RegionRoutes:
        """The indexer's regions of this call and their block mask (the recorded ones in a
        checkpoint recompute). Indexer keys and compression logits are projected on the shard and
        all-gathered without gradient; the metadata is the batch's."""
        metadata, group = batch.sparse_metadata, batch.cp.group

        def select() -> RegionRoutes:
            keys = logits = None
            if batch.cp.size > 1 or metadata.score_tiles:
                keys, logits = self.indexer.project_keys(hidden, batch.positions)
                keys, logits = gather_no_grad(keys, group), gather_no_grad(logits, group)
            selection = self.indexer(
                hidden,
                batch.positions,
                keys,
                logits,
                batch.global_positions,
                batch.global_padding,
                batch.local_start,
                metadata,
            )
            return region_routes(
                selection,
                metadata,
                kv_length,
                self.config.num_attention_heads,
                self.config.head_dim,
                self.backend,
            )

        return self.routes.select_or_replay(select)

    def _gather_kv(self, key, value, batch: Step5Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.cp.size == 1:
            return key, value
        both = gather_sequence(torch.cat((key, value), dim=2), batch.cp.group)
        return both.split(self.config.num_attention_groups, dim=2)

    def _check(self, hidden: torch.Tensor, batch: Step5Batch) -> None:
        fn = "Step5Attention.forward"
        if not isinstance(batch, Step5Batch):
            raise TypeError(f"{fn}: batch must be a Step5Batch; got {type(batch).__name__}")
        want = (batch.batch_size, batch.local_length, self.config.hidden_size)
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != want:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(
                f"{fn}: hidden must be [batch, local_length, hidden_size] = {want}; got {got}"
            )
        if self.cp_group is not None and batch.cp.group is not self.cp_group:
            raise ValueError(
                f"{fn}: batch is laid out over another context-parallel group than the one "
                "setup_cp_attention attached"
            )
        if self.layer_type == "csa" and batch.sparse_metadata is None:
            raise ValueError(f"{fn}: a CSA layer needs batch.sparse_metadata; got None")


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_documents: torch.Tensor,
    key_documents: torch.Tensor,
    *,
    query_start: int,
    key_start: int,
    window: int | None,
    scale: float,
    query_chunk: int = MASKED_QUERY_CHUNK,
) -> torch.Tensor:
    """Causal GQA attention within each document, optionally windowed, by masked SDPA over chunks
    of queries (each chunk reads only the keys it can see). Padding queries give 0.

    Args:
        query: [B, L, heads, D], global rows `[query_start, query_start + L)`.
        key, value: [B, K, G, D], global rows `[key_start, key_start + K)` (rows before 0 are never
            visible), `key_start + K >= query_start + L`.
        query_documents: int64 [B, L]; key_documents: int64 [B, K]; −1 for padding.
        window: `W` (key k visible to q iff `0 <= q − k < W`), or None (causal).
    Returns:
        [B, L, heads, D] in query's dtype.
    """
    length, keys = query.shape[1], key.shape[1]
    device = query.device
    outputs = []
    for c0 in range(0, length, query_chunk):
        c1 = min(length, c0 + query_chunk)
        first = query_start + c0
        k0 = max(key_start, 0, first - (window - 1) if window is not None else 0)
        k1 = min(query_start + c1, key_start + keys)
        rows = torch.arange(first, query_start + c1, device=device)
        distance = rows[:, None] - torch.arange(k0, k1, device=device)[None, :]
        q_docs = query_documents[:, c0:c1]
        visible = (
            q_docs[:, :, None] == key_documents[:, None, k0 - key_start : k1 - key_start]
        ) & (distance >= 0)
        if window is not None:
            visible &= distance < window
        valid = q_docs >= 0
        visible &= valid[:, :, None]
        # a padding query sees its own key so that the softmax is defined; its output is zeroed below
        own = torch.arange(c1 - c0, device=device)
        visible[:, own, own + (first - k0)] |= ~valid
        out = F.scaled_dot_product_attention(
            query[:, c0:c1].transpose(1, 2),
            key[:, k0 - key_start : k1 - key_start].transpose(1, 2),
            value[:, k0 - key_start : k1 - key_start].transpose(1, 2),
            attn_mask=visible[:, None],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
        outputs.append(out * valid[:, :, None, None].to(out.dtype))
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]


def _flex(
    query, key, value, block_mask, scale: float, capability, *, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention over a Flex block mask of the batch, in our [B, tokens, heads, D] layout
    (`sa_kernels`' `flex_attend`; rows with no visible key give 0), compiled once per process, with
    `flex_kernel_options` for the batch's arithmetic window / causal mask_mods on a GPU of compute
    `capability`. Inside a torch.compile'd model the plain `flex_attention` is traced into the
    model's graph (Inductor compiles it) instead of nesting a compile. With `return_lse`,
    `(out, lse)`: lse float32 [B, tokens, heads], Flex's natural log-sum-exp, detached, −inf on a
    row with no visible key."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention as attention
    else:
        attention = compiled_flex()
    options = flex_kernel_options(
        query.shape[-1], query.dtype, query.device.type, capability, bitmap_mask=False
    )
    return flex_attend(
        attention, query, key, value, block_mask, scale, options, return_lse=return_lse
    )
