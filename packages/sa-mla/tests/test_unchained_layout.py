"""The 8-warp kernels' dots keep out of Triton's dot chains (see `sa_mla.sparse_mla.triton_chain_break`).

Compiled offline for sm_90 (no GPU needed), in a subprocess without TRITON_INTERPRET, which would hand
the compiler interpreted functions. The check reads the MMA layouts of the compiled kernels: a 64-row
dot laid out as a chain link has all 8 warps along its rows (`warpsPerCTA = [8, 1]`), which computes
every product twice on the H200; and the forward's gathered key tiles must still be loaded by
asynchronous copies (dots inside the chain break's branch would lose that pipelining).
"""

import json
import textwrap

import pytest
import torch

from sa_kernels.testing import run_without_interpreter

pytest.importorskip("triton")

_NO_SM90 = 77  # the subprocess's exit code when this Triton cannot compile for sm_90 at all

_COMPILE = textwrap.dedent(
    f"""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        sys.exit({_NO_SM90})
    from sa_mla.sparse_mla.triton_backward import _sparse_mla_bwd_dkv_kernel, _sparse_mla_bwd_dq_kernel
    from sa_mla.sparse_mla.triton_forward import _sparse_mla_fwd_kernel
    from sa_mla.sparse_mla.triton_launch import dkv_configs

    POINTERS = dict(
        Q="*bf16", KV="*bf16", OUT="*bf16", DOUT="*bf16", DQ="*bf16", IDX="*i32", TOPK_LEN="*i32", LENGTHS="*i32",
        SINK="*fp32", LSE="*fp32", LSE2="*fp32", DELTA="*fp32", P="*bf16", DS="*bf16",
        DKV="*fp32",
    )
    SCALARS = dict(scale="fp32", scale_log2="fp32")
    INTS = ("heads", "keys", "width", "t0")

    def mma_layouts(fn, const, num_stages, **options):
        signature = {{}}
        for name in fn.arg_names:
            if name in const:
                signature[name] = "constexpr"
            elif name in POINTERS or name in SCALARS:
                signature[name] = POINTERS.get(name) or SCALARS[name]
            elif name.startswith("stride") or name in INTS:
                signature[name] = "i32"
            else:
                raise SystemExit(f"unexpected kernel argument {{name!r}}: update this test")
        # As the launch specializes the goal shape's arguments: pointers, strides and sizes
        # divisible by 16 (all but the chunk's first token).
        aligned = {{
            (i,): [["tt.divisibility", 16]]
            for i, name in enumerate(fn.arg_names)
            if name not in const and name not in SCALARS and name != "t0"
        }}
        kernel = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=const, attrs=aligned),
            target=GPUTarget("cuda", 90, 32),
            options={{"num_warps": 8, "num_stages": num_stages, **options}},
        )
        ttgir = kernel.asm["ttgir"]
        return dict(
            layouts=[line for line in ttgir.splitlines() if line.startswith("#mma")],
            async_copies=ttgir.count("async_copy_global_to_local"),
        )

    blocks = dict(D_ROPE=64, DV=512, BLOCK_H=64, BLOCK_K=64, UPCAST=False, UNCHAIN=True)
    shipped = dkv_configs(128)[0]  # the dkv kernel as it ships: its stages and register cap
    dkv = dict(
        D=576, DV=512, BLOCK_H=shipped.block_h, BLOCK_K=shipped.block_k,
        BLOCK_D=shipped.block_d, SLOT_CHUNK=shipped.slot_chunk, UPCAST=False, UNCHAIN=True,
    )
    print(json.dumps({{
        "forward": mma_layouts(_sparse_mla_fwd_kernel, dict(blocks, HAS_LEN=False, HAS_SINK=True), 2),
        "dq": mma_layouts(_sparse_mla_bwd_dq_kernel, dict(blocks, DR=64), 1),
        "dkv": mma_layouts(
            _sparse_mla_bwd_dkv_kernel, dkv, shipped.num_stages, maxnreg=shipped.max_registers
        ),
    }}))
    """
)


@pytest.fixture(scope="module")
def compiled_layouts() -> dict:
    result = run_without_interpreter(_COMPILE, timeout=600)
    if result.returncode == _NO_SM90:
        pytest.skip("this Triton has no NVIDIA backend to compile for sm_90")
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["forward", "dq", "dkv"])
def test_64_row_dots_split_their_columns_between_the_warpgroups(compiled_layouts, kernel):
    layouts = compiled_layouts[kernel]["layouts"]
    assert layouts, f"no MMA layout in the compiled {kernel} kernel"
    assert all("warpsPerCTA = [8, 1]" not in line for line in layouts), layouts
    assert any("warpsPerCTA = [4, 2]" in line for line in layouts), layouts


def test_forward_key_tiles_are_loaded_by_asynchronous_copies(compiled_layouts):
    assert compiled_layouts["forward"]["async_copies"] > 0


def test_shipped_dkv_config_loads_its_p_and_ds_tiles_asynchronously(compiled_layouts):
    # The reason for its two stages (25.99 against 26.21 ms for one stage on the H200).
    assert compiled_layouts["dkv"]["async_copies"] > 0


@pytest.mark.parametrize(
    ("capability", "expected"), [((9, 0), True), ((8, 0), False), ((10, 0), False)]
)
def test_dots_are_unchained_only_on_hopper(monkeypatch, capability, expected):
    """Only where the duplicated scores were seen and the fix measured; CPU (the interpreter) never."""
    from sa_mla.sparse_mla import triton_chain_break

    monkeypatch.setattr(triton_chain_break, "device_capability", lambda index: capability)
    assert triton_chain_break.unchain_dots(torch.device("cuda", 0)) is expected
    assert triton_chain_break.unchain_dots(torch.device("cpu")) is False
