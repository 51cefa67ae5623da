"""How close a low-precision tensor is to its reference."""

from __future__ import annotations

import math

import torch


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10·log10(Σx² / Σ(x-x̂)²) in dB, computed in float64: inf for no noise
    (or an infinite signal), -inf for no signal (or infinite noise, as a finite value decoded as inf), NaN where a
    NaN (or inf on both sides) leaves no ratio."""
    if not (isinstance(reference, torch.Tensor) and isinstance(approx, torch.Tensor)):
        raise TypeError(f"sqnr_db compares two tensors, got {type(reference).__name__} and {type(approx).__name__}")
    for name, t in (("reference", reference), ("approx", approx)):
        if t.is_complex() or t.device.type == "meta":  # .double() dropped the imaginary part; meta holds no numbers
            raise TypeError(f"sqnr_db compares real tensors that hold numbers, got a {t.dtype} {name} on "
                            f"{t.device.type}")
    if reference.shape != approx.shape:
        raise ValueError(f"sqnr_db compares tensors of one shape, got {tuple(reference.shape)} (reference) and "
                         f"{tuple(approx.shape)} (approx)")
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if math.isnan(noise) or math.isnan(signal) or (math.isinf(noise) and math.isinf(signal)):
        return math.nan  # a NaN, or inf on both sides: no ratio to speak of
    if noise == 0 or math.isinf(signal):
        return math.inf
    if signal == 0 or math.isinf(noise):  # e.g. a finite reference decoded as inf
        return -math.inf
    return 10.0 * math.log10(signal / noise)
