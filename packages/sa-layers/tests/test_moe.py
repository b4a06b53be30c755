"""Step5MoE against a per-token reference loop written here (routing with the bias, top-k, weights, shared expert)."""

import io

import pytest
import torch
import torch.nn.functional as F

import sa_layers.moe as moe_module
from sa_layers import ClampedSwiGLUMLP
from sa_layers.moe import Step5MLP, Step5MoE


def swiglu_formula(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    activation = F.silu(gate)
    if limit > 0:
        activation = activation.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return activation * up


def mlp_formula(x, gate_weight, up_weight, down_weight, limit):
    return down_weight @ swiglu_formula(gate_weight @ x, up_weight @ x, limit)


def moe_reference(moe: Step5MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """One token at a time: experts by (biased score descending, id ascending), unbiased weights."""
    experts, shared = moe.experts, moe.shared_expert
    rows, selections = [], []
    for token in x.reshape(-1, x.shape[-1]):
        scores = torch.sigmoid(moe.router.weight @ token.to(moe.router.weight.dtype))
        biased = (scores + moe.expert_bias).tolist()
        chosen = sorted(range(moe.num_experts), key=lambda e: (-biased[e], e))[: moe.top_k]
        weights = scores[chosen]
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        weights = weights * moe.routed_scaling_factor
        out = mlp_formula(
            token,
            shared.gate_proj.weight,
            shared.up_proj.weight,
            shared.down_proj.weight,
            shared.limit,
        )
        for weight, e in zip(weights, chosen, strict=True):
            routed = mlp_formula(
                token, experts.gate_proj[e], experts.up_proj[e], experts.down_proj[e], experts.limit
            )
            out = out + weight.to(x.dtype) * routed
        rows.append(out)
        selections.append(chosen)
    return torch.stack(rows).reshape(x.shape), selections


def make_moe(dtype=torch.float32, seed=0, bias_scale=0.05, **overrides) -> Step5MoE:
    torch.manual_seed(seed)
    config = {
        "hidden_size": 16,
        "moe_intermediate_size": 8,
        "num_experts": 6,
        "top_k": 2,
        "swiglu_limit": 0.6,
        "shared_intermediate_size": 12,
    }
    config.update(overrides)
    moe = Step5MoE(**config, dtype=dtype)
    with torch.no_grad():
        moe.expert_bias.normal_(0, bias_scale)
        for p in moe.parameters():
            p.mul_(3)  # larger activations so that the SwiGLU clamps act on some entries
    return moe


def grads(moe: Step5MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    found = {name: p.grad.clone() for name, p in moe.named_parameters()}
    found["x"] = x.grad.clone()
    moe.zero_grad(set_to_none=True)
    x.grad = None
    return found


def assert_matches_reference(moe: Step5MoE, x: torch.Tensor, rtol: float, atol: float) -> None:
    upstream = torch.randn_like(x)
    out = moe(x)
    (out * upstream).sum().backward()
    got = grads(moe, x)
    expected, selections = moe_reference(moe, x)
    (expected * upstream).sum().backward()
    want = grads(moe, x)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)
    counts = torch.bincount(torch.tensor(selections).flatten(), minlength=moe.num_experts)
    assert torch.equal(moe.last_expert_counts, counts)


@pytest.mark.parametrize(
    ("dtype", "overrides"),
    [
        (torch.float32, {}),
        (torch.float64, {}),
        (torch.float64, {"routed_scaling_factor": 2.5, "top_k": 3}),
        (torch.float64, {"norm_topk_prob": False, "swiglu_limit": 0.0}),
        (torch.float32, {"top_k": 6, "shared_swiglu_limit": 2.0}),
    ],
    ids=["fp32", "fp64", "fp64-top3-scaled", "fp64-unnormalised-no-clamp", "fp32-all-experts"],
)
def test_moe_matches_the_reference_loop_forward_and_backward(dtype, overrides):
    moe = make_moe(dtype, **overrides)
    x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
    tolerance = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10)}[dtype]
    assert_matches_reference(moe, x, *tolerance)


def test_moe_input_gradient_passes_gradcheck():
    moe = make_moe(torch.float64, hidden_size=8, moe_intermediate_size=4, top_k=3)
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(moe, (x,), eps=1e-6, atol=1e-8)


def test_expert_bias_changes_the_selection_but_not_the_combine_weights():
    moe = make_moe(torch.float64, norm_topk_prob=False, bias_scale=0.0)
    x = torch.randn(9, 16, dtype=torch.float64)
    scores = torch.sigmoid(x @ moe.router.weight.T)
    unbiased_experts, _ = moe.route(x)
    favourite = int(scores.mean(0).argmin())
    with torch.no_grad():
        moe.expert_bias[favourite] = 10.0  # every token now selects the least-liked expert
    experts, weights = moe.route(x)
    assert (experts[:, 0] == favourite).all()
    assert not (unbiased_experts == favourite).any(dim=1).all()
    # the weights are the selected sigmoid scores without the bias
    torch.testing.assert_close(weights, scores.gather(1, experts), rtol=0, atol=0)


def test_ties_in_router_scores_go_to_the_lowest_expert_id():
    moe = make_moe(torch.float32, top_k=3, bias_scale=0.0)
    with torch.no_grad():
        moe.router.weight.zero_()  # every score is sigmoid(0) = 0.5
    x = torch.randn(4, 16)
    experts, weights = moe.route(x)
    assert experts.tolist() == [[0, 1, 2]] * 4
    torch.testing.assert_close(weights, torch.full((4, 3), 1 / 3))
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.25, 0.25, 0.0, 0.25, 0.25]))
    experts, weights = moe.route(x)
    assert experts.tolist() == [[1, 2, 4]] * 4
    torch.testing.assert_close(weights, torch.full((4, 3), 1 / 3))
    assert_matches_reference(moe, x.requires_grad_(), 1e-5, 1e-5)


def test_experts_without_tokens_get_zero_counts_and_zero_gradients():
    moe = make_moe(torch.float64, num_experts=8)
    with torch.no_grad():
        moe.expert_bias[[0, 5]] = -10.0  # never selected
    x = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    moe(x).square().sum().backward()
    assert moe.last_expert_counts[[0, 5]].tolist() == [0, 0]
    assert int(moe.last_expert_counts.sum()) == 12 * moe.top_k
    for name in ("gate_proj", "up_proj", "down_proj"):
        grad = getattr(moe.experts, name).grad
        assert grad[[0, 5]].count_nonzero() == 0
        assert grad[[1, 2, 3, 4, 6, 7]].abs().amax(dim=(1, 2)).min() > 0
    moe.zero_grad(set_to_none=True)
    x.grad = None
    assert_matches_reference(moe, x, 1e-10, 1e-10)


def grouped_mm_refusal_on(device: str, dtype: torch.dtype) -> str | None:
    probe = make_moe(dtype)
    return probe.experts.grouped_mm_refusal(torch.device(device), dtype)


def assert_grouped_matches_loop(device: str, dtype: torch.dtype, rtol: float, atol: float) -> None:
    loop = make_moe(torch.float32, expert_backend="loop", num_experts=8, hidden_size=32).to(
        device, dtype
    )
    grouped = make_moe(torch.float32, expert_backend="grouped_mm", num_experts=8, hidden_size=32)
    grouped.to(device, dtype).load_state_dict(loop.state_dict())
    with torch.no_grad():
        for moe in (loop, grouped):
            moe.expert_bias[[2, 6]] = -10.0  # two experts without tokens
    x = torch.randn(3, 7, 32, device=device, dtype=dtype)
    upstream = torch.randn_like(x)
    results = []
    for moe in (loop, grouped):
        x_leaf = x.clone().requires_grad_()
        out = moe(x_leaf)
        (out * upstream).sum().backward()
        results.append((out, grads(moe, x_leaf)))
    assert grouped.expert_path(x.device, dtype) == "grouped_mm"
    assert loop.expert_path(x.device, dtype) == "loop"
    (out_loop, grads_loop), (out_grouped, grads_grouped) = results
    torch.testing.assert_close(out_grouped, out_loop, rtol=rtol, atol=atol)
    for name, grad in grads_loop.items():
        torch.testing.assert_close(grads_grouped[name], grad, rtol=rtol, atol=atol, msg=name)
    assert grads_grouped["experts.gate_proj"][[2, 6]].count_nonzero() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_path_matches_the_loop_path_on_cpu(dtype):
    refusal = grouped_mm_refusal_on("cpu", dtype)
    if refusal is not None:
        pytest.skip(f"torch._grouped_mm does not run on CPU here: {refusal}")
    tolerance = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    assert_grouped_matches_loop("cpu", dtype, *tolerance)


def test_grouped_mm_probe_at_a_first_forward_under_inference_mode_still_passes(monkeypatch):
    if grouped_mm_refusal_on("cpu", torch.float32) is not None:
        pytest.skip("torch._grouped_mm does not run on CPU here")
    probes = {}
    monkeypatch.setattr(moe_module, "_GROUPED_MM_PROBES", probes)
    moe = make_moe(expert_backend="grouped_mm")
    x = torch.randn(4, 16)
    with torch.inference_mode():
        out = moe(x)
    assert probes == {("cpu", None, torch.float32): None}
    moe.expert_backend = "loop"
    torch.testing.assert_close(out, moe(x), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_grouped_mm_path_matches_the_loop_path_in_bf16_on_cuda():
    refusal = grouped_mm_refusal_on("cuda", torch.bfloat16)
    assert refusal is None, refusal
    assert_grouped_matches_loop("cuda", torch.bfloat16, 2e-2, 2e-2)


@pytest.mark.gpu
def test_auto_backend_runs_grouped_mm_on_sm90_without_host_synchronisation():
    moe = make_moe(torch.bfloat16, hidden_size=64, moe_intermediate_size=32, num_experts=8)
    moe.cuda().train()
    x = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    expected = "grouped_mm" if torch.cuda.get_device_capability()[0] == 9 else "loop"
    assert moe.expert_path(x.device, x.dtype) == expected  # the one-time probe runs here
    if expected != "grouped_mm":
        pytest.skip("the auto backend picks torch._grouped_mm on sm90 only")
    moe(x).sum().backward()  # warm-up: Triton compiles clamped_swiglu
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_three_dimensional_input_equals_the_flattened_call():
    moe = make_moe()
    x = torch.randn(3, 4, 16)
    out = moe(x)
    assert out.shape == (3, 4, 16)
    torch.testing.assert_close(out, moe(x.reshape(12, 16)).reshape(3, 4, 16), rtol=0, atol=0)


def test_empty_input_gives_empty_output_and_zero_counts():
    moe = make_moe()
    out = moe(torch.randn(2, 0, 16))
    assert out.shape == (2, 0, 16)
    assert moe.last_expert_counts.tolist() == [0] * 6


def test_state_dict_round_trip_keeps_expert_bias_and_outputs():
    moe = make_moe(bias_scale=0.3)
    moe.train()
    moe(torch.randn(5, 16))
    buffer = io.BytesIO()
    torch.save(moe.state_dict(), buffer)
    assert "expert_bias" in moe.state_dict()
    assert "pending_expert_counts" not in moe.state_dict()
    restored = make_moe(seed=1, bias_scale=0.0)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert torch.equal(restored.expert_bias, moe.expert_bias)
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(restored(x), moe(x), rtol=0, atol=0)


def test_bf16_module_keeps_the_router_and_bias_fp32_without_rounding():
    moe = make_moe(torch.float32, bias_scale=0.1)
    router, bias = moe.router.weight.detach().clone(), moe.expert_bias.clone()
    moe.to(torch.bfloat16)
    assert moe.experts.gate_proj.dtype == moe.shared_expert.up_proj.weight.dtype == torch.bfloat16
    assert torch.equal(moe.router.weight, router) and moe.router.weight.dtype == torch.float32
    assert torch.equal(moe.expert_bias, bias) and moe.expert_bias.dtype == torch.float32
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    assert moe(x).dtype == torch.bfloat16
    _, weights = moe.route(x.reshape(6, 16))
    assert weights.dtype == torch.float32


def test_training_forwards_accumulate_counts_and_the_bias_update_is_a_sign_step():
    moe = make_moe(num_experts=4, top_k=1, bias_scale=0.0)
    moe.train()
    total = torch.zeros(4, dtype=torch.int64)
    for _ in range(2):
        moe(torch.randn(6, 16))
        total += moe.last_expert_counts
    moe.eval()
    moe(torch.randn(6, 16))  # evaluation forwards are not counted
    assert torch.equal(moe.pending_expert_counts, total)
    moe.update_expert_bias(0.01)
    expected = 0.01 * torch.sign(total.float().mean() - total.float())
    torch.testing.assert_close(moe.expert_bias, expected, rtol=0, atol=0)
    assert moe.pending_expert_counts.count_nonzero() == 0
    moe.update_expert_bias(0.5, counts=torch.tensor([3, 1, 1, 3]))
    torch.testing.assert_close(moe.expert_bias, expected + torch.tensor([-0.5, 0.5, 0.5, -0.5]))


def test_step5_mlp_is_the_clamped_swiglu_mlp():
    assert Step5MLP is ClampedSwiGLUMLP


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"hidden_size": 0}, ValueError, "hidden_size must be >= 1"),
        ({"moe_intermediate_size": 2.0}, TypeError, "moe_intermediate_size must be an int"),
        ({"num_experts": True}, TypeError, "num_experts must be an int"),
        ({"top_k": 7}, ValueError, "top_k must be <= num_experts"),
        ({"top_k": 0}, ValueError, "top_k must be >= 1"),
        ({"shared_intermediate_size": 0}, ValueError, "shared_intermediate_size must be >= 1"),
        ({"swiglu_limit": float("nan")}, ValueError, "swiglu_limit must not be NaN"),
        ({"routed_scaling_factor": 0.0}, ValueError, "routed_scaling_factor must be a finite"),
        ({"norm_topk_prob": 1}, TypeError, "norm_topk_prob must be a bool"),
        ({"expert_backend": "triton"}, ValueError, "expert_backend must be one of"),
    ],
    ids=lambda value: str(value)[:40] if isinstance(value, dict) else "",
)
def test_bad_configuration_raises_naming_the_argument(overrides, error, message):
    with pytest.raises(error, match=f"Step5MoE: {message}"):
        make_moe(**overrides)


def test_bad_inputs_raise_naming_the_argument():
    moe = make_moe()
    with pytest.raises(
        ValueError, match=r"Step5MoE: x must be \[\.\.\., hidden_size=16\]; got \(4, 15\)"
    ):
        moe(torch.randn(4, 15))
    with pytest.raises(
        TypeError, match=r"Step5MoE: x must have the experts' dtype \(torch.float32\)"
    ):
        moe(torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="Step5MoE: x must be a tensor"):
        moe([0.0] * 16)
    with pytest.raises(ValueError, match="update_expert_bias: rate must be a finite float >= 0"):
        moe.update_expert_bias(-1.0)
    with pytest.raises(ValueError, match=r"update_expert_bias: counts must be \[num_experts=6\]"):
        moe.update_expert_bias(0.1, counts=torch.ones(5))


def test_forced_grouped_mm_where_it_cannot_run_raises_with_the_reason():
    moe = make_moe(hidden_size=6, expert_backend="grouped_mm")  # 6 fp32 = 24 bytes per row
    with pytest.raises(RuntimeError, match=r"grouped_mm' cannot run: .*hidden_size=6"):
        moe(torch.randn(3, 6))
