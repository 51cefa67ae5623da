"""How close a low-precision tensor is to its reference."""

from __future__ import annotations

import math

import torch


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10·log10(Σx² / Σ(x-x̂)²) in dB, computed in float64."""
    if not (isinstance(reference, torch.Tensor) and isinstance(approx, torch.Tensor)):
        raise TypeError(f"sqnr_db compares two tensors, got {type(reference).__name__} and {type(approx).__name__}")
    if reference.shape != approx.shape:
        raise ValueError(f"sqnr_db compares tensors of one shape, got {tuple(reference.shape)} (reference) and "
                         f"{tuple(approx.shape)} (approx)")
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf
