"""Integer codes for block-scaled tensors: linear int8 / int4 and the dynamic 8-bit map.

Floats are rounded onto float grids by `minifloat.numerics.quantize`; this module holds the integer encodings, which
have no float grid. Every function takes a (n_blocks, block) float32 tensor, one scale per row:

* linear, signed: codes c = round(x / s) in [-q, q], q = 2^(bits-1) - 1, s = amax / q (symmetric, no zero point);
  unsigned (for non-negative tensors): c in [0, 2^bits - 1], s = amax / (2^bits - 1). Rounding is torch.round
  (half to even). |x - c·s| <= s / 2.
* zero-free linear (unsigned only; Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", arXiv
  2310.01507 §4.1): the codes stand for (c + 1)·s, s = amax / 2^bits, so no code is 0. A second moment v that
  rounds to 0 turns Adam's update m / (√v + ε) into m / ε, a step of up to lr·|m|/ε that wrecks training; with 16
  linear codes most of a block's v fall below the first step. Zero-free codes overestimate them instead (at least
  s), which only shrinks those updates. An all-zero block stores s = 0. |x - (c+1)·s| <= s / 2 for x >= s / 2.
* dynamic map (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", §2.2; bitsandbytes'
  `create_dynamic_map`): 256 code values in [-1, 1] whose leading zeros act as an exponent, so that the map spans
  seven decades with fewer fraction bits for smaller values. x is normalised by its block's absmax and stored as the
  index of the nearest code value.
  The 4-bit dynamic map (3 exponent bits: 16 codes over 10^-3 .. 1) is built the same way; its zero-free unsigned
  variant drops the 0 code (15 codes), as the 4-bit optimizer paper does for v.
* 4-bit codes are packed two per byte: element 2i in the low nibble, 2i+1 in the high nibble.
"""

from __future__ import annotations

import functools

import torch

DYNAMIC_EXPONENT_BITS = {8: 7, 4: 3}  # per code width; 8 bits is bitsandbytes' default: 10^-6 .. 1


def linear_qmax(bits: int, *, signed: bool) -> int:
    """Largest code magnitude: 2^(bits-1) - 1 signed (symmetric), 2^bits - 1 unsigned."""
    return 2 ** (bits - 1) - 1 if signed else 2**bits - 1


def block_absmax(xb: torch.Tensor) -> torch.Tensor:
    """amax of |x| per row of a (n_blocks, block) tensor, shape (n_blocks,), in float32."""
    return xb.abs().amax(dim=-1).float() if xb.shape[-1] else torch.zeros(xb.shape[0], device=xb.device)


# the smallest positive float32 (a subnormal): a code step below it would round to 0
_SMALLEST_STEP = 2.0**-149


def _step(amax: torch.Tensor, levels: int) -> torch.Tensor:
    """amax / levels, at least the smallest positive float32: for a block whose amax is a subnormal, the quotient
    underflows to 0 and every code would decode to 0 (or divide by it)."""
    return (amax / levels).clamp(min=_SMALLEST_STEP)


def linear_encode(xb: torch.Tensor, bits: int, *, signed: bool,
                  zero_free: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear codes of a (n_blocks, block) tensor.

    Args:
        xb: float tensor, one block per row; non-negative when `signed` is False (negatives clamp to 0).
        bits: code width (8 or 4).
        signed: symmetric signed codes, or unsigned codes for non-negative tensors.
        zero_free: unsigned codes standing for (c + 1)·scale (see the module docstring).
    Returns:
        (codes, scales): codes of xb's shape, int8 when signed and bits == 8, else uint8 (signed 4-bit codes are
        offset by 8, so 0..14); float32 dequantization scales of shape (n_blocks,) (1.0 for all-zero blocks, 0.0
        when zero_free).
    """
    if zero_free:
        if signed:
            raise ValueError("zero-free linear codes are unsigned (for non-negative tensors)")
        levels = 2**bits
        amax = block_absmax(xb)
        safe = torch.where(amax > 0, _step(amax, levels), torch.ones_like(amax))
        codes = (torch.round(xb.float() / safe[:, None]) - 1).clamp(0, levels - 1)
        return codes.to(torch.uint8), torch.where(amax > 0, safe, torch.zeros_like(amax))
    qmax = linear_qmax(bits, signed=signed)
    amax = block_absmax(xb)
    scale = torch.where(amax > 0, _step(amax, qmax), torch.ones_like(amax))
    lo = -qmax if signed else 0
    codes = torch.round(xb.float() / scale[:, None]).clamp(lo, qmax)
    if signed and bits == 8:
        return codes.to(torch.int8), scale
    offset = 2 ** (bits - 1) if signed else 0
    return (codes + offset).to(torch.uint8), scale


def linear_decode(codes: torch.Tensor, scale: torch.Tensor, bits: int, *, signed: bool,
                  zero_free: bool = False) -> torch.Tensor:
    """Inverse of `linear_encode`: codes · scale in float32, (n_blocks, block)."""
    c = codes.float()
    if zero_free:
        c = c + 1
    elif signed and bits != 8:
        c = c - 2 ** (bits - 1)
    return c * scale[:, None]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes < 16 two per byte along the last dim (even length): low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even number of elements per row, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 codes, twice as many along the last dim."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@functools.lru_cache(maxsize=None)
def _dynamic_map_values(signed: bool, bits: int, zero: bool) -> tuple[float, ...]:
    exponent_bits = DYNAMIC_EXPONENT_BITS[bits]
    values = [0.0, 1.0] if zero else [1.0]
    # Decade i (scale 10^(i - exponent_bits + 1)) holds the midpoints of an even split of [0.1, 1] into 2^i parts
    # (signed; both signs) or 2^(i+1) parts (unsigned, which spends the sign bit on one more fraction bit). With
    # 8 bits and 7 decades: 2·(1+2+...+64) = 254 signed or 2+4+...+128 = 254 unsigned values, plus 0 and 1; with
    # 4 bits and 3 decades: 2·(1+2+4) = 14 or 2+4+8 = 14, plus 0 and 1.
    for i in range(exponent_bits):
        parts = 2 ** (i + bits - 1 - exponent_bits) if signed else 2 ** (i + bits - exponent_bits)
        decade = 10.0 ** (i - exponent_bits + 1)
        edges = torch.linspace(0.1, 1.0, parts + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * decade).tolist()
        values += mids + ([-v for v in mids] if signed else [])
    return tuple(sorted(values))


def dynamic_map(*, signed: bool, bits: int = 8, zero: bool = True) -> torch.Tensor:
    """The 2^bits sorted code values of the dynamic map, float32 (computed in float64 and rounded once).

    Args:
        signed: values in [-1, 1] (first moments) or [0, 1] (second moments, which are never negative).
        bits: 8 or 4.
        zero: False drops the 0 code (2^bits - 1 values; unsigned only): the zero-free map for second moments.
    """
    if bits not in DYNAMIC_EXPONENT_BITS:
        raise ValueError(f"the dynamic map has {sorted(DYNAMIC_EXPONENT_BITS)} bits, got {bits}")
    if not zero and signed:
        raise ValueError("the zero-free dynamic map is unsigned (for non-negative tensors)")
    return torch.tensor(_dynamic_map_values(signed, bits, zero), dtype=torch.float32)


def dynamic_encode(xb: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-code indices of a (n_blocks, block) tensor normalised by each block's absmax.

    Args:
        xb: float tensor, one block per row.
        code: sorted code values (from `dynamic_map`), on xb's device.
    Returns:
        (uint8 indices of xb's shape, float32 absmax per block; all-zero blocks store 1.0, or 0.0 with a zero-free
        map, so that they decode to 0).
    """
    amax = block_absmax(xb)
    scale = torch.where(amax > 0, amax, torch.ones_like(amax))
    xn = xb.float() / scale[:, None]
    # nearest code: the number of midpoints below xn (ties go to the lower code)
    mids = (code[1:] + code[:-1]) / 2
    zero_block_scale = (code[0] <= 0).float()  # 0 when the map has no zero (and no negatives): no host sync
    return torch.bucketize(xn, mids).to(torch.uint8), torch.where(amax > 0, amax, zero_block_scale)


def dynamic_decode(codes: torch.Tensor, scale: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Inverse of `dynamic_encode`: code[index] · absmax, float32 (n_blocks, block)."""
    return code[codes.long()] * scale[:, None]
