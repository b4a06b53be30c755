"""`Step5DecoderLayer` and `Step5Model`: a trainable Step-5 language model (SEMANTICS §1, §4, §5)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sa_routing import Step5IndexerLayerNorm, Step5IndexerRMSNorm, Step5IndexerWeightProjection

from ..moe import Step5MLP, Step5MoE, Step5RoutedExperts
from ..norm import Step5RMSNorm, ZeroCenteredRMSNorm
from ..output import CausalLMOutput, language_model_loss
from ..routed_model import RoutedModel
from .attention import Step5Attention
from .config import Step5Config
from .layout import Step5Batch


def _residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype: FP32 (FP64 in an FP64 model)."""
    return torch.promote_types(dtype, torch.float32)


class Step5DecoderLayer(nn.Module):
    """Pre-norm decoder layer on an FP32 residual stream: `h + attn(norm(h))`, then
    `h + ffn(norm(h))`, the FFN a `Step5MLP` or, for `config.moe_layers`, a `Step5MoE`.

    The norms read the FP32 residual and output the activation dtype (the parameters'); the
    branches' outputs are added to the FP32 residual.

    Shapes:
        residual: float32 [B, L, hidden_size] → (float32 [B, L, hidden_size], the attention's
        indexer loss or None).
    """

    def __init__(
        self,
        config: Step5Config,
        layer_idx: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        activation = dtype or torch.get_default_dtype()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Step5RMSNorm(hidden, eps, output_dtype=activation)
        self.self_attn = Step5Attention(config, layer_idx, dtype, device)
        self.post_attention_layernorm = Step5RMSNorm(hidden, eps, output_dtype=activation)
        limit = config.swiglu_limit_for(layer_idx)
        if layer_idx in config.moe_layers:
            self.mlp = Step5MoE(
                hidden,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                limit,
                config.shared_expert_intermediate_size,
                config.routed_scaling_factor,
                config.norm_topk_prob,
                dtype,
                device,
            )
        else:
            self.mlp = Step5MLP(hidden, config.intermediate_size, limit, dtype, device)
        if device is not None:
            self.input_layernorm.to(device)
            self.post_attention_layernorm.to(device)

    def _apply(self, fn, recurse=True):
        # the norms output whatever dtype the layer's parameters take (`.to(torch.bfloat16)`)
        super()._apply(fn, recurse)
        activation = self.self_attn.qkv_proj.weight.dtype
        self.input_layernorm.output_dtype = activation
        self.post_attention_layernorm.output_dtype = activation
        return self

    def forward(
        self, residual: torch.Tensor, batch: Step5Batch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, indexer_loss = self.self_attn(self.input_layernorm(residual), batch)
        residual = residual + attn
        return residual + self.mlp(self.post_attention_layernorm(residual)), indexer_loss


class Step5Model(RoutedModel, nn.Module):
    """Embedding, Step-5 decoder layers, final norm and LM head.

    Build it in the activation dtype (`dtype=torch.bfloat16`) or in FP32 and cast with
    `.to(torch.bfloat16)`: residual norms, per-head norms, the MoE router and the indexers' FP32
    weights stay FP32. The residual stream is FP32. One `Step5Batch` per forward carries the
    positions, documents, CP shard, rotary tables, masks and the `RegionMetadata` shared by every
    CSA layer. Under activation checkpointing (`enable_activation_checkpointing`) every decoder layer
    is checkpointed and, with `config.reuse_routes_on_recompute`, its routes (and their block mask)
    are replayed in the recompute.
    """

    def __init__(
        self,
        config: Step5Config,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, Step5Config):
            raise TypeError(
                f"Step5Model: config must be a Step5Config; got {type(config).__name__}"
            )
        self.config = config
        activation = dtype or torch.get_default_dtype()
        factory = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(
            Step5DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.norm = Step5RMSNorm(config.hidden_size, config.rms_norm_eps, output_dtype=activation)
        if device is not None:
            self.norm.to(device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.cp_group = None
        self._checkpoint_context: object | None = None
        self._checkpointing = False
        self.init_weights()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.norm.output_dtype = self.lm_head.weight.dtype
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) projections, experts and embeddings; zero (identity) scales of
        the zero-centred norms; the indexers' own scales (LayerNorm 1 and 0, `w_proj` normal with
        std hidden_size ** -0.5)."""
        _init_modules(self.modules(), self.config.initializer_range)

    # -- indexer training --------------------------------------------------------------------------

    @torch.no_grad()
    def init_indexers(self, std: float | None = None) -> None:
        """Fresh indexers: normal(0, std) `q_proj` / `k_proj` / `z_proj` (std default
        `initializer_range`), `w_proj` normal with std hidden_size ** -0.5, identity norms (zero-
        centred RMSNorm 0, LayerNorm 1 and 0). The first step of sparsifying a model whose layers
        were trained dense; every other weight is kept."""
        _init_modules(
            (m for ix in self.indexers() for m in ix.modules()),
            self.config.initializer_range if std is None else std,
        )

    @classmethod
    def sparsify(
        cls,
        dense: Step5Model,
        layer_types: tuple[str, ...] | None = None,
        indexer_std: float | None = None,
    ) -> Step5Model:
        """A Step-5 model with the weights of `dense` (a model whose layers were trained dense or
        SWA) and fresh indexers on its CSA layers.

        Args:
            dense: the trained model; its config is kept except `layer_types`.
            layer_types: the new model's layer types; default: "csa" where `dense` has a "dense"
                layer at a CSA position of the Step-5 pattern (`layer_idx % 4 == 3`), `dense`'s
                type elsewhere.
            indexer_std: std of the fresh indexers' projections (`init_indexers`).
        Returns:
            A new `Step5Model` on `dense`'s device, in its activation dtype (FP32 norms, router and
            indexer weights), whose every non-indexer weight equals `dense`'s; dropping the
            `.indexer.` entries of its state dict gives a state dict `dense` loads. Then
            `set_indexer_training("dense_warmup")`, then `"sparse"`.
        Raises:
            TypeError: dense is not a Step5Model. ValueError: layer_types of another length or
                type (as `Step5Config`), or weights that do not fit.
        """
        if not isinstance(dense, Step5Model):
            raise TypeError(
                f"Step5Model.sparsify: dense must be a Step5Model; got {type(dense).__name__}"
            )
        old = dense.config.layer_types
        types = (
            tuple("csa" if t == "dense" and i % 4 == 3 else t for i, t in enumerate(old))
            if layer_types is None
            else tuple(layer_types)
        )
        config = dataclasses.replace(dense.config, layer_types=types)
        weight = dense.embed_tokens.weight
        model = cls(config, dtype=weight.dtype, device=weight.device)
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in dense.state_dict().items() if ".indexer." not in k}, strict=False
        )
        if unexpected or any(".indexer." not in k for k in missing):
            raise ValueError(
                f"Step5Model.sparsify: the dense model's weights do not fit; missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}"
            )
        model.init_indexers(indexer_std)
        if dense.cp_group is not None:
            model.setup_cp_attention(dense.cp_group)
        return model

    def setup_cp_attention(self, cp_mesh_or_group) -> None:
        """Attach a context-parallel group (or 1-D DeviceMesh) to every attention layer; `forward`
        then shards over it when `cp_group` is not given."""
        for layer in self.layers:
            layer.self_attn.setup_cp_attention(cp_mesh_or_group)
        self.cp_group = self.layers[0].self_attn.cp_group if self.layers else None

    # -- forward -----------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        cp_group: Any = None,
    ) -> CausalLMOutput:
        """Logits, and the loss when `labels` are given.

        Args:
            input_ids: int [B, L] token ids (this rank's shard under context parallelism).
            positions: int64 [B, L] document-local positions; a position 0 starts a document (packed
                documents), positions count up by one within one. None: one document per row.
            padding_mask: bool [B, L], True on padding tokens (a tail of each global row), or None.
            labels: int [B, L], the target of each position (already shifted: labels[t] is the
                token that follows position t), IGNORE_INDEX (−100) where no loss is taken; padding
                positions are ignored whatever their label.
            cp_group: context parallelism: a process group (contiguous shards of L tokens, rank
                order) or an `sa_cp.ContextParallelLayout`; None uses the group of
                `setup_cp_attention`, if any, else one rank.
        Returns:
            `CausalLMOutput` (loss as `QSAModel`'s: under context parallelism each rank's loss is
            its shard's share scaled by the group size, `size · Σ_local / N_global`; so is
            `indexer_loss`, the sum of the CSA layers' distillation losses while indexer training
            is on, over the global count of sparse queries).
        Raises:
            TypeError, ValueError: see `Step5Batch.create`; labels of another shape or dtype.
        """
        config = self.config
        batch = Step5Batch.create(
            config,
            input_ids,
            positions,
            padding_mask,
            self.cp_group if cp_group is None else cp_group,
            dense_warmup=any(
                layer.self_attn.indexer is not None
                and layer.self_attn.indexer_training == "dense_warmup"
                for layer in self.layers
            ),
        )
        if labels is not None and (
            not isinstance(labels, torch.Tensor)
            or labels.shape != input_ids.shape
            or labels.is_floating_point()
            or labels.dtype == torch.bool
        ):
            got = (
                (tuple(labels.shape), labels.dtype)
                if isinstance(labels, torch.Tensor)
                else type(labels).__name__
            )
            raise ValueError(
                f"Step5Model.forward: labels must be an integer tensor shaped like input_ids "
                f"{tuple(input_ids.shape)}; got {got}"
            )
        embeds = self.embed_tokens(input_ids)
        residual = embeds.to(_residual_dtype(embeds.dtype))
        kwargs = (
            {} if self._checkpoint_context is None else {"context_fn": self._checkpoint_context}
        )
        indexer_losses = []
        for layer in self.layers:
            if self._checkpointing and torch.is_grad_enabled():
                residual, aux = checkpoint(layer, residual, batch, use_reentrant=False, **kwargs)
            else:
                residual, aux = layer(residual, batch)
            if aux is not None:
                indexer_losses.append(aux)
        logits = self.lm_head(self.norm(residual))
        loss = (
            None
            if labels is None
            else language_model_loss(logits, labels, batch.query_documents < 0, batch.cp.group)
        )
        indexer_loss = torch.stack(indexer_losses).sum() if indexer_losses else None
        return CausalLMOutput(logits, loss, indexer_loss)


def _init_modules(modules, std: float) -> None:
    """The scratch initialisation of `init_weights` on each of `modules`."""
    for module in modules:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, Step5RoutedExperts):
            for weight in (module.gate_proj, module.up_proj, module.down_proj):
                nn.init.normal_(weight, mean=0.0, std=std)
        elif isinstance(module, ZeroCenteredRMSNorm | Step5IndexerRMSNorm):
            nn.init.zeros_(module.weight)
        elif isinstance(module, Step5IndexerLayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, Step5IndexerWeightProjection):
            nn.init.normal_(module.weight, std=module.weight.shape[1] ** -0.5)
        elif isinstance(module, Step5MoE):
            module.expert_bias.zero_()
