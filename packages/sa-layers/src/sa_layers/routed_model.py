"""What QSAModel and Step5Model share: their routed layers' indexers, the indexer training stages
and activation checkpointing with route replay.

A model using `RoutedModel` holds `self.layers` (decoder layers whose `self_attn` has `indexer`
(None on unrouted layers), a `routes` replay channel and an `indexer_training` stage) and a
`config` with `reuse_routes_on_recompute`; its forward checkpoints each layer when
`self._checkpointing` is set, with `self._checkpoint_context` as the `context_fn`.
"""

from __future__ import annotations

from torch import nn

from sa_cp import checkpoint_context_fn

from .routes import INDEXER_TRAINING


class RoutedModel:
    """Mixin for `nn.Module` models built of routed attention layers."""

    layers: nn.ModuleList
    _checkpointing: bool = False
    _checkpoint_context: object | None = None

    def indexers(self) -> list[nn.Module]:
        """The routed layers' indexers, in layer order."""
        return [
            layer.self_attn.indexer for layer in self.layers if layer.self_attn.indexer is not None
        ]

    def set_indexer_training(self, mode: str) -> None:
        """Switch the indexer training stage of every routed layer (`routes.INDEXER_TRAINING`).

        "off": indexers frozen, the rest trainable (plain training). "dense_warmup": the routed
        layers attend densely, only the indexers trainable (everything else frozen). "sparse":
        sparse attention, everything trainable; the indexers learn only from the distillation loss
        (`CausalLMOutput.indexer_loss`, which the caller scales and adds), the rest only from the
        LM loss. Route replay under checkpointing stays on in every stage.

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in INDEXER_TRAINING:
            raise ValueError(
                f"{type(self).__name__}.set_indexer_training: mode must be one of "
                f"{INDEXER_TRAINING}; got {mode!r}"
            )
        indexers = {id(p) for ix in self.indexers() for p in ix.parameters()}
        for p in self.parameters():
            is_indexer = id(p) in indexers
            p.requires_grad_(
                {"off": not is_indexer, "dense_warmup": is_indexer, "sparse": True}[mode]
            )
        for layer in self.layers:
            layer.self_attn.indexer_training = mode

    def checkpoint_context_fn(self, context_fn=None):
        """A `context_fn` for `torch.utils.checkpoint.checkpoint` that records every routed layer's
        routes in the forward and replays them in the recompute; `context_fn` (e.g. selective
        checkpointing's `partial(create_selective_checkpoint_contexts, policy)`) is composed in."""
        channels = [
            layer.self_attn.routes for layer in self.layers if layer.self_attn.indexer is not None
        ]
        return checkpoint_context_fn(context_fn, *channels)

    def enable_activation_checkpointing(self, context_fn=None) -> None:
        """Checkpoint every decoder layer (full, or selective through `context_fn`)."""
        self._checkpointing = True
        self._checkpoint_context = (
            self.checkpoint_context_fn(context_fn)
            if self.config.reuse_routes_on_recompute
            else context_fn
        )

    def disable_activation_checkpointing(self) -> None:
        self._checkpointing = False
        self._checkpoint_context = None
