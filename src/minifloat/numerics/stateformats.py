"""Formats of optimizer states, as data, and the block-wise encoding of a state into plain tensors.

A state tensor (a moment of one parameter) is flattened and split into blocks of `block` elements, zero-padded at
the end; a block-scaled format stores per block one float32 scale beside the codes:

    format        element codes                      per block       rounding
    fp32          float32 (parameter-shaped)         -               none
    bf16          bfloat16 (parameter-shaped)        -               numerics.quantize.cast (RNE)
    e4m3, e5m2    float8 (n_blocks, block)           scale           numerics.quantize.quantize, "row" of a block
    int8          int8 / uint8 (n_blocks, block)     scale           numerics.intquant linear, symmetric
    int8-dynamic  uint8 (n_blocks, block)            absmax          numerics.intquant dynamic map, nearest code
    int4          uint8 (n_blocks, block / 2)        scale           numerics.intquant linear, two codes per byte
    int4-dynamic  uint8 (n_blocks, block / 2)        absmax          4-bit dynamic map, two codes per byte

Moments that are never negative (Adam's second moment) use the unsigned variants of the integer codes (the
unsigned dynamic map; linear codes 0..2^bits-1), which spend the sign bit on resolution. At 4 bits those codes are
zero-free (numerics.intquant): a second moment rounded to 0 would turn Adam's update into m / eps, which is what
made 4-bit second moments diverge; zero-free codes round the smallest values up to the first code instead.

Dynamic range expansion (COAT, Xi et al. 2024, arXiv 2410.19313 §4.2): before quantization a block is normalised by
its absmax, u = x / amax, and expanded, y = sign(u)·|u|^k, with k chosen per block so that the block's dynamic range
R = max|x| / min|x≠0| becomes the format's: R^k = R_fmt, k = log R_fmt / log R. Decoding inverts it,
x = amax·sign(y)·|y|^(1/k). COAT takes R_fmt from the smallest subnormal; here it is the normal range
max / min_normal for float formats (below min_normal the relative precision decays, so filling the subnormals
would trade the small values' precision away), max / min-nonzero-code for integer codes. The block stores amax and
k beside the inner encoding's codes and scale.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from minifloat.numerics.formats import BF16, E4M3, E5M2, NumberFormat
from minifloat.numerics.intquant import (
    block_absmax,
    dynamic_decode,
    dynamic_encode,
    dynamic_map,
    linear_decode,
    linear_encode,
    linear_qmax,
    pack_nibbles,
    unpack_nibbles,
)
from minifloat.numerics.quantize import cast, quantize


class StateFormat(str, enum.Enum):
    """How one optimizer state is stored. A str enum: StateFormat.E4M3 == "e4m3"."""

    FP32 = "fp32"
    BF16 = "bf16"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    INT8 = "int8"
    INT8_DYNAMIC = "int8-dynamic"
    INT4 = "int4"
    INT4_DYNAMIC = "int4-dynamic"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value, *, field: str = "state format") -> StateFormat:
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"{field} must be one of {[f.value for f in cls]}, got {value!r}") from None


class Coding(str, enum.Enum):
    """The encoding family of a state format."""

    PLAIN = "plain"  # a torch float dtype, parameter-shaped, no scales
    FLOAT = "float"  # a float grid with one scale per block (numerics.quantize)
    LINEAR = "linear"  # linear integer codes with one scale per block (numerics.intquant)
    DYNAMIC = "dynamic"  # dynamic-map codes with the block's absmax (numerics.intquant)


@dataclasses.dataclass(frozen=True)
class StateFormatInfo:
    """Properties of a StateFormat.

    Attributes:
        coding: the encoding family.
        bits: stored bits per element (scales excluded).
        number_format: the float grid (PLAIN and FLOAT codings), else None.
    """

    coding: Coding
    bits: int
    number_format: NumberFormat | None = None

    @property
    def block_scaled(self) -> bool:
        return self.coding != Coding.PLAIN


STATE_FORMATS: dict[StateFormat, StateFormatInfo] = {
    StateFormat.FP32: StateFormatInfo(Coding.PLAIN, 32),
    StateFormat.BF16: StateFormatInfo(Coding.PLAIN, 16, BF16),
    StateFormat.E4M3: StateFormatInfo(Coding.FLOAT, 8, E4M3),
    StateFormat.E5M2: StateFormatInfo(Coding.FLOAT, 8, E5M2),
    StateFormat.INT8: StateFormatInfo(Coding.LINEAR, 8),
    StateFormat.INT8_DYNAMIC: StateFormatInfo(Coding.DYNAMIC, 8),
    StateFormat.INT4: StateFormatInfo(Coding.LINEAR, 4),
    StateFormat.INT4_DYNAMIC: StateFormatInfo(Coding.DYNAMIC, 4),
}


def state_format_info(fmt: StateFormat | str) -> StateFormatInfo:
    return STATE_FORMATS[StateFormat.parse(fmt)]


def code_dtype(fmt: StateFormat | str, *, signed: bool) -> torch.dtype:
    """The dtype of the stored codes (what a state_dict holds; load_state_dict casts them back to it)."""
    fmt = StateFormat.parse(fmt)
    info = STATE_FORMATS[fmt]
    if fmt == StateFormat.FP32:
        return torch.float32
    if info.number_format is not None:
        return info.number_format.torch_dtype
    return torch.int8 if (info.coding == Coding.LINEAR and info.bits == 8 and signed) else torch.uint8


def dynamic_range(fmt: StateFormat | str, *, signed: bool) -> float:
    """max / smallest value kept at full precision (see the module docstring), for range expansion."""
    info = state_format_info(fmt)
    if info.coding == Coding.FLOAT:
        return info.number_format.max / info.number_format.min_normal
    if info.coding == Coding.LINEAR:
        return 2.0**info.bits if _zero_free(info, signed) else float(linear_qmax(info.bits, signed=signed))
    if info.coding == Coding.DYNAMIC:
        code = dynamic_map(signed=signed, bits=info.bits, zero=not _zero_free(info, signed))
        return 1.0 / code[code > 0].min().item()
    raise ValueError(f"the {fmt} state format has no block scale to expand into")


def _zero_free(info: StateFormatInfo, signed: bool) -> bool:
    """Unsigned 4-bit integer codes leave out 0 (see the module docstring)."""
    return not signed and info.bits == 4 and info.coding in (Coding.LINEAR, Coding.DYNAMIC)


@dataclasses.dataclass(frozen=True)
class BlockCodec:
    """Encodes (n_blocks, block) float32 states of one format into named plain tensors and back.

    Attributes:
        fmt: a block-scaled StateFormat.
        signed: False for states that are never negative (unsigned integer codes).
        expand: COAT dynamic range expansion.
    """

    fmt: StateFormat
    signed: bool = True
    expand: bool = False

    def __post_init__(self):
        if not STATE_FORMATS[self.fmt].block_scaled:
            raise ValueError(f"BlockCodec is for block-scaled formats, not {self.fmt}")

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Names of the stored tensors, appended to the state's name ("" is the codes)."""
        return ("", "_scale", "_absmax", "_expo") if self.expand else ("", "_scale")

    def empty(self, n_blocks: int, block: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The encoding of n_blocks zero blocks."""
        return self.encode(torch.zeros(n_blocks, block, device=device))

    def encode(self, xb: torch.Tensor) -> dict[str, torch.Tensor]:
        """{suffix: tensor}: codes (n_blocks, block or block / 2) and float32 per-block tensors (n_blocks,)."""
        if not self.expand:
            return self._encode_plain(xb)
        amax = block_absmax(xb)
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        u = xb / amax[:, None]
        a = u.abs()
        smallest = torch.where(a > 0, a, torch.ones_like(a)).amin(dim=-1)  # 1 for all-zero blocks: k = 1
        log_range = -torch.log(smallest)  # log(max|u| / min|u≠0|), max|u| = 1
        target = math.log(dynamic_range(self.fmt, signed=self.signed))
        expo = torch.where(log_range > 0, target / log_range, torch.ones_like(log_range))
        y = torch.sign(u) * a.pow(expo[:, None])
        return {**self._encode_plain(y), "_absmax": amax, "_expo": expo}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of `encode`: float32 (n_blocks, block)."""
        y = self._decode_plain(parts)
        if not self.expand:
            return y
        x = torch.sign(y) * y.abs().pow(1.0 / parts["_expo"][:, None])
        return x * parts["_absmax"][:, None]

    def _encode_plain(self, xb: torch.Tensor) -> dict[str, torch.Tensor]:
        info = STATE_FORMATS[self.fmt]
        if info.coding == Coding.FLOAT:
            q = quantize(xb, info.number_format, granularity="row")
            return {"": q.data, "_scale": q.scale.reshape(-1)}
        zero_free = _zero_free(info, self.signed)
        if info.coding == Coding.LINEAR:
            codes, scale = linear_encode(xb, info.bits, signed=self.signed, zero_free=zero_free)
        else:
            codes, scale = dynamic_encode(xb, self._map(info).to(xb.device))
        return {"": pack_nibbles(codes) if info.bits == 4 else codes, "_scale": scale}

    def _map(self, info: StateFormatInfo) -> torch.Tensor:
        return dynamic_map(signed=self.signed, bits=info.bits, zero=not _zero_free(info, self.signed))

    def _decode_plain(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        info = STATE_FORMATS[self.fmt]
        codes, scale = parts[""], parts["_scale"]
        if info.coding == Coding.FLOAT:
            return codes.float() * scale[:, None]
        codes = unpack_nibbles(codes) if info.bits == 4 else codes
        if info.coding == Coding.LINEAR:
            return linear_decode(codes, scale, info.bits, signed=self.signed, zero_free=_zero_free(info, self.signed))
        return dynamic_decode(codes, scale, self._map(info).to(codes.device))


def round_plain(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """A PLAIN-format state's stored form of float32 x: x itself for fp32, RNE-rounded bfloat16 for bf16."""
    info = STATE_FORMATS[fmt]
    if fmt == StateFormat.FP32:
        return x
    return cast(x, info.number_format).to(info.number_format.torch_dtype)


def expected_codec_bytes(fmt: StateFormat | str, numel: int, block: int, *, expand: bool = False) -> int:
    """Bytes a state of `numel` elements takes in `fmt` (codes of the padded blocks and float32 per-block values)."""
    info = state_format_info(fmt)
    if not info.block_scaled:
        return numel * info.bits // 8
    n_blocks = -(-numel // block)
    per_block = 4 * (3 if expand else 1)
    return n_blocks * (block * info.bits // 8 + per_block)
