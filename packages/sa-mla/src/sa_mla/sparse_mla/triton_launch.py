"""Launch configs for the sparse MLA Triton kernels, with a fallback when a config does not fit the GPU."""

from dataclasses import dataclass

import torch
import triton

from sa_kernels.backend import triton_interpret

from .reference import VALUE_DIM
from .triton_chain_break import unchain_dots

LOG2E = 1.4426950408889634

# Triton's interpreter multiplies bf16 dot operands as raw uint16 (Triton 3.9); the kernels widen them to
# FP32 first when interpreting (UPCAST), which the compiled kernels never do.


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and warps for one kernel launch."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    # Dims per program, for the kernels that split the head dim across programs (the backward's dkv).
    block_d: int | None = None
    # Slots per program for the dkv kernel (None: the whole row), a multiple of block_k; the slot
    # ranges are the grid's slowest axis, so that with ascending ids the programs in flight add into
    # nearby dkv rows.
    slot_chunk: int | None = None
    # ptxas register cap (`maxnreg`), where more programs per SM matter more than spills.
    max_registers: int | None = None

    def __post_init__(self):
        # The kernel walks a range in whole slot blocks: a ragged range would add its last block's
        # slots twice (once more from the next range).
        if self.slot_chunk is not None and (self.slot_chunk < 1 or self.slot_chunk % self.block_k):
            raise ValueError(
                f"LaunchConfig: slot_chunk must be a positive multiple of block_k "
                f"({self.block_k}); got {self.slot_chunk}"
            )


def _head_block(heads: int) -> int:
    return 64 if heads > 32 else max(16, triton.next_power_of_2(heads))


def forward_configs(heads: int) -> list[LaunchConfig]:
    """Configs to try in order: the first that fits the GPU's shared memory and registers is kept."""
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    # Two stages: with the ids loaded a block ahead, the pipeliner buffers the gathered key tiles
    # one more time per stage (three stages need 296 KiB of shared memory on Triton 3.6).
    h = _head_block(heads)
    return [
        LaunchConfig(h, 64, 8, 2),
        LaunchConfig(h, 32, 8, 2),
        LaunchConfig(16, 32, 4, 1),
    ]


def dq_configs(heads: int) -> list[LaunchConfig]:
    """The backward's dq kernel: one stage, as q, dO and a 64-slot key tile fill shared memory (two
    stages needed 288 KiB on the H200's Triton 3.6)."""
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = _head_block(heads)
    return [LaunchConfig(h, 64, 8, 1), LaunchConfig(h, 32, 8, 1), LaunchConfig(16, 32, 4, 1)]


def dkv_configs(heads: int) -> list[LaunchConfig]:
    """dkv += ds^T q + p^T dO in blocks of block_d dims per program: a [BLOCK_K, block_d] FP32
    accumulator, converted through shared memory for the vectorised atomics, beside the block's q and
    dO columns (resident in shared memory). Up to 128 heads per program: every head block adds its
    own share to the same dkv rows, so fewer blocks mean fewer atomics (H200: with 128 heads × 64
    slots × 64 dims the whole backward takes 29.44 ms against 36.45 with 64 heads × 128 dims).

    The kernel is memory-bound, so programs per SM matter (H200):
    - a mask on loaded values splits its p/ds loads into 2-byte ones and takes it from 64 to 110
      registers (two programs per SM instead of four): the backward goes from 27.7 to 34.6 ms;
    - slot ranges of 512 (with the backward's ascending ids, the programs in flight add into about a
      quarter of the dkv rows at a time) want 74 registers, capped at 64 (no spills in Triton 3.6);
    - two stages (112 KiB of shared memory, so two programs per SM; the p/ds tiles loaded
      asynchronously) measured 25.99 against 26.21 ms for one, within the spread between calls;
      one stage, four programs per SM at the cap, is the fallback.
    """
    if triton_interpret():
        block_h = max(16, min(64, triton.next_power_of_2(heads)))
        return [LaunchConfig(block_h, 16, 4, 1, block_d=128, slot_chunk=16)]
    h = max(16, min(128, triton.next_power_of_2(heads)))
    return [
        LaunchConfig(h, 64, 8, 2, block_d=64, slot_chunk=512, max_registers=64),
        LaunchConfig(h, 64, 8, 1, block_d=64, slot_chunk=512, max_registers=64),
        LaunchConfig(h, 32, 8, 1, block_d=64, slot_chunk=512, max_registers=64),
        LaunchConfig(16, 32, 4, 1, block_d=64, slot_chunk=512),
    ]


_CHOSEN: dict[tuple, LaunchConfig] = {}


def _launch(
    kernel, key: tuple | None, configs: list[LaunchConfig], grid_of, *args, **constexprs
) -> None:
    """Launch with the first config that compiles within the device's limits (remembered per key)."""
    if key is not None and key in _CHOSEN:
        configs = [_CHOSEN[key]]
    error = None
    for config in configs:
        try:
            kernel[grid_of(config)](
                *args,
                **constexprs,
                BLOCK_H=config.block_h,
                BLOCK_K=config.block_k,
                **({"BLOCK_D": config.block_d} if "BLOCK_D" in kernel.arg_names else {}),
                **(
                    {"SLOT_CHUNK": config.slot_chunk or 0}
                    if "SLOT_CHUNK" in kernel.arg_names
                    else {}
                ),
                UPCAST=triton_interpret(),
                UNCHAIN=unchain_dots(args[0].device),
                num_warps=config.num_warps,
                num_stages=config.num_stages,
                **({"maxnreg": config.max_registers} if config.max_registers else {}),
            )
        except triton.runtime.errors.OutOfResources as exc:
            error = exc
            continue
        if key is not None:
            _CHOSEN[key] = config
        return
    raise error


def forward_arguments(
    q: torch.Tensor,
    kv: torch.Tensor,
    ids: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, tuple, dict]:
    """The outputs (out [T, H, 512] in q's dtype, lse [T, H] fp32, uninitialised) and the launch
    arguments (positional, constexpr) that both forward kernels take, the portable one of
    `triton_forward.py` and the Gluon one of `gluon_forward.py` (absent optional inputs replaced by unread
    placeholders)."""
    tokens, heads, head_dim = q.shape
    out = torch.empty(tokens, heads, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    args = (
        q,
        kv,
        ids,
        topk_length if topk_length is not None else ids,
        attn_sink if attn_sink is not None else lse,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        ids.stride(0),
        out.stride(0),
        out.stride(1),
        heads,
        kv.shape[0],
        ids.shape[1],
        float(softmax_scale) * LOG2E,
    )
    constexprs = dict(
        HAS_LEN=topk_length is not None,
        HAS_SINK=attn_sink is not None,
        D_ROPE=head_dim - VALUE_DIM,
        DV=VALUE_DIM,
    )
    return out, lse, args, constexprs
