"""Switching torch.autocast off around the fp32 islands, on any device (including "meta", which has no autocast)."""

from __future__ import annotations

import contextlib

import torch


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context that disables torch.autocast for `device_type`, or does nothing where autocast does not exist."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
