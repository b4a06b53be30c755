"""`Step5SparseIndexer`: the checkpoint-backed CSA router of one layer (SEMANTICS §1.2)."""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from sa_kernels import rms_norm_rope_e4m3

from .config import Step5SparseConfig
from .layouts import RegionMetadata, RegionSelection
from .metadata import region_metadata
from .norms import Step5IndexerLayerNorm, Step5IndexerRMSNorm
from .projection import Step5IndexerWeightProjection
from .rotary import Step5IndexerRotaryEmbedding
from .selection import no_mark, select_regions_dense, select_regions_marked
from .summaries import gather_region_payload, region_summaries


class Step5SparseIndexer(nn.Module):
    """Projects indexer queries, keys and compression logits, and selects regions per KV group.

    Weights are frozen (`requires_grad_(False)`) and selection runs under `no_grad`: the LM loss does
    not train routes. The `training_*` methods are the differentiable FP32 form of the scores, for
    the attention-distillation loss (`sa_routing.csa_indexer_distillation_loss`) that trains an
    unfrozen indexer. Typical use per forward: every rank calls `project_keys` on its shard, the keys
    and logits are gathered without gradient (sa-cp `gather_no_grad`), `region_metadata` is built once,
    then `forward` selects for the rank's queries.

    Args:
        config: `Step5SparseConfig`.
        layer_idx: the model layer (picks the RoPE base when `rope_theta` is per layer).
        dtype: activation dtype of the projections (BF16 in the reference).
        device: where to allocate the parameters.
    """

    def __init__(
        self,
        config: Step5SparseConfig,
        layer_idx: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        groups, heads, dim = config.num_provider_groups, config.heads_per_group, config.proxy_dim
        linear = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = nn.Linear(config.hidden_size, groups * heads * dim, **linear)
        self.k_proj = nn.Linear(config.hidden_size, dim, **linear)
        self.z_proj = nn.Linear(config.hidden_size, dim, **linear)
        self.w_proj = Step5IndexerWeightProjection(config.hidden_size, groups, heads, device=device)
        self.q_norm = Step5IndexerRMSNorm(dim, config.norm_eps, device=device)
        self.k_norm = Step5IndexerLayerNorm(dim, config.norm_eps, device=device)
        self.rotary = Step5IndexerRotaryEmbedding(config.rope_dim, config.rope_theta_for(layer_idx))
        self.requires_grad_(False)
        self.selection_options: dict = {}
        """Keyword options of `select_regions_tiled` (region_chunk, score_budget_bytes, project_rows,
        method, backend)."""

    @torch.no_grad()
    def project_keys(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer keys and compression logits of a (shard of the) sequence.

        Args:
            hidden: [B, S, hidden_size] in the activation dtype.
            positions: int64 [B, S] document-local positions.
        Returns:
            `(keys, compression_logits)`, each [B, S, proxy_dim] in the activation dtype; keys are
            LayerNorm-ed, rounded, then rotated in FP32 and rounded again.
        Raises:
            TypeError, ValueError: as `_check_hidden`.
        """
        self._check_hidden("project_keys", hidden, positions)
        keys = self.rotary.rotate_(self.k_norm(self.k_proj(hidden)), positions)
        return keys, self.z_proj(hidden)

    @torch.no_grad()
    def project_queries(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """E4M3-rounded queries [B, S, G, H, proxy_dim] widened to BF16 (SEMANTICS §1.2, whatever the
        activation dtype) and FP32 weights [B, S, G, H]."""
        self._check_hidden("project_queries", hidden, positions)
        return self._project_queries(hidden, *self.rotary.cos_sin(positions))

    def _project_queries(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`project_queries` with the rotary `cos_sin` of the rows' positions given (FP32
        [B, S, rope_dim / 2] each): a forward computes them once for all its spans."""
        cfg = self.config
        batch, tokens = hidden.shape[:2]
        groups, heads, dim = cfg.num_provider_groups, cfg.heads_per_group, cfg.proxy_dim
        query = rms_norm_rope_e4m3(
            self.q_proj(hidden).reshape(batch * tokens, groups * heads, dim),
            self.q_norm.weight,
            self.q_norm.eps,
            cos.flatten(0, 1),
            sin.flatten(0, 1),
        )
        # E4M3 values are exact in BF16: the widening never rounds
        query = query.view(batch, tokens, groups, heads, dim).to(torch.bfloat16)
        return query, self.w_proj(hidden)

    @torch.no_grad()
    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor | None,
        compression_logits: torch.Tensor | None,
        key_positions: torch.Tensor,
        key_padding: torch.Tensor | None,
        query_start: int = 0,
        metadata: RegionMetadata | None = None,
    ) -> RegionSelection:
        """Select regions for this shard's queries.

        Args:
            hidden: [B, Q, hidden_size], the shard's hidden states (activation dtype).
            positions: int64 [B, Q], their document-local positions.
            keys: [B, S, proxy_dim] global indexer keys from `project_keys` (gathered over CP ranks), or
                None when no query on this rank is sparse.
            compression_logits: [B, S, proxy_dim] global compression logits, or None with `keys`.
            key_positions: int64 [B, S] global positions.
            key_padding: bool [B, S] global padding (True = padding), or None.
            query_start: global row of the shard's first query.
            metadata: `region_metadata(key_positions, key_padding, query_start, Q, region_size, topk)`,
                built once per forward and shared by every layer; built here when None.
        Returns:
            `RegionSelection` with region_ids int32 [B, G, Q, topk + 1], ascending, unused slots
            `region_count`.
        Raises:
            TypeError, ValueError: bad shapes or dtypes; metadata of another shard or geometry; keys
            missing while a query is sparse.
        """
        return self._forward(
            hidden, positions, keys, compression_logits, key_positions, key_padding, query_start,
            metadata, no_mark,
        )  # fmt: skip

    @torch.no_grad()
    def _forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor | None,
        compression_logits: torch.Tensor | None,
        key_positions: torch.Tensor,
        key_padding: torch.Tensor | None,
        query_start: int,
        metadata: RegionMetadata | None,
        mark: Callable[[str], None],
    ) -> RegionSelection:
        """`forward`, calling `mark(stage)` after each stage ("summaries", then the stages of
        `select_regions_marked`): the per-stage timing of the benchmark."""
        fn = "Step5SparseIndexer.forward"
        self._check_hidden(fn, hidden, positions)
        cfg = self.config
        batch, queries = hidden.shape[:2]
        if metadata is None:
            metadata = region_metadata(
                key_positions, key_padding, query_start, queries, cfg.region_size, cfg.topk
            )
        got = (
            metadata.batch_size,
            metadata.query_start,
            metadata.queries,
            metadata.region_size,
            metadata.topk,
        )
        want = (batch, query_start, queries, cfg.region_size, cfg.topk)
        if got != want:
            raise ValueError(
                f"{fn}: metadata must describe (batch, query_start, queries, region_size, topk) = {want}; got {got}"
            )
        if not metadata.score_tiles:
            return RegionSelection(
                select_regions_dense(metadata, cfg.num_provider_groups), metadata.region_count
            )
        if keys is None or compression_logits is None:
            raise ValueError(
                f"{fn}: keys and compression_logits are required when a query is sparse; got None"
            )
        shape = (batch, metadata.global_length, cfg.proxy_dim)
        for name, t in (("keys", keys), ("compression_logits", compression_logits)):
            if tuple(t.shape) != shape:
                raise ValueError(f"{fn}: {name} must be {shape}; got {tuple(t.shape)}")
        summary = region_summaries(keys, compression_logits, metadata)
        mark("summaries")

        # the queries' rotary angles once for every span (each span's own took four launches)
        cos, sin = self.rotary.cos_sin(positions)

        def tile_inputs(b: int, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
            rows = (slice(b, b + 1), slice(q0, q1))
            return self._project_queries(hidden[rows], cos[rows], sin[rows])

        ids = select_regions_marked(
            tile_inputs, cfg.num_provider_groups, summary, metadata, mark, **self.selection_options
        )
        return RegionSelection(ids, metadata.region_count)

    # -- training path: differentiable FP32 scores for the distillation loss -----------------------

    def training_queries(
        self, hidden: torch.Tensor, positions: torch.Tensor, *, detach_hidden: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable queries and head weights, FP32 throughout (SEMANTICS §1.2 without roundings).

        `q_proj`, the zero-centred RMSNorm `x · rstd · (1 + w)` and RoPE, and `w_proj · H^-0.5`, with
        every weight widened to FP32 and none of the routing path's roundings: no activation-dtype
        rounding of the weights or the normalised values and no E4M3 rounding of the queries (those
        exist to reproduce the checkpoint's routes; a gradient through them would be zero almost
        everywhere). Autocast is off inside. Gradients reach `q_proj`, `q_norm` and `w_proj` when
        they require grad (the module is frozen: the caller unfreezes it).

        Args:
            hidden: [B, Q, hidden_size], the shard's hidden states (the indexer's dtype).
            positions: int64 [B, Q], their document-local positions.
            detach_hidden: cut the graph at `hidden`, so that the distillation loss trains the
                indexer only (DeepSeek-V3.2 detaches the indexer input).
        Returns:
            `(queries, weights)`: float32 [B, Q, G, H, proxy_dim] and float32 [B, Q, G, H].
        Raises:
            TypeError, ValueError: as `forward`.
        """
        self._check_hidden("Step5SparseIndexer.training_queries", hidden, positions)
        cfg = self.config
        batch, tokens = hidden.shape[:2]
        groups, heads, dim = cfg.num_provider_groups, cfg.heads_per_group, cfg.proxy_dim
        x = (hidden.detach() if detach_hidden else hidden).float()
        with torch.autocast(x.device.type, enabled=False):
            query = F.linear(x, self.q_proj.weight.float()).view(batch, tokens, groups, heads, dim)
            rstd = torch.rsqrt(query.square().mean(dim=-1, keepdim=True) + self.q_norm.eps)
            query = self._rotate_fp32(query * rstd * (1.0 + self.q_norm.weight.float()), positions)
            weights = F.linear(x, self.w_proj.weight.float()) * heads**-0.5
        return query, weights.view(batch, tokens, groups, heads)

    def training_keys(
        self, hidden: torch.Tensor, positions: torch.Tensor, *, detach_hidden: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable keys and compression logits of a (shard of the) sequence, FP32 throughout.

        `k_proj`, the LayerNorm (variance `E[x²] − E[x]²`, FP32 weight and bias) and RoPE; `z_proj`.
        No roundings, autocast off. Under context parallelism gather both with
        `sa_cp.gather_sequence` (its backward reduce-scatters) before `training_summaries`.

        Args: as `training_queries`.
        Returns:
            `(keys, compression_logits)`, each float32 [B, S, proxy_dim].
        Raises:
            TypeError, ValueError: as `project_keys`.
        """
        self._check_hidden("Step5SparseIndexer.training_keys", hidden, positions)
        x = (hidden.detach() if detach_hidden else hidden).float()
        with torch.autocast(x.device.type, enabled=False):
            key = F.linear(x, self.k_proj.weight.float())
            mean = key.mean(dim=-1, keepdim=True)
            variance = (key.square().mean(dim=-1, keepdim=True) - mean.square()).clamp_min(0.0)
            key = (key - mean) * torch.rsqrt(variance + self.k_norm.eps)
            key = key * self.k_norm.weight.float() + self.k_norm.bias.float()
            return self._rotate_fp32(key, positions), F.linear(x, self.z_proj.weight.float())

    @staticmethod
    def training_summaries(
        keys: torch.Tensor, compression_logits: torch.Tensor, metadata: RegionMetadata
    ) -> torch.Tensor:
        """Differentiable FP32 summaries of every region: `s_d = Σ_t softmax_t(z_td) · k_td` over the
        region's valid tokens, without the BF16 / E4M3 roundings of `region_summaries`.

        Args:
            keys, compression_logits: float32 [B, S, proxy_dim] of the whole (gathered) sequence
                `metadata` describes, from `training_keys`.
            metadata: `region_metadata(...)` of the forward.
        Returns:
            float32 [B, N, proxy_dim], N = metadata.region_count; zero for a region without tokens
            (past a row's last region). Temporaries: two [B, N, region_size, proxy_dim] gathers.
        Raises:
            ValueError: shapes disagree with `metadata`.
        """
        want = (metadata.batch_size, metadata.global_length)
        for name, t in (("keys", keys), ("compression_logits", compression_logits)):
            if t.dim() != 3 or tuple(t.shape[:2]) != want or not t.is_floating_point():
                raise ValueError(
                    f"Step5SparseIndexer.training_summaries: {name} must be floating [batch, "
                    f"global_length, D] with (batch, global_length) = {want}; got {tuple(t.shape)} {t.dtype}"
                )
        valid = metadata.region_source_valid
        key_rows, logit_rows = gather_region_payload(
            keys.float(), compression_logits.float(), metadata.region_sources, valid
        )
        occupied = valid.any(dim=-1, keepdim=True)  # [B, N, 1]
        # -inf on missing tokens; an empty region pools zeros (logits 0, never -inf: no NaN gradient)
        z = logit_rows.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        z = torch.where(occupied.unsqueeze(-1), z, 0.0)
        pooled = (torch.softmax(z, dim=-2) * key_rows).sum(dim=-2)
        return torch.where(occupied, pooled, 0.0)

    def training_scores(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        compression_logits: torch.Tensor,
        metadata: RegionMetadata,
        *,
        detach_hidden: bool = True,
    ) -> torch.Tensor:
        """Differentiable FP32 scores `Σ_{h in g} w_h(q) · relu(q_h · s_r)` of every (group, local
        query, region), unmasked: for inspection and small inputs. The loss scores regions tile by
        tile from `training_queries` and `training_summaries` instead, so no [Q, N] tensor exists
        there.

        Args:
            hidden, positions: the shard's queries, as `training_queries`.
            keys, compression_logits: float32 [B, S, proxy_dim] global, from `training_keys`.
            metadata: the forward's `RegionMetadata`.
        Returns:
            float32 [B, G, Q, N].
        """
        query, weights = self.training_queries(hidden, positions, detach_hidden=detach_hidden)
        summary = self.training_summaries(keys, compression_logits, metadata)
        dots = torch.einsum("bqghd,bnd->bgqhn", query, summary)
        return torch.einsum("bgqhn,bqgh->bgqn", torch.relu(dots), weights)

    def _rotate_fp32(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Out-of-place NeoX half-split RoPE of the first `rope_dim` dims, FP32 (autograd-friendly)."""
        rope = self.config.rope_dim
        if rope == 0:
            return x
        half = rope // 2
        cos, sin = self.rotary.cos_sin(positions)
        middle = [1] * (x.dim() - 3)
        cos = cos.view(*positions.shape, *middle, half)
        sin = sin.view(*positions.shape, *middle, half)
        x1, x2 = x[..., :half], x[..., half:rope]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rope:]), dim=-1)

    def _check_hidden(self, fn: str, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        if hidden.dim() != 3 or hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"{fn}: hidden must be [batch, tokens, hidden_size={self.config.hidden_size}]; got {tuple(hidden.shape)}"
            )
        if hidden.dtype != self.q_proj.weight.dtype and not torch.is_autocast_enabled(
            hidden.device.type
        ):
            raise TypeError(
                f"{fn}: hidden must have the indexer's dtype ({self.q_proj.weight.dtype}); got {hidden.dtype}"
            )
        if positions.dtype != torch.int64:
            raise TypeError(f"{fn}: positions must be int64; got {positions.dtype}")
        if positions.shape != hidden.shape[:2]:
            raise ValueError(
                f"{fn}: positions must be {tuple(hidden.shape[:2])}; got {tuple(positions.shape)}"
            )
