"""`QSAAttention`: gated GQA attention over the token routes of a frozen QSA indexer (SEMANTICS §2)."""

import torch
from torch import nn
from torch.nn import functional as F

from sa_cp import RecomputeReplay, gather_sequence
from sa_kernels import sparse_gqa_attention
from sa_routing import QSAIndexer, apply_qsa_rope, qsa_indexer_distillation_loss

from ..norm import ZeroCenteredRMSNorm
from ..routes import INDEXER_TRAINING, TokenRoutes, token_routes
from .config import QSAConfig
from .layout import QSABatch, dense_visibility


class QSAAttention(nn.Module):
    """One attention layer of a QSA model: "qsa" layers attend over routed keys, "dense" ones causally.

    Parameters: `q_proj` [heads · 2 · head_dim, hidden] (per head: query, then gate), `k_proj` and
    `v_proj` [kv_heads · head_dim, hidden], `o_proj` [hidden, heads · head_dim], zero-centred per-head
    `q_norm` / `k_norm` [head_dim] (FP32); "qsa" layers also hold the frozen `indexer`.
    Routes are chosen once per call on the `routes` replay channel (`RecomputeReplay`), so activation
    checkpointing with `QSAModel.checkpoint_context_fn()` replays them in the recompute.

    `indexer_training` (set by `QSAModel.set_indexer_training`): "off" routes with the frozen
    indexer; "dense_warmup" attends densely (causal) and returns the indexer's distillation loss over
    every visible block; "sparse" attends over the routes and returns the loss over the selected
    blocks, its target normalised by the log-sum-exp the sparse attention returned
    (`return_lse=True`), so the loss runs no LSE pass of its own. The warm-up's dense attention
    is SDPA, which returns no log-sum-exp: there the loss computes it. The loss reads the
    attention's query and key without gradient and the hidden states detached, so it trains only
    the indexer.
    """

    def __init__(self, config: QSAConfig, layer_idx: int) -> None:
        super().__init__()
        if not isinstance(config, QSAConfig):
            raise TypeError(
                f"QSAAttention: config must be a QSAConfig; got {type(config).__name__}"
            )
        if not 0 <= layer_idx < config.num_hidden_layers:
            raise ValueError(
                f"QSAAttention: layer_idx must be in [0, {config.num_hidden_layers}); got {layer_idx!r}"
            )
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.backend = config.attn_backend
        hidden, heads, kv_heads, dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(hidden, heads * 2 * dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(dim, config.rms_norm_eps)
        self.indexer = QSAIndexer(config.indexer) if self.layer_type == "qsa" else None
        self.routes: RecomputeReplay[TokenRoutes] = RecomputeReplay(f"qsa-routes-{layer_idx}")
        self.indexer_training = "off"

    def forward(
        self, hidden: torch.Tensor, batch: QSABatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [batch, local_length, hidden_size] → (output [batch, local_length, hidden_size],
        the indexer's FP32 distillation loss, or None when indexer training is off)."""
        heads, kv_heads, dim = (
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            self.config.head_dim,
        )
        b, s, _ = hidden.shape
        query, gate = self.q_proj(hidden).view(b, s, heads, 2 * dim).chunk(2, dim=-1)
        query = apply_qsa_rope(self.q_norm(query), batch.freqs.expand(b, -1, -1))
        key = apply_qsa_rope(
            self.k_norm(self.k_proj(hidden).view(b, s, kv_heads, dim)),
            batch.freqs.expand(b, -1, -1),
        )
        value = self.v_proj(hidden).view(b, s, kv_heads, dim)
        key = gather_sequence(key, batch.cp.group)
        value = gather_sequence(value, batch.cp.group)
        mode = "off" if self.indexer is None else self.indexer_training
        routes = lse = None
        if self.indexer is None or mode == "dense_warmup":
            out = dense_causal_attention(query, key, value, batch)
        else:
            out, routes, lse = self.routed_attention(
                hidden, query, key, value, batch, return_lse=mode == "sparse"
            )
        aux = (
            None
            if mode == "off"
            else self.indexer_loss(hidden, query, key, batch, mode, routes, lse)
        )
        return self.o_proj((torch.sigmoid(gate) * out).flatten(-2)), aux

    @torch.compiler.disable
    def routed_attention(
        self,
        hidden: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch: QSABatch,
        *,
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, TokenRoutes, torch.Tensor | None]:
        """Route selection (`select_routes`) and `sparse_gqa_attention` over the routes → (out
        [batch, local_length, heads, head_dim], the routes, with `return_lse` the attention's
        float32 natural log-sum-exp [batch, local_length, heads] from the same call (detached),
        else None).

        Runs outside torch.compile's graph (one graph break per routed layer): the indexer's top-k,
        the replay channel, the mask build's host reads and the backend's dispatch (Triton launches,
        compiled Flex, FA4's CuTe kernels) are host logic that Dynamo cannot or should not trace.
        """
        routes = self.select_routes(hidden, batch, key.shape[1])
        result = sparse_gqa_attention(
            query,
            key,
            value,
            routes.token_ids,
            block_mask=routes.block_mask,
            backend=self.backend,
            return_lse=return_lse,
        )
        out, lse = result if return_lse else (result, None)
        return out, routes, lse

    @torch.compiler.disable  # the distillation loss's dispatch runs eagerly, like route selection
    def indexer_loss(
        self,
        hidden: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        batch: QSABatch,
        mode: str,
        routes: TokenRoutes | None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The indexer's KL distillation loss (`sa_routing.qsa_indexer_distillation_loss`) as this
        shard's share of the global mean over sparse queries (`QSABatch.sparse_query_count`).
        `lse`: the main attention's float32 log-sum-exp [batch, local_length, heads] over the keys
        it attended (the sparse attention's, in "sparse"), or None: the loss computes it."""
        if mode not in INDEXER_TRAINING[1:]:
            raise ValueError(
                f"QSAAttention: indexer_training must be one of {INDEXER_TRAINING}; got {mode!r}"
            )
        cfg, cp = self.config.indexer, batch.cp
        freqs = batch.freqs.expand(hidden.shape[0], -1, -1)
        total = qsa_indexer_distillation_loss(
            query,
            key,
            self.indexer.training_queries(hidden, freqs),
            self.indexer.training_keys(hidden, freqs, cp_context=cp),
            token_budget=cfg.indexer_budget,
            compress_ratio=cfg.indexer_compress_ratio,
            mode=mode,
            routes=None if routes is None else routes.token_ids,
            sequence_lengths=cp.sequence_lengths,
            cu_seqlens=cp.cu_seqlens,
            query_start=cp.local_start,
            lse=lse,
            reduction="sum",
        )
        return total * cp.size / max(1, batch.sparse_query_count(cfg.dense_positions))

    @torch.compiler.disable
    def select_routes(self, hidden: torch.Tensor, batch: QSABatch, kv_length: int) -> TokenRoutes:
        """The indexer's routes of this call (or the recorded ones in a checkpoint recompute)."""

        def select() -> TokenRoutes:
            ids = self.indexer(hidden, batch.freqs, cp_context=batch.cp)
            return token_routes(ids, kv_length, self.config.num_attention_heads, self.backend)

        return self.routes.select_or_replay(select)


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: QSABatch
) -> torch.Tensor:
    """Causal GQA attention within each document; padding queries give 0.

    A plain causal batch (`batch.plain_causal`) runs SDPA's causal path (no mask); any other reads
    `batch.dense_mask`, built once per model call (or builds it here for a batch laid out without).

    Args:
        query: [batch, local_length, heads, head_dim]; key, value: [batch, global_length, kv_heads,
            head_dim] (all-gathered under context parallelism).
    Returns:
        [batch, local_length, heads, head_dim] in query's dtype.
    """
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if batch.plain_causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)
    visible = batch.dense_mask
    if visible is None:
        visible = dense_visibility(batch.key_documents, batch.cp.local_start, query.shape[1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    valid = (batch.query_documents >= 0)[:, :, None, None]
    return out.transpose(1, 2) * valid.to(out.dtype)
