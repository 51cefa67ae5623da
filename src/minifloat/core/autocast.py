"""Switching torch.autocast off, on any device (including "meta", which has no autocast): for the fp32 islands and
for kernels that must run in the dtype they were given (the emulated FP8 GEMMs); and the precision of CUDA's fp32
matmuls for a training run (`cuda_fp32_matmuls`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# Which device types have torch.autocast, asked once per type outside any compiled region: dynamo (torch 2.11) cannot
# trace torch.amp.is_autocast_available, and a fullgraph compile of a model calling it failed. A plain dict read is a
# constant to dynamo once the entry exists; the common types are filled in at import.
_AVAILABLE: dict[str, bool] = {}


def has_autocast(device_type: str) -> bool:
    """Whether torch.autocast exists for `device_type` ("cpu", "cuda", ...; False for "meta")."""
    known = _AVAILABLE.get(device_type)
    if known is None:
        try:
            known = bool(torch.amp.is_autocast_available(device_type))
        except RuntimeError:  # a device type this torch does not know
            known = False
        _AVAILABLE[device_type] = known
    return known


for _device_type in ("cpu", "cuda", "meta", "xpu", "mps"):
    has_autocast(_device_type)


def autocast_device(device_type) -> str:
    """The device type of `device_type` ("cuda:0" -> "cuda") for torch.autocast; ValueError naming the fix for one
    without autocast ("meta" passes: torch.autocast accepts it and does nothing)."""
    base = device_type.partition(":")[0] if isinstance(device_type, str) else None
    if base is None or not (base == "meta" or has_autocast(base)):
        known = [t for t in ("cpu", "cuda", "xpu", "mps") if has_autocast(t)]
        raise ValueError(f"device_type must be a device type with torch.autocast (as tensor.device.type gives it: "
                         f"{', '.join(known)}, ...), got {device_type!r}")
    return base


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context that disables torch.autocast for `device_type`, or does nothing where autocast does not exist."""
    if has_autocast(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype torch.autocast computes x's device's matmuls in, or x's dtype (no autocast there: also meta)."""
    if has_autocast(x.device.type) and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


FP32_MATMUL_PRECISIONS = ("tf32", "ieee")


@contextlib.contextmanager
def cuda_fp32_matmuls(precision: str) -> Iterator[None]:
    """CUDA's float32 matmuls in `precision` inside the block, as they were after it. "tf32": on TF32 tensor cores
    (inputs rounded to 10 mantissa bits, bfloat16 has 7; float32 accumulation and output), about 8× the rate of
    "ieee" (float32 products) on an H100. Through torch.backends.cuda.matmul.fp32_precision (torch 2.9+; the legacy
    allow_tf32 on older torch). The CPU's matmuls are not affected."""
    if precision not in FP32_MATMUL_PRECISIONS:
        raise ValueError(f"precision must be one of {FP32_MATMUL_PRECISIONS}, got {precision!r}")
    knob = torch.backends.cuda.matmul
    name, value = ("fp32_precision", precision) if hasattr(knob, "fp32_precision") else \
        ("allow_tf32", precision == "tf32")
    old = getattr(knob, name)
    setattr(knob, name, value)
    try:
        yield
    finally:
        setattr(knob, name, old)
