"""How quantized values are stored: in torch's own dtype where it has one, else as packed integer codes.

An element format with a torch dtype (E4M3: torch.float8_e4m3fn, E5M2, E8M0: torch.float8_e8m0fnu) is stored in it,
one byte per value, and read back as it is. A format torch lacks (E2M1, FP4) is stored as its bit codes in uint8,
packed two to a byte for formats of 4 bits or fewer (element 2i in the low nibble, 2i+1 in the high one, as the
OCP MX and NVIDIA FP4 layouts do), so FP4 weights take half a byte each.

The codes come from `code_values(fmt)`, the value of every bit pattern, derived from the format's fields
(minifloat.numerics.formats): sign | exponent | mantissa, subnormals at exponent 0, the top exponent spent as the
format says (IEEE inf/NaN, "fn" NaN only, none, E8M0's NaN).
"""

from __future__ import annotations

import functools

import torch

from minifloat.numerics.formats import NumberFormat, Special


@functools.cache
def code_values(fmt: NumberFormat) -> torch.Tensor:
    """float32 (2^bits,): the value of each code of `fmt` (index = code); NaN where a code is NaN."""
    codes = torch.arange(2**fmt.bits, dtype=torch.int64)
    mant = (codes & (2**fmt.mbits - 1)).double()
    exp = (codes >> fmt.mbits) & (2**fmt.ebits - 1)
    top = 2**fmt.ebits - 1
    if fmt.special == Special.SCALE:  # unsigned powers of two 2^(e - bias); the all-ones code is NaN
        return torch.where(exp == top, float("nan"), torch.exp2((exp - fmt.bias).double())).float()
    normal = (1 + mant / 2**fmt.mbits) * torch.exp2((exp - fmt.bias).double())
    subnormal = mant / 2**fmt.mbits * 2.0**fmt.emin
    value = torch.where(exp == 0, subnormal, normal)
    if fmt.special == Special.IEEE:
        value = torch.where((exp == top) & (mant == 0), float("inf"), value)
        value = torch.where((exp == top) & (mant != 0), float("nan"), value)
    elif fmt.special == Special.FN:  # only the all-ones pattern of the top binade is NaN
        value = torch.where((exp == top) & (mant == 2**fmt.mbits - 1), float("nan"), value)
    sign = (codes >> (fmt.ebits + fmt.mbits)) & 1
    return torch.where(sign == 1, -value, value).float()


def packed(fmt: NumberFormat) -> bool:
    """Whether `fmt` is stored as integer codes (torch has no dtype for it)."""
    return fmt.torch_dtype is None


def per_byte(fmt: NumberFormat) -> int:
    """Values stored per byte: 2 for packed formats of 4 bits or fewer, else 1."""
    return 2 if packed(fmt) and fmt.bits <= 4 else 1


def storage_dtype(fmt: NumberFormat) -> torch.dtype:
    return fmt.torch_dtype if not packed(fmt) else torch.uint8


def storage_shape(shape: tuple[int, ...], fmt: NumberFormat) -> tuple[int, ...]:
    """Shape of the stored tensor for values of `shape` (the last dim halved, rounded up, when two share a byte)."""
    if not shape:
        return shape
    return (*shape[:-1], -(-shape[-1] // per_byte(fmt)))


def encode(values: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Values already on `fmt`'s grid (e.g. `Quantized.data`) in their storage form. Exact; not a rounding step."""
    if not packed(fmt):
        return values.to(fmt.torch_dtype)
    # codes of one sign increase with magnitude (exponent above mantissa): search |v| among the non-negative half
    half = 2 ** (fmt.bits - 1) if fmt.signed else 2**fmt.bits
    mags = code_values(fmt)[:half].to(values.device)
    mags = mags[: int(torch.isfinite(mags).sum())]  # inf / NaN codes sit at the top
    v = values.float()
    codes = torch.searchsorted(mags, v.abs()).clamp(max=mags.numel() - 1)
    if not torch.equal(mags[codes], v.abs()):
        raise ValueError(f"values are not on the {fmt.name} grid (or are NaN); quantize them first")
    if fmt.signed:
        codes = codes + half * torch.signbit(v).long()
    codes = codes.to(torch.uint8)
    if per_byte(fmt) == 1:
        return codes
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << fmt.bits)


def decode(stored: torch.Tensor, fmt: NumberFormat, shape: tuple[int, ...]) -> torch.Tensor:
    """The grid values of a stored tensor: itself for torch dtypes, float32 values of the codes otherwise."""
    if not packed(fmt):
        return stored
    codes = stored.long()
    if per_byte(fmt) == 2:
        low, high = codes & (2**fmt.bits - 1), codes >> fmt.bits
        codes = torch.stack((low, high), dim=-1).flatten(-2)[..., : shape[-1]]
    return code_values(fmt).to(stored.device)[codes].reshape(shape)
