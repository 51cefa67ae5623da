"""Rounding rules other than round-to-nearest-even: stochastic rounding onto a format's grid.

Stochastic rounding (SR) sends y, lying between the neighbouring grid values lo < y < hi, to hi with probability
(y - lo) / (hi - lo) and to lo otherwise, so E[SR(y)] = y: rounding errors average out instead of piling up. An
update far below half an ulp, which round-to-nearest drops every time, moves the weight by one ulp with the right
probability (Gupta et al., "Deep Learning with Limited Numerical Precision", arXiv 1502.02551; Zamirai et al.,
"Revisiting BFloat16 Training", arXiv 2010.06192).

The rule takes its randomness as an argument — a uniform u in [0, 1) per element — so that it is a pure function:
    ulp = 2^(max(e, emin) - mbits) with e = floor(log2 |y|)   (the spacing of the binade holding |y|)
    lo  = floor(|y| / ulp) · ulp,   f = |y| / ulp - floor(|y| / ulp)  in [0, 1)
    SR(y) = sign(y) · (lo + ulp · [u >= 1 - f])                 P(up) = P(u >= 1 - f) = f
Every step is exact in float32 (|y| / ulp is a power-of-two scaling and has at most mbits + 1 integer bits), and
e comes from frexp, which is exact where log2 is not. With u = k / 2^24 (torch.rand's float32 grid) P(up) is exactly f
whenever f is a multiple of 2^-24, which holds for every float32 y and every format of at most 23 mantissa bits.
Comparing u with 1 - f (not f) makes bfloat16 SR bitwise the classic integer form: add floor(u·2^16) to the float32
bit pattern and truncate the low 16 bits (checked in tests/test_rounding.py).

`minifloat.numerics.quantize.cast(x, fmt, rounding="stochastic")` is the entry point: it saturates, draws u and calls
`round_stochastic`.
"""

from __future__ import annotations

import torch

from minifloat.numerics.formats import NumberFormat, Special

ROUNDINGS = ("nearest", "stochastic")


def round_stochastic(y: torch.Tensor, fmt: NumberFormat, u: torch.Tensor) -> torch.Tensor:
    """Round float32 `y` to one of its two neighbours on `fmt`'s grid, up (in magnitude) with probability equal to
    its distance to the lower neighbour over their spacing. No saturation: callers clamp first.

    Args:
        y: float32 tensor with |y| <= fmt.max.
        fmt: the target format (not a scale format such as E8M0).
        u: float32 tensor of y's shape, uniform in [0, 1): the randomness (torch.rand).
    Returns:
        float32 tensor of values of `fmt`; grid values of `fmt` (zeros included, signs kept) come back unchanged and
        NaN stays NaN.
    """
    if fmt.special == Special.SCALE:
        raise ValueError(f"stochastic rounding onto the scale format {fmt.name} is not supported")
    if fmt.mbits >= 23:
        return y
    a = y.abs()
    _, exponent = torch.frexp(a)  # a = m · 2^exponent with m in [0.5, 1): floor(log2 a) = exponent - 1
    ulp = torch.exp2(((exponent - 1).clamp(min=fmt.emin) - fmt.mbits).float())
    units = a / ulp
    lo = torch.floor(units)
    up = (u >= 1.0 - (units - lo)).float()
    return torch.copysign((lo + up) * ulp, y)
