"""cast(x, fmt): the saturating rounding of a tensor onto a number format's grid, with a straight-through gradient.

The rounding itself is minifloat.numerics.rounding's (integer arithmetic on the float32 bit pattern); `quantize`
(minifloat.numerics.quantize) scales before it. This is the one function every other cast in minifloat goes through.
"""

from __future__ import annotations

import torch

from minifloat.core.validate import check_choice
from minifloat.numerics.formats import NumberFormat, Special, get_format, holds
from minifloat.numerics.rounding import ROUNDINGS, float32_for, round_saturated, round_stochastic


def cast(x: torch.Tensor, fmt: NumberFormat | str, *, rounding: str = "nearest",
         generator: torch.Generator | None = None, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Saturating cast of `x` onto `fmt`'s grid, rounding to nearest even or stochastically.

    Values beyond ±fmt.max (infinities included) saturate to ±fmt.max, subnormals are kept, NaN stays NaN.

    Args:
        x: a floating tensor.
        fmt: target format (NumberFormat or its name).
        rounding: "nearest" (ties to even) or "stochastic" (unbiased; see minifloat.numerics.rounding).
        generator: the torch.Generator stochastic rounding draws from (None: torch's default one).
        uniform: stochastic rounding's draws, float32 uniform in [0, 1) of x's shape, when the caller drew them
            (a compiled kernel takes them as an input: minifloat.numerics.fp4); None draws them from `generator`.
    Returns:
        A tensor of x's dtype and shape holding only values of `fmt` (exactly so when x's dtype can hold them,
        which float32 always can and bfloat16 can for every 8-bit format).

    Gradients go straight through the rounding (a fake-quantization's usual estimator, as in quantization-aware
    training): d cast(x) / dx is 1 where -fmt.max <= x <= fmt.max and 0 where x saturated (or is NaN), on every
    device and for every format and rounding.
    """
    fmt = get_format(fmt)
    check_choice("rounding", rounding, ROUNDINGS)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"cast expects a floating-point torch tensor (torch.as_tensor(values) makes one), got {got}")
    if uniform is not None and (rounding != "stochastic" or not isinstance(uniform, torch.Tensor)
                                or uniform.shape != x.shape):
        raise ValueError(f"uniform= is stochastic rounding's draws, a tensor of x's shape {tuple(x.shape)} with "
                         f"rounding='stochastic'; got "
                         f"{tuple(uniform.shape) if isinstance(uniform, torch.Tensor) else type(uniform).__name__}"
                         f" with rounding={rounding!r}")
    if not holds(x.dtype, fmt):  # the result's dtype is x's: values of fmt it cannot hold would come back wrong
        raise ValueError(f"cast of a {str(x.dtype).removeprefix('torch.')} tensor onto {fmt.name}: that dtype cannot "
                         f"hold every {fmt.name} value (max {fmt.max:g}, {fmt.mbits} mantissa bits), so the result "
                         f"would not be on {fmt.name}'s grid; cast x.float() instead")
    if x.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(x, fmt, rounding, generator, uniform)
    return _cast(x, fmt, rounding, generator, uniform)


def _cast(x: torch.Tensor, fmt: NumberFormat, rounding: str, generator: torch.Generator | None,
          uniform: torch.Tensor | None) -> torch.Tensor:
    y = float32_for(x, fmt)
    if fmt.special != Special.SCALE:
        y = y.clamp(-fmt.max, fmt.max)
    if rounding == "stochastic":
        u = torch.rand(y.shape, generator=generator, device=y.device) if uniform is None else uniform
        return round_stochastic(y, fmt, u).to(x.dtype)
    return round_saturated(y, fmt)[0].to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """`cast` with a gradient: the rounding passes it unchanged, saturation stops it (clamp's rule). Without this the
    gradient was whatever autograd made of the rounding's arithmetic, which differed by device and route."""

    generate_vmap_rule = True  # torch.func transforms (grad, vmap) work through it, as they did through plain ops

    @staticmethod
    def forward(x, fmt, rounding, generator, uniform):
        return _cast(x, fmt, rounding, generator, uniform)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, fmt = inputs[:2]
        ctx.save_for_backward(x)
        ctx.limit = None if fmt.special == Special.SCALE else fmt.max

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if ctx.limit is not None:
            grad = grad * ((x >= -ctx.limit) & (x <= ctx.limit)).to(grad.dtype)
        return grad, None, None, None, None
