"""The seam between routing and attention: what a routed layer selects once and replays.

A routed layer's forward asks its replay channel for routes (`channel.select_or_replay(select)`):
in the forward the router runs and the routes are recorded; when activation checkpointing reruns the
layer, the recorded routes (ids and the block mask built from them) come back unchanged, so the
recompute neither runs the router nor rebuilds the mask and needs no host synchronisation.
"""

from dataclasses import dataclass

import torch

from sa_kernels import RouteBlockMask, build_route_block_mask

ATTENTION_BACKENDS = ("auto", "flex", "gather", "fa4", "reference")
INDEXER_TRAINING = ("off", "dense_warmup", "sparse")
"""Indexer training stages: frozen routing; a dense warm-up that trains only the indexers by
distillation from dense attention; sparse training with the distillation loss on the selected units."""
# What each backend needs of the route mask (`build_route_block_mask(build_flex=...)`): None builds
# the tile statistics `auto` decides from, False a gather-only mask.
_BUILD_FLEX = {"auto": None, "flex": True, "fa4": True, "gather": False}


@dataclass(frozen=True)
class TokenRoutes:
    """One layer's token routes and, for the fused backends, their block mask.

    Attributes:
        token_ids: int32 [batch, queries, W] (shared by every KV head) or [batch, kv_heads, queries, W]:
            global key ids, valid ids first, −1 padding.
        block_mask: the `RouteBlockMask` of `token_ids`, or None where the backend reads the ids
            (the reference backend, "auto" on CPU).
    """

    token_ids: torch.Tensor
    block_mask: RouteBlockMask | None


def token_routes(
    token_ids: torch.Tensor, kv_length: int, query_heads: int, backend: str
) -> TokenRoutes:
    """`TokenRoutes` of `token_ids` with the block mask `backend` needs (built once, here).

    The "auto" build reads the tile statistics back (one host sync); "gather" builds no Flex mask.
    """
    needs_mask = backend != "reference" and not (
        backend == "auto" and token_ids.device.type != "cuda"
    )
    if not needs_mask:
        return TokenRoutes(token_ids, None)
    mask = build_route_block_mask(
        token_ids, kv_length, query_heads, build_flex=_BUILD_FLEX[backend]
    )
    return TokenRoutes(token_ids, mask)
