"""`QSAIndexer`: the frozen compressed-block indexer that routes every QSA query (SEMANTICS §2, §5).

One fused projection hidden → `(H_idx + 1) · D_idx` gives the index queries (RMSNorm, RoPE at their
own positions) and one key row per token; keys are averaged over groups of `c` tokens in FP32 (blocks
restart at every packed document), cast back, RMSNorm'd and rotated at the group's first position.
Queries are projected chunk by chunk inside the selection, so no `[S, H_idx, D_idx]` tensor and no
`[S, blocks]` score tensor exists at once. No cache, no state: a forward hook sees the exact routes.

`training_queries` / `training_keys` are the differentiable FP32 form of the same projections, for
the attention-distillation loss (`sa_routing.distillation`) that trains an unfrozen indexer.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from sa_kernels.backend import check_eps

from .config import QSAIndexerConfig
from .context_parallel import QSAContextParallel
from .lengths import _right_padded_lengths_host, packed_block_starts, validate_cu_seqlens
from .rope import apply_qsa_rope
from .selection.chunked import RouteSegment, packed_segments, padded_segments, select_segments

_OP = "QSAIndexer.forward"


class QSARMSNorm(nn.Module):
    """RMSNorm over the last dim: FP32 statistics and scale `x · rstd · w`, rounded once to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        check_eps("QSARMSNorm", eps)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            raise TypeError(f"QSARMSNorm: x must be a floating tensor; got {x.dtype}")
        if x.shape[-1:] != self.weight.shape:
            raise ValueError(
                f"QSARMSNorm: x must be [..., {self.weight.shape[0]}]; got {tuple(x.shape)}"
            )
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class QSAIndexer(nn.Module):
    """Frozen QSA indexer: hidden states → int32 global token routes per query.

    Parameters: `qk_proj.weight` [(H_idx + 1) · D_idx, hidden] (queries first, the key last),
    `q_norm.weight` [D_idx], `k_norm.weight` [D_idx]. Every parameter has `requires_grad=False`.
    """

    def __init__(self, config: QSAIndexerConfig) -> None:
        super().__init__()
        if not isinstance(config, QSAIndexerConfig):
            raise TypeError(
                f"QSAIndexer: config must be a QSAIndexerConfig; got {type(config).__name__}"
            )
        self.config = config
        heads, dim = config.indexer_n_heads, config.indexer_head_dim
        self.qk_proj = nn.Linear(config.hidden_size, (heads + 1) * dim, bias=False)
        self.q_norm = QSARMSNorm(dim, config.rms_norm_eps)
        self.k_norm = QSARMSNorm(dim, config.rms_norm_eps)
        self.requires_grad_(False)

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        """Scratch initialisation: normal(0, init_std) projection, unit norm weights."""
        nn.init.normal_(self.qk_proj.weight, mean=0.0, std=init_std)
        nn.init.ones_(self.q_norm.weight)
        nn.init.ones_(self.k_norm.weight)

    # -- the two halves of the fused projection -----------------------------------------------------

    def _query_rows(self, hidden_rows: torch.Tensor, freqs_rows: torch.Tensor) -> torch.Tensor:
        """[rows, hidden], [rows, r] → normalised, rotated index queries [rows, H_idx, D_idx]."""
        heads, dim = self.config.indexer_n_heads, self.config.indexer_head_dim
        queries = F.linear(hidden_rows, self.qk_proj.weight[: heads * dim]).view(1, -1, heads, dim)
        return apply_qsa_rope(self.q_norm(queries), freqs_rows[None])[0]

    def _key_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, S, hidden] → one raw key row per token [B, S, D_idx]."""
        heads, dim = self.config.indexer_n_heads, self.config.indexer_head_dim
        return F.linear(hidden_states, self.qk_proj.weight[heads * dim :])

    def _finish_keys(
        self, block_means: torch.Tensor, freqs_first: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """FP32 block means [B, P, D] → cast, RMSNorm, RoPE at the block's first position → [B, P, 1, D]."""
        keys = self.k_norm(block_means.to(dtype)).unsqueeze(2)
        return apply_qsa_rope(keys, freqs_first)

    def _compress(self, key_rows: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        c = self.config.indexer_compress_ratio
        blocks = key_rows.shape[1] // c
        means = key_rows[:, : blocks * c].unflatten(1, (blocks, c)).mean(dim=2, dtype=torch.float32)
        return self._finish_keys(means, freqs[:, : blocks * c : c], key_rows.dtype)

    def _compress_packed(
        self, key_rows: torch.Tensor, freqs: torch.Tensor, cu_seqlens: tuple[int, ...]
    ) -> torch.Tensor:
        c = self.config.indexer_compress_ratio
        firsts = [
            torch.arange(start, start + (stop - start) // c * c, c)
            for start, stop in itertools.pairwise(cu_seqlens)
        ]
        first = torch.cat(firsts).to(key_rows.device)
        tokens = first[:, None] + torch.arange(c, device=key_rows.device)
        means = key_rows[:, tokens].mean(dim=2, dtype=torch.float32)
        return self._finish_keys(means, freqs[:, first], key_rows.dtype)

    @torch.no_grad()
    def index_queries(self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """All index queries at once (for oracles and inspection): [B, S, H_idx, D_idx]."""
        hidden_states, freqs_cis = self._check_inputs(hidden_states, freqs_cis)
        batch, rows = hidden_states.shape[:2]
        queries = self._query_rows(
            hidden_states.reshape(batch * rows, -1), freqs_cis.reshape(batch * rows, -1)
        )
        return queries.view(batch, rows, *queries.shape[1:])

    @torch.no_grad()
    def compressed_keys(
        self,
        hidden_states: torch.Tensor,
        freqs_cis: torch.Tensor,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Compressed keys of an unsharded sequence: [B, S // c, 1, D_idx], or packed [1, Σ len_d // c, 1, D_idx]."""
        hidden_states, freqs_cis = self._check_inputs(hidden_states, freqs_cis)
        if cu_seqlens is None:
            return self._compress(self._key_rows(hidden_states), freqs_cis)
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"QSAIndexer.compressed_keys: cu_seqlens (packed documents) needs batch 1; got "
                f"batch {hidden_states.shape[0]}"
            )
        bounds = validate_cu_seqlens(
            "QSAIndexer.compressed_keys", cu_seqlens, hidden_states.shape[1]
        )
        return self._compress_packed(self._key_rows(hidden_states), freqs_cis, bounds)

    # -- training path: differentiable FP32 projections for the distillation loss ------------------

    def training_queries(
        self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor, *, detach_hidden: bool = True
    ) -> torch.Tensor:
        """Differentiable index queries of every local token, FP32 throughout.

        The routing path's formula (fused projection, RMSNorm, RoPE at the token's position) computed
        with the weights widened to FP32 and no rounding to the activation dtype; autocast is off
        inside. Gradients reach `qk_proj` and `q_norm` when they require grad (the module is frozen:
        the caller unfreezes it with `requires_grad_(True)`). Feed the result to
        `sa_routing.qsa_indexer_distillation_loss`.

        Args:
            hidden_states: [batch, local_sequence, hidden_size], the indexer's dtype.
            freqs_cis: [batch or 1, local_sequence, r], as `forward`.
            detach_hidden: cut the graph at `hidden_states`, so that the distillation loss trains the
                indexer only and never the layers below (DeepSeek-V3.2 detaches the indexer input).
        Returns:
            float32 [batch, local_sequence, indexer_n_heads, indexer_head_dim].
        Raises:
            ValueError, TypeError: as `forward`.
        """
        hidden_states, freqs_cis = self._check_inputs(hidden_states, freqs_cis)
        hidden = hidden_states.detach() if detach_hidden else hidden_states
        heads, dim = self.config.indexer_n_heads, self.config.indexer_head_dim
        with torch.autocast(hidden.device.type, enabled=False):
            queries = F.linear(hidden.float(), self.qk_proj.weight[: heads * dim].float())
            return apply_qsa_rope(
                self.q_norm(queries.unflatten(-1, (heads, dim))), freqs_cis.float()
            )

    def training_keys(
        self,
        hidden_states: torch.Tensor,
        freqs_cis: torch.Tensor,
        cp_context: QSAContextParallel | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
        *,
        detach_hidden: bool = True,
    ) -> torch.Tensor:
        """Differentiable compressed keys of the whole (global) sequence, FP32 throughout.

        The routing path's blocks (means of `c` key rows, restarting at every packed document, a
        partial trailing group dropped; RMSNorm; RoPE at the block's first position) without the cast
        of the means back to the activation dtype. Under context parallelism the keys (padded rows)
        or the raw key rows (packed documents, whose blocks may straddle shards) are all-gathered
        with `sa_cp.gather_sequence`, whose backward reduce-scatters, so every rank's `qk_proj` and
        `k_norm` receive the gradient of every rank's loss on their keys.

        Args:
            hidden_states, freqs_cis, cp_context, cu_seqlens: as `forward` (no attention mask: blocks
                past a row's length are never candidates of the loss).
            detach_hidden: as `training_queries`.
        Returns:
            float32 [batch, global_sequence // c, 1, indexer_head_dim], or packed
            [1, Σ len_d // c, 1, indexer_head_dim].
        Raises:
            ValueError, TypeError: as `forward`.
        """
        hidden_states, freqs_cis = self._check_inputs(hidden_states, freqs_cis)
        batch, rows = hidden_states.shape[:2]
        bounds, _ = self._route_layout(batch, rows, None, cp_context, cu_seqlens)
        hidden = hidden_states.detach() if detach_hidden else hidden_states
        heads, dim = self.config.indexer_n_heads, self.config.indexer_head_dim
        freqs = freqs_cis.float()
        with torch.autocast(hidden.device.type, enabled=False):
            key_rows = F.linear(hidden.float(), self.qk_proj.weight[heads * dim :].float())
            if bounds is None:
                keys = self._compress(key_rows, freqs)
                return keys if cp_context is None else _gather_with_grad(keys, cp_context.group)
            if cp_context is not None:
                key_rows = _gather_with_grad(key_rows, cp_context.group)
                freqs = _gather(freqs.contiguous(), cp_context.group)
            return self._compress_packed(key_rows, freqs, bounds)

    def training_scores(
        self,
        hidden_states: torch.Tensor,
        freqs_cis: torch.Tensor,
        cp_context: QSAContextParallel | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
        *,
        detach_hidden: bool = True,
    ) -> torch.Tensor:
        """Differentiable FP32 logits `Σ_h relu(q_h · k_b) / sqrt(D_idx)` of every local query against
        every (global) block, unmasked: for inspection and small inputs. The loss scores blocks tile
        by tile from `training_queries` and `training_keys` instead, so no [sequence, blocks] tensor
        exists there.

        Returns:
            float32 [batch, local_sequence, blocks] (blocks as `training_keys`; packed: batch 1).
        """
        queries = self.training_queries(hidden_states, freqs_cis, detach_hidden=detach_hidden)
        keys = self.training_keys(
            hidden_states, freqs_cis, cp_context, cu_seqlens, detach_hidden=detach_hidden
        )
        dots = torch.einsum("bshd,bpd->bshp", queries, keys[:, :, 0])
        return torch.relu(dots).sum(dim=2) / self.config.indexer_head_dim**0.5

    def _check_inputs(
        self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"{_OP}: hidden_states must be [batch, sequence, hidden_size={self.config.hidden_size}]; "
                f"got {tuple(hidden_states.shape)}"
            )
        if not hidden_states.is_floating_point():
            raise TypeError(
                f"{_OP}: hidden_states must be floating point; got {hidden_states.dtype}"
            )
        if hidden_states.dtype != self.qk_proj.weight.dtype and not torch.is_autocast_enabled(
            hidden_states.device.type
        ):
            raise TypeError(
                f"{_OP}: hidden_states must have the indexer's dtype ({self.qk_proj.weight.dtype}); "
                f"got {hidden_states.dtype}"
            )
        batch, rows = hidden_states.shape[:2]
        if batch == 0 or rows == 0:
            raise ValueError(
                f"{_OP}: hidden_states must hold at least one token per row; got {tuple(hidden_states.shape)}"
            )
        if (
            freqs_cis.dim() != 3
            or freqs_cis.shape[0] not in (1, batch)
            or freqs_cis.shape[1] != rows
        ):
            raise ValueError(
                f"{_OP}: freqs_cis must be [batch or 1, sequence={rows}, rotary_dim] at the local positions; "
                f"got {tuple(freqs_cis.shape)}"
            )
        return hidden_states, freqs_cis.expand(batch, rows, freqs_cis.shape[-1])

    # -- forward -------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        hidden_states: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cp_context: QSAContextParallel | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Route every local query to `indexer_budget + c − 1` global token ids.

        Args:
            hidden_states: [batch, local_sequence, hidden_size] bf16/fp16/fp32.
            freqs_cis: [batch or 1, local_sequence, r]: `cat(cos, sin)` at each local token's position
                (document-relative when packed).
            attention_mask: [batch, sequence] right-padding mask (1 = token), or None. Without context
                parallelism only; under it the global mask lives in `cp_context`. Reading a mask costs
                one host sync per call: a model with many indexer layers builds
                `QSAContextParallel.create(sequence, attention_mask=mask)` (a single rank) once per
                forward and passes it to every layer as `cp_context` instead.
            cp_context: this rank's shard; compressed keys are all-gathered without gradient and
                row `i` is global position `local_start + i`.
            cu_seqlens: packed documents (batch 1), int [documents + 1]. Without context parallelism
                only; under it the global boundaries live in `cp_context`.
        Returns:
            int32 [batch, local_sequence, indexer_budget + indexer_compress_ratio − 1]: global token ids
            (ascending, valid ids first), −1 padding.
        Raises:
            ValueError: shapes, a mask that is not right-padded binary [batch, sequence], `cu_seqlens`
                with `attention_mask` or batch != 1 or non-increasing, a local length that is not a
                multiple of the compress ratio or differs from `cp_context.local_length`.
        """
        config = self.config
        c = config.indexer_compress_ratio
        hidden_states, freqs_cis = self._check_inputs(hidden_states, freqs_cis)
        batch, rows = hidden_states.shape[:2]
        bounds, lengths = self._route_layout(batch, rows, attention_mask, cp_context, cu_seqlens)
        offset = 0 if cp_context is None else cp_context.local_start
        group = None if cp_context is None else cp_context.group

        key_rows = self._key_rows(hidden_states)
        segments: tuple[RouteSegment, ...]
        if bounds is None:
            keys = self._compress(key_rows, freqs_cis)
            if cp_context is not None:
                keys = _gather(keys, group)
            segments = padded_segments(lengths, rows, offset, keys.shape[1])
        else:
            freqs = freqs_cis
            if cp_context is not None:  # packed blocks may straddle shards: gather the raw key rows
                key_rows, freqs = _gather(key_rows, group), _gather(freqs_cis.contiguous(), group)
            keys = self._compress_packed(key_rows, freqs, bounds)
            segments = packed_segments(bounds, rows, offset, packed_block_starts(bounds, c))
        del key_rows

        flat_hidden = hidden_states.reshape(batch * rows, -1)
        flat_freqs = freqs_cis.reshape(batch * rows, -1)
        out = torch.full(
            (batch * rows, config.route_width), -1, dtype=torch.int32, device=hidden_states.device
        )
        select_segments(
            lambda start, stop: self._query_rows(flat_hidden[start:stop], flat_freqs[start:stop]),
            keys.reshape(-1, config.indexer_head_dim),
            segments,
            out,
            token_budget=config.indexer_budget,
            compress_ratio=c,
            query_chunk_size=config.query_chunk_size,
        )
        return out.view(batch, rows, config.route_width)

    def _route_layout(
        self,
        batch: int,
        rows: int,
        attention_mask: torch.Tensor | None,
        cp_context: QSAContextParallel | None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None,
    ) -> tuple[tuple[int, ...] | None, list[int]]:
        """(packed bounds or None, per-row lengths), read from the host once."""
        if cp_context is None:
            if cu_seqlens is None:
                if attention_mask is None:
                    return None, [rows] * batch
                return None, _right_padded_lengths_host(_OP, attention_mask, batch, rows)
            if attention_mask is not None:
                raise ValueError(
                    f"{_OP}: cu_seqlens (packed documents) and attention_mask exclude each other"
                )
            if batch != 1:
                raise ValueError(
                    f"{_OP}: cu_seqlens (packed documents) needs batch 1; got batch {batch}"
                )
            return validate_cu_seqlens(_OP, cu_seqlens, rows), []
        if not isinstance(cp_context, QSAContextParallel):
            raise TypeError(
                f"{_OP}: cp_context must be a QSAContextParallel; got {type(cp_context).__name__}"
            )
        if attention_mask is not None or cu_seqlens is not None:
            raise ValueError(
                f"{_OP}: under context parallelism pass the global attention_mask / cu_seqlens to "
                "QSAContextParallel.create, not to forward"
            )
        if rows != cp_context.local_length:
            raise ValueError(
                f"{_OP}: hidden_states holds {rows} tokens; cp_context.local_length is {cp_context.local_length}"
            )
        if cp_context.size > 1:  # a single rank holds every block, whole or not
            cp_context.check_compress_ratio(_OP, self.config.indexer_compress_ratio)
        if cp_context.cu_seqlens is not None:
            if batch != 1:
                raise ValueError(
                    f"{_OP}: cu_seqlens (packed documents) needs batch 1; got batch {batch}"
                )
            return cp_context.cu_seqlens, []
        lengths = cp_context.sequence_lengths
        if lengths is None:
            lengths = (cp_context.global_length,) * batch
        if len(lengths) != batch:
            raise ValueError(
                f"{_OP}: cp_context.sequence_lengths has {len(lengths)} rows; the batch has {batch}"
            )
        return None, list(lengths)


def _gather(x: torch.Tensor, group: object | None) -> torch.Tensor:
    from sa_cp import gather_no_grad

    return gather_no_grad(x, group=group, dim=1)


def _gather_with_grad(x: torch.Tensor, group: object | None) -> torch.Tensor:
    from sa_cp import gather_sequence

    return gather_sequence(x, group=group, dim=1)
