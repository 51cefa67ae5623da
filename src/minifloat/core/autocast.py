"""Switching torch.autocast off, on any device (including "meta", which has no autocast): for the fp32 islands and
for kernels that must run in the dtype they were given (the emulated FP8 GEMMs)."""

from __future__ import annotations

import contextlib

import torch


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context that disables torch.autocast for `device_type`, or does nothing where autocast does not exist."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype torch.autocast computes x's device's matmuls in, or x's dtype (no autocast there: also meta)."""
    if torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
