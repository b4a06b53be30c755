"""Launch configs for the sparse MLA Triton kernels, with a fallback when a config does not fit the GPU."""

from dataclasses import dataclass

import triton

from sa_kernels.backend import triton_interpret
from sa_mla.triton.unchained import unchain_dots

# Triton's interpreter multiplies bf16 dot operands as raw uint16 (Triton 3.9); the kernels widen them to
# FP32 first when interpreting (UPCAST), which the compiled kernels never do.


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and warps for one kernel launch."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int


def _head_block(heads: int) -> int:
    return 64 if heads > 32 else max(16, triton.next_power_of_2(heads))


def forward_configs(heads: int) -> list[LaunchConfig]:
    """Configs to try in order: the first that fits the GPU's shared memory and registers is kept."""
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = _head_block(heads)
    return [
        LaunchConfig(h, 64, 8, 3),
        LaunchConfig(h, 64, 8, 2),
        LaunchConfig(h, 32, 8, 2),
        LaunchConfig(16, 32, 4, 1),
    ]


def dq_configs(heads: int) -> list[LaunchConfig]:
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = _head_block(heads)
    return [LaunchConfig(h, 64, 8, 1), LaunchConfig(h, 32, 8, 1), LaunchConfig(16, 32, 4, 1)]


def dq_from_ds_configs(heads: int) -> list[LaunchConfig]:
    """dq = ds · k: one MMA per slot block, whose [BLOCK_H, 576] FP32 accumulator is the only large
    register tile (144 per thread at 64 heads, 8 warps); two stages of gathered keys (72 KiB each)."""
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = _head_block(heads)
    return [LaunchConfig(h, 64, 8, 2), LaunchConfig(h, 64, 8, 1), LaunchConfig(16, 32, 4, 1)]


def dkv_configs(heads: int) -> list[LaunchConfig]:
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    # 64 heads per program: half the atomic adds of 32 heads; the whole backward took 44.7 ms against
    # 54.2 on the H200 (2026-11-29, docs/benchmarks.md).
    h = _head_block(heads)
    return [LaunchConfig(h, 64, 4, 1), LaunchConfig(h, 32, 4, 1), LaunchConfig(16, 32, 4, 1)]


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
                UPCAST=triton_interpret(),
                UNCHAIN=unchain_dots(args[0].device),
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
        except triton.runtime.errors.OutOfResources as exc:
            error = exc
            continue
        if key is not None:
            _CHOSEN[key] = config
        return
    raise error
