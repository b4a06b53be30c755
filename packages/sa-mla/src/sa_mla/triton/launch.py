"""Launch configs for the sparse MLA Triton kernels, with a fallback when a config does not fit the GPU."""

from dataclasses import dataclass

import triton

from sa_kernels.backend import triton_interpret

# Triton's interpreter multiplies bf16 dot operands as raw uint16 (Triton 3.9); the kernels widen them to
# FP32 first when interpreting (UPCAST), which the compiled kernels never do.


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and warps for one kernel launch."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    # dq only: > 1 runs the split dq kernel (grid axis 2 over DV / dv_split value dims, scores
    # recomputed per slice). Opt-in through the private config argument; no default uses it.
    dv_split: int = 1


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


def dkv_configs(heads: int) -> list[LaunchConfig]:
    if triton_interpret():
        return [LaunchConfig(max(16, min(64, triton.next_power_of_2(heads))), 16, 4, 1)]
    h = min(32, _head_block(heads))
    return [LaunchConfig(h, 64, 4, 1), LaunchConfig(h, 32, 4, 1), LaunchConfig(16, 32, 4, 1)]


# Spill-free candidates for the benchmark sweep (issue 6), not defaults until timed on the H200. Figures:
# ptxas-blackwell (CUDA 13.4) for sm_90a on Triton 3.9's PTX at H 128, D 576, top-k 2048, bf16, sink on;
# "regs / spill stores/loads B" with plain `-v`, then with Triton's `-lineinfo --regAllocOptLevel=2`.
# The defaults above spill: forward (64, 64, 8, 3) 255 regs, 164/156 B (252/248 B); dq (64, 64, 8, 1)
# 255 regs, 1000/1380 B (1312/1664 B). The H200 runs Triton 3.6, whose PTX may allocate differently.
# A dv_split of n recomputes the scores n times: dq kernel FLOPs x (1 + 0.65 (n - 1)) at D 576.
FORWARD_SPILL_FREE_CANDIDATES = [
    LaunchConfig(32, 64, 8, 3),  # 179 regs, 0/0 B (179, 0/0 B); 115 456 B shared
    LaunchConfig(32, 128, 8, 2),  # 202 regs, 0/0 B (198, 0/0 B); 193 024 B shared
]
DQ_SPILL_FREE_CANDIDATES = [
    LaunchConfig(32, 128, 8, 1, dv_split=2),  # 236 regs, 0/0 B (230, 0/0 B); 159 744 B shared
    LaunchConfig(32, 128, 8, 1, dv_split=4),  # 230 regs, 0/0 B (222, 0/0 B); 126 976 B shared
    LaunchConfig(64, 128, 8, 1, dv_split=4),  # 250 regs, 0/0 B (250, 0/0 B); 204 800 B shared
    LaunchConfig(16, 128, 8, 1, dv_split=2),  # 226 regs, 0/0 B (218, 0/0 B); 120 832 B shared
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
                UPCAST=triton_interpret(),
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
