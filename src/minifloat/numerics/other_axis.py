"""A 2-D tensor quantized along its other axis: the backward GEMMs' operands.

The weight gradient sums over the token axis, so its operands, dyᵀ and xᵀ, must be scaled along it: per column of
x for row scaling, in 128×1 tiles for DeepSeek-V3's recipe (1×128 tiles of xᵀ). Scales that transpose exactly
(per tensor, 128×128 blocks) are x's own, transposed; the others are new casts:

  * `quantize_t(x)`: quantize(xᵀ) computed on x as it lies in memory;
  * `quantize_both(x)`: quantize(x) and quantize_t(x) — the output gradient's two casts, dgrad's and wgrad's; on a
    GPU one Triton pass for tiles (minifloat.numerics.triton_blocks), two for rows (triton_rows) where each cast
    alone takes two;
  * `requantize_t(q)`: quantize_t of a quantized tensor's values — the forward's saved FP8 input, re-quantized for
    wgrad; on a GPU straight from the FP8 bytes, without writing its bfloat16 values.

On the torch path (every CPU) each is exactly the composition of `quantize` calls it names, bit for bit, and so are
the Triton kernels' results (tests/test_triton_blocks.py).
"""

from __future__ import annotations

import torch

from minifloat.numerics import triton_blocks, triton_cast, triton_rows
from minifloat.numerics.compiling import transposed_copy
from minifloat.numerics.formats import NumberFormat, get_format
from minifloat.numerics.granularity import Granularity, granularity_info, pad_to_multiple
from minifloat.numerics import quantize as kernels  # its cast kernels by attribute: tests swap them in place
from minifloat.numerics.quantize import Quantized, abs_max, quantize
from minifloat.numerics.scales import block_scales


def quantize_t(x: torch.Tensor, fmt: NumberFormat | str, *, granularity: Granularity | str, margin: int = 0,
               power_of_two: bool = False, mx_rule: str = "up", operand_dtype: torch.dtype | None = None,
               keep_data: bool = True) -> Quantized:
    """quantize(x.t(), ...) for a 2-D x, computed on x as it lies in memory: no transposed copy is made.

    Scales that transpose exactly (tensor, 128×128 blocks) are computed on x and transposed with it. Row, tile and MX
    blocks of xᵀ run down the columns of x; the returned data and operand are transposed views and the scales follow
    xᵀ's conventions. The backward GEMMs need their operands scaled along the token axis (DeepSeek-V3's 128×1
    tiles), which is this.
    """
    fmt = get_format(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize_t needs a 2-D tensor, got shape {tuple(x.shape)}")
    granularity = Granularity.parse(granularity)
    info = granularity_info(granularity)
    options = dict(granularity=granularity, margin=margin, power_of_two=power_of_two, mx_rule=mx_rule,
                   operand_dtype=operand_dtype, keep_data=keep_data)
    if info.transposes_exactly:  # on the native path the cast writes xᵀ's row-major data too: .t() hands it over
        with_t = keep_data and operand_dtype is None and fmt.torch_dtype is not None
        return quantize(x, fmt, **options, with_t=with_t).t()
    if info.block is not None and info.block[0] != 1:  # 2-D blocks that do not transpose exactly: copy xᵀ
        return quantize(x.t(), fmt, **options)
    if torch.compiler.is_compiling():
        # the same blocks, amaxes and casts on a materialised xᵀ (see transposed_copy for why)
        return quantize(transposed_copy(x.detach()), fmt, **options)
    if not keep_data and operand_dtype is None:
        raise ValueError("keep_data=False needs an operand_dtype, or nothing would be returned")
    m, k = x.shape
    x = x.detach()
    storage = (fmt.torch_dtype or torch.float32) if keep_data else None
    if triton_blocks.takes(x, storage, operand_dtype, granularity):  # tiles down the columns, written as xᵀ (GPU)
        out = triton_blocks.block_cast(x, fmt, cols=True, margin=margin, power_of_two=power_of_two)
        return Quantized(out["data_t"], out["scale_t"], fmt, granularity, out["amax_t"],
                         scale_folded=info.folds(power_of_two))
    if triton_rows.takes(x, storage, operand_dtype, granularity):  # per column, written as xᵀ: two passes (GPU)
        out = triton_rows.row_col_cast(x, fmt, rows=False, margin=margin, power_of_two=power_of_two)
        return Quantized(out["data_t"], out["scale_t"], fmt, granularity, out["amax_t"])
    if info.block is None:  # one scale per row of xᵀ, i.e. per column of x
        view = x
    else:
        size = info.block[1]
        view = pad_to_multiple(x, size, dim=-2)
        view = view.reshape(view.shape[0] // size, size, k)  # (MB, size, K): blocks down the columns
    amax = abs_max(view, -2) if m else torch.zeros(view.shape[:-2] + (1, k), device=x.device)
    qscale, dscale = block_scales(amax, fmt, info, margin, power_of_two, mx_rule)
    folded = info.folds(power_of_two)
    fold = dscale if (folded and operand_dtype is not None) else None
    data, operand, _ = kernels._cast_kernel_compiled(view, qscale, fmt.name, storage, operand_dtype, fold, False)
    return _as_transpose(data, operand, amax, dscale, m, k, fmt, granularity, folded)


def _as_transpose(data, operand, amax, dscale, m: int, k: int, fmt: NumberFormat, granularity: Granularity,
                  folded: bool) -> Quantized:
    """quantize_t's result from a cast down the columns of an (M, K) tensor (its blocks viewed (M, K) per row, or
    (MB, n, K) / (MB, n, KB, n) per 1 × n block, padded rows last): data and operand as xᵀ views, scales and amaxes in
    xᵀ's convention, (K, 1) per row and (K, MB) per block."""

    def back(y):
        return None if y is None else y.reshape(-1, k)[:m].t()

    def to_t(a):
        return a.reshape(k, 1) if granularity_info(granularity).block is None else a.reshape(-1, k).t()

    return Quantized(back(data), to_t(dscale), fmt, granularity, to_t(amax), back(operand), scale_folded=folded)


def quantize_both(x: torch.Tensor, fmt: NumberFormat | str, *, granularity: Granularity | str, margin: int = 0,
                  power_of_two: bool = False, mx_rule: str = "up", operand_dtype: torch.dtype | None = None,
                  keep_data: bool = True, record: triton_cast.AmaxSlot | None = None) -> tuple[Quantized, Quantized]:
    """(quantize(x, ..., record=record), quantize_t(x, ...)) of a 2-D x: its casts along each axis. On a GPU, 1×128
    tiles take one Triton pass for both (each with its own scales and amaxes) and rows two passes, where the casts
    alone take two each; `record` (a ScalingState's slot) is then folded in the first pass."""
    fmt = get_format(fmt)
    granularity = Granularity.parse(granularity)
    storage = fmt.torch_dtype if keep_data else None
    options = dict(margin=margin, power_of_two=power_of_two, record=record)
    if triton_rows.takes(x, storage, operand_dtype, granularity):
        out = triton_rows.row_col_cast(x.detach(), fmt, **options)
    elif granularity == Granularity.TILE and triton_blocks.takes(x, storage, operand_dtype, granularity):
        out = triton_blocks.block_cast(x.detach(), fmt, rows=True, cols=True, **options)
    else:
        options = dict(margin=margin, power_of_two=power_of_two, granularity=granularity, mx_rule=mx_rule,
                       operand_dtype=operand_dtype, keep_data=keep_data)
        return quantize(x, fmt, record=record, **options), quantize_t(x, fmt, **options)
    folded = granularity_info(granularity).folds(power_of_two)
    return (Quantized(out["data"], out["scale"], fmt, granularity, out["amax"], scale_folded=folded),
            Quantized(out["data_t"], out["scale_t"], fmt, granularity, out["amax_t"], scale_folded=folded))


def requantize_t(q: Quantized, *, margin: int = 0, power_of_two: bool = False, mx_rule: str = "up",
                 operand_dtype: torch.dtype | None = None, keep_data: bool = True) -> Quantized:
    """quantize_t of the values `q` holds (its FP8 data times its scales; as bfloat16 where the scales are folded
    powers of two, else float32), at q's format and granularity: a saved FP8 input re-quantized along the token axis.

    On a GPU, rows and 1×128 tiles are re-quantized from the FP8 bytes by Triton kernels; elsewhere this is
    quantize_t(q.dequantize(...)), the same bits."""
    if q.data is None:
        raise ValueError("requantize_t needs the quantized data (keep_data=True)")
    storage = q.fmt.torch_dtype if keep_data else None
    options = dict(margin=margin, power_of_two=power_of_two, row_scales=q.scale)
    fp8 = q.data.dtype == q.fmt.torch_dtype
    if fp8 and not q.scale_folded and triton_rows.takes(q.data, storage, operand_dtype, q.granularity):
        out = triton_rows.row_col_cast(q.data, q.fmt, rows=False, **options)
    elif fp8 and q.granularity == Granularity.TILE and triton_blocks.takes(q.data, storage, operand_dtype,
                                                                          q.granularity):
        out = triton_blocks.block_cast(q.data, q.fmt, cols=True, fold_bf16=q.scale_folded, **options)
    else:
        fused = _decoded_columns(q, margin, power_of_two, mx_rule, operand_dtype, keep_data)
        if fused is not None:
            return fused
        source = q.dequantize(torch.bfloat16 if q.scale_folded else torch.float32)
        return quantize_t(source, q.fmt, granularity=q.granularity, margin=margin, power_of_two=power_of_two,
                          mx_rule=mx_rule, operand_dtype=operand_dtype, keep_data=keep_data)
    return Quantized(out["data_t"], out["scale_t"], q.fmt, q.granularity, out["amax_t"],
                     scale_folded=granularity_info(q.granularity).folds(power_of_two))


def _decoded_columns(q: Quantized, margin: int, power_of_two: bool, mx_rule: str, operand_dtype: torch.dtype | None,
                     keep_data: bool) -> Quantized | None:
    """requantize_t on the torch path for float32 scales per row or per 1 × n block (1×128 tiles): quantize_t of q's
    float32 values, each pass computing them from the stored bytes instead of reading them written out. None where
    that does not apply (the caller then dequantizes and calls quantize_t: the same bits). Folded power-of-two scales
    stay on that route: their bfloat16 values are half the bytes to read back, and a compiled kernel must be told to
    keep their rounding (inductor's `emulate_precision_casts`), which made it slower than the two passes it saves."""
    info = granularity_info(q.granularity)
    if info.per_tensor or q.scale_folded or (info.block is not None and info.block[0] != 1) \
            or torch.compiler.is_compiling():
        return None
    if q.data.dim() != 2 or (not keep_data and operand_dtype is None):  # the latter: quantize_t refuses it
        return None
    m, k = q.data.shape
    data = q.data.detach()
    size = 1 if info.block is None else info.block[1]
    if m == 0 or m % size or k % size or not data.is_contiguous():
        return None
    if info.block is None:  # (M, K) · (M, 1), amaxes down the columns
        data, scale, dim = data, q.scale.reshape(m, 1), -2
    else:  # (MB, n, KB, n) · (MB, n, KB, 1): element (r, c) of block (mb, kb); amaxes down each n rows
        data, scale, dim = data.view(m // size, size, k // size, size), q.scale.view(m // size, size, -1, 1), -3
    amax = kernels.decoded_amax(data, scale, dim)
    qscale, dscale = block_scales(amax, q.fmt, info, margin, power_of_two, mx_rule)
    storage = (q.fmt.torch_dtype or torch.float32) if keep_data else None
    folded = info.folds(power_of_two)
    fold = dscale if (folded and operand_dtype is not None) else None
    out, operand, _ = kernels.decoded_cast(data, scale, qscale, q.fmt.name, storage, operand_dtype, fold)
    return _as_transpose(out, operand, amax, dscale, m, k, q.fmt, q.granularity, folded)
