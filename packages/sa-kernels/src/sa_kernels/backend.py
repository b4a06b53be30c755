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


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once (kernel dispatch checks it on every call)."""
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


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(
    op: str, backend: str, *tensors: torch.Tensor
) -> Literal["triton", "reference"]:
    """Pick `"triton"` or `"reference"` for `op`, or raise saying why the requested one cannot run.

    auto: Triton when every tensor is on CUDA and Triton imports, the reference on CPU.
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
        return "triton" if on_cuda and has_triton() else "reference"
    if not has_triton():
        raise RuntimeError(
            f"{op}: backend='triton' needs the triton package, which is not installed"
        )
    if not on_cuda and not triton_interpret():
        raise RuntimeError(
            f"{op}: backend='triton' on {sorted(devices)} tensors needs TRITON_INTERPRET=1 "
            "(Triton's interpreter); use CUDA tensors or backend='reference'"
        )
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
