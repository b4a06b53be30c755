"""FlashAttention-4 backend: FA4's block-sparse kernels over a route mask's tiles.

FA4 (`flash-attn-4`, CuTe DSL; an optional extra, never a hard dependency) takes, per query tile, the
counts and indices of its full and partial key tiles (like a Flex `BlockMask`) and applies a mask on the
partial ones. This backend serves the routes whose partial tiles are exact causal cuts with FA4's own
causal alignment (query i sits at key i + kv_length − queries; see
`TileStatistics.causal_offset`): FA4's built-in causal mask is then exact on every tile, and no
per-element mask has to run. Other routes raise; flex and gather serve them.

Tiles: our 128×128 route tiles. On sm_90 FA4's forward needs the sparse key block to equal its own
key tile (128 up to head_dim 128, 80 at 256) unless the block is smaller; so at head_dim 256 each
route tile is split into two 64-key tiles (FA4 then runs 64-key tiles) and halves above the causal
line are dropped.
"""

import functools
import inspect
from dataclasses import dataclass

import torch

from sa_kernels.backend import device_capability

from .block_mask import TILE, RouteBlockMask, _blocks_first

# Compute capabilities where this backend was measured and tested (FA4's sm_90 kernels), with
# flash-attn-4 4.0.0b36 (a beta: its interface may change; `fa4_attention` checks what it returns).
FA4_TESTED_CAPABILITIES = ((9, 0),)


@functools.cache
def _import_error() -> str | None:
    """Why flash-attn-4 cannot be imported, or None; tried once per process."""
    try:
        from flash_attn.cute.interface import flash_attn_func  # noqa: F401
    except Exception as err:  # ImportError, or the CuTe DSL runtime failing to load
        return f"flash-attn-4 is not usable: {type(err).__name__}: {err}"
    return None


def _flash_attn_func():
    from flash_attn.cute.interface import flash_attn_func

    return flash_attn_func


@functools.cache
def _takes_return_lse(attention) -> bool:
    """Whether this flash-attn-4 `flash_attn_func` takes `return_lse` (releases without it return
    the LSE beside the output only when an input requires grad)."""
    try:
        return "return_lse" in inspect.signature(attention).parameters
    except (TypeError, ValueError):
        return False


def fa4_unavailable_reason(
    device: torch.device | str | None = None, capability: tuple[int, int] | None = None
) -> str | None:
    """None when FA4 can run on `device` (import works, a GPU generation in
    FA4_TESTED_CAPABILITIES); otherwise why not. `capability`: the device's, where the caller has
    read it (`backend.device_capability`; default: read here)."""
    if (reason := _import_error()) is not None:
        return reason
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA tensors"
    if capability is None:
        capability = device_capability(device)
    if capability not in FA4_TESTED_CAPABILITIES:
        return f"tested on compute capability {FA4_TESTED_CAPABILITIES}; this GPU is {capability}"
    return None


def fa4_key_tile(head_dim: int) -> int | None:
    """Key-tile width of the sparse blocks FA4's sm_90 kernels take at this head_dim (None: none fits;
    FA4 also needs 16-byte rows: a multiple of 8 for 16-bit inputs)."""
    if head_dim < 8 or head_dim % 8:
        return None
    if head_dim <= 128:
        return TILE
    if head_dim == 256:
        return 64
    return None


def fa4_route_issue(block_mask: RouteBlockMask, head_dim: int) -> str | None:
    """None when these routes suit the FA4 backend at this head_dim; otherwise why not."""
    if fa4_key_tile(head_dim) is None:
        return (
            "FA4's sm_90 block sparsity fits head_dim 8 to 128 in steps of 8, or 256, here; "
            f"got {head_dim}"
        )
    if block_mask.flex is None or block_mask.statistics is None:
        return (
            "the block_mask holds no Flex tiles (built with build_flex=False, or build_flex=None "
            "on routes too scattered for tiles)"
        )
    offset = block_mask.statistics.causal_offset
    aligned = block_mask.kv_length - block_mask.queries
    # FA4's causal mask runs on every tile: the selected pairs must lie on or below its line, and
    # partial tiles must be cut exactly by it.
    exact = offset is not None and (
        offset == aligned or (offset < aligned and not block_mask.statistics.partial_tiles)
    )
    if not exact:
        return (
            "the routes are not whole tiles plus exact causal cuts aligned like FA4's causal mask "
            f"(query i at key i + {aligned}); flex and gather take any routes"
        )
    return None


@dataclass(frozen=True)
class Fa4Tiles:
    """FA4 block-sparse lists (int32): forward per query tile, backward per key tile.

    forward: (partial counts [B, H, q_tiles], partial indices [B, H, q_tiles, k_tiles], full counts,
        full indices), key tiles ascending after the counts' prefix.
    backward: the same per key tile ([B, H, k_tiles], [B, H, k_tiles, q_tiles]).
    block_size: (query tile, key tile) = (128, `fa4_key_tile(head_dim)`); H is 1 (shared routes) or
        query_heads.
    """

    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    backward: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    block_size: tuple[int, int]


def _dense(num: torch.Tensor, idx: torch.Tensor, columns: int) -> torch.Tensor:
    """bool [..., rows, columns] from Flex-style (counts, indices) lists."""
    live = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    dense = torch.zeros(*idx.shape[:-1], columns + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, torch.where(live, idx.long(), columns), True)
    return dense[..., :columns]


def fa4_tiles(block_mask: RouteBlockMask, head_dim: int) -> Fa4Tiles:
    """The FA4 lists of these routes' tiles (cached on the mask per key-tile width); raises
    ValueError where `fa4_route_issue` finds one."""
    issue = fa4_route_issue(block_mask, head_dim)
    if issue is not None:
        raise ValueError(f"fa4_tiles: {issue}")
    return _tiles(block_mask, fa4_key_tile(head_dim))


def _tiles(block_mask: RouteBlockMask, key_tile: int) -> Fa4Tiles:
    """`fa4_tiles` of routes `fa4_route_issue` has accepted (not checked again)."""
    cached = block_mask.cache.get(("fa4", key_tile))
    if cached is not None:
        return cached
    flex = block_mask.flex
    kv_tiles = -(-block_mask.kv_length // TILE)
    full = _dense(flex.full_kv_num_blocks, flex.full_kv_indices, kv_tiles)
    partial = _dense(flex.kv_num_blocks, flex.kv_indices, kv_tiles)
    split = TILE // key_tile
    if split > 1:
        columns = -(-block_mask.kv_length // key_tile)
        full = full.repeat_interleave(split, dim=-1)[..., :columns]
        partial = partial.repeat_interleave(split, dim=-1)[..., :columns]
        # A half of a causal-cut tile that lies wholly above the causal line holds no pair.
        offset = block_mask.kv_length - block_mask.queries
        last_row = torch.arange(partial.shape[-2], device=partial.device) * TILE + TILE - 1
        first_key = torch.arange(columns, device=partial.device) * key_tile
        partial &= first_key[None, :] <= (last_row + offset)[:, None]
    tiles = Fa4Tiles(
        forward=(*_blocks_first(partial), *_blocks_first(full)),
        backward=(
            *_blocks_first(partial.transpose(-1, -2)),
            *_blocks_first(full.transpose(-1, -2)),
        ),
        block_size=(TILE, key_tile),
    )
    block_mask.cache[("fa4", key_tile)] = tiles
    return tiles


def fa4_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: RouteBlockMask,
    scale: float,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FA4 block-sparse causal attention over the route tiles; [batch, queries, query_heads, head_dim].

    With `return_lse`, `(out, lse)`: FA4's log-sum-exp (asked for with `return_lse=True` where
    `flash_attn_func` takes it; FP32 [batch, query_heads, queries], natural log, −inf on a row with
    no key) as float32 [batch, queries, query_heads], contiguous and detached; a flash-attn-4 call
    that returns none raises RuntimeError.
    The caller has checked that FA4 runs here (`fa4_unavailable_reason`) and serves these routes at
    this head_dim (`fa4_route_issue`); neither is asked again."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    tiles = _tiles(block_mask, fa4_key_tile(query.shape[-1]))
    forward = BlockSparseTensorsTorch(*tiles.forward, block_size=tiles.block_size)
    backward = BlockSparseTensorsTorch(*tiles.backward, block_size=tiles.block_size)
    attention = _flash_attn_func()
    extra = {"return_lse": True} if return_lse and _takes_return_lse(attention) else {}
    result = attention(
        query,
        key,
        value,
        softmax_scale=scale,
        causal=True,
        block_sparse_tensors=forward,
        block_sparse_tensors_bwd=backward,
        **extra,
    )
    out = result[0] if isinstance(result, tuple) else result  # 4.0.0b36 returns (out, lse)
    if out.shape != query.shape:
        raise RuntimeError(
            f"fa4_attention: flash-attn-4 returned shape {tuple(out.shape)} for queries "
            f"{tuple(query.shape)} (tested with 4.0.0b36)"
        )
    if not return_lse:
        return out
    batch, queries, heads, _ = query.shape
    lse = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (batch, heads, queries):
        got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise RuntimeError(
            "sparse_gqa_attention: backend='fa4' cannot serve return_lse=True: flash-attn-4 "
            f"returned no log-sum-exp [batch, query_heads, queries] = {(batch, heads, queries)} "
            f"(got {got}); use backend 'gather' or 'flex'"
        )
    return out, lse.detach().float().transpose(1, 2).contiguous()
