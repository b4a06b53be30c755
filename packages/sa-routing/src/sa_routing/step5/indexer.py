"""`Step5SparseIndexer`: the checkpoint-backed CSA router of one layer (SEMANTICS §1.2)."""

import torch
from torch import nn

from sa_kernels import rms_norm_rope_e4m3

from .config import Step5SparseConfig
from .layouts import RegionMetadata, RegionSelection
from .metadata import region_metadata
from .norms import Step5IndexerLayerNorm, Step5IndexerRMSNorm
from .projection import Step5IndexerWeightProjection
from .rotary import Step5IndexerRotaryEmbedding
from .selection import select_regions_dense, select_regions_tiled
from .summaries import summarize_regions

SUMMARY_CHUNK_REGIONS = 16384
"""Regions summarised per call of `summarize_regions` (about 50 KB of temporaries per region, 0.8 GB
per call at this size, below the scoring calls' peak): each call is some twenty small launches,
whose host time the GPU waited for at the start of a forward (4096 took 0.99 ms of host time at
65 536 tokens on the H200's host, docs/benchmarks.md)."""


class Step5SparseIndexer(nn.Module):
    """Projects indexer queries, keys and compression logits, and selects regions per KV group.

    Weights are frozen (`requires_grad_(False)`) and selection runs under `no_grad`: the LM loss does
    not train routes. Typical use per forward: every rank calls `project_keys` on its shard, the keys
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
        options = dict(self.selection_options)
        summary = region_summaries(keys, compression_logits, metadata)
        if options.get("_mark") is not None:
            options["_mark"]("summaries")

        # the queries' rotary angles once for every span (each span's own took four launches)
        cos, sin = self.rotary.cos_sin(positions)

        def tile_inputs(b: int, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
            rows = (slice(b, b + 1), slice(q0, q1))
            return self._project_queries(hidden[rows], cos[rows], sin[rows])

        ids = select_regions_tiled(
            tile_inputs, cfg.num_provider_groups, summary, metadata, **options
        )
        return RegionSelection(ids, metadata.region_count)

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


def region_summaries(
    keys: torch.Tensor, logits: torch.Tensor, metadata: RegionMetadata
) -> torch.Tensor:
    """BF16 [B, N, D] summaries of the regions in `metadata.summary_ranges` (zero elsewhere).

    keys, logits: [B, S, D] of the whole sequence `metadata` describes (B = metadata.batch_size,
    S = metadata.global_length)."""
    for name, t in (("keys", keys), ("logits", logits)):
        want = (metadata.batch_size, metadata.global_length)
        if t.dim() != 3 or tuple(t.shape[:2]) != want or not t.is_floating_point():
            raise ValueError(
                f"region_summaries: {name} must be floating [batch, global_length, D] with "
                f"(batch, global_length) = {want}; got {tuple(t.shape)} {t.dtype}"
            )
    batch, _, dim = keys.shape
    summary = torch.zeros(
        batch, metadata.region_count, dim, dtype=torch.bfloat16, device=keys.device
    )
    for b, first, past in metadata.summary_ranges:
        for c0 in range(first, past, SUMMARY_CHUNK_REGIONS):
            c1 = min(c0 + SUMMARY_CHUNK_REGIONS, past)
            summary[b, c0:c1] = summarize_regions(
                keys[b : b + 1],
                logits[b : b + 1],
                metadata.region_sources[b : b + 1, c0:c1],
                metadata.region_source_valid[b : b + 1, c0:c1],
            )[0]
    return summary
