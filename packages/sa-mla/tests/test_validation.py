"""Every argument check of the four public functions, and the backend choice on a machine without CUDA."""

import pytest
import torch

from sa_mla import (
    cudnn_sparse_attention,
    is_cudnn_sparse_attention_available,
    sparse_mla,
    sparse_mla_attention,
    sparse_mla_reference,
    sparse_mla_triton,
)
from sa_mla.sparse_mla import select_backend

FUNCTIONS = {
    "cudnn_sparse_attention": cudnn_sparse_attention,
    "sparse_mla_triton": sparse_mla_triton,
    "sparse_mla_reference": sparse_mla_reference,
    "sparse_mla_attention": sparse_mla_attention,
}


def valid_arguments():
    tokens, heads, dim, keys, width = 4, 3, 576, 9, 5
    return dict(
        q=torch.randn(tokens, heads, dim).bfloat16(),
        kv_latent=torch.randn(keys, 1, dim).bfloat16(),
        topk_indices=torch.randint(-1, keys, (tokens, 1, width), dtype=torch.int32),
        softmax_scale=dim**-0.5,
        topk_length=torch.full((tokens,), width, dtype=torch.int32),
        all_rows_nonempty=False,
        valid_row_indices=None,
        attn_sink=torch.randn(heads),
    )


BAD = [
    ("q-not-tensor", dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ("q-int", dict(q=torch.ones(4, 3, 576, dtype=torch.int32)), TypeError, "q must be"),
    (
        "kv-dtype",
        dict(kv_latent=torch.randn(9, 1, 576)),
        TypeError,
        "kv_latent must have q's dtype",
    ),
    (
        "ids-float",
        dict(topk_indices=torch.zeros(4, 1, 5)),
        TypeError,
        "topk_indices must be torch.int32",
    ),
    ("scale-str", dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    ("scale-bool", dict(softmax_scale=True), TypeError, "softmax_scale must be a real number"),
    ("scale-zero", dict(softmax_scale=0.0), ValueError, "softmax_scale must be finite and > 0"),
    (
        "scale-negative",
        dict(softmax_scale=-0.1),
        ValueError,
        "softmax_scale must be finite and > 0",
    ),
    (
        "scale-nan",
        dict(softmax_scale=float("nan")),
        ValueError,
        "softmax_scale must be finite and > 0",
    ),
    (
        "rows-flag-not-bool",
        dict(all_rows_nonempty=1),
        TypeError,
        "all_rows_nonempty must be a bool",
    ),
    (
        "q-2d",
        dict(q=torch.randn(4, 576).bfloat16()),
        ValueError,
        "q must be [tokens, heads, head_dim]",
    ),
    (
        "head-dim-256",
        dict(q=torch.randn(4, 3, 256).bfloat16()),
        ValueError,
        "head_dim must be 512 or 576",
    ),
    (
        "kv-two-heads",
        dict(kv_latent=torch.randn(9, 2, 576).bfloat16()),
        ValueError,
        "kv_latent must be [keys >= 1, 1, 576]",
    ),
    (
        "kv-dim",
        dict(kv_latent=torch.randn(9, 1, 512).bfloat16()),
        ValueError,
        "kv_latent must be [keys >= 1, 1, 576]",
    ),
    (
        "kv-no-keys",
        dict(kv_latent=torch.randn(0, 1, 576).bfloat16()),
        ValueError,
        "kv_latent must be [keys >= 1, 1, 576]",
    ),
    (
        "ids-tokens",
        dict(topk_indices=torch.zeros(5, 1, 5, dtype=torch.int32)),
        ValueError,
        "topk_indices must be [4, 1, width]",
    ),
    (
        "ids-2d",
        dict(topk_indices=torch.zeros(4, 5, dtype=torch.int32)),
        ValueError,
        "topk_indices must be [4, 1, width]",
    ),
    (
        "ids-width-0",
        dict(topk_indices=torch.zeros(4, 1, 0, dtype=torch.int32)),
        ValueError,
        "at least one slot",
    ),
    ("length-float", dict(topk_length=torch.ones(4)), TypeError, "topk_length must be torch.int32"),
    (
        "length-shape",
        dict(topk_length=torch.ones(3, dtype=torch.int32)),
        ValueError,
        "topk_length must be [4]",
    ),
    (
        "sink-bf16",
        dict(attn_sink=torch.randn(3).bfloat16()),
        TypeError,
        "attn_sink must be torch.float32",
    ),
    ("sink-shape", dict(attn_sink=torch.randn(4)), ValueError, "attn_sink must be [3]"),
    (
        "rows-and-flag",
        dict(valid_row_indices=torch.tensor([0, 1]), all_rows_nonempty=True),
        ValueError,
        "exclusive",
    ),
    (
        "rows-float",
        dict(valid_row_indices=torch.tensor([0.0])),
        TypeError,
        "valid_row_indices must be torch.int32",
    ),
    (
        "rows-2d",
        dict(valid_row_indices=torch.zeros(2, 2, dtype=torch.int64)),
        ValueError,
        "valid_row_indices must be 1-D",
    ),
]


@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize(("case", "change", "error", "message"), BAD, ids=[b[0] for b in BAD])
def test_invalid_arguments_raise_naming_function_and_argument(name, case, change, error, message):
    arguments = {**valid_arguments(), **change}
    with pytest.raises(error, match=rf"^{name}: .*") as raised:
        FUNCTIONS[name](**arguments)
    assert message in str(raised.value)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the reason given where no CUDA device is visible"
)
def test_fused_path_without_cuda_or_runtimes_raises_runtime_error_with_reason():
    assert not is_cudnn_sparse_attention_available()
    with pytest.raises(RuntimeError, match=r"^cudnn_sparse_attention: cannot run: no CUDA device"):
        cudnn_sparse_attention(**valid_arguments())
    with pytest.raises(RuntimeError, match=r"^cudnn_sparse_attention: cannot run"):
        sparse_mla_attention(**valid_arguments(), backend="cudnn")


def test_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        sparse_mla_triton(**valid_arguments())


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match=r"^sparse_mla_attention: backend must be one of"):
        sparse_mla_attention(**valid_arguments(), backend="flash")


def test_backend_is_keyword_only():
    """As in `sparse_gqa_attention`: a ninth positional argument is refused, `backend=` is not."""
    arguments = valid_arguments()
    with pytest.raises(TypeError, match="positional argument"):
        sparse_mla_attention(*arguments.values(), "reference")
    sparse_mla_attention(**arguments, backend="reference")


def test_auto_on_cpu_runs_the_oracle(monkeypatch):
    arguments = valid_arguments()
    assert (
        select_backend("auto", arguments["q"], arguments["kv_latent"], arguments["topk_indices"])
        == "reference"
    )

    def fail(*args, **kwargs):
        raise AssertionError("auto on CPU must not run the Triton path")

    monkeypatch.setattr(sparse_mla, "_sparse_mla_triton", fail)
    torch.testing.assert_close(
        sparse_mla_attention(**arguments), sparse_mla_reference(**arguments), rtol=0, atol=0
    )


def test_reference_accepts_fp64_but_triton_and_fused_path_do_not():
    arguments = valid_arguments()
    arguments.update(
        q=arguments["q"].double(), kv_latent=arguments["kv_latent"].double(), attn_sink=None
    )
    assert sparse_mla_reference(**arguments).dtype == torch.float64
    for fn in (sparse_mla_triton, cudnn_sparse_attention):
        with pytest.raises(TypeError, match="q must be"):
            fn(**arguments)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_validates_once(backend, monkeypatch):
    calls = []
    check = sparse_mla.check_sparse_mla_arguments
    monkeypatch.setattr(
        sparse_mla,
        "check_sparse_mla_arguments",
        lambda *a, check=check, **k: calls.append(a[0]) or check(*a, **k),
    )
    sparse_mla_attention(**valid_arguments(), backend=backend)
    assert calls == ["sparse_mla_attention"]


@pytest.mark.parametrize("backend", ["triton", "cudnn"])
def test_attention_names_itself_when_q_dtype_does_not_suit_the_backend(backend):
    arguments = valid_arguments()
    arguments.update(
        q=arguments["q"].double(), kv_latent=arguments["kv_latent"].double(), attn_sink=None
    )
    with pytest.raises(TypeError, match=rf"^sparse_mla_attention: q must be .* the '{backend}'"):
        sparse_mla_attention(**arguments, backend=backend)
