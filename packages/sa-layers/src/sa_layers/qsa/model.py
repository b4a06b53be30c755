"""`QSADecoderLayer` and `QSAModel`: a trainable QSA language model (SEMANTICS §2, §4, §5)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sa_routing import QSAContextParallel

from ..mlp import ClampedSwiGLUMLP
from ..norm import ZeroCenteredRMSNorm
from ..output import CausalLMOutput, language_model_loss
from ..routed_model import RoutedModel
from .attention import QSAAttention
from .config import QSAConfig
from .layout import QSABatch


class QSADecoderLayer(nn.Module):
    """Pre-norm decoder layer: `h + attn(norm(h))`, then `h + mlp(norm(h))` (SwiGLU, no clamp)."""

    def __init__(self, config: QSAConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = QSAAttention(config, layer_idx)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ClampedSwiGLUMLP(config.hidden_size, config.intermediate_size, limit=0.0)

    def forward(
        self, hidden: torch.Tensor, batch: QSABatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ (hidden, the attention's indexer loss or None)."""
        attn, indexer_loss = self.self_attn(self.input_layernorm(hidden), batch)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), indexer_loss


class QSAModel(RoutedModel, nn.Module):
    """Embedding, QSA decoder layers, final norm and LM head.

    Build it in FP32 and cast with `.to(torch.bfloat16)` (norm weights stay FP32). Under activation
    checkpointing (`enable_activation_checkpointing`) every decoder layer is checkpointed and, with
    `config.reuse_routes_on_recompute`, its routes are replayed in the recompute.
    """

    def __init__(self, config: QSAConfig) -> None:
        super().__init__()
        if not isinstance(config, QSAConfig):
            raise TypeError(f"QSAModel: config must be a QSAConfig; got {type(config).__name__}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            QSADecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._checkpoint_context: object | None = None
        self._checkpointing = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) projections and embeddings, zero (identity) norm scales,
        the indexers' own initialisation."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, ZeroCenteredRMSNorm):
                nn.init.zeros_(module.weight)
        for indexer in self.indexers():
            indexer.init_weights(std)

    # -- indexer training --------------------------------------------------------------------------

    @torch.no_grad()
    def init_indexers(self, std: float | None = None) -> None:
        """Fresh indexers (normal(0, std) projections, unit norms): the first step of sparsifying a
        model whose layers were trained dense (the state dict keeps every other weight)."""
        for indexer in self.indexers():
            indexer.init_weights(self.config.initializer_range if std is None else std)

    @classmethod
    def sparsify(
        cls,
        dense: QSAModel,
        layer_types: tuple[str, ...] | None = None,
        indexer_std: float | None = None,
    ) -> QSAModel:
        """A QSA model with the weights of `dense` (a model whose layers were trained dense) and
        fresh indexers on the routed layers.

        Args:
            dense: the trained model; its config is kept except `layer_types`.
            layer_types: the new model's layer types; default every layer "qsa".
            indexer_std: std of the fresh indexers' projections (default `initializer_range`).
        Returns:
            A new `QSAModel` on `dense`'s device and dtype whose every non-indexer weight equals
            `dense`'s. Then `set_indexer_training("dense_warmup")`, then `"sparse"`.
        Raises:
            TypeError: `dense` is not a QSAModel.
            ValueError: its weights do not fit the new model (another geometry), or bad
                `layer_types` (as `QSAConfig`).
        """
        if not isinstance(dense, QSAModel):
            raise TypeError(
                f"QSAModel.sparsify: dense must be a QSAModel; got {type(dense).__name__}"
            )
        types = ("qsa",) * dense.config.num_hidden_layers if layer_types is None else layer_types
        config = dataclasses.replace(dense.config, layer_types=tuple(types))
        reference = next(dense.parameters())
        model = cls(config).to(device=reference.device)
        model.to(dtype=dense.embed_tokens.weight.dtype)
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in dense.state_dict().items() if ".indexer." not in k}, strict=False
        )
        if unexpected or any(".indexer." not in k for k in missing):
            raise ValueError(
                f"QSAModel.sparsify: the dense model's weights do not fit; missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}"
            )
        model.init_indexers(indexer_std)
        return model

    # -- forward -----------------------------------------------------------------------------------

    def attends_densely(self) -> bool:
        """Whether a layer attends densely in this stage: a "dense" layer, or a routed one in the
        dense warm-up (then `QSABatch.create` builds the dense mask once per call)."""
        return any(
            layer.self_attn.indexer is None or layer.self_attn.indexer_training == "dense_warmup"
            for layer in self.layers
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | tuple[int, ...] | None = None,
        labels: torch.Tensor | None = None,
        *,
        cp_context: QSAContextParallel | None = None,
    ) -> CausalLMOutput:
        """Logits, and the loss when `labels` are given.

        Args:
            input_ids: int [batch, local_length] token ids (this rank's shard under CP).
            attention_mask: [batch, length] right-padding mask (1 = token), or None.
            cu_seqlens: int [documents + 1] packed-document boundaries (batch 1), ending at the length.
            labels: int [batch, local_length], the target of each position (already shifted: labels[t]
                is the token that follows position t), IGNORE_INDEX (−100) where no loss is taken;
                padding positions are ignored whatever their label.
            cp_context: context parallelism: `QSAContextParallel.create(local_length, group=...,
                attention_mask=global_mask or cu_seqlens=global_bounds)`; then attention_mask and
                cu_seqlens stay None.
        Returns:
            `CausalLMOutput`. Under context parallelism each rank's loss is its shard's share scaled
            by the group size, `size · Σ_local / N_global`: the average over the CP group (what data-
            parallel gradient averaging computes) is the global mean, as are the averaged gradients.
        Raises:
            TypeError, ValueError: see `QSABatch.create`; labels of another shape or dtype.
        """
        config = self.config
        batch = QSABatch.create(
            input_ids,
            rotary_dim=config.rotary_dim,
            rope_theta=config.rope_theta,
            compress_ratio=config.indexer_compress_ratio,
            attention_mask=attention_mask,
            cu_seqlens=cu_seqlens,
            cp_context=cp_context,
            dense_mask=self.attends_densely(),
        )
        if labels is not None and (
            not isinstance(labels, torch.Tensor)
            or labels.shape != input_ids.shape
            or labels.is_floating_point()
        ):
            got = (
                (tuple(labels.shape), labels.dtype)
                if isinstance(labels, torch.Tensor)
                else type(labels).__name__
            )
            raise ValueError(
                f"QSAModel.forward: labels must be an integer tensor shaped like input_ids "
                f"{tuple(input_ids.shape)}; got {got}"
            )
        hidden = self.embed_tokens(input_ids)
        context = (
            {} if self._checkpoint_context is None else {"context_fn": self._checkpoint_context}
        )
        indexer_losses = []
        for layer in self.layers:
            if self._checkpointing and torch.is_grad_enabled():
                hidden, aux = checkpoint(layer, hidden, batch, use_reentrant=False, **context)
            else:
                hidden, aux = layer(hidden, batch)
            if aux is not None:
                indexer_losses.append(aux)
        logits = self.lm_head(self.norm(hidden))
        loss = None
        if labels is not None:
            loss = language_model_loss(logits, labels, batch.query_documents < 0, batch.cp.group)
        indexer_loss = torch.stack(indexer_losses).sum() if indexer_losses else None
        return CausalLMOutput(logits, loss, indexer_loss)
