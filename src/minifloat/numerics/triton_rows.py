"""A tensor cast per row and per column on a GPU in two passes, not four: row scaling's backward operands.

Row-wise scaling (one scale per row of each GEMM operand, along the axis the GEMM sums over) needs the output gradient
dy twice: scaled per row for dgrad (dy @ W) and per column, written as dyᵀ, for wgrad (dyᵀ @ x). Each cast alone is an
amax pass and a cast pass over dy; here

    pass 1  `row_col_amax`: every program takes its tile's row and column maxima of |x| and merges them into the
            per-row and per-column amaxes with integer atomic maxima of the bit patterns (NaN propagates);
    pass 2  `row_col_cast`: every program computes its rows' and columns' multipliers from those amaxes by
            `scale_from_amax`'s rule and writes the row-scaled (M, K) data and the column-scaled (K, M) data of xᵀ,

so dy is read twice instead of four times. The same passes re-quantize the forward's saved FP8 input per column for
wgrad straight from its bytes and row scales (decoded exactly), where the torch path first writes its float32 values.
The rounding is `triton_cast`'s exact integer arithmetic, so every byte, scale and amax is the torch path's
(`quantize` and `quantize_t`), with or without FMA contraction: tests/test_triton_rows.py checks it in Triton's
interpreter, the GPU tier and `triton_cast.self_check` on CUDA.
"""

from __future__ import annotations

import functools

import torch

from minifloat.numerics import triton_blocks, triton_cast, triton_tiles
from minifloat.numerics.formats import NumberFormat
from minifloat.numerics.granularity import Granularity

tl = None  # triton.language, bound by _kernels()
_larger = _scale = _code = _load = _record = None  # jitted helpers, bound by _kernels()


def takes(x: torch.Tensor, storage: torch.dtype | None, operand_dtype: torch.dtype | None,
          granularity: Granularity) -> bool:
    """Whether a per-row cast of `x` to FP8 data (`storage`), without a bfloat16 operand, runs here."""
    return (granularity == Granularity.ROW and x.dim() == 2 and x.numel() > 0 and operand_dtype is None
            and storage in triton_blocks._FP8 and triton_cast.available(x))


@functools.cache
def _kernels():
    """(amax kernel, cast kernel), built on first use (TRITON_INTERPRET is read then)."""
    global tl, _larger, _scale, _code, _load, _record
    triton_blocks._kernel()
    tl = triton_cast.tl
    _larger, _scale, _code, _load = triton_cast._larger, triton_cast._scale, triton_cast._code, triton_blocks._load
    _record = triton_cast._record
    jit = triton_cast._triton().jit
    return jit(_amax_kernel_fn), jit(_cast_kernel_fn)


def _amax_kernel_fn(x_ptr, lut_ptr, xs_ptr, row_ptr, col_ptr, tamax_ptr, slot_ptr, counter_ptr, scratch_ptr, M, K,
                    stride_xm, stride_xk, FROM_FP8: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                    RECORD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = _load(x_ptr, lut_ptr, xs_ptr, rows, cols, M, K, stride_xm, stride_xk, 1, 0, FROM_FP8, False)
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if ROWS:
        tl.atomic_max(row_ptr + rows, tl.reduce(a, 1, _larger), mask=rows < M)
    if COLS:
        tl.atomic_max(col_ptr + cols, tl.reduce(a, 0, _larger), mask=cols < K)
    if RECORD:  # the whole tensor's amax into a ScalingState's slot (triton_cast._record_fn), in this launch
        _record(tl.reduce(tl.reduce(a, 1, _larger), 0, _larger), tamax_ptr, slot_ptr, counter_ptr, scratch_ptr)


def _cast_kernel_fn(x_ptr, lut_ptr, xs_ptr, row_ptr, col_ptr, out_ptr, out_t_ptr, ds_ptr, ds_t_ptr, M, K,
                    stride_xm, stride_xk, FROM_FP8: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                    FMT_MAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, MARGIN: tl.constexpr,
                    POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = _load(x_ptr, lut_ptr, xs_ptr, rows, cols, M, K, stride_xm, stride_xk, 1, 0, FROM_FP8, False)
    if ROWS:  # the programs of the first column of the grid store the rows' 1 / multiplier
        q = _scale(tl.load(row_ptr + rows, mask=rows < M, other=0).to(tl.float32, bitcast=True), FMT_MAX, MARGIN,
                   POW2)
        tl.store(ds_ptr + rows, tl.div_rn(1.0 + 0.0 * q, q), mask=(rows < M) & ((rows * 0 + pid_k) == 0))
        r8 = _code(x * q[:, None], FMT_MAX, EMIN, MBITS).to(tl.uint8)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], r8, mask=mask)
    if COLS:  # and those of the first row, the columns'
        q = _scale(tl.load(col_ptr + cols, mask=cols < K, other=0).to(tl.float32, bitcast=True), FMT_MAX, MARGIN,
                   POW2)
        tl.store(ds_t_ptr + cols, tl.div_rn(1.0 + 0.0 * q, q), mask=(cols < K) & ((cols * 0 + pid_m) == 0))
        c8 = _code(x * q[None, :], FMT_MAX, EMIN, MBITS).to(tl.uint8)
        tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(c8), mask=tl.trans(mask))


def row_col_cast(x: torch.Tensor, fmt: NumberFormat, *, rows: bool = True, cols: bool = True, margin: int = 0,
                 power_of_two: bool = False, row_scales: torch.Tensor | None = None,
                 record: triton_cast.AmaxSlot | None = None) -> dict[str, torch.Tensor]:
    """Cast a 2-D `x` to `fmt` scaled per row and/or per column (written as xᵀ), in an amax pass and a cast pass.

    Args:
        x: (M, K): a floating tensor (any strides), or FP8 data with `row_scales`.
        fmt: E4M3 or E5M2.
        rows: write the row-scaled (M, K) data.
        cols: write the column-scaled data of xᵀ, (K, M).
        margin, power_of_two: `scale_from_amax`'s options.
        row_scales: x is FP8 data (a float8 dtype) and these its (M, 1) dequantization scales: the values cast are
            data · row_scales in float32, as the torch path's dequantization computes them.
        record: a ScalingState's slot (`ScalingState.amax_slot`): the amax pass also folds x's amax into it, as
            `ScalingState.record` does with the cast's amaxes (`triton_cast.fused_cast`'s scheme).
    Returns:
        a dict with "data", "scale", "amax" (rows: (M, K), (M, 1), (M, 1)) and "data_t", "scale_t", "amax_t" (cols:
        (K, M), (K, 1), (K, 1)); float32 scales and amaxes.
    """
    if x.dim() != 2 or not x.numel() or fmt.torch_dtype not in triton_blocks._FP8 or not (rows or cols):
        raise ValueError(f"row_col_cast takes a non-empty 2-D tensor, an FP8 format and rows and/or cols, got shape "
                         f"{tuple(x.shape)}, {fmt.name}, rows={rows}, cols={cols}")
    m, k = x.shape
    device = x.device
    bits = torch.zeros(m + k, dtype=torch.int32, device=device)  # one launch fills both
    row_bits, col_bits = bits[:m], bits[m:]
    from_fp8 = row_scales is not None
    source = x.view(torch.uint8) if from_fp8 else x
    lut = triton_blocks._decode_table(x.dtype, device) if from_fp8 else row_bits
    xs = row_scales.float().contiguous() if from_fp8 else row_bits
    amax_kernel, cast_kernel = _kernels()
    slot, counter, scratch = record if record is not None else (row_bits, row_bits, row_bits)
    tamax = torch.empty((), dtype=torch.int32, device=device) if record is not None else row_bits
    flags = dict(FROM_FP8=from_fp8, ROWS=rows, COLS=cols)
    triton_tiles.launch(amax_kernel, triton_tiles.CAST_TILES, x,
                        (source, lut, xs, row_bits, col_bits, tamax, slot, counter, scratch, m, k, x.stride(0),
                         x.stride(1)), dict(flags, RECORD=record is not None),
                        restore=("row_ptr", "col_ptr", "tamax_ptr", "slot_ptr", "counter_ptr"),
                        key=("FROM_FP8", "ROWS", "COLS", "RECORD"))
    out: dict[str, torch.Tensor] = {}
    if rows:
        out.update(data=torch.empty((m, k), dtype=fmt.torch_dtype, device=device),
                   scale=torch.empty((m, 1), dtype=torch.float32, device=device),
                   amax=row_bits.view(torch.float32).reshape(m, 1))
    if cols:
        out.update(data_t=torch.empty((k, m), dtype=fmt.torch_dtype, device=device),
                   scale_t=torch.empty((k, 1), dtype=torch.float32, device=device),
                   amax_t=col_bits.view(torch.float32).reshape(k, 1))
    any_data = out.get("data", out.get("data_t")).view(torch.uint8)  # placeholders for pointers not used
    any_scale = out.get("scale", out.get("scale_t"))
    triton_tiles.launch(cast_kernel, triton_tiles.CAST_TILES, x,
                        (source, lut, xs, row_bits, col_bits, out["data"].view(torch.uint8) if rows else any_data,
                         out["data_t"].view(torch.uint8) if cols else any_data, out.get("scale", any_scale),
                         out.get("scale_t", any_scale), m, k, x.stride(0), x.stride(1)),
                        dict(flags, FMT_MAX=float(fmt.max), EMIN=fmt.emin, MBITS=fmt.mbits, MARGIN=margin,
                             POW2=power_of_two), key=("FROM_FP8", "ROWS", "COLS"))
    return out
