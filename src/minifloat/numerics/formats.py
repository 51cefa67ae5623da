"""Number formats as data.

Every limit of every format (448, 57344, 2**-9, ...) is derived here from four facts: exponent bits, mantissa bits,
exponent bias and how the format spends its top exponent code (IEEE inf/NaN, OCP "fn" NaN-only, none, or E8M0's
single NaN). Nothing else in minifloat writes a format limit.

References: OCP 8-bit Floating Point Specification (OFP8) rev 1.0; OCP Microscaling Formats (MX) v1.0.
"""

from __future__ import annotations

import dataclasses
import enum

import torch


class Special(str, enum.Enum):
    """How a format uses its largest exponent code."""

    IEEE = "ieee"  # top exponent reserved for inf and NaN (E5M2, FP16, BF16, FP32)
    FN = "fn"  # finite-only: only S.1111.111 is NaN, the rest of the top binade holds normals (E4M3)
    NONE = "none"  # no inf, no NaN: every code is a finite number (E2M1)
    SCALE = "scale"  # E8M0: unsigned powers of two, 0xFF is NaN, no zero


@dataclasses.dataclass(frozen=True)
class NumberFormat:
    """A binary floating-point format described by its bit layout.

    Attributes:
        name: short name ("e4m3", "e5m2", ...).
        ebits: exponent bits.
        mbits: explicit mantissa bits.
        bias: exponent bias.
        special: how the top exponent code is used (see `Special`).
        signed: whether the format has a sign bit (E8M0 has none).
        torch_dtype: the storage dtype torch offers for it, or None.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    special: Special
    signed: bool = True
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return int(self.signed) + self.ebits + self.mbits

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade."""
        top = 2**self.ebits - 1
        if self.special == Special.IEEE:
            return top - 1 - self.bias
        if self.special == Special.SCALE:
            return top - 1 - self.bias  # 0xFF is NaN
        return top - self.bias  # FN and NONE keep the top binade for numbers

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        if self.special == Special.SCALE:
            return -self.bias  # exponent code 0 is 2**-127: E8M0 has no subnormals and no zero
        return 1 - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        if self.special == Special.FN:
            # the all-ones mantissa of the top binade is NaN, so the largest mantissa is 1 - 2 ulp
            significand = 2.0 - 2.0 * 2.0**-self.mbits
        else:
            significand = 2.0 - 2.0**-self.mbits
        return significand * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        if self.special == Special.SCALE:
            return self.min_normal
        return 2.0 ** (self.emin - self.mbits)

    @property
    def has_inf(self) -> bool:
        return self.special == Special.IEEE

    @property
    def has_nan(self) -> bool:
        return self.special != Special.NONE

    @property
    def is_fp8(self) -> bool:
        return self.bits == 8 and self.signed

    def describe(self) -> dict[str, object]:
        """The format's derived limits as a plain dict (for tables and JSON)."""
        return {
            "name": self.name,
            "bits": self.bits,
            "exponent_bits": self.ebits,
            "mantissa_bits": self.mbits,
            "bias": self.bias,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": None if self.special == Special.SCALE else self.min_subnormal,  # E8M0 has none
            "has_inf": self.has_inf,
            "has_nan": self.has_nan,
            "torch_dtype": str(self.torch_dtype).replace("torch.", "") if self.torch_dtype else None,
        }


E4M3 = NumberFormat("e4m3", ebits=4, mbits=3, bias=7, special=Special.FN, torch_dtype=torch.float8_e4m3fn)
E5M2 = NumberFormat("e5m2", ebits=5, mbits=2, bias=15, special=Special.IEEE, torch_dtype=torch.float8_e5m2)
E8M0 = NumberFormat(
    "e8m0", ebits=8, mbits=0, bias=127, special=Special.SCALE, signed=False,
    torch_dtype=getattr(torch, "float8_e8m0fnu", None),
)
E2M1 = NumberFormat("e2m1", ebits=2, mbits=1, bias=1, special=Special.NONE)  # no unpacked torch dtype
BF16 = NumberFormat("bf16", ebits=8, mbits=7, bias=127, special=Special.IEEE, torch_dtype=torch.bfloat16)
FP16 = NumberFormat("fp16", ebits=5, mbits=10, bias=15, special=Special.IEEE, torch_dtype=torch.float16)
FP32 = NumberFormat("fp32", ebits=8, mbits=23, bias=127, special=Special.IEEE, torch_dtype=torch.float32)

FORMATS: dict[str, NumberFormat] = {f.name: f for f in (E4M3, E5M2, E8M0, E2M1, BF16, FP16, FP32)}


def get_format(fmt: NumberFormat | str) -> NumberFormat:
    """Look a format up by name ("e4m3") or pass a NumberFormat through."""
    if isinstance(fmt, NumberFormat):
        return fmt
    key = str(fmt).lower()
    if key not in FORMATS:
        raise ValueError(f"unknown number format {fmt!r}; known: {sorted(FORMATS)}")
    return FORMATS[key]


def holds(dtype: torch.dtype, fmt: NumberFormat) -> bool:
    """Whether tensors of `dtype` hold every value of `fmt` exactly (float32 and float64 hold all of minifloat's;
    float16 does not hold BF16's range, bfloat16 not FP16's precision)."""
    if dtype == torch.float64:
        return True
    home = next((f for f in FORMATS.values() if f.torch_dtype == dtype), None)
    return home is not None and fmt.max <= home.max and fmt.min_subnormal >= home.min_subnormal \
        and fmt.mbits <= home.mbits

