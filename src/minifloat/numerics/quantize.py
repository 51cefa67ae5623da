"""The one place values are rounded onto a low-precision grid.

`round_to_grid` is the rounding rule (round-to-nearest-even, subnormals kept); `cast` adds saturation; `quantize`
adds scaling at a granularity and returns a `Quantized`. Every other module quantizes through `quantize`.

The rounding rules themselves (round-to-nearest-even and stochastic, both exact on every device) live in
`minifloat.numerics.rounding`.
"""

from __future__ import annotations

import dataclasses

import torch

from minifloat.core.validate import check_int
from minifloat.numerics.compiling import maybe_compile
from minifloat.numerics.formats import FORMATS, NumberFormat, Special, get_format
from minifloat.numerics.granularity import (
    Granularity,
    blocked_view,
    expand_scale,
    from_blocks,
    granularity_info,
    scale_shape,
    to_blocks,
    whole_block_view,
)
from minifloat.numerics.rounding import float32_round_to_odd, reciprocal_rn, round_saturated
from minifloat.numerics import triton_blocks, triton_cast, triton_rows
from minifloat.numerics.cast import cast  # noqa: F401 - re-exported (defined here before cast.py)
from minifloat.numerics.metrics import sqnr_db  # noqa: F401 - re-exported (defined here before metrics.py)
from minifloat.numerics.scales import MAX_MARGIN, MX_RULES, block_scales, mx_scale, scale_from_amax  # noqa: F401


# ---------------------------------------------------------------------------------------------------- rounding


# ---------------------------------------------------------------------------------------------------- kernels


def _cast_kernel(x: torch.Tensor, qscale: torch.Tensor, fmt_name: str, storage: torch.dtype | None,
                 operand_dtype: torch.dtype | None, fold: torch.Tensor | None, want_amax: bool):
    """One pass: y = cast(x·qscale); returns (y in storage dtype, y·fold in operand dtype, amax of x or None).

    The format is passed by name so that the compiler sees its limits as constants (a NumberFormat argument's
    fields would become symbolic under dynamic shapes, and the kernel ~8× slower).
    """
    fmt = FORMATS[fmt_name]
    xf = x.float()
    y = (xf * qscale).clamp(-fmt.max, fmt.max)
    r, stored = round_saturated(y, fmt)  # stored: the conversion's bytes, their NaN already the positive one
    # one NaN (positive), whatever sign the device's arithmetic gave it; r != r rather than isnan, which inductor's
    # C++ code runs element by element
    r = torch.where(r != r, float("nan"), r)
    if storage is None:
        data = None
    else:  # the conversion's bytes are already the stored form (r.to(storage) would convert a second time)
        data = stored if stored is not None and storage == stored.dtype else r.to(storage)
    operand = None if operand_dtype is None else (r if fold is None else r * fold).to(operand_dtype)
    # delayed scaling needs this step's amax too: computed in the same pass (NaN propagates through max)
    amax = torch.maximum(-xf.amin(), xf.amax()) if want_amax else None
    return data, operand, amax


_cast_kernel_compiled = maybe_compile(_cast_kernel)


# CPU: a reduction down the columns walks each strip of columns row by row, a page apart; from 2^23 elements (out of
# cache) two stages, chunks of rows read as streams and then the rest, are 1.7-3x faster (benchmarks/column_amax.py)
_DOWN_SPLIT, _DOWN_MIN_ELEMENTS = 8, 1 << 23


def _block_amax_kernel(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    y, d = x.abs(), dim % x.dim() if isinstance(dim, int) else None
    down = d is not None and d < x.dim() - 1 and x.device.type == "cpu" and x.numel() >= _DOWN_MIN_ELEMENTS
    if down and x.shape[d] % _DOWN_SPLIT == 0 and x.shape[d] >= 2 * _DOWN_SPLIT:
        y = y.unflatten(d, (_DOWN_SPLIT, -1)).amax(d)  # the same maxima, exactly (NaN propagates through amax)
    return y.amax(dim=dim, keepdim=True).float()


_block_amax = maybe_compile(_block_amax_kernel)


def abs_max(x: torch.Tensor, dim: int | tuple[int, ...] | None):
    """amax of |x| over everything (dim=None) or along `dim` (one or several, kept), in float32."""
    if x.numel() == 0:
        dims = {d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim or ())}
        shape = () if dim is None else tuple(1 if d in dims else n for d, n in enumerate(x.shape))
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    if dim is None:
        lo, hi = torch.aminmax(x)  # one eager pass, no temporary
        return torch.maximum(-lo, hi).abs().float()  # abs: maximum(-0.0, +0.0) of an all-zero x is -0.0
    return _block_amax(x, dim)  # eager reductions along a dim are 3-10× slower than this compiled one


def _decode_kernel(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    y = data.float()
    return (y if scale is None else y * scale).to(dtype)


decode = maybe_compile(_decode_kernel)  # stored grid values (· scale) in another dtype, one pass


def _decoded_amax_kernel(data: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """`_block_amax_kernel` of data · scale in float32, as `decode` computes it."""
    return _block_amax_kernel(data.float() * scale, dim)


def _decoded_cast_kernel(data: torch.Tensor, scale: torch.Tensor, qscale: torch.Tensor, fmt_name: str,
                         storage: torch.dtype | None, operand_dtype: torch.dtype | None, fold: torch.Tensor | None):
    """`_cast_kernel` of data · scale in float32, as `decode` computes it."""
    return _cast_kernel(data.float() * scale, qscale, fmt_name, storage, operand_dtype, fold, False)


# requantize_t's passes read the stored bytes, not the float32 values written out and read back
decoded_amax = maybe_compile(_decoded_amax_kernel)
decoded_cast = maybe_compile(_decoded_cast_kernel)


# ---------------------------------------------------------------------------------------------------- Quantized


@dataclasses.dataclass
class Quantized:
    """A tensor stored on a low-precision grid with its scales: x ≈ data · scale (scale broadcast per block).

    Attributes:
        data: the grid values, in fmt's torch dtype (float8_*) or float32 where torch has no such dtype (E2M1);
            None when only the GEMM operand was asked for (quantize(..., keep_data=False)).
        scale: float32 dequantization multipliers, shaped per granularity — tensor: (); row: (..., 1);
            tile / mx: (..., ceil(K/128)) / (..., ceil(K/32)); block: (..., ceil(M/128), ceil(K/128)).
        fmt: the element format.
        granularity: a `Granularity` (strings are accepted and converted; it compares equal to its string).
        amax: the absolute maximum of x per scale block (same shape as scale); with an explicit scale, the tensor's
            amax for "tensor" granularity (computed in the same pass) and None otherwise.
        operand: optional bfloat16 copy of the grid values for the emulated GEMM (None unless asked for).
        scale_folded: True for power-of-two block scales ("mx", and "tile"/"block" with power_of_two), which the
            GEMM operand carries folded in (data · scale is still an exact bfloat16 value).
        data_t: optional row-major copy of a 2-D data's transpose (the same values; quantize(..., with_t=True)), so
            that `.t()` hands a GEMM a row-major operand instead of a view it would have to copy.
    """

    data: torch.Tensor | None
    scale: torch.Tensor
    fmt: NumberFormat
    granularity: Granularity
    amax: torch.Tensor | None = None
    operand: torch.Tensor | None = None
    scale_folded: bool = False
    data_t: torch.Tensor | None = None

    def __post_init__(self):
        self.granularity = Granularity.parse(self.granularity)

    @property
    def shape(self) -> torch.Size:
        return (self.data if self.data is not None else self.operand).shape

    @property
    def block_size(self) -> int:
        """Elements along the last dim that share one scale (the whole last dim for tensor and row scales)."""
        block = granularity_info(self.granularity).block
        return self.shape[-1] if block is None else block[1]

    def expanded_scale(self) -> torch.Tensor:
        """The scale broadcast to data's shape."""
        return expand_scale(self.scale, self.granularity, self.shape)

    def grid_values(self) -> torch.Tensor:
        """The unscaled grid values in float32 (from data, or from the operand when data was not kept)."""
        if self.data is not None:
            return self.data.float()
        if self.operand is None:
            raise ValueError("this Quantized holds neither data nor an operand")
        inverse = expand_scale(reciprocal_rn(self.scale), self.granularity, self.shape) if self.scale_folded else 1.0
        return self.operand.float() * inverse  # folded scales are powers of two: the product is the quotient

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data · scale in `dtype` (computed in float32, one compiled pass)."""
        if self.data is None:
            if self.scale_folded:
                return self.operand.to(dtype)  # the operand already carries its (power-of-two) scales: exact
            return (self.grid_values() * self.expanded_scale()).to(dtype)
        data = self.data.detach()
        # broadcast each block's scale instead of materialising a full-size scale tensor where the layout allows
        view = blocked_view(data, self.scale, self.granularity)
        if view is None:
            return decode(data, self.expanded_scale(), dtype)
        return decode(*view, dtype).reshape(data.shape)

    def t(self) -> "Quantized":
        """Transpose of a 2-D tensor whose scales transpose with it (granularity_info(...).transposes_exactly)."""
        if len(self.shape) != 2 or not granularity_info(self.granularity).transposes_exactly:
            exact = [g.value for g in Granularity if granularity_info(g).transposes_exactly]
            raise ValueError(f"only 2-D tensors of granularity {exact} transpose exactly, not a {len(self.shape)}-D "
                             f"tensor of granularity '{self.granularity}'")

        def flip(a):  # per-tensor (0-d) scales and amaxes stay as they are
            return a if a is None or a.dim() < 2 else a.t()

        if self.data_t is not None:  # the transposed copy becomes the data, the data its transposed copy
            return Quantized(self.data_t, flip(self.scale), self.fmt, self.granularity, flip(self.amax),
                             flip(self.operand), self.scale_folded, self.data)
        return Quantized(flip(self.data), flip(self.scale), self.fmt, self.granularity, flip(self.amax),
                         flip(self.operand), self.scale_folded)

    def nbytes(self) -> int:
        """Bytes of data (both layouts, where a transposed copy is kept) and scales (the optional operand excluded)."""
        data = sum(t.numel() * t.element_size() for t in (self.data, self.data_t) if t is not None)
        return data + self.scale.numel() * self.scale.element_size()


def quantize(x: torch.Tensor, fmt: NumberFormat | str, *, granularity: Granularity | str = "tensor",
             scale: torch.Tensor | None = None, margin: int = 0, power_of_two: bool = False,
             mx_rule: str = "up", operand_dtype: torch.dtype | None = None, keep_data: bool = True,
             amax: torch.Tensor | None = None, with_t: bool = False,
             multiplier: torch.Tensor | None = None, record: triton_cast.AmaxSlot | None = None) -> Quantized:
    """Scale `x` per `granularity` and cast it onto `fmt` (saturating, RNE).

    Args:
        x: floating tensor; "tile"/"mx" blocks run along the last dim, "block" covers the last two dims; ragged
            edges (sizes not multiples of 128 or 32) are zero-padded for the amax and trimmed from the result.
        fmt: element format (E4M3, E5M2, E2M1, ...).
        granularity: "tensor", "row", "tile" (1×128), "block" (128×128) or "mx" (32, E8M0 scales): a
            `Granularity` or its string.
        scale: dequantization scale to use instead of one computed from the current amax (delayed scaling).
            Only for "tensor" and "row" granularity.
        margin: scale = fmt.max / amax / 2^margin.
        power_of_two: round scales down to powers of two (always so for "mx").
        mx_rule: "up" (no element overflows) or "floor" (OCP MX v1.0 rule) for "mx" scales.
        operand_dtype: if set, also return `operand`, the grid values in this dtype with power-of-two block scales
            folded in, for the emulated GEMM.
        keep_data: False skips writing `data` (only with operand_dtype): for operands used once and not saved.
        amax: a per-tensor amax the caller has already. With an explicit `scale` it is x's own, returned as the
            result's amax instead of being computed again in the cast's pass; without one the scale is computed
            from it instead of from x (e.g. the whole tensor's amax, for one shard of it: the shard's cast is then
            bitwise that part of the whole tensor's).
        with_t: also keep `data_t`, the 2-D data's transpose in row-major order (the same pass on a GPU).
        multiplier: with `scale`, the quantization multiplier `1.0 / scale` (float32) the caller has already (delayed
            scaling keeps it per step): the cast uses it as given, and launches no division.
        record: a ScalingState's slot (`ScalingState.amax_slot`): x's amax is recorded there as `ScalingState.record`
            does with the cast's amaxes; on a GPU by the one-pass kernels, in the launch that takes it.
    Returns:
        Quantized with data of x's shape.
    """
    fmt = get_format(fmt)
    granularity = Granularity.parse(granularity)
    info = granularity_info(granularity)
    if mx_rule not in MX_RULES:
        raise ValueError(f"mx_rule must be one of {MX_RULES}, got {mx_rule!r}")
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating tensor, got {x.dtype}")
    if fmt.special == Special.SCALE:
        raise ValueError("E8M0 is a scale format; quantize elements to E4M3, E5M2 or E2M1")
    if FORMATS.get(fmt.name) != fmt:  # the kernels take a format by name, for its limits as constants
        raise ValueError(f"quantize takes minifloat's formats ({', '.join(FORMATS)}), got a NumberFormat of its own "
                         f"named {fmt.name!r}; mf.cast rounds onto any NumberFormat")
    if x.dtype == torch.float64:  # rounded to odd: the kernels' float32 rounding is then x's own (see cast)
        x = float32_round_to_odd(x.detach())
    if x.element_size() == 1:  # float8 values (a re-quantization from E4M3 to E5M2): exact in float32, which every
        x = x.float()  # device's kernels read (torch's CPU reductions have no float8 kernels)
    if not keep_data and operand_dtype is None:
        raise ValueError("keep_data=False needs an operand_dtype, or nothing would be returned")
    check_int("margin", margin, low=0, high=MAX_MARGIN)
    if not info.per_tensor and (x.dim() == 0 or x.shape[-1] == 0):
        raise ValueError(f"granularity '{granularity}' scales along the last dim, which a tensor of shape "
                         f"{tuple(x.shape)} does not have (or has empty); use granularity='tensor'")
    if scale is not None:  # its shape only: its values live on the device, and a check would wait for them
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 1
        want = 1 if info.per_tensor else rows
        if not isinstance(scale, torch.Tensor) or scale.numel() != want:
            raise ValueError(f"scale must be a tensor of {want} element(s) for granularity '{granularity}' of a "
                             f"tensor of shape {tuple(x.shape)}, got "
                             f"{tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    storage = (fmt.torch_dtype if fmt.torch_dtype is not None else torch.float32) if keep_data else None

    if amax is not None and not info.per_tensor:
        raise ValueError(f"a given amax goes with a per-tensor cast, not '{granularity}'")
    if with_t and x.dim() != 2:
        raise ValueError(f"with_t needs a 2-D tensor, got shape {tuple(x.shape)}")
    if multiplier is not None and scale is None:
        raise ValueError("a multiplier goes with the scale it is the reciprocal of: pass scale= too")
    out = None
    if scale is None and triton_blocks.takes(x, storage, operand_dtype, granularity):  # tiles, blocks: GPU, one pass
        block = granularity == Granularity.BLOCK
        out = triton_blocks.block_cast(x.detach(), fmt, rows=True, block=block, write_t=with_t and block,
                                       margin=margin, power_of_two=power_of_two, record=record)
    elif scale is None and amax is None and triton_rows.takes(x, storage, operand_dtype, granularity):
        out = triton_rows.row_col_cast(x.detach(), fmt, cols=False, margin=margin, power_of_two=power_of_two,
                                       record=record)  # rows: GPU, an amax pass (recording) and a cast pass
    if out is not None:
        data_t = out["data_t"] if "data_t" in out else out["data"].t().contiguous() if with_t else None
        return Quantized(out["data"], out["scale"], fmt, granularity, out["amax"],
                         scale_folded=info.folds(power_of_two), data_t=data_t)
    # (n_blocks, block_elements), one scale per row; 128×128 blocks of a tensor made of whole blocks are instead a
    # view (..., MB, 128, KB, 128) with scales (..., MB, 1, KB, 1): no copy into block order and back
    # on a GPU, one Triton pass (minifloat.numerics.triton_cast): scales from the amax, both layouts, the amax
    fused = triton_cast.takes(x, storage, operand_dtype, info.block is None)
    two_d = info.block is not None and info.block[0] > 1 and x.dim() >= 2 and x.numel() > 0
    xb = whole_block_view(x.detach(), granularity) if two_d else None
    xb = x if fused else to_blocks(x.detach(), granularity) if xb is None else xb  # the kernel reads x itself
    qscale = None
    recorded = False  # whether a kernel recorded the amax into `record`
    if scale is None:
        if amax is None:
            recorded = fused and info.per_tensor and record is not None
            amax = triton_cast.tensor_amax(x, record) if fused and info.per_tensor else abs_max(
                xb, None if info.per_tensor else (-3, -1) if xb.dim() > 2 else -1)
        else:
            amax = _float_0d(amax)
        if not fused:
            qscale, dscale = block_scales(amax, fmt, info, margin, power_of_two, mx_rule)
    else:
        if info.block is not None:  # a given scale must not depend on per-block amaxes the caller cannot see
            allowed = [g.value for g in Granularity if granularity_info(g).block is None]
            raise ValueError(f"an explicit scale is supported for {allowed} granularity, not '{granularity}'")
        dscale = scale.float().reshape(-1, 1) if info.per_row else _float_0d(scale)
        qscale = reciprocal_rn(dscale) if multiplier is None else (
            _float_0d(multiplier) if dscale.dim() == 0 else multiplier.float().reshape(dscale.shape))

    folded = info.folds(power_of_two)
    want_amax = amax is None and info.per_tensor and xb.numel() > 0
    data_t = None
    if fused:
        in_pass = record if want_amax and not recorded else None
        data, data_t, kernel_amax, kernel_dscale = triton_cast.fused_cast(
            x.detach(), fmt, qscale, along="row" if info.per_row else "tensor", write_t=with_t, want_amax=want_amax,
            amax=amax if qscale is None else None, margin=margin, power_of_two=power_of_two, record=in_pass)
        dscale, operand = (dscale if qscale is not None else kernel_dscale), None
        recorded = recorded or in_pass is not None
    else:
        fold = dscale if (folded and operand_dtype is not None) else None
        data, operand, kernel_amax = _cast_kernel_compiled(xb, qscale.reshape(()) if info.per_tensor else qscale,
                                                           fmt.name, storage, operand_dtype, fold, want_amax)
    if want_amax:
        amax = kernel_amax
    if record is not None and not recorded and amax is not None:
        triton_cast.record_amax(record, amax)
    if not info.per_tensor:
        shape = scale_shape(x.shape, granularity)
        dscale = dscale.reshape(shape)
        amax = None if amax is None else amax.reshape(shape)
    else:  # (already 0-d: no reshape calls, a few µs of host time each)
        dscale, amax = _float_0d(dscale, widen=False), None if amax is None else _float_0d(amax, widen=False)
    if not fused:  # (the kernel wrote x's shape)
        viewed = xb.dim() > 2  # to_blocks gives 2-D rows
        data = None if data is None else _unblock(data, x.shape, granularity, viewed)
        operand = None if operand is None else _unblock(operand, x.shape, granularity, viewed)
    if with_t and data_t is None and data is not None:
        data_t = data.t().contiguous()
    return Quantized(data, dscale, fmt, granularity, amax, operand, scale_folded=folded, data_t=data_t)


def _float_0d(t: torch.Tensor, widen: bool = True) -> torch.Tensor:
    """`t` (one element) as a 0-d tensor, float32 where `widen`; itself when it is one already."""
    if widen and t.dtype != torch.float32:
        t = t.float()
    return t if t.dim() == 0 else t.reshape(())


def _unblock(y: torch.Tensor, shape: torch.Size, granularity: Granularity, viewed: bool) -> torch.Tensor:
    """A cast's output back to x's shape: a view when x was cast through `whole_block_view`, else `from_blocks`."""
    return y.view(shape) if viewed else from_blocks(y, shape, granularity)
