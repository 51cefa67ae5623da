"""Scaling granularity as data: which elements share one scale, and what follows from that.

A quantized tensor is x ≈ data · scale with one scale per block of elements. `Granularity` names the block layouts;
`GranularityInfo` is the one table of their properties, which quantization and the GEMM read instead of comparing
names. Adding a granularity means adding a member and a row to `_INFO`.

    granularity  block     scale shape of an (..., M, K) tensor   references
    tensor       all       ()                                     Transformer Engine per-tensor scaling
    row          1 × K     (..., M, 1)                            per-token / per-channel scaling
    tile         1 × 128   (..., M, ceil(K/128))                  DeepSeek-V3 §3.3 activation tiles
    block        128×128   (..., ceil(M/128), ceil(K/128))        DeepSeek-V3 §3.3 weight blocks
    mx           1 × 32    (..., M, ceil(K/32)), E8M0 scales      OCP MX v1.0

The layout helpers below (`to_blocks`, `from_blocks`, `scale_shape`, `expand_scale`) turn a tensor into one row per
scale block and back, driven by the block shape alone.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from minifloat.numerics.formats import E8M0, FP32, NumberFormat, Special

TILE = 128  # DeepSeek-V3 §3.3: 1×128 activation tiles, 128×128 weight blocks
MX_BLOCK = 32  # OCP MX v1.0 §5: 32 elements share one E8M0 scale


class Granularity(str, enum.Enum):
    """Which elements share one scale. A str enum: Granularity.TILE == "tile", so strings work wherever it does."""

    TENSOR = "tensor"
    ROW = "row"
    TILE = "tile"
    BLOCK = "block"
    MX = "mx"

    def __str__(self) -> str:
        return self.value  # f"{g}" and error messages read "tile", not "Granularity.TILE"

    @classmethod
    def parse(cls, value, *, field: str = "granularity", allowed: tuple[Granularity, ...] | None = None
              ) -> Granularity:
        """The member named by `value` (a member or its string).

        Raises:
            ValueError naming `field`, the allowed values (all members unless `allowed` is given) and `value`.
        """
        if allowed is None and isinstance(value, cls):  # the hot path: every cast parses its granularity
            return value
        allowed = tuple(cls) if allowed is None else allowed
        try:
            member = value if isinstance(value, cls) else cls(value)
        except (ValueError, TypeError):  # TypeError: an unhashable value
            member = None
        if member not in allowed:
            raise ValueError(f"{field} must be one of {[g.value for g in allowed]}, got {value!r}")
        return member


GRANULARITIES = tuple(Granularity)


@dataclasses.dataclass(frozen=True)
class GranularityInfo:
    """What a granularity implies for storage, transposes and GEMMs.

    Attributes:
        block: (rows, cols) of one scale block along the last two dims; None when one scale covers the whole tensor
            or a whole row (see `per_row`).
        per_row: with block None, one scale per row (along the last dim) instead of one for the tensor.
        scale_fmt: the format the scale values lie on. E8M0 scales are powers of two by construction, chosen by the
            MX rule (`quantize.mx_scale`); FP32 scales are fmt.max / amax (`quantize.scale_from_amax`).
        transposes_exactly: xᵀ's scales are x's scales transposed (one scale per tensor, or square blocks), so a
            quantized tensor transposes without re-quantization. Row, tile and MX blocks run along K only: xᵀ must
            be re-quantized along the other axis.
        factors_out: the scale is constant along K, so Σ_k (a_k·sa)(b_k·sb) = sa·sb·Σ_k a_k·b_k: it is applied once
            to the GEMM output (per tensor, per row).
        folds_when_power_of_two: power-of-two block scales are multiplied into the bfloat16 GEMM operand (exact:
            an FP8 value times a power of two is a bfloat16 value), so the GEMM needs no per-block scaling.
    """

    block: tuple[int, int] | None
    per_row: bool
    scale_fmt: NumberFormat
    transposes_exactly: bool
    factors_out: bool
    folds_when_power_of_two: bool

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole tensor."""
        return self.block is None and not self.per_row

    @property
    def always_folds(self) -> bool:
        """Scales on a power-of-two-only format (E8M0) are always folded into the GEMM operand."""
        return self.scale_fmt.special == Special.SCALE

    def folds(self, power_of_two: bool) -> bool:
        """Whether scales chosen with `power_of_two` are folded into the GEMM operand."""
        return self.always_folds or (power_of_two and self.folds_when_power_of_two)


_INFO: dict[Granularity, GranularityInfo] = {
    #                                   block            per_row  scale_fmt  transposes  factors_out  folds_p2
    Granularity.TENSOR: GranularityInfo(None,            False,   FP32,      True,       True,        False),
    Granularity.ROW:    GranularityInfo(None,            True,    FP32,      False,      True,        False),
    Granularity.TILE:   GranularityInfo((1, TILE),       False,   FP32,      False,      False,       True),
    Granularity.BLOCK:  GranularityInfo((TILE, TILE),    False,   FP32,      True,       False,       True),
    Granularity.MX:     GranularityInfo((1, MX_BLOCK),   False,   E8M0,      False,      False,       True),
}  # fmt: skip
# Which pairs of scalings torch._scaled_mm runs natively, on which GPUs, is the GEMM's table: fp8.gemm.NATIVE_RULES.


def granularity_info(granularity: Granularity | str) -> GranularityInfo:
    """The table row of `granularity` (a member or its string); ValueError naming the allowed values otherwise."""
    return _INFO[Granularity.parse(granularity)]


# ---------------------------------------------------------------------------------------------------- layout


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = -1) -> torch.Tensor:
    """x zero-padded at the end of `dim` to a multiple of `multiple` (x itself when no padding is needed)."""
    n = x.shape[dim]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, pad]
    return torch.nn.functional.pad(x, widths)


def to_blocks(x: torch.Tensor, granularity: Granularity | str) -> torch.Tensor:
    """x as (n_blocks, block_elements): one row per scale, in scale order. Ragged edges are zero-padded.

    Copies only for ragged edges and for 2-D blocks (whose elements are not contiguous in x).
    """
    info = granularity_info(granularity)
    if info.block is None:
        return x.reshape(-1, x.shape[-1]) if info.per_row else x.reshape(1, -1)
    rows, cols = info.block
    if rows == 1:
        return pad_to_multiple(x, cols).reshape(-1, cols)
    if x.dim() < 2:
        raise ValueError(f"granularity '{granularity}' needs a tensor of at least 2 dims")
    xp = pad_to_multiple(pad_to_multiple(x, cols, -1), rows, -2)
    *lead, m, k = xp.shape
    xb = xp.reshape(*lead, m // rows, rows, k // cols, cols).transpose(-3, -2)  # (..., MB, KB, rows, cols)
    return xb.reshape(-1, rows * cols)


def from_blocks(y: torch.Tensor, shape: torch.Size, granularity: Granularity | str) -> torch.Tensor:
    """Inverse of `to_blocks`: (n_blocks, block_elements) back to `shape`, padding trimmed."""
    info = granularity_info(granularity)
    if info.block is None:
        return y.reshape(shape)
    rows, cols = info.block
    k = shape[-1]
    kp = -(-k // cols) * cols  # K padded to whole blocks
    if rows == 1:
        y = y.reshape(*shape[:-1], kp)
        return y[..., :k] if kp != k else y
    *lead, m, _ = shape
    mp = -(-m // rows) * rows
    y = y.reshape(*lead, mp // rows, kp // cols, rows, cols).transpose(-3, -2).reshape(*lead, mp, kp)
    return y[..., :m, :k]


def scale_shape(shape: torch.Size, granularity: Granularity | str) -> tuple[int, ...]:
    """Shape of the scales of a tensor of `shape`: one per block, ragged edges rounded up."""
    info = granularity_info(granularity)
    if info.block is None:
        return (*shape[:-1], 1) if info.per_row else ()
    rows, cols = info.block
    k_blocks = -(-shape[-1] // cols)
    if rows == 1:
        return (*shape[:-1], k_blocks)
    return (*shape[:-2], -(-shape[-2] // rows), k_blocks)


def expand_scale(scale: torch.Tensor, granularity: Granularity | str, shape: torch.Size) -> torch.Tensor:
    """`scale` broadcastable to `shape`: each block's scale repeated over its block (tensor/row scales as they are)."""
    info = granularity_info(granularity)
    if info.block is None:
        return scale
    rows, cols = info.block
    s = scale.repeat_interleave(cols, dim=-1)[..., : shape[-1]]
    if rows > 1:
        s = s.repeat_interleave(rows, dim=-2)[..., : shape[-2], :]
    return s


def blocked_view(data: torch.Tensor, scale: torch.Tensor, granularity: Granularity | str
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(data, scale) reshaped so that their product broadcasts block by block without a full-size scale tensor.

    None when data is not contiguous or not a whole number of blocks (use `expand_scale` then); tensor and row
    scales broadcast as they are.
    """
    info = granularity_info(granularity)
    if info.block is None:
        return data, scale
    view = whole_block_view(data, granularity)
    if view is None:
        return None
    return (view, scale.unsqueeze(-1)) if info.block[0] == 1 else (view, scale.unsqueeze(-1).unsqueeze(-3))


def whole_block_view(x: torch.Tensor, granularity: Granularity | str) -> torch.Tensor | None:
    """x viewed block by block, without a copy: (..., M, K/cols, cols) for 1 × cols blocks, (..., M/rows, rows,
    K/cols, cols) for 2-D blocks. None when x is not contiguous, not a whole number of blocks, or its granularity has
    no blocks."""
    info = granularity_info(granularity)
    if info.block is None or not x.is_contiguous():
        return None
    *lead, m, k = x.shape if x.dim() >= 2 else (1, x.numel())
    rows, cols = info.block
    if m % rows or k % cols:
        return None
    if rows == 1:
        return x.view(*lead, m, k // cols, cols)
    return x.view(*lead, m // rows, rows, k // cols, cols)
