"""One-pass FP8 casts on a GPU: scale, round, store row-major and/or transposed, and take the amax, in one Triton kernel.

An FP8 linear layer needs each 2-D tensor in two layouts: x (M, K) row-major for one GEMM and xᵀ (K, M) row-major for
another (torch._scaled_mm takes its first operand row-major and its second column-major). Cast and transpose as
separate steps read the high-precision tensor once and the FP8 one again (`.contiguous()`: a third of the GPU time of
an FP8 layer's step before this kernel); here one program loads a (BLOCK_M, BLOCK_K) tile once and writes both.

    y    = clamp(x · qscale, ±fmt.max)          qscale: one per tensor, per row or per column (its strides say which)
    data = round_to_grid(y)                      written as (M, K) and/or (K, M), either or both
    amax = max |x|                               optional; per tensor, NaN propagates

The rounding is `minifloat.numerics.rounding.round_to_grid`, in the kernel's own arithmetic: ulp = 2^(max(e, emin) -
mbits) from y's exponent bits, |y|·2^-k rounded to an integer by adding and subtracting 1.5·2^23 (round-half-to-even
in float32's default rounding mode, exact for |v| < 2^22), the sign put back bit for bit. Every step is exact, so the
result is the CPU emulation's, bit for bit, with or without FMA contraction. Only exactly representable values reach
the FP8 conversion, so no conversion rounds (Triton's interpreter rounds inexact values wrongly near powers of two).

The amax is the maximum of |x|'s float32 bit patterns as int32 (for non-negative floats integer order is value order,
and every NaN pattern lies above +inf), taken per tile and merged with an integer atomic max: NaN propagates, as
torch's amax does.

`quantize` and `quantize_t` call `fused_cast` for 2-D tensors cast per tensor, row or column to FP8 data without a
bfloat16 operand, on CUDA when Triton imports (the native GEMM path). Under torch.compile they do not: the graph's own
ops are left to inductor, which fuses them itself. The kernels are built on first use, so TRITON_INTERPRET=1 set
before then runs them on CPU tensors (tests/test_triton_cast.py).
"""

from __future__ import annotations

import functools
import os

import torch

from minifloat.numerics.formats import NumberFormat

BLOCK_M = 64
BLOCK_K = 64
_MAGIC = 12582912.0  # 1.5 · 2^23: v + MAGIC - MAGIC rounds |v| < 2^22 to an integer, ties to even
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.cache
def _triton():
    """The triton module, or None where it does not import."""
    try:
        import triton  # noqa: F401 - optional: shipped with CUDA builds of torch
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Triton kernels
        return None
    return triton


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(x: torch.Tensor) -> bool:
    """Whether `fused_cast` can run on `x` here: a CUDA tensor with Triton, or any tensor in the interpreter."""
    if torch.compiler.is_compiling() or (not x.is_cuda and not interpreted()):
        return False
    return _triton() is not None


def takes(x: torch.Tensor, storage: torch.dtype | None, operand_dtype: torch.dtype | None, unblocked: bool) -> bool:
    """Whether `quantize` casts `x` here: FP8 data (`storage`) of a 2-D tensor scaled per tensor, row or column
    (`unblocked`), no bfloat16 operand, where `available`."""
    return (x.dim() == 2 and operand_dtype is None and storage in _FP8 and unblocked and available(x))


tl = None  # triton.language, bound by _kernel() where the kernels are built
_larger = None  # _larger_fn once compiled by triton.jit


@functools.cache
def _kernel():
    """The Triton kernel, built on first use, so TRITON_INTERPRET is read then, not at import. Its helpers are module
    globals (the kernel's source resolves names there; the interpreter runs tl's own library functions such as tl.max
    only when TRITON_INTERPRET was set before triton's import, hence the combine function of our own)."""
    global tl, _larger
    triton = _triton()
    tl = triton.language
    _larger = triton.jit(_larger_fn)
    return triton.jit(_cast_kernel_fn)


def _larger_fn(a, b):
    return tl.maximum(a, b)


def _cast_kernel_fn(x_ptr, q_ptr, out_ptr, out_t_ptr, amax_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_qk,
                    FMT_MAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                    WRITE: tl.constexpr, WRITE_T: tl.constexpr, AMAX: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    q = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qk, mask=mask, other=1.0)
    y = x * q
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX))  # saturate; NaN stays NaN
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    # |y| · 2^(mbits - e), an exact power-of-two scaling, rounded to an integer (ties to even), scaled back
    inv_ulp = ((MBITS - exponent + 127) << 23).to(tl.float32, bitcast=True)
    ulp = ((exponent - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    units = tl.abs(y) * inv_ulp
    rounded = ((units + 12582912.0) - 12582912.0) * ulp
    # the FP8 code, built from the exact value's bits (no conversion instruction rounds anything)
    rb = rounded.to(tl.int32, bitcast=True)
    e = ((rb >> 23) & 0xFF) - 127
    normal = ((e + 1 - EMIN) << MBITS) | ((rb & 0x7FFFFF) >> (23 - MBITS))
    small = tl.where((e < EMIN) & (y == y), rounded, 0.0)  # a subnormal's code is the exact integer |y| / 2^(emin-m)
    subnormal = (small * (1 << (MBITS - EMIN))).to(tl.int32)
    code = tl.where(e >= EMIN, normal, subnormal)
    code = tl.where(y != y, 0x7F, code) | ((bits >> 24) & 0x80)  # NaN as torch writes it; the sign bit for bit
    r8 = code.to(tl.uint8)
    if WRITE:
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], r8, mask=mask)
    if WRITE_T:
        tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(r8), mask=tl.trans(mask))
    if AMAX:
        a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tl.atomic_max(amax_ptr, tl.reduce(tl.reduce(a, 1, _larger), 0, _larger))


def fused_cast(x: torch.Tensor, fmt: NumberFormat, qscale: torch.Tensor, *, along: str = "tensor",
               write: bool = True, write_t: bool = False, want_amax: bool = False
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """cast(x · qscale) onto `fmt` for a 2-D `x`, in one pass over x.

    Args:
        x: (M, K) floating tensor (any strides).
        fmt: E4M3 or E5M2.
        qscale: float32 quantization multipliers: () for along="tensor", M of them for "row", K for "column".
        along: which axis the multipliers follow: "tensor", "row" or "column".
        write: return the (M, K) row-major FP8 data.
        write_t: return the (K, M) row-major FP8 data of xᵀ (the same values).
        want_amax: return max |x| (float32, 0-dim; NaN if x holds one).
    Returns:
        (data or None, data of xᵀ or None, amax or None); bitwise `quantize`'s data and amax for the same scales.
    """
    if x.dim() != 2 or fmt.torch_dtype not in _FP8:
        raise ValueError(f"fused_cast takes a 2-D tensor and an FP8 format, got shape {tuple(x.shape)} and {fmt.name}")
    m, k = x.shape
    q = qscale.float().contiguous()
    strides = {"tensor": (0, 0), "row": (1, 0), "column": (0, 1)}[along]
    dtype = fmt.torch_dtype
    out = torch.empty((m, k), dtype=dtype, device=x.device) if write else None
    out_t = torch.empty((k, m), dtype=dtype, device=x.device) if write_t else None
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device) if want_amax else None
    if m and k:
        grid = (-(-m // BLOCK_M), -(-k // BLOCK_K))
        placeholder = out if out is not None else out_t
        placeholder = placeholder.view(torch.uint8)
        _kernel()[grid](x, q, out.view(torch.uint8) if write else placeholder,
                        out_t.view(torch.uint8) if write_t else placeholder,
                        amax_bits if want_amax else q, m, k, x.stride(0), x.stride(1), *strides,
                        FMT_MAX=float(fmt.max), EMIN=fmt.emin, MBITS=fmt.mbits,
                        WRITE=write, WRITE_T=write_t, AMAX=want_amax, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    amax = amax_bits.view(torch.float32) if want_amax else None
    return out, out_t, amax
