"""`Step5Batch`: what every layer of one Step-5 model call shares, computed once in the model's forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sa_cp import ContextParallelLayout, gather_no_grad, group_rank_and_size
from sa_kernels.backend import device_capability
from sa_routing import RegionMetadata, region_metadata

from ..rotary import rotary_table
from .config import Step5Config

_OP = "Step5Model.forward"


@dataclass(frozen=True)
class Step5Batch:
    """Positions, documents, the CP shard, rotary tables, the CSA metadata and the attention masks of
    one model call (the same object reaches every layer, and the checkpoint recompute).

    `B` batch, `L` this rank's tokens, `S = cp.size · L` the global (padded) length; this rank's
    tokens are global rows `[cp.local_start, cp.local_start + L)`.

    Attributes:
        cp: the shard (`sa_cp.ContextParallelLayout`; `group` None and `size` 1 without context
            parallelism).
        positions: int64 [B, L], document-local positions of the shard's tokens (a document starts
            where the position is 0).
        padding: bool [B, L], True on padding tokens, or None (no padding anywhere).
        global_positions: int64 [B, S], the positions of every rank's tokens (gathered without
            gradient under context parallelism).
        global_padding: bool [B, S] or None, likewise.
        documents: int64 [B, S], the document index of every token within its row, −1 for padding.
        rotary: float32 `cat(cos, sin)` tables [B or 1, L, rotary_dim] at the local positions, keyed by
            `(rope_theta, rotary_dim)` (one per distinct pair of the model's layers).
        sparse_metadata: the `RegionMetadata` shared by every CSA layer (global keys, this shard's
            queries), or None in a model without CSA layers.
        sparse_query_count: int64 scalar tensor, the sparse queries of the whole (global) batch
            (`sparse_metadata.sparse_queries` summed over every shard: valid tokens at document
            position `p` with `p // region_size > topk`), counted from the global positions on
            every rank: no collective, no host sync. 0 in a model without CSA layers.
        window: the SWA window `W`.
        swa_key_start: global row of the first key an SWA layer holds: `local_start − (W − 1)` with
            the previous rank's halo (negative on rank 0: zero rows there, never visible), the
            shard's own start on one rank, `max(0, local_start − (W − 1))` where the halo would
            pass one shard (the SWA layer then all-gathers the keys and keeps that range).
        swa_halo: "none" (one rank), "halo" (`gather_halo` of `W − 1` rows) or "gather".
        swa_key_documents: int64 [B, swa_key_rows], the document of every SWA key row, −1 for rows
            outside the sequence or padding.
        flex_masks: FlexAttention `BlockMask`s built once per call on CUDA ("swa": window and
            document over the SWA key rows; "dense": causal and document over the global keys, for
            dense layers and for CSA layers in the indexer's dense warm-up; window or causal alone
            when positions and padding_mask are None), or empty where the chunked masked-SDPA path
            runs (CPU, backend "reference").
        capability: the compute capability of the batch's CUDA device (None off CUDA), read once
            per call for the Flex kernel options (`sa_kernels.flex_kernel_options`).
    """

    cp: ContextParallelLayout
    positions: torch.Tensor
    padding: torch.Tensor | None
    global_positions: torch.Tensor
    global_padding: torch.Tensor | None
    documents: torch.Tensor
    rotary: dict[tuple[float, int], torch.Tensor]
    sparse_metadata: RegionMetadata | None
    sparse_query_count: torch.Tensor
    window: int
    swa_key_start: int
    swa_halo: str
    swa_key_documents: torch.Tensor
    flex_masks: dict[str, Any]
    capability: tuple[int, int] | None = None

    batch_size = property(lambda self: self.positions.shape[0])
    local_length = property(lambda self: self.positions.shape[1])
    local_start = property(lambda self: self.cp.local_start)
    global_length = property(lambda self: self.global_positions.shape[1])

    @property
    def query_documents(self) -> torch.Tensor:
        """int64 [B, L]: the document of every local token, −1 for padding."""
        start = self.cp.local_start
        return self.documents[:, start : start + self.local_length]

    @classmethod
    @torch.compiler.disable  # host validation and metadata, once per call: eager under torch.compile
    def create(
        cls,
        config: Step5Config,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        cp: Any = None,
        *,
        dense_warmup: bool = False,
    ) -> Step5Batch:
        """Validate a batch at the model boundary and lay it out.

        Host synchronisation: none when positions and padding_mask are None; else one read of three
        validation flags, plus `region_metadata`'s one when the model has CSA layers.

        Args:
            config: the model's `Step5Config`.
            input_ids: int [B, L] token ids (this rank's shard under context parallelism).
            positions: int64 [B, L] document-local positions of the shard's tokens, or None (one
                document per row: the global row index).
            padding_mask: bool [B, L], True on padding tokens, or None. Padding must be a tail of
                each (global) row: no valid token after a padding token.
            cp: None (one rank), a process group (contiguous shards of L tokens over it), or an
                `sa_cp.ContextParallelLayout` whose `local_length` is L.
            dense_warmup: the CSA layers attend densely (the indexer's warm-up): build the dense
                causal mask on CUDA even without dense layers.
        Raises:
            TypeError: input_ids not an integer tensor, positions not int64, padding_mask not bool,
                cp of another type.
            ValueError: shapes that disagree, a negative position of a valid token, positions that
                do not start each document at 0 or count up by one, padding before a valid token,
                a cp layout of another local length, a shard length that is not a multiple of
                `sparse_config.region_size` under context parallelism with CSA layers.
        """
        batch, length, device = _check_inputs(input_ids, positions, padding_mask)
        layout = _cp_layout(cp, length)
        csa = bool(config.csa_layers)
        region_size = config.sparse_config.region_size
        if layout.size > 1 and csa and length % region_size:
            raise ValueError(
                f"{_OP}: cp_group: under context parallelism the local length ({length}) must be a multiple of "
                f"sparse_config.region_size ({region_size})"
            )
        if layout.size > 1 and layout.group is None:
            raise ValueError(
                f"{_OP}: cp_group: a layout of {layout.size} ranks needs its process group (layout.group); got None"
            )
        total = layout.padded_length
        plain = positions is None and padding_mask is None  # known on the host: nothing to check
        if positions is None:
            global_positions = torch.arange(total, device=device).expand(batch, total)
            positions = global_positions[:, layout.local_start : layout.local_stop]
            rotary_positions = positions[:1]
        else:
            global_positions = gather_no_grad(positions, layout.group)
            rotary_positions = positions
        global_padding = (
            None if padding_mask is None else gather_no_grad(padding_mask, layout.group)
        )
        if plain:
            documents = torch.zeros((1, total), dtype=torch.int64, device=device).expand(batch, -1)
        else:
            _check_positions(global_positions, global_padding)
            valid = (
                torch.ones_like(global_positions, dtype=torch.bool)
                if global_padding is None
                else ~global_padding
            )
            starts = valid & (global_positions == 0)
            documents = torch.where(valid, torch.cumsum(starts, dim=1) - 1, -1)
        rotary = {
            (theta, dim): rotary_table(rotary_positions, dim, theta)
            for theta, dim in config.rotary_keys()
        }
        metadata = None
        sparse_count = torch.zeros((), dtype=torch.int64, device=device)
        if csa:
            sparse = config.sparse_config
            metadata = region_metadata(
                global_positions.contiguous(),
                None if global_padding is None else global_padding.contiguous(),
                layout.local_start,
                length,
                sparse.region_size,
                sparse.topk,
            )
            sparse_count = _sparse_query_count(
                global_positions, global_padding, sparse.region_size, sparse.topk
            )

        window = config.sliding_window
        halo = window - 1
        if layout.size == 1:
            swa_start, mode = layout.local_start, "none"
        elif halo <= length:
            swa_start, mode = layout.local_start - halo, "halo"
        else:
            swa_start, mode = max(0, layout.local_start - halo), "gather"
        key_rows = torch.arange(swa_start, layout.local_stop, device=device)
        inside = key_rows >= 0
        swa_documents = torch.where(
            inside, documents[:, key_rows.clamp(min=0)], torch.full_like(key_rows, -1)
        )
        masks = _flex_masks(
            config, documents, swa_documents, layout, swa_start, device, dense_warmup and csa, plain
        )
        return cls(
            cp=layout,
            positions=positions,
            padding=padding_mask,
            global_positions=global_positions,
            global_padding=global_padding,
            documents=documents,
            rotary=rotary,
            sparse_metadata=metadata,
            sparse_query_count=sparse_count,
            window=window,
            swa_key_start=swa_start,
            swa_halo=mode,
            swa_key_documents=swa_documents,
            flex_masks=masks,
            capability=device_capability(device),
        )


def _check_inputs(
    input_ids: torch.Tensor, positions: torch.Tensor | None, padding_mask: torch.Tensor | None
) -> tuple[int, int, torch.device]:
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.is_floating_point()
        or input_ids.is_complex()
        or input_ids.dtype == torch.bool
    ):
        got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TypeError(f"{_OP}: input_ids must be an integer tensor [batch, sequence]; got {got}")
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(
            f"{_OP}: input_ids must be [batch, sequence] with at least one token; got shape "
            f"{tuple(input_ids.shape)}"
        )
    shape = tuple(input_ids.shape)
    for name, t, dtype in (
        ("positions", positions, torch.int64),
        ("padding_mask", padding_mask, torch.bool),
    ):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(
                f"{_OP}: {name} must be a {dtype} tensor [batch, sequence] or None; got {got}"
            )
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{_OP}: {name} must have input_ids' shape {shape}; got {tuple(t.shape)}"
            )
        if t.device != input_ids.device:
            raise ValueError(
                f"{_OP}: {name} must be on input_ids' device {input_ids.device}; got {t.device}"
            )
    return shape[0], shape[1], input_ids.device


def _cp_layout(cp: Any, length: int) -> ContextParallelLayout:
    if cp is None:
        return ContextParallelLayout(0, 1, length, length)
    if isinstance(cp, ContextParallelLayout):
        if cp.local_length != length:
            raise ValueError(
                f"{_OP}: cp_group.local_length ({cp.local_length}) must be the tokens per row of input_ids "
                f"({length})"
            )
        return cp
    if not isinstance(cp, torch.distributed.ProcessGroup):
        raise TypeError(
            f"{_OP}: cp_group must be None, a torch.distributed ProcessGroup or an "
            f"sa_cp.ContextParallelLayout; got {type(cp).__name__}"
        )
    rank, size = group_rank_and_size(cp)
    return ContextParallelLayout(rank, size, size * length, length, group=cp)


def _check_positions(positions: torch.Tensor, padding: torch.Tensor | None) -> None:
    """Valid positions >= 0, starting every document at 0 and counting up by one; padding only as a
    tail of each row. One host read of three flags."""
    valid = torch.ones_like(positions, dtype=torch.bool) if padding is None else ~padding
    negative = (valid & (positions < 0)).any()
    follows = positions[:, 1:] == positions[:, :-1] + 1
    broken = (valid[:, 1:] & (positions[:, 1:] != 0) & ~follows).any() | (
        valid[:, 0] & (positions[:, 0] != 0)
    ).any()
    left_padding = (valid[:, 1:] & ~valid[:, :-1]).any()
    negative, broken, left_padding = torch.stack([negative, broken, left_padding]).tolist()
    if negative:
        raise ValueError(f"{_OP}: positions of valid tokens must be >= 0; got a negative position")
    if left_padding:
        raise ValueError(
            f"{_OP}: padding_mask must mark padding only after the valid tokens of each row; got "
            "padding before a valid token"
        )
    if broken:
        raise ValueError(
            f"{_OP}: positions must start every document at 0 and count up by one within it; got a "
            "valid token whose position is neither 0 nor its predecessor's + 1"
        )


def _sparse_query_count(
    positions: torch.Tensor, padding: torch.Tensor | None, region_size: int, topk: int
) -> torch.Tensor:
    """int64 scalar: the valid tokens with more than `topk` historical regions in their document
    (`RegionMetadata.sparse_queries` over the whole sequence)."""
    sparse = torch.div(positions, region_size, rounding_mode="floor") > topk
    if padding is not None:
        sparse &= ~padding
    return sparse.sum()


def _flex_masks(
    config, documents, swa_documents, layout, swa_start, device, dense_csa, plain
) -> dict[str, Any]:
    """The SWA and dense FlexAttention block masks of this call (CUDA, backend not "reference") from
    `mask_mods`."""
    if device.type != "cuda" or config.attn_backend == "reference":
        return {}
    from torch.nn.attention.flex_attention import create_block_mask

    mods = mask_mods(
        config, documents, swa_documents, layout.local_start, layout.local_length, swa_start,
        dense_csa, plain,
    )  # fmt: skip
    return {
        name: create_block_mask(
            mod, documents.shape[0], None, layout.local_length, keys, device=device, _compile=True
        )
        for name, (mod, keys) in mods.items()
    }


def mask_mods(
    config, documents, swa_documents, local_start, local_length, swa_start, dense_csa, plain
) -> dict[str, tuple[Any, int]]:
    """{"swa" / "dense": (Flex mask_mod, key rows)} of a call: the window over the SWA key rows
    (global rows `swa_start …`, negative ones never visible) and the causal mask over the global
    keys, each within the query's document; "dense" only with dense layers or `dense_csa` (the CSA
    layers attend densely as well). A `plain` batch (one document per row, no padding: known on the
    host) gets purely arithmetic mask_mods, which read no document tensor.

    Args:
        documents: int64 [B, S], the document of every global row (−1 padding).
        swa_documents: int64 [B, swa_key_rows], the document of every SWA key row (−1 outside).
        local_start, local_length: the shard's first global row and its rows.
    """
    start, window = local_start, config.sliding_window
    queries = documents[:, start : start + local_length].contiguous()
    mods: dict[str, tuple[Any, int]] = {}
    if "swa" in config.layer_types:
        keys = swa_documents.contiguous()
        shift = start - swa_start

        def window_mod(b, h, q, kv):
            doc = queries[b, q]
            distance = q + shift - kv
            return (doc >= 0) & (doc == keys[b, kv]) & (distance >= 0) & (distance < window)

        def plain_window_mod(b, h, q, kv):  # key rows before global row 0 are never visible
            distance = q + shift - kv
            return (distance >= 0) & (distance < window) & (kv + swa_start >= 0)

        mods["swa"] = (plain_window_mod if plain else window_mod, keys.shape[1])
    if "dense" in config.layer_types or dense_csa:
        every = documents.contiguous()

        def causal_mod(b, h, q, kv):
            doc = queries[b, q]
            return (doc >= 0) & (doc == every[b, kv]) & (kv <= q + start)

        def plain_causal_mod(b, h, q, kv):
            return kv <= q + start

        mods["dense"] = (plain_causal_mod if plain else causal_mod, every.shape[1])
    return mods
