"""FlexAttention backend: compiled `flex_attention` over a route or region mask's 128×128 BlockMask.

Shared by `sparse_gqa_attention` and `sparse_region_attention` (both masks carry a Flex `BlockMask`
in `.flex`).

Kernel options: on the H200 with torch 2.11, Inductor's default sm_90 configurations for
head_dim <= 128 (e.g. backward 64/128/128/64 tiles, 3 stages, 8 warps) need 256–368 KiB of shared
memory with a bitmap `mask_mod` (227 KiB available), while head_dim 256 compiles with its 64×64,
2-stage defaults. `flex_kernel_options` therefore pins, for head_dim <= 128 (16-bit inputs on
CUDA) and the bitmap mask_mod, the fastest configuration of an H200 sweep that fits: forward
128×64 tiles, backward 64×128 (dK/dV) and 128×64 (dQ), 2 stages, 8 warps. For 128 < head_dim <=
192 (Step-5's 192) Inductor's sm_90 default is 64×64 forward tiles with 3 stages and 4 warps and a
64×64, 2-stage, 4-warp backward; the sweep's fastest there is 128×64 forward tiles, 64×64 backward
tiles, 2 stages and 8 warps. Every tile divides the 128-wide route tiles, as Flex requires (its
BlockMask block size must be a multiple of the kernel's). Arithmetic mask_mods (the causal one of
`block_mask`, the Step-5 layers' window and document masks) keep torch's defaults for head_dim <=
128, which is what a block-aligned causal Flex mask compiles to, and take the same 128 < head_dim
<= 192 options, measured on the Step-5 masks only: in `bench_step5_layer.py` on the H200 (64k
tokens, D 192, fwd+bwd), Flex's own sliding-window mask takes 46.5 ms with them
(docs/results/step5_layer.json, commit b4424f6) against 67.7 ms with Inductor's defaults (the same
benchmark at commit cbe7d4d). `sparse_gqa_attention`'s causal route masks at that head dim take
them unmeasured.
"""

import functools

import torch

__all__ = [
    "FLEX_TESTED_CAPABILITIES",
    "FLEX_TESTED_DTYPES",
    "compiled_flex",
    "flex_attend",
    "flex_kernel_options",
]

FLEX_TESTED_CAPABILITIES = ((9, 0),)
"""GPU generations (compute capability) where `auto` may pick Flex: measured and tested there."""
FLEX_TESTED_DTYPES = (torch.bfloat16, torch.float16)
"""Input dtypes where `auto` may pick Flex."""

# Flex tiles for head_dim <= 128 on CUDA (see the module docstring): forward BLOCK_M × BLOCK_N,
# backward BLOCK_M1 × BLOCK_N1 (dK/dV) and BLOCK_M2 × BLOCK_N2 (dQ); unprefixed keys, which every
# torch release with FlexAttention reads (forward and backward each take the names they know).
# The fastest of `bench_sparse_gqa.py --sweep` on the H200 (clustered per-group routes, 32k,
# Hq 64 / Hkv 4 / D 128, bitmap mask_mod): fwd+bwd 54.6 ms against 77.2 ms for 64×64 tiles with 4
# warps; 128×128 forward tiles with a mask_mod need 294 912 bytes of shared memory (the limit is
# 232 448).
_SMALL_HEAD_FLEX_OPTIONS = {
    "BLOCK_M": 128,
    "BLOCK_N": 64,
    "BLOCK_M1": 64,
    "BLOCK_N1": 128,
    "BLOCK_M2": 128,
    "BLOCK_N2": 64,
    "num_stages": 2,
    "num_warps": 8,
}
# Flex tiles for 128 < head_dim <= 192 on CUDA, chosen on the H200 (clustered region routes, Hq 64
# / G 4 / D 192, bitmap mask_mod) over 128×32 forward tiles, one stage, and 4 warps; 64×128 /
# 128×64 backward tiles or 3 stages need 295 424 bytes of shared memory (the limit is 232 448).
# Recorded effect (docs/results/step5_layer.json, bench_step5_layer.py): the Step-5 CSA layer on
# clustered routes runs 1.49× / 2.71× / 5.15× dense at 32k / 64k / 128k, against 1.18× / 2.16× /
# 4.12× with Inductor's defaults.
_MID_HEAD_FLEX_OPTIONS = {
    "BLOCK_M": 128,
    "BLOCK_N": 64,
    "BLOCK_M1": 64,
    "BLOCK_N1": 64,
    "BLOCK_M2": 64,
    "BLOCK_N2": 64,
    "num_stages": 2,
    "num_warps": 8,
}


@functools.cache
def compiled_flex():
    """`torch.compile(flex_attention)`, built once per process."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_kernel_options(
    head_dim: int,
    dtype: torch.dtype,
    device_type: str,
    capability: tuple[int, int] | None = (9, 0),
    *,
    bitmap_mask: bool = True,
) -> dict | None:
    """`kernel_options` for compiled flex_attention; None keeps torch's defaults.

    16-bit inputs on an sm_90 GPU (`capability` (9, 0)): with 128 < head_dim <= 192, 128×64
    forward / 64×64 backward tiles, 2 stages and 8 warps, for every mask_mod; with head_dim <= 128
    and the bitmap mask_mod (`bitmap_mask`; False: an arithmetic one such as the causal one of
    `RouteBlockMask.statistics.causal_offset`), 128×64 / 64×128 tiles, 2 stages and 8 warps (both
    fit sm_90's 227 KiB of shared memory). Arithmetic mask_mods at head_dim <= 128, head_dim > 192,
    FP32, CPU and other GPU generations keep torch's defaults.
    """
    if device_type != "cuda" or dtype == torch.float32 or head_dim > 192 or capability != (9, 0):
        return None
    if head_dim > 128:
        return dict(_MID_HEAD_FLEX_OPTIONS)
    return dict(_SMALL_HEAD_FLEX_OPTIONS) if bitmap_mask else None


def flex_attend(
    attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask,
    scale: float,
    kernel_options: dict | None = None,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` (flex_attention, compiled or not) over a Flex `BlockMask` in our layout.

    query: [batch, queries, query_heads, head_dim]; key, value: [batch, kv_length, kv_heads,
    head_dim]; block_mask: a Flex `BlockMask` (a `RouteBlockMask`'s or `RegionBlockMask`'s `.flex`).
    Returns [batch, queries, query_heads, head_dim], contiguous; with `return_lse`, `(out, lse)`:
    lse float32 [batch, queries, query_heads], contiguous and detached, Flex's log-sum-exp
    (`return_aux=AuxRequest(lse=True)`; natural log in every torch release that has `AuxRequest`:
    `flex_attention` converts its kernels' log2 values before returning; −inf on a row that attends
    no key).

    On CUDA the options always hold `FORCE_USE_FLEX_ATTENTION`: Inductor would otherwise pick its
    flex-decoding kernel, meant for inference, for fewer than 128 queries over a one-head mask, and
    it has no configuration for some training shapes (FP32, small head dims).
    """
    if query.is_cuda:
        kernel_options = {"FORCE_USE_FLEX_ATTENTION": True, **(kernel_options or {})}
    extra = {} if kernel_options is None else {"kernel_options": kernel_options}
    if return_lse:
        from torch.nn.attention.flex_attention import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    result = attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        **extra,
    )
    if not return_lse:
        return result.transpose(1, 2).contiguous()
    out, aux = result
    return out.transpose(1, 2).contiguous(), aux.lse.detach().float().transpose(1, 2).contiguous()
