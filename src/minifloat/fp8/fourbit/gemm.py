"""The 4-bit layer's GEMMs: NVFP4 operands on Blackwell's FP4 tensor cores where they run, else the exact emulation.

An NVFP4 cast made for the native GEMM (`minifloat.fp8.native.native_nvfp4`: a Blackwell GPU whose check against
the emulation passed) keeps its E2M1 elements; `fp4_mm` multiplies two such casts with torch._scaled_mm (the elements
packed two per byte, the E4M3 block scales swizzled) and applies the per-tensor scales to the product as the
emulation does: the product rounded to the output dtype for bfloat16 outputs (else kept in fp32), then
g_a · g_b (and the bias) in fp32, rounded once. Everything else (casts made as bfloat16 operands, MXFP4, shapes or
devices the kernel cannot take) runs `scaled_mm` on the operands' exact bfloat16 values.
"""

from __future__ import annotations

import logging

import torch

from minifloat.fp8.gemm import epilogue, scaled_mm
from minifloat.fp8.native import NVFP4_PAIR, backend_from_env, nvfp4_mm, nvfp4_support
from minifloat.numerics.fp4 import NVFP4Quantized
from minifloat.numerics.quantize import Quantized

log = logging.getLogger("minifloat")
_REFUSED: set[tuple] = set()  # shapes torch._scaled_mm refused in this process: they run emulated


def as_operand(q: NVFP4Quantized | Quantized) -> Quantized:
    """`q` as an operand of `scaled_mm`: an NVFP4 cast's exact bfloat16 values under its per-tensor scale."""
    return q.gemm_operand(torch.bfloat16) if isinstance(q, NVFP4Quantized) else q


def fp4_mm(a: NVFP4Quantized | Quantized, b: NVFP4Quantized | Quantized, *, out_dtype: torch.dtype,
           bias: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """a @ bᵀ (+ bias) for a (M, K) and b (N, K) cast by a 4-bit layer; natively where `nvfp4_support` allows."""
    backend = backend_from_env(backend)
    if isinstance(a, NVFP4Quantized) and isinstance(b, NVFP4Quantized) and backend != "emulated":
        reason = nvfp4_support(a, b, out_dtype)
        if reason is None:
            return _native(a, b, out_dtype, bias)
        if backend == "native":
            raise ValueError(f"the native backend cannot run this {NVFP4_PAIR} product of shapes {tuple(a.shape)} × "
                             f"{tuple(b.shape)}: {reason}")
    return scaled_mm(as_operand(a), as_operand(b), out_dtype=out_dtype, bias=bias, backend=backend)


def _native(a: NVFP4Quantized, b: NVFP4Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    compiling = torch.compiler.is_compiling()
    key = None if compiling else (tuple(a.shape), tuple(b.shape), out_dtype, a.data.device)
    if key is not None and key in _REFUSED:
        return _emulated(a, b, out_dtype, bias)
    try:
        return native_product(a, b, out_dtype, bias)
    except (RuntimeError, ValueError) as exc:  # a product the rules admit but this cuBLAS refuses
        if compiling:
            raise
        _REFUSED.add(key)
        log.warning("minifloat: torch._scaled_mm refused an %s product of shapes %s × %s (%s); it runs emulated",
                    NVFP4_PAIR, tuple(a.shape), tuple(b.shape), str(exc).splitlines()[0] if str(exc) else exc)
        return _emulated(a, b, out_dtype, bias)


def native_product(a: NVFP4Quantized, b: NVFP4Quantized, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native GEMM's product with the per-tensor scales and bias applied as the emulation applies them: the
    kernel's product rounded to bfloat16 for bfloat16 outputs (else kept in fp32), then g_a · g_b (+ bias)."""
    acc = nvfp4_mm(a, b, torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    return epilogue(acc, a.global_scale.float(), b.global_scale.float(), bias, out_dtype)


def _emulated(a: NVFP4Quantized, b: NVFP4Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None):
    return scaled_mm(as_operand(a), as_operand(b), out_dtype=out_dtype, bias=bias, backend="emulated")
