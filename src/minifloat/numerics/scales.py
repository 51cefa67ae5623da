"""Scales from amaxes: the per-tensor (and per-block) FP32 multiplier `scale_from_amax`, the MX blocks' E8M0 scale
`mx_scale`, and `block_scales`, both kinds for a tensor of block amaxes in one compiled pass. `quantize` (and
`minifloat.numerics.quantize`'s other users, which import these names from there as before) take their scales here.
"""

from __future__ import annotations

import torch

from minifloat.numerics.compiling import maybe_compile
from minifloat.numerics.formats import E8M0, FORMATS, NumberFormat
from minifloat.numerics.granularity import GranularityInfo
from minifloat.numerics.rounding import exact_pow2, reciprocal_rn

MX_RULES = ("up", "floor")
# margin: scale = fmt.max / amax / 2^margin. Beyond this the scale of any amax above 2^-60 underflows float32 and
# falls back to 1, so a larger margin would silently do nothing
MAX_MARGIN = 64


def scale_from_amax(amax: torch.Tensor, fmt: NumberFormat | torch.Tensor, *, margin: int = 0,
                    power_of_two: bool = False, fallback: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Quantization multiplier s = fmt.max / amax / 2^margin (values are stored as x·s); `fmt` may also be a float32
    tensor of format maxima broadcasting with amax (several formats' scales in one pass, the same bits).

    A zero, infinite or NaN amax yields `fallback` (Transformer Engine keeps the previous scale), so a bad tensor
    can never make a scale non-finite. With `power_of_two`, s is rounded down to a power of two so nothing overflows
    and dequantization (multiplying by 1/s) is exact.
    """
    amax = amax.float()
    # clamp: for amax below ~fmt.max/3.4e38 the quotient overflows float32, yet the tensor deserves a huge scale
    fmax = fmt if isinstance(fmt, torch.Tensor) else fmt.max  # fmax / amax is fmax · (1 / amax), as torch computes it
    # · 2^-margin, not / 2^margin: the same bits (a power-of-two scaling), and no float32 division for inductor's
    # Triton code to approximate (minifloat.numerics.rounding.div_rn)
    s = (reciprocal_rn(amax) * fmax * 2.0**-margin).clamp(max=torch.finfo(torch.float32).max)
    if power_of_two:  # 2^floor(log2 s), exactly: s = m·2^k with m in [0.5, 1) (frexp), so floor(log2 s) = k - 1
        s = torch.where(torch.isfinite(s) & (s > 0), exact_pow2(torch.frexp(s)[1] - 1), s)
    good = torch.isfinite(s) & (amax > 0) & (s > 0)  # a number `fallback` stays one: no copy from the host (a sync)
    fallback = fallback.to(amax.device, torch.float32) if isinstance(fallback, torch.Tensor) else float(fallback)
    return torch.where(good, s, fallback)


def mx_scale(amax: torch.Tensor, fmt: NumberFormat, *, rule: str = "up") -> torch.Tensor:
    """E8M0 dequantization scale 2^e of an MX block (x ≈ element · 2^e).

    rule="up": e = ceil(log2(amax / fmt.max)), the smallest power of two that keeps every element <= fmt.max.
    rule="floor": OCP MX v1.0 §6.3, e = floor(log2(amax)) - emax(fmt); the largest elements may saturate.
    All-zero or non-finite blocks get e = 0. Exact: the exponent comes from frexp (float32 log2 of 8·(1 - 2^-24) is 3).
    Either rule keeps e <= 127 - emax(fmt), the floor rule's exponent for float32's top binade: the "up" rule's next
    binade would be 2^(128 - emax), where an element rounding up to 2^emax dequantizes to 2^128, past float32 (inf),
    so blocks with amax above fmt.max · 2^(127 - emax) (3.0e38 for E4M3) saturate there instead.
    """
    if rule not in MX_RULES:
        raise ValueError(f"mx rule must be one of {MX_RULES}, got {rule!r}")
    m, k = torch.frexp(amax.float())  # amax = m·2^k, m in [0.5, 1): floor(log2(amax)) = k - 1
    e = (k - 1 - fmt.emax).float()  # the "floor" rule
    if rule == "up":  # amax / 2^e = 2m·2^emax (exact); above fmt.max the block needs the next binade
        e = e + (2.0 * m * 2.0**fmt.emax > fmt.max).float()
    e = torch.where(torch.isfinite(amax) & (amax > 0), e, torch.zeros_like(e)).clamp(E8M0.emin, E8M0.emax - fmt.emax)
    return exact_pow2(e.to(torch.int32))


def _scales_kernel(amax: torch.Tensor, fmt_name: str, e8m0: bool, margin: int, power_of_two: bool,
                   mx_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = FORMATS[fmt_name]
    if e8m0:  # MX: power-of-two scales by the MX rule
        dscale = mx_scale(amax, fmt, rule=mx_rule)
        return reciprocal_rn(dscale), dscale
    qscale = scale_from_amax(amax, fmt, margin=margin, power_of_two=power_of_two)
    return qscale, reciprocal_rn(qscale)


_block_scales_compiled = maybe_compile(_scales_kernel)  # one pass over a block-scaled tensor's amaxes, not ten


def block_scales(amax: torch.Tensor, fmt: NumberFormat, info: GranularityInfo, margin: int, power_of_two: bool,
                 mx_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantization multipliers, dequantization scales) from block amaxes."""
    return _block_scales_compiled(amax, fmt.name, info.scale_fmt == E8M0, margin, power_of_two, mx_rule)
