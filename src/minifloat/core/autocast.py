"""Switching torch.autocast off, on any device (including "meta", which has no autocast): for the fp32 islands and
for kernels that must run in the dtype they were given (the emulated FP8 GEMMs)."""

from __future__ import annotations

import contextlib

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
