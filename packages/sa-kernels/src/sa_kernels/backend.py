"""Backend choice and argument checks shared by every op (public: sa-mla and sa-routing dispatch through it too).

CUDA tensors run Triton, CPU tensors run the reference.

`backend="triton"` on CPU tensors runs the same kernels through Triton's interpreter, which needs
`TRITON_INTERPRET=1` in the environment before Triton compiles anything (the CPU test sessions set it).
"""

import functools
import importlib.util
import math
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "reference"]


def triton_interpret() -> bool:
    """True when Triton kernels run through the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (for launches that size their grid by them)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def cuda_matmuls_use_tf32() -> bool:
    """Whether PyTorch's FP32 CUDA matmuls may run in TF32: `torch.backends.cuda.matmul.fp32_precision`
    is "tf32" (set directly, inherited from `torch.backends.fp32_precision`, or by
    `torch.set_float32_matmul_precision("high" / "medium")`). Read through the `fp32_precision` API,
    which, unlike `allow_tf32`, answers whichever of the two APIs set it."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


DeviceLike = torch.device | torch.Tensor | str | int | None


def device_capability(device: DeviceLike) -> tuple[int, int] | None:
    """The compute capability `(major, minor)` of the CUDA device `device` names, asked of the driver
    once per device (dispatch checks it on every call); None for a device that is not CUDA.

    The one place the GPU generation is read. `device`: a CUDA device index, a `torch.device` or
    device string, or a tensor (its device); an index-less CUDA device or None is the current one.
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    if device is None or isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        index = device.index
    if index is None:
        index = torch.cuda.current_device()
    return _cuda_capability(index)


@functools.cache
def _cuda_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def gluon_module(name: str):
    """The Gluon kernels module `name`, imported once, or None where this Triton has no Gluon or
    lacks a name the module uses (the caller then keeps to its Triton kernels). Dispatch asks on
    every call; a failed import is not cached by Python, so it is cached here."""
    try:
        return importlib.import_module(name)
    except (ImportError, AttributeError):
        return None


@functools.cache
def has_triton() -> bool:
    """Whether the triton package is installed (looked up once per process)."""
    return importlib.util.find_spec("triton") is not None


def triton_unavailable_reason(device: torch.device, *, named: str | None = None) -> str | None:
    """None when Triton kernels can run on tensors of `device` (CUDA, or any other device under
    Triton's interpreter); otherwise why not, worded to follow "backend='<name>'" (the device is
    called `named`, default `str(device)`)."""
    if not has_triton():
        return "needs the triton package, which is not installed"
    if device.type != "cuda" and not triton_interpret():
        return (
            f"on {named or device} tensors needs TRITON_INTERPRET=1 (Triton's interpreter); use "
            "CUDA tensors or backend='reference'"
        )
    return None


def resolve_backend(
    op: str, backend: str, *tensors: torch.Tensor, compiled_reference: bool = False
) -> Literal["triton", "reference"]:
    """Pick `"triton"` or `"reference"` for `op`, or raise saying why the requested one cannot run.

    auto: Triton when every tensor is on CUDA and Triton imports, the reference on CPU. With
    `compiled_reference` (ops whose PyTorch reference Inductor fuses as fast as the kernel: the
    norms, `clamped_swiglu`), also the reference while torch.compile traces: a hand-written Triton
    launch inside a traced graph breaks it on symbolic shapes.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"{op}: backend must be 'auto', 'triton' or 'reference'; got {backend!r}")
    devices = {t.device.type for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device; got {sorted(devices)}")
    on_cuda = devices == {"cuda"}
    if backend == "reference":
        return "reference"
    if backend == "auto":
        if compiled_reference and torch.compiler.is_compiling():
            return "reference"
        return "triton" if on_cuda and has_triton() else "reference"
    device = torch.device(next(iter(devices), "cpu"))
    reason = triton_unavailable_reason(device, named=str(sorted(devices)))
    if reason is not None:
        raise RuntimeError(f"{op}: backend='triton' {reason}")
    return "triton"


def check_eps(op: str, eps: object) -> None:
    """Raise ValueError naming `op` unless `eps` is a finite, non-negative real number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"{op}: eps must be a finite, non-negative float; got {eps!r}")


def check_out(
    op: str,
    out: object,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    dtype_name: str | None = None,
    padded_rows: bool = False,
) -> None:
    """Raise ValueError naming `op` unless `out` (an optional output buffer) is None or a contiguous
    `dtype` tensor of `shape` on `device`; the message calls the dtype `dtype_name` (default `str(dtype)`).
    `padded_rows`: any strides are accepted but a last-dim stride of 1 (rows may be padded)."""
    if out is None:
        return

    def laid_out(t: torch.Tensor) -> bool:
        if not padded_rows:
            return t.is_contiguous()
        if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            return False
        # no two elements share memory: each dim's stride clears the extent of the smaller ones
        extent = 1
        for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim())):
            if size > 1:
                if stride < extent:
                    return False
                extent = stride * size
        return True

    if (
        isinstance(out, torch.Tensor)
        and out.shape == shape
        and out.dtype == dtype
        and out.device == device
        and laid_out(out)
    ):
        return
    what = (
        "tensor with last-dim stride 1 and no overlapping elements"
        if padded_rows
        else "contiguous tensor"
    )
    got = (
        f"{tuple(out.shape)} {out.dtype} on {out.device}"
        + ("" if laid_out(out) else f" with strides {out.stride()}")
        if isinstance(out, torch.Tensor)
        else type(out).__name__
    )
    raise ValueError(
        f"{op}: out must be a {what} ({dtype_name or dtype}, shape {shape}, on {device}); got {got}"
    )
