"""The Triton path against the oracle: small shapes through the interpreter on CPU, real shapes on CUDA."""

from dataclasses import replace

import pytest
import torch
from mla_cases import errors_against_oracle, random_problem, relative_error

from sa_mla import sparse_mla_attention, sparse_mla_reference, sparse_mla_triton
from sa_mla.sparse_mla import lse_with_sink, select_backend, triton_backward
from sa_mla.sparse_mla.cudnn_flashmla import unavailable_reason
from sa_mla.sparse_mla.reference import sparse_mla_reference_with_lse
from sa_mla.sparse_mla.triton_forward import sparse_mla_forward

INTERPRETED = [
    pytest.param(
        dict(tokens=6, heads=5, head_dim=576, keys=40, width=21, sink=True, dtype=torch.float32),
        id="H5-D576-W21-sink-fp32",
    ),
    pytest.param(
        dict(tokens=5, heads=20, head_dim=512, keys=33, width=35, lengths=True),
        id="H20-D512-W35-len-bf16",
    ),
    pytest.param(
        dict(tokens=4, heads=70, head_dim=576, keys=25, width=9, sink=True, lengths=True),
        id="H70-D576-W9-sink-len-bf16",
    ),
]


@pytest.mark.parametrize("case", INTERPRETED)
def test_triton_interpreted_matches_oracle_forward_and_backward(case):
    p = random_problem(**case, seed=41)
    errors = errors_against_oracle(sparse_mla_triton, p)
    tolerance = 1e-5 if case.get("dtype") == torch.float32 else 1e-2
    assert all(e <= tolerance for e in errors.values()), errors


def test_triton_lse_is_natural_log_and_inf_for_empty_rows():
    p = random_problem(
        7, 3, 576, 30, 17, sink=True, dtype=torch.float32, seed=43, requires_grad=False
    )
    ids = p.topk_indices[:, 0].contiguous()
    out, lse = sparse_mla_forward(p.q, p.kv_latent[:, 0], ids, p.softmax_scale, None, p.attn_sink)
    expected_out, expected_lse = sparse_mla_reference_with_lse(*p.args(), attn_sink=p.attn_sink)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    assert torch.all(torch.isposinf(lse[p.empty_rows]))


def test_triton_counts_a_duplicated_id_once_per_slot_in_output_and_dkv():
    p = random_problem(3, 2, 512, 8, 4, invalid=False, dtype=torch.float32, seed=47)
    ids = p.topk_indices.clone()
    ids[:, :, :] = ids[:, :, :1]  # all four slots name one key: softmax weight 1 on it
    out = sparse_mla_triton(p.q, p.kv_latent, ids, p.softmax_scale)
    key = ids[:, 0, 0].long()
    torch.testing.assert_close(
        out, p.kv_latent[key, 0, :512].detach()[:, None, :].expand(3, 2, 512)
    )
    (dkv,) = torch.autograd.grad(out.sum(), [p.kv_latent])
    expected = torch.zeros(8, 512)
    expected.index_add_(0, key, torch.full((3, 512), 2.0))  # two heads, weights sum to one per head
    torch.testing.assert_close(dkv[:, 0, :512], expected, rtol=1e-5, atol=1e-5)


def test_triton_accepts_int64_ids_and_lengths_and_strided_q():
    p = random_problem(
        5, 4, 576, 20, 10, lengths=True, dtype=torch.float32, seed=53, requires_grad=False
    )
    wide = torch.randn(5, 8, 576)[:, ::2]
    wide.copy_(p.q)
    out = sparse_mla_triton(
        wide, p.kv_latent, p.topk_indices.long(), p.softmax_scale, p.topk_length.long()
    )
    expected, _ = sparse_mla_reference_with_lse(*p.args())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _backward_in_chunks(p, buffer_bytes, monkeypatch):
    """(dq, dkv, delta) of the Triton backward on `p` with its score buffers capped at
    `buffer_bytes`, and the delta expected (rowsum of dO * O in FP32)."""
    q, kv, ids = p.q.detach(), p.kv_latent.detach()[:, 0], p.topk_indices[:, 0].contiguous()
    out, lse = sparse_mla_forward(q, kv, ids, p.softmax_scale, p.topk_length, p.attn_sink)
    gen = torch.Generator(device=out.device).manual_seed(5)
    dout = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
    lse_total = lse_with_sink(lse, p.attn_sink)
    monkeypatch.setattr(triton_backward, "SCORE_BUFFER_BYTES", buffer_bytes)
    grads = triton_backward.sparse_mla_backward(
        q, kv, ids, p.softmax_scale, p.topk_length, dout, out, lse_total
    )
    return grads, (out.float() * dout.float()).sum(dim=-1)


def test_triton_dkv_reads_p_and_ds_written_for_a_smaller_dq_head_block_without_slots(monkeypatch):
    """dq in 16-head blocks, dkv in 32-head blocks, and heads 0-15 without any slot (sink +inf): the dq
    program of heads 0-15 must still write their p and ds (zeros), since the dkv program of heads
    0-31 reads them (the buffers are filled with NaN here, where `torch.empty` would leave whatever
    memory held)."""
    from sa_mla.sparse_mla.triton_launch import LaunchConfig

    p = random_problem(
        5, 32, 576, 40, 21, sink=True, dtype=torch.float32, seed=71, requires_grad=False
    )
    p.attn_sink[:16] = float("inf")
    real_empty = torch.empty

    def poisoned(*args, **kwargs):  # float buffers only (the marked ids are int32)
        buffer = real_empty(*args, **kwargs)
        return buffer.fill_(float("nan")) if buffer.is_floating_point() else buffer

    monkeypatch.setattr(triton_backward.torch, "empty", poisoned)
    q, kv, ids = p.q, p.kv_latent[:, 0], p.topk_indices[:, 0].contiguous()
    out, lse = sparse_mla_forward(q, kv, ids, p.softmax_scale, None, p.attn_sink)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    lse_total = lse_with_sink(lse, p.attn_sink)
    grads = {
        dq_heads: triton_backward.sparse_mla_backward(
            q,
            kv,
            ids,
            p.softmax_scale,
            None,
            dout,
            out,
            lse_total,
            LaunchConfig(dq_heads, 16, 4, 1),
            LaunchConfig(32, 16, 4, 1, 32),
        )
        for dq_heads in (16, 32)
    }
    assert torch.isfinite(grads[16][1]).all() and grads[32][1].abs().amax() > 0
    # dkv and dq to FP32 rounding: the interpreter's dots are the CPU's BLAS, whose sums over other
    # block shapes round differently on some CPUs (OpenBLAS's Haswell and Zen kernels)
    torch.testing.assert_close(grads[16][1], grads[32][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[16][0], grads[32][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "width"), [(70_000, 2048), (4, 2**25 + 2**20)], ids=["many-tokens", "wide-rows"]
)
def test_triton_grids_stay_within_cuda_limits(monkeypatch, tokens, width):
    """Grid y and z stop at 65535: 70 000 tokens never go on y or z (the grids' x axes hold them),
    and rows of 34M slots get slot ranges wide enough that at most 65535 cover a row (the dkv grid's
    y). Meta tensors, and a launcher that only records the grids."""
    from sa_mla.sparse_mla import triton_forward

    grids = []

    def record(kernel, key, configs, grid_of, *args, **constexprs):
        grids.append((kernel.fn.__name__, grid_of(configs[0])))

    monkeypatch.setattr(triton_forward, "_launch", record)
    monkeypatch.setattr(triton_backward, "_launch", record)
    heads = 128
    q = torch.empty(tokens, heads, 576, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(65_536, 576, device="meta", dtype=torch.bfloat16)
    ids = torch.empty(tokens, width, device="meta", dtype=torch.int32)
    stats = torch.empty(tokens, heads, device="meta")
    out = torch.empty(tokens, heads, 512, device="meta", dtype=torch.bfloat16)
    triton_forward.sparse_mla_forward(q, kv, ids, 0.1, None, None)
    triton_backward.sparse_mla_backward(q, kv, ids, 0.1, None, out, out, stats)
    names = {name for name, _ in grids}
    assert {
        "_sparse_mla_fwd_kernel",
        "_sparse_mla_bwd_dq_kernel",
        "_sparse_mla_bwd_dkv_kernel",
    } <= names
    for name, grid in grids:
        assert grid[0] < 2**31 and all(extent <= 65_535 for extent in grid[1:]), (name, grid)
    dkv_ranges = {grid[1] for name, grid in grids if name == "_sparse_mla_bwd_dkv_kernel"}
    assert max(dkv_ranges) > 1  # the slot ranges are on y (a test of the cap, not of nothing)


def test_triton_backward_in_token_chunks_equals_one_chunk(monkeypatch):
    """Chunks of 2 tokens, alternating between the two lanes (each lane's buffers reused by every
    other chunk): chunk edges at odd tokens, empty rows (1, 6) and short rows inside chunks."""
    tokens, heads, width = 7, 5, 19
    p = random_problem(
        tokens,
        heads,
        576,
        30,
        width,
        sink=True,
        lengths=True,
        dtype=torch.float32,
        seed=61,
        requires_grad=False,
    )
    token_bytes = 2 * width * heads * 4
    (dq_chunked, dkv_chunked, delta_chunked), delta = _backward_in_chunks(
        p, 2 * 2 * token_bytes, monkeypatch
    )
    (dq_whole, dkv_whole, delta_whole), _ = _backward_in_chunks(p, 1 << 30, monkeypatch)
    assert dq_whole.abs().amax() > 0 and dkv_whole.abs().amax() > 0
    torch.testing.assert_close(dq_chunked, dq_whole, rtol=0, atol=0)
    torch.testing.assert_close(dkv_chunked, dkv_whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(delta_chunked, delta_whole, rtol=0, atol=0)
    torch.testing.assert_close(delta_whole, delta, rtol=1e-5, atol=1e-5)
    assert torch.all(dq_whole[p.empty_rows] == 0)


def test_dkv_slot_ranges_must_be_whole_slot_blocks_and_fit_grid_y():
    from sa_mla.sparse_mla.triton_launch import LaunchConfig

    with pytest.raises(
        ValueError, match=r"slot_chunk must be a positive multiple of block_k \(16\)"
    ):
        LaunchConfig(16, 16, 4, 1, block_d=64, slot_chunk=24)
    config = LaunchConfig(16, 64, 4, 1, block_d=64, slot_chunk=128)
    wide = triton_backward._dkv_launch_config(config, 64, 2**25 + 2**20)
    assert wide.slot_chunk % 64 == 0 and -(-(2**25 + 2**20) // wide.slot_chunk) <= 65_535
    assert triton_backward._dkv_launch_config(config, 64, 2048).slot_chunk == 128
    assert triton_backward._dkv_launch_config(config, 64, 0).slot_chunk is None
    # Dim blocks stay powers of two however wide the config asks (the kernel masks dims past D).
    assert (
        triton_backward._dkv_launch_config(replace(config, block_d=4096), 576, 32).block_d == 1024
    )
    assert triton_backward._dkv_launch_config(replace(config, block_d=None), 576, 32).block_d == 64


def test_triton_backward_of_zero_tokens():
    p = random_problem(0, 4, 576, 20, 10, sink=True, dtype=torch.float32, seed=3)
    out = sparse_mla_triton(*p.args(), attn_sink=p.attn_sink)
    dq, dkv, dsink = torch.autograd.grad(out.sum(), [p.q, p.kv_latent, p.attn_sink])
    assert dq.shape == p.q.shape and not dkv.any() and not dsink.any()


@pytest.mark.gpu
def test_triton_backward_on_a_caller_stream_and_in_a_cuda_graph(monkeypatch):
    """Five chunks over the two lanes, run on the default stream, on a stream of the caller's, and
    captured in a CUDA graph and replayed: the same dq and delta, dkv up to FP32 atomic order."""
    p = random_problem(301, 16, 576, 2000, 256, sink=True, device="cuda", seed=5)
    q, kv, ids = p.q.detach(), p.kv_latent.detach()[:, 0], p.topk_indices[:, 0].contiguous()
    out, lse = sparse_mla_forward(q, kv, ids, p.softmax_scale, None, p.attn_sink)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    dout = dout.to(out.dtype)
    lse_total = lse_with_sink(lse, p.attn_sink)
    monkeypatch.setattr(triton_backward, "SCORE_BUFFER_BYTES", 2 * 64 * (2 * 256 * 16 * 2))
    run = lambda: triton_backward.sparse_mla_backward(
        q, kv, ids, p.softmax_scale, None, dout, out, lse_total
    )
    expected = run()
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        on_caller = run()
    torch.cuda.current_stream().wait_stream(caller)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    for got in (on_caller, captured):
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        assert relative_error(got[1], expected[1]) <= 1e-5
        torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)


GPU_CASES = [
    pytest.param(h, d, w, s, id=f"H{h}-D{d}-W{w}-{'sink' if s else 'nosink'}")
    for h in (16, 32, 64, 128)
    for d in (512, 576)
    for w, s in ((200, True), (1000, False))
]


@pytest.mark.gpu
@pytest.mark.parametrize("forward_kernel", ["auto", "portable"])
@pytest.mark.parametrize(("heads", "head_dim", "width", "sink"), GPU_CASES)
def test_triton_gpu_matches_oracle(heads, head_dim, width, sink, forward_kernel, monkeypatch):
    """`auto`: on Hopper the forward runs the Gluon kernel; `portable` keeps the portable forward
    covered on every GPU."""
    if forward_kernel == "portable":
        from sa_mla.sparse_mla import triton_forward

        monkeypatch.setattr(triton_forward, "hopper_forward_applies", lambda q, kv: False)
    p = random_problem(
        300, heads, head_dim, 3000, width, sink=sink, device="cuda", seed=heads + width
    )
    errors = errors_against_oracle(sparse_mla_triton, p)
    assert errors["out"] <= 5e-3 and errors["dq"] <= 1e-2 and errors["dkv"] <= 1e-2, errors
    assert errors.get("dsink", 0.0) <= 1e-2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 20, 200])
def test_triton_gpu_odd_head_counts_with_lengths_and_sink(heads):
    p = random_problem(
        129, heads, 576, 777, 333, sink=True, lengths=True, device="cuda", seed=heads
    )
    errors = errors_against_oracle(sparse_mla_triton, p)
    assert errors["out"] <= 5e-3 and errors["dq"] <= 1e-2 and errors["dkv"] <= 1e-2, errors
    # d_sink of one head is one sum of T signed terms (random dO): cancellation inflates its relative
    # error (bf16 outputs give ~2e-3 per term, ~2e-3 * sqrt(T) on the sum), so it is measured against
    # the size of its terms; with many heads the plain relative error is checked (1e-2, grid above).
    assert errors["dsink_vs_terms"] <= 1e-2, errors


@pytest.mark.gpu
def test_auto_backend_on_cuda_runs_a_fused_or_triton_path_matching_oracle():
    """`auto` takes the fused path where FlashMLA and the cuDNN frontend run, else Triton: the
    chosen path is checked against that rule and named in the failure message."""
    p = random_problem(200, 64, 576, 2000, 256, sink=True, device="cuda", seed=59)
    chosen = select_backend("auto", p.q, p.kv_latent, p.topk_indices)
    assert chosen == ("cudnn" if unavailable_reason(p.q.device) is None else "triton")
    errors = errors_against_oracle(sparse_mla_attention, p)
    assert (
        errors["out"] <= 5e-3
        and errors["dq"] <= 1e-2
        and errors["dkv"] <= 1e-2
        and errors["dsink"] <= 1e-2
    ), (chosen, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_triton_gpu_backward_in_token_chunks_equals_one_chunk(heads, monkeypatch):
    p = random_problem(
        333,
        heads,
        576,
        4000,
        700,
        sink=True,
        lengths=True,
        device="cuda",
        seed=heads + 3,
        requires_grad=False,
    )
    # 100 tokens per chunk, the chunks alternating between two streams (their dkv atomics
    # overlap, and each lane reuses its buffers): chunk edges inside the rows, a short last chunk.
    (dq_chunked, dkv_chunked, delta_chunked), delta = _backward_in_chunks(
        p, 2 * 100 * (2 * 700 * heads * 2), monkeypatch
    )
    (dq_whole, dkv_whole, delta_whole), _ = _backward_in_chunks(p, 1 << 30, monkeypatch)
    torch.testing.assert_close(dq_chunked, dq_whole, rtol=0, atol=0)
    assert relative_error(dkv_chunked, dkv_whole) <= 1e-5
    torch.testing.assert_close(delta_chunked, delta_whole, rtol=0, atol=0)
    torch.testing.assert_close(delta_whole, delta, rtol=1e-4, atol=1e-4)


def test_int64_ids_beyond_int32_are_invalid_not_wrapped():
    p = random_problem(5, 4, 576, 20, 10, dtype=torch.float32, seed=7, requires_grad=False)
    ids = p.topk_indices.long()
    ids[:, 0, -1] = 2**32 + 3  # would wrap to the valid id 3 as int32
    dropped = ids.masked_fill(ids >= p.kv_latent.shape[0], -1)
    expected = sparse_mla_reference(p.q, p.kv_latent, dropped, p.softmax_scale)
    torch.testing.assert_close(
        sparse_mla_reference(p.q, p.kv_latent, ids, p.softmax_scale), expected
    )
    torch.testing.assert_close(
        sparse_mla_triton(p.q, p.kv_latent, ids, p.softmax_scale), expected, rtol=1e-5, atol=1e-5
    )
