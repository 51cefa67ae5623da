"""An NVFP4 cast of one of a layer's tensors, always from the high-precision tensor (never from a quantized copy).

`LayerCaster.cast` calls `cast_nvfp4` for every role whose spec is an `NVFP4Spec`, after drawing the stochastic
rounding seed from the layer's stream; the result's bfloat16 operand is what the 4-bit layer's GEMMs multiply.
"""

from __future__ import annotations

import torch

from minifloat.fp8.recipes import NVFP4Spec
from minifloat.numerics.fp4 import NVFP4Quantized, quantize_nvfp4, quantize_nvfp4_t
from minifloat.numerics.granularity import pad_to_multiple
from minifloat.numerics.hadamard import RHT_BLOCK, rht


def cast_nvfp4(spec: NVFP4Spec, t: torch.Tensor, *, seed: torch.Tensor | None, transposed: bool,
               rht_signs: torch.Tensor | None, operand_dtype: torch.dtype, keep_data: bool) -> NVFP4Quantized:
    """`t` (or tᵀ with `transposed`) quantized to NVFP4 under `spec`.

    Args:
        spec: the role's NVFP4 spec (16×16 tiles with `block_2d`, stochastic or nearest rounding).
        t: the high-precision tensor.
        seed: the stochastic rounding seed (None for round-to-nearest).
        transposed: quantize tᵀ, blocked down t's columns (the wgrad operands).
        rht_signs: rotate the blocks of the quantized axis by the random Hadamard transform first (wgrad operands);
            the token axis is zero-padded to whole 16-blocks, which adds nothing to the product.
        operand_dtype: the GEMM operand's dtype.
        keep_data: also keep the E2M1 elements (telemetry reads them).
    """
    if transposed and t.dim() == 2 and not spec.block_2d:  # tᵀ blocked down t's columns, no copy of tᵀ
        return quantize_nvfp4_t(t, rounding=spec.rounding, seed=seed, operand_dtype=operand_dtype,
                                rht_signs=rht_signs, keep_data=keep_data)
    source = t.t() if transposed else t
    if rht_signs is not None:
        source = rht(pad_to_multiple(source.float(), RHT_BLOCK), rht_signs)
    return quantize_nvfp4(source, block_2d=spec.block_2d, rounding=spec.rounding, seed=seed,
                          operand_dtype=operand_dtype, keep_data=keep_data)
