"""Scaled FP8 matrix multiply: out = (a · sa) @ (b · sb)ᵀ with FP8 operands and fp32 accumulation.

Two backends compute the same thing:
  * "native": torch._scaled_mm on GPUs with FP8 tensor cores (compute capability 8.9+), for per-tensor and per-row
    scales with K and N multiples of 16, and not E5M2 × E5M2;
  * "emulated": everywhere else, by the fastest exact route on the host. Every FP8 value (times a power of two) is
    exactly a bfloat16 value, so a bfloat16 GEMM with fp32 accumulation multiplies FP8 operands exactly. Per-tensor
    and per-row scales factor out of the sum onto the output; power-of-two block scales (MX, BlockScaling's default)
    are folded into the bfloat16 operands exactly; other block scales are applied per 128-wide K block to fp32
    partial sums (DeepSeek-V3's promotion).

Output rounding of the emulated backend: for a bfloat16 output the accumulator is rounded to bfloat16 by the GEMM
and the per-tensor/row scales are applied to that (at most one extra bfloat16 rounding, 2^-8 relative, against the
one a tensor core makes); for float32 (and float16) outputs the GEMM runs with fp32 output and no extra rounding.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from minifloat.numerics.compiling import maybe_compile
from minifloat.numerics.quantize import TILE, Quantized, decode

BACKENDS = ("auto", "native", "emulated")


def _backend_from_env() -> str:
    value = os.environ.get("MINIFLOAT_GEMM_BACKEND", "auto")
    if value not in BACKENDS:
        raise ValueError(f"MINIFLOAT_GEMM_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


@functools.cache
def native_fp8_available(device_index: int = 0) -> bool:
    """Whether this machine has a CUDA GPU with FP8 tensor cores (SM 8.9+) and torch._scaled_mm."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def native_supports(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch._scaled_mm can run this product."""
    if a.data is None or b.data is None:  # operand-only tensors are for the emulated backend
        return False
    if not (a.data.is_cuda and native_fp8_available(a.data.device.index or 0)):
        return False
    if a.data.dim() != 2 or b.data.dim() != 2:
        return False
    if (a.granularity, b.granularity) not in (("tensor", "tensor"), ("row", "row")):
        return False
    if a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2:
        return False
    if a.granularity == "row" and out_dtype != torch.bfloat16:  # cuBLASLt row-wise scaling outputs bf16 only
        return False
    k, n = a.shape[1], b.shape[0]
    return k % 16 == 0 and n % 16 == 0


def resolve_backend(backend: str | None, a: Quantized, b: Quantized,
                    out_dtype: torch.dtype = torch.bfloat16) -> str:
    backend = backend or _backend_from_env()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "native" if native_supports(a, b, out_dtype) else "emulated"
    if backend == "native" and not native_supports(a, b, out_dtype):
        raise ValueError(f"the native backend cannot run this {a.granularity}×{b.granularity} product of shapes "
                         f"{tuple(a.shape)}×{tuple(b.shape)} (needs an SM 8.9+ GPU, FP8 data, tensor or row scales, "
                         f"K and N multiples of 16, not E5M2×E5M2)")
    return backend


def scaled_mm(a: Quantized, b: Quantized, *, out_dtype: torch.dtype = torch.float32,
              bias: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """(a.data · a.scale) @ (b.data · b.scale)ᵀ (+ bias) with fp32 accumulation.

    Args:
        a: (M, K), scaled along K ("tensor", "row", "tile", "mx") or in 128×128 blocks.
        b: (N, K), same conventions.
        out_dtype: output dtype.
        bias: optional (N,) added to the fp32-scaled accumulator.
        backend: "auto" (default, or $MINIFLOAT_GEMM_BACKEND), "native" or "emulated".
    Returns:
        (M, N) tensor of out_dtype.
    """
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_mm needs a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    if resolve_backend(backend, a, b, out_dtype) == "native":
        return _native(a, b, out_dtype, bias)
    return _emulated(a, b, out_dtype, bias)


# ---------------------------------------------------------------------------------------------------- native


def _native(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    # torch._scaled_mm wants A row-major (M, K), B column-major (K, N) and dequantization scales.
    sa, sb = a.scale.float(), b.scale.float()
    if a.granularity == "row":
        sa, sb = sa.reshape(-1, 1), sb.reshape(1, -1)
    bias = None if bias is None else bias.to(out_dtype)
    return torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a=sa, scale_b=sb, bias=bias,
                            out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------------- emulated


def _epilogue_kernel(acc: torch.Tensor, sa: torch.Tensor | None, sb: torch.Tensor | None,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """acc · sa · sb + bias in fp32, rounded once to out_dtype (one pass over the output)."""
    out = acc.float()
    if sa is not None:
        out = out * sa
    if sb is not None:
        out = out * sb
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


_epilogue = maybe_compile(_epilogue_kernel)


def operand(q: Quantized, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q's grid values in `dtype`, with its scales folded in when `q.scale_folded` (exact)."""
    if q.operand is not None and q.operand.dtype == dtype:
        return q.operand
    if q.data is None:
        return q.operand.to(dtype)
    if q.scale_folded:
        return q.dequantize(dtype)  # data · power-of-two scales: exact in bfloat16
    return decode(q.data.detach(), None, dtype)


def _outer_scale(q: Quantized, side: str) -> torch.Tensor | None:
    """Per-tensor or per-row scale that factors out of the sum, shaped to broadcast over (M, N)."""
    if q.scale_folded:
        return None
    if q.granularity == "tensor":
        return q.scale.float()
    if q.granularity == "row":
        return q.scale.float().reshape(-1, 1) if side == "a" else q.scale.float().reshape(1, -1)
    raise AssertionError("block scales are either folded or handled per K block")


def _k_block_scales(q: Quantized) -> torch.Tensor:
    """(rows, ceil(K/128)) scales of a tile- or block-scaled operand."""
    if q.granularity == "tile":
        return q.scale.float().reshape(q.shape[0], -1)
    return q.scale.float().repeat_interleave(TILE, dim=0)[: q.shape[0]]


@contextlib.contextmanager
def _fp32_matmul_via_bf16():
    """Let oneDNN run fp32 GEMMs on bfloat16 units. Exact here: every operand value is a bfloat16 value."""
    knob = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if knob is None or not hasattr(knob, "fp32_precision"):
        yield
        return
    old = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        yield
    finally:
        knob.fp32_precision = old


def _mm_fp32(x: torch.Tensor, y_t: torch.Tensor) -> torch.Tensor:
    """x @ y_t in float32 with exact products (operands are bf16 values) and fp32 accumulation."""
    if x.device.type == "cpu":
        with _fp32_matmul_via_bf16():
            return x.float() @ y_t.float()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would round the operands' mantissas
    try:
        return x.float() @ y_t.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _emulated(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    foldable = all(q.granularity in ("tensor", "row") or q.scale_folded for q in (a, b))
    if not foldable:
        return _emulated_k_blocks(a, b, out_dtype, bias)
    A, B = operand(a), operand(b)
    sa, sb = _outer_scale(a, "a"), _outer_scale(b, "b")
    if out_dtype == torch.bfloat16:
        scalar = (sa is None or sa.dim() == 0) and (sb is None or sb.dim() == 0)
        if scalar and A.device.type == "cpu":
            # one GEMM: alpha scales the fp32 accumulator, bias is added in the epilogue (beta=0 ignores the
            # zero-stride placeholder when there is no bias)
            alpha = (1.0 if sa is None else float(sa)) * (1.0 if sb is None else float(sb))
            base = (bias.to(torch.bfloat16) if bias is not None
                    else torch.zeros((), dtype=torch.bfloat16).expand(A.shape[0], B.shape[0]))
            return torch.addmm(base, A, B.t(), beta=1.0 if bias is not None else 0.0, alpha=alpha)
        acc = torch.mm(A, B.t())
    else:
        acc = _mm_fp32(A, B.t())
    if sa is None and sb is None and bias is None:
        return acc.to(out_dtype)
    return _epilogue(acc, sa, sb, bias, out_dtype)


def _emulated_k_blocks(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None):
    # DeepSeek-V3 §3.3.2: products of each 128-wide K block are summed in fp32, scaled by that block's scales and
    # accumulated into an fp32 result ("promotion to CUDA cores").
    A, B = operand(a, torch.float32), operand(b, torch.float32)
    sa = _k_block_scales(a) if a.granularity in ("tile", "block") else None
    sb = _k_block_scales(b) if b.granularity in ("tile", "block") else None
    m, k = A.shape
    out = torch.zeros(m, B.shape[0], dtype=torch.float32, device=A.device)
    for kb, start in enumerate(range(0, k, TILE)):
        part = _mm_fp32(A[:, start:start + TILE], B[:, start:start + TILE].t())
        if sa is not None:
            part = part * sa[:, kb : kb + 1]
        if sb is not None:
            part = part * sb[:, kb].reshape(1, -1)
        out += part
    outer = [_outer_scale(q, side) if q.granularity in ("tensor", "row") else None for q, side in ((a, "a"), (b, "b"))]
    return _epilogue(out, *outer, bias, out_dtype)
