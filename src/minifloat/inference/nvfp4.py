"""NVFP4 in an inference layer: E2M1 weights stored with their two levels of scale, activations cast at run time.

    W ≈ (weight · weight_scale) · weight_global_scale    weight: E2M1 codes, two per byte, uint8 (out, ⌈in/2⌉)
                                                         weight_scale: float8_e4m3fn, one per 1×16 block along K
                                                           (out, ⌈in/16⌉), or per 16×16 tile (⌈out/16⌉, ⌈in/16⌉)
                                                         weight_global_scale: float32 (), g = 1 / (2688 / amax)

Every cast goes through minifloat.numerics.fp4.quantize_nvfp4, the one NVFP4 rounding path (round to nearest). An
activation's E4M3 block scales always come from its own 16 elements at run time, as NVFP4 kernels compute them;
its global scale, which only places the block scales within E4M3's range, is

    dynamic   per token: the token's amax rounded up to a power of two, 2^e (frexp). Each row is multiplied by 2^-e
              (exact) and the whole tensor cast with global amax 1, which is bitwise the cast of each row alone with
              global amax 2^e (tested): a token's rounding never depends on the other tokens of its batch (a
              per-tensor global scale would), and its largest block scale lands in [224, 448), E4M3's top binade.
    static    one per layer, `input_scale` = 1 / (2688 / amax) from calibration (ModelOpt's NVFP4 input_scale); the
              cast takes 2688 · input_scale as the input's global amax (within an ulp of amax). A token above it
              saturates its block scales at 448.

The product runs through minifloat.fp8.fourbit.gemm.fp4_mm: on FP4 tensor cores where `native_nvfp4` allows (static
activations: both operands are NVFP4 casts), else the exact emulation (one bfloat16 GEMM, fp32 accumulation).
"""

from __future__ import annotations

import torch

from minifloat.fp8.recipes import NVFP4Spec
from minifloat.inference import storage
from minifloat.numerics.formats import E2M1
from minifloat.numerics.fp4 import GLOBAL_RANGE, NVFP4_BLOCK, NVFP4Quantized, global_encode_scale, quantize_nvfp4
from minifloat.numerics.granularity import Granularity
from minifloat.numerics.quantize import Quantized, abs_max
from minifloat.numerics.rounding import div_rn

JSON_FMT = "nvfp4"  # a LayerSpec's JSON "fmt" for an NVFP4Spec (E2M1 elements with two levels of scale)
# the per-token exponent e of 2^-e · x: 2^-e stays a float32 number (2^-128 subnormal, exact) on every device
TOKEN_EXPONENT_RANGE = (-125, 128)


def scale_shape(shape: tuple[int, int], spec: NVFP4Spec) -> tuple[int, int]:
    """Shape of the E4M3 block scales of an (out, in) weight: per 1×16 block along in, or per 16×16 tile."""
    rows, k = shape
    return (-(-rows // NVFP4_BLOCK) if spec.block_2d else rows, -(-k // NVFP4_BLOCK))


def quantize_weight(weight: torch.Tensor, spec: NVFP4Spec) -> NVFP4Quantized:
    """The (out, in) weight cast to NVFP4 (round to nearest; 16×16 tiles with `spec.block_2d`)."""
    return quantize_nvfp4(weight.detach().float(), block_2d=spec.block_2d)


def stored_weight(codes: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                  shape: tuple[int, int], spec: NVFP4Spec) -> NVFP4Quantized:
    """The stored buffers as the NVFP4 cast they hold (E2M1 values as float32)."""
    g = global_scale.float()
    return NVFP4Quantized(storage.decode(codes, E2M1, shape), block_scale, g, g * GLOBAL_RANGE, spec.block_2d)


def static_scale(amax: torch.Tensor) -> torch.Tensor:
    """The static input's global decode scale g = 1 / (2688 / amax) (1 for a zero or non-finite amax)."""
    return div_rn(1.0, global_encode_scale(amax))


def quantize_input(x2: torch.Tensor, input_scale: torch.Tensor | None, *, keep_data: bool
                   ) -> NVFP4Quantized | Quantized:
    """The (tokens, in) input cast to NVFP4 (module docstring): with a static `input_scale` an NVFP4Quantized
    (`keep_data` keeps its E2M1 elements for the native GEMM); dynamic, a per-row scaled operand of scaled_mm."""
    if input_scale is not None:
        return quantize_nvfp4(x2, global_amax=input_scale.float() * GLOBAL_RANGE, operand_dtype=torch.bfloat16,
                              keep_data=keep_data)
    amax = abs_max(x2, -1)  # (tokens, 1)
    _, e = torch.frexp(amax)  # amax = m · 2^e, m in [0.5, 1)
    e = torch.where(torch.isfinite(amax) & (amax > 0), e, torch.zeros_like(e)).clamp(*TOKEN_EXPONENT_RANGE)
    q = quantize_nvfp4(torch.ldexp(x2.float(), -e), global_amax=amax.new_ones(()), operand_dtype=torch.bfloat16,
                       keep_data=False)
    # x̂ = operand · (g · 2^e) per row: g · 2^e is exact
    return Quantized(None, torch.ldexp(torch.ones_like(amax), e) * q.global_scale, E2M1, Granularity.ROW, None,
                     q.operand)
