"""Normalization layers that compute in float32 and return their input's dtype.

A norm is a reduction followed by a reciprocal square root: RMSNorm computes y = x / sqrt(mean(x²) + eps) · w,
LayerNorm y = (x - mean(x)) / sqrt(var(x) + eps) · w + b. In bfloat16 (8 significant bits) the sum of d squares
loses about log2(d) bits to rounding as it grows, the variance E[x²] - E[x]² cancels, and an eps of 1e-5 or 1e-6 is
below half an ulp of typical mean squares, so it does nothing. Mixed-precision practice therefore runs reductions in
float32 and stores the result in the low-precision dtype (Micikevicius et al., "Mixed Precision Training",
arXiv 1710.03740 §3.3). The weights stay float32: a norm gain near 1.0 receives updates far below bfloat16's
half-ulp at 1.0 (2^-9), which bfloat16 storage would round away.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minifloat.core.autocast import autocast_off
from minifloat.core.validate import check_number

_SWAPPED = (nn.LayerNorm, nn.RMSNorm)


def _shape(normalized_shape: int | tuple[int, ...] | list[int] | torch.Size) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"normalized_shape must be a positive int or a tuple of them, got {normalized_shape!r}")
    return shape


def _eps(eps: float) -> float:
    check_number("eps", eps, low=0.0)
    return float(eps)


def _upcast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class _Fp32Norm(nn.Module):
    """The shared part of RMSNorm and LayerNorm: shape, eps, float32 parameters and the upcast around `_normalize`."""

    def __init__(self, normalized_shape, eps: float, *, elementwise_affine: bool, bias: bool, device, dtype):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = _eps(eps)
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 at least: float64 inputs (the tests' references) keep float64
        compute = torch.promote_types(x.dtype, torch.float32)
        with autocast_off(x.device.type):  # autocast would run the norm in its own dtype
            y = self._normalize(x.to(compute), _upcast(self.weight, compute), _upcast(self.bias, compute))
        return y.to(x.dtype)

    def _normalize(self, x, weight, bias) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, fp32 compute"


class RMSNorm(_Fp32Norm):
    """RMSNorm (Zhang & Sennrich 2019) computed in float32, returning the input's dtype.

    Args:
        dim: the normalized shape (an int for the last dimension, or a tuple of trailing dimensions).
        eps: added to mean(x²) under the square root.
        elementwise_affine: learn a gain `weight` (initialized to 1, stored in `dtype`).
        device, dtype: of the parameters (float32 by default).
    """

    def __init__(self, dim, eps: float = 1e-6, *, elementwise_affine: bool = True, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(dim, eps, elementwise_affine=elementwise_affine, bias=False, device=device, dtype=dtype)

    def _normalize(self, x, weight, bias) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class LayerNorm(_Fp32Norm):
    """LayerNorm (Ba et al. 2016) computed in float32, returning the input's dtype.

    Args:
        dim: the normalized shape (an int for the last dimension, or a tuple of trailing dimensions).
        eps: added to the variance under the square root.
        elementwise_affine: learn a gain `weight` (and, with `bias`, an offset `bias`).
        bias: learn the offset (as torch.nn.LayerNorm's `bias`).
        device, dtype: of the parameters (float32 by default).
    """

    def __init__(self, dim, eps: float = 1e-5, *, elementwise_affine: bool = True, bias: bool = True, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(dim, eps, elementwise_affine=elementwise_affine, bias=bias, device=device, dtype=dtype)

    def _normalize(self, x, weight, bias) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def fp32_norm(norm: nn.LayerNorm | nn.RMSNorm) -> LayerNorm | RMSNorm:
    """The float32-internal equivalent of a torch.nn.LayerNorm or torch.nn.RMSNorm, sharing its parameters.

    The parameters are the same Parameter objects (optimizers keep them), moved to float32. torch.nn.RMSNorm's
    `eps=None` means finfo(input dtype).eps; the computation is now float32, so it becomes finfo(float32).eps, which
    makes the result equal torch's on float32 inputs.
    """
    if type(norm) not in _SWAPPED:
        raise ValueError(f"norm must be a torch.nn.LayerNorm or torch.nn.RMSNorm, got {type(norm).__name__}")
    affine = norm.elementwise_affine
    with torch.device("meta"):  # the new module's own parameters are replaced below; do not allocate them
        if isinstance(norm, nn.RMSNorm):
            eps = torch.finfo(torch.float32).eps if norm.eps is None else norm.eps
            new = RMSNorm(norm.normalized_shape, eps, elementwise_affine=affine)
        else:
            new = LayerNorm(norm.normalized_shape, norm.eps, elementwise_affine=affine, bias=norm.bias is not None)
    for name in ("weight", "bias"):
        param = getattr(norm, name, None)
        if param is not None:
            param.data = param.data.float()
        setattr(new, name, param)
    new.train(norm.training)
    return new


def swap_norms(model: nn.Module) -> nn.Module:
    """Replace (in place) every torch.nn.LayerNorm and torch.nn.RMSNorm in `model` by its float32-internal twin.

    Only those exact classes are swapped: a subclass may change `forward`, so it is left alone.

    Args:
        model: any nn.Module.
    Returns:
        The model (the new norm itself if `model` is one of the swapped classes).
    """
    if type(model) in _SWAPPED:
        return fp32_norm(model)
    for name, module in list(model.named_modules()):
        if type(module) in _SWAPPED:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, fp32_norm(module))
    return model
