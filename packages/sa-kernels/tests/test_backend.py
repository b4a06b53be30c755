"""sa_kernels.backend: the one home of the GPU generation and of Triton's availability."""

import inspect

import pytest
import torch

import sa_kernels
from sa_kernels import backend
from sa_kernels.backend import device_capability, resolve_backend, triton_unavailable_reason


@pytest.fixture
def fake_gpu(monkeypatch):
    """A driver that reports compute capability (9, 0) for device 0 and counts the questions."""
    asked = []

    def capability(index):
        asked.append(index)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    backend._cuda_capability.cache_clear()
    yield asked
    backend._cuda_capability.cache_clear()


def test_device_capability_is_none_off_cuda():
    for device in ("cpu", torch.device("cpu"), torch.zeros(1), "meta"):
        assert device_capability(device) is None


def test_device_capability_takes_every_spelling_of_a_device_and_asks_the_driver_once(fake_gpu):
    spellings = (0, None, "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0))
    assert all(device_capability(device) == (9, 0) for device in spellings)
    assert fake_gpu == [0]  # one question for device 0, whichever spelling asked


def test_triton_unavailable_reason_names_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = triton_unavailable_reason(torch.device("cpu"))
    assert reason is not None and "on cpu tensors needs TRITON_INTERPRET=1" in reason
    assert triton_unavailable_reason(torch.device("cuda", 0)) is None
    with pytest.raises(RuntimeError, match=r"op: backend='triton' on \['cpu'\] tensors needs"):
        resolve_backend("op", "triton", torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_unavailable_reason(torch.device("cpu")) is None
    assert resolve_backend("op", "triton", torch.zeros(1)) == "triton"


def test_every_public_op_takes_backend_keyword_only_defaulting_to_auto():
    ops = [getattr(sa_kernels, name) for name in sa_kernels.__all__]
    with_backend = [op for op in ops if "backend" in inspect.signature(op).parameters]
    assert len(with_backend) >= 12  # every op but the mask builder
    for op in with_backend:
        parameter = inspect.signature(op).parameters["backend"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, op.__name__
        assert parameter.default == "auto", op.__name__


def test_cuda_matmuls_use_tf32_follows_both_precision_apis() -> None:
    """The legacy `set_float32_matmul_precision` and the `fp32_precision` API, read without the
    mixed-API error `allow_tf32` raises once the newer API has set TF32."""
    from sa_kernels.backend import cuda_matmuls_use_tf32

    matmul = torch.backends.cuda.matmul
    saved_legacy = torch.get_float32_matmul_precision()
    saved = (torch.backends.fp32_precision, matmul.fp32_precision)
    try:
        torch.set_float32_matmul_precision("highest")
        assert not cuda_matmuls_use_tf32()
        torch.set_float32_matmul_precision("high")
        assert cuda_matmuls_use_tf32()
        torch.set_float32_matmul_precision("highest")
        matmul.fp32_precision = "tf32"
        assert cuda_matmuls_use_tf32()
        matmul.fp32_precision = "none"
        torch.backends.fp32_precision = "tf32"  # inherited by the CUDA matmuls
        assert cuda_matmuls_use_tf32()
    finally:
        torch.set_float32_matmul_precision(saved_legacy)
        torch.backends.fp32_precision, matmul.fp32_precision = saved
