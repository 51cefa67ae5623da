"""One-pass FP8 casts of DeepSeek-V3's 1×128 tiles and 128×128 blocks on a GPU: one Triton kernel.

The block recipe's three GEMMs want each tensor scaled along the axis they sum over:

    fprop  x (M, K) tiles along K        W (N, K) 128×128 blocks
    dgrad  dy (M, N) tiles along N       Wᵀ (K, N) the same blocks, transposed
    wgrad  dyᵀ (N, M) tiles along M      xᵀ (K, M) tiles along M

A program here loads one 128×128 tile of a tensor once and writes what those GEMMs need from it, row-major, each
with its own scales and amaxes:
  * "rows": the tile's 128 row pieces, each scaled by its own amax (1×128 tiles along the last axis): (M, K) data,
    (M, ceil(K/128)) scales;
  * "cols": its 128 column pieces scaled the same way, written as the transpose (1×128 tiles of xᵀ, i.e. 128×1 tiles
    of x): (K, M) data, (K, ceil(M/128)) scales. The same load gives both, so dy is read once for dgrad and wgrad;
  * "block": the whole tile under one scale, written as (M, K) and/or (K, M) data: the weight for fprop and dgrad;
  * from FP8: the input is the forward's saved FP8 x with its row-tile scales (decoded exactly through a 256-entry
    table, times its scale, rounded to bfloat16 where the scales are powers of two, exactly as the torch path's
    dequantization), re-quantized as "cols" for wgrad: the bfloat16 x is never materialised again.

The scales come from each piece's amax by `scale_from_amax`'s rule, the rounding is `triton_cast`'s exact integer
arithmetic (`_code_fn`), the amaxes are integer maxima of |x|'s bit patterns (NaN propagates): every byte is the CPU
emulation's (`quantize` and `quantize_t` on the torch path), with or without FMA contraction. Ragged edges count as
zeros for the amax, as `to_blocks` pads them. `minifloat.numerics.other_axis` and `quantize` call `block_cast` on CUDA
where `triton_cast.available` (the self-check covers these casts too); tests/test_triton_blocks.py runs it in
Triton's interpreter.
"""

from __future__ import annotations

import functools

import torch

from minifloat.numerics import triton_cast
from minifloat.numerics.formats import NumberFormat
from minifloat.numerics.granularity import TILE, Granularity

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
tl = None  # triton.language, bound by _kernel()
_larger = _scale = _code = _load = _record = None  # jitted helpers, bound by _kernel()
# Rows of a tile a program holds in registers at once, and its warps. Compiled for SM 9.0 (Triton 3.9, ptxas 13.4, on
# a CPU: tests/test_triton_aot.py) these use 78-115 registers per thread, no spills; a whole 128×128 tile in registers
# took all 255 and spilled. Not yet timed on a GPU.
SUB = 16
SUB_INTERPRETED = 64  # in Triton's interpreter (tests on the CPU): two slices per tile, the same code, 4x fewer steps
NUM_WARPS = 8


def takes(x: torch.Tensor, storage: torch.dtype | None, operand_dtype: torch.dtype | None,
          granularity: Granularity) -> bool:
    """Whether a cast of `x` to FP8 data (`storage`) in tiles or blocks, without a bfloat16 operand, runs here."""
    return (granularity in (Granularity.TILE, Granularity.BLOCK) and x.dim() == 2 and x.numel() > 0
            and operand_dtype is None and storage in _FP8 and triton_cast.available(x))


@functools.cache
def _kernel():
    """The kernel, built on first use (TRITON_INTERPRET is read then); its helpers are triton_cast's."""
    global tl, _larger, _scale, _code, _load, _record
    triton_cast._kernel()
    tl = triton_cast.tl
    _larger, _scale, _code, _record = triton_cast._larger, triton_cast._scale, triton_cast._code, triton_cast._record
    _load = triton_cast._triton().jit(_load_fn)
    return triton_cast._triton().jit(_block_kernel_fn)


def _load_fn(x_ptr, lut_ptr, xs_ptr, rows, cols, M, K, stride_xm, stride_xk, N_KB, pid_k,
             FROM_FP8: tl.constexpr, FOLD_BF16: tl.constexpr):
    """x[rows, cols] as float32 (zeros outside the tensor), decoded from FP8 codes times their row tiles' scales
    where FROM_FP8, rounded to bfloat16 on the bits (ties to even, exactly) where FOLD_BF16."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offsets = rows[:, None] * stride_xm + cols[None, :] * stride_xk
    if FROM_FP8:
        codes = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32)
        x = tl.load(lut_ptr + codes, mask=mask, other=0.0)
        x = x * tl.load(xs_ptr + rows * N_KB + pid_k, mask=rows < M, other=1.0)[:, None]
        if FOLD_BF16:
            b = x.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            x = tl.where(x != x, x, b.to(tl.float32, bitcast=True))
    else:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return x


def _block_kernel_fn(x_ptr, lut_ptr, xs_ptr, out_ptr, out_t_ptr, ds_ptr, ds_t_ptr, am_ptr, am_t_ptr,
                     tamax_ptr, slot_ptr, counter_ptr, scratch_ptr, M, K, stride_xm, stride_xk, N_KB, N_MB,
                     FROM_FP8: tl.constexpr, FOLD_BF16: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                     BLOCK: tl.constexpr, WRITE_T: tl.constexpr, FMT_MAX: tl.constexpr, EMIN: tl.constexpr,
                     MBITS: tl.constexpr, MARGIN: tl.constexpr, POW2: tl.constexpr, RECORD: tl.constexpr,
                     T: tl.constexpr, SUB: tl.constexpr):
    # One program per 128×128 tile, walked in (SUB, 128) slices so that few values live in registers at once: the
    # first walk casts the row pieces (each slice holds whole rows) and takes the column (or tile) amaxes; the
    # second, where columns or the whole tile set the scales, reads the slices again (from cache) and casts them.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_k * T + tl.arange(0, T)
    col_bits = cols * 0  # (not tl.zeros: a library function the interpreter runs only if set before the import)
    for i in range(0, T, SUB):
        rows = pid_m * T + i + tl.arange(0, SUB)
        x = _load(x_ptr, lut_ptr, xs_ptr, rows, cols, M, K, stride_xm, stride_xk, N_KB, pid_k, FROM_FP8, FOLD_BF16)
        a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        if COLS or BLOCK or RECORD:
            col_bits = tl.maximum(col_bits, tl.reduce(a, 0, _larger))
        if ROWS and not BLOCK:  # one scale per row piece: 1×128 tiles along K
            amax_r = tl.reduce(a, 1, _larger).to(tl.float32, bitcast=True)
            q_r = _scale(amax_r, FMT_MAX, MARGIN, POW2)
            tl.store(ds_ptr + rows * N_KB + pid_k, tl.div_rn(1.0 + 0.0 * q_r, q_r), mask=rows < M)
            tl.store(am_ptr + rows * N_KB + pid_k, amax_r, mask=rows < M)
            r8 = _code(x * q_r[:, None], FMT_MAX, EMIN, MBITS).to(tl.uint8)
            tl.store(out_ptr + rows[:, None] * K + cols[None, :], r8, mask=(rows[:, None] < M) & (cols[None, :] < K))
    if COLS or BLOCK:
        if BLOCK:  # one scale for the tile
            amax = tl.reduce(col_bits, 0, _larger).to(tl.float32, bitcast=True)
            q = _scale(amax, FMT_MAX, MARGIN, POW2)
            tl.store(ds_ptr + pid_m * N_KB + pid_k, tl.div_rn(1.0 + 0.0 * q, q))
            tl.store(am_ptr + pid_m * N_KB + pid_k, amax)
        else:  # one scale per column piece: 1×128 tiles of xᵀ, written as xᵀ
            amax_c = col_bits.to(tl.float32, bitcast=True)
            q = _scale(amax_c, FMT_MAX, MARGIN, POW2)
            tl.store(ds_t_ptr + cols * N_MB + pid_m, tl.div_rn(1.0 + 0.0 * q, q), mask=cols < K)
            tl.store(am_t_ptr + cols * N_MB + pid_m, amax_c, mask=cols < K)
        for i in range(0, T, SUB):
            rows = pid_m * T + i + tl.arange(0, SUB)
            mask = (rows[:, None] < M) & (cols[None, :] < K)
            x = _load(x_ptr, lut_ptr, xs_ptr, rows, cols, M, K, stride_xm, stride_xk, N_KB, pid_k, FROM_FP8,
                      FOLD_BF16)
            c8 = _code(x * (q if BLOCK else q[None, :]), FMT_MAX, EMIN, MBITS).to(tl.uint8)
            if BLOCK and ROWS:
                tl.store(out_ptr + rows[:, None] * K + cols[None, :], c8, mask=mask)
            if COLS or WRITE_T:
                tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(c8), mask=tl.trans(mask))
    if RECORD:  # the whole tensor's amax into a ScalingState's slot (triton_cast._record_fn), in this launch
        _record(tl.reduce(col_bits, 0, _larger), tamax_ptr, slot_ptr, counter_ptr, scratch_ptr)


@functools.cache
def _decode_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """float32 value of each of the 256 codes of an FP8 dtype (torch's own exact decoding)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float().to(device)


def block_cast(x: torch.Tensor, fmt: NumberFormat, *, rows: bool = False, cols: bool = False, block: bool = False,
               write_t: bool = False, margin: int = 0, power_of_two: bool = False,
               row_scales: torch.Tensor | None = None, fold_bf16: bool = False,
               record: triton_cast.AmaxSlot | None = None) -> dict[str, torch.Tensor]:
    """Cast a 2-D `x` to `fmt` in 1×128 tiles along its rows and/or columns, or in 128×128 blocks, in one pass.

    Args:
        x: (M, K): a floating tensor (any strides), or FP8 data with `row_scales` (see below).
        fmt: E4M3 or E5M2.
        rows: 1×128 tiles along K (with `block`: write the (M, K) data).
        cols: 1×128 tiles along M, written as xᵀ (K, M); not with `block`.
        block: 128×128 blocks, one scale each.
        write_t: with `block`, also write the (K, M) transposed data (the same values).
        margin, power_of_two: `scale_from_amax`'s options.
        row_scales: x is FP8 data (float8 dtype) and these are its (M, ceil(K/128)) dequantization scales: the values
            cast are data · row_scales (rounded to bfloat16 with `fold_bf16`), as the torch path's dequantization.
        record: a ScalingState's slot (`ScalingState.amax_slot`): x's amax is also folded into it, as
            `ScalingState.record` does with the cast's amaxes, in this launch (`triton_cast.fused_cast`'s scheme).
    Returns:
        a dict with "data", "scale", "amax" (rows or block: (M, K), (M, KB) / (MB, KB)) and "data_t", "scale_t",
        "amax_t" (cols: (K, M), (K, MB); block with write_t: "data_t" only), float32 scales and amaxes.
    """
    if x.dim() != 2 or not x.numel() or fmt.torch_dtype not in _FP8:
        raise ValueError(f"block_cast takes a non-empty 2-D tensor and an FP8 format, got shape {tuple(x.shape)} "
                         f"and {fmt.name}")
    if not ((block and not cols and (rows or write_t)) or (not block and not write_t and (rows or cols))):
        raise ValueError("block_cast casts rows and/or cols, or blocks written as rows and/or write_t")
    m, k = x.shape
    n_mb, n_kb = -(-m // TILE), -(-k // TILE)
    device, dtype = x.device, fmt.torch_dtype
    out: dict[str, torch.Tensor] = {}
    if rows:
        out["data"] = torch.empty((m, k), dtype=dtype, device=device)
    if rows or block:
        shape = (n_mb, n_kb) if block else (m, n_kb)
        out["scale"] = torch.empty(shape, dtype=torch.float32, device=device)
        out["amax"] = torch.empty(shape, dtype=torch.float32, device=device)
    if cols or write_t:
        out["data_t"] = torch.empty((k, m), dtype=dtype, device=device)
    if cols:
        out["scale_t"] = torch.empty((k, n_mb), dtype=torch.float32, device=device)
        out["amax_t"] = torch.empty((k, n_mb), dtype=torch.float32, device=device)
    from_fp8 = row_scales is not None
    source = x.view(torch.uint8) if from_fp8 else x
    any_data = out.get("data", out.get("data_t")).view(torch.uint8)  # placeholders for pointers not used
    any_f32 = out.get("scale", out.get("scale_t"))
    lut = _decode_table(x.dtype, device) if from_fp8 else any_f32

    def arg(name, u8=False):
        t = out.get(name)
        return (any_data if u8 else any_f32) if t is None else (t.view(torch.uint8) if u8 else t)

    slot, counter, scratch = record if record is not None else (any_f32, any_f32, any_f32)
    tamax = torch.empty((), dtype=torch.int32, device=device) if record is not None else any_f32
    _kernel()[(n_mb, n_kb)](
        source, lut, row_scales.float().contiguous() if from_fp8 else any_f32, arg("data", True), arg("data_t", True),
        arg("scale"), arg("scale_t"), arg("amax"), arg("amax_t"), tamax, slot, counter, scratch, m, k, x.stride(0),
        x.stride(1), n_kb, n_mb, FROM_FP8=from_fp8, FOLD_BF16=fold_bf16, ROWS=rows, COLS=cols, BLOCK=block,
        WRITE_T=write_t, FMT_MAX=float(fmt.max), EMIN=fmt.emin, MBITS=fmt.mbits, MARGIN=margin,
        POW2=power_of_two, RECORD=record is not None, T=TILE, SUB=SUB_INTERPRETED if triton_cast.interpreted() else SUB, num_warps=NUM_WARPS)
    return out
