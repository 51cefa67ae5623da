"""The autograd Function behind a linear layer under a 4-bit recipe (NVFP4Scaling, MXScaling(format="e2m1")).

    fprop:  x @ Wᵀ  = y        (M, K) · (K, N)     x along K, W along K (NVFP4: 16×16 tiles with weight_2d)
    dgrad:  dy @ W  = dx       (M, N) · (N, K)     dy along N, Wᵀ along N
    wgrad:  dyᵀ @ x = dW       (N, M) · (M, K)     dyᵀ and xᵀ along M, the token axis (NVFP4: rotated by the RHT)

It differs from the FP8 function (minifloat.fp8.autograd.Fp8LinearFunction) where four bits make a difference
(arXiv 2509.25149 §4):

* Every transposed operand is quantized from the high-precision tensor. Re-quantizing a 4-bit copy along the other
  axis would round values a second time onto a grid with one mantissa bit. So the forward quantizes xᵀ along M
  from x and saves that copy for wgrad (what Transformer Engine's column-wise usage saves), and the backward
  quantizes dyᵀ from dy and Wᵀ from W.
* With NVFP4's `weight_2d` the forward's weight tiles transpose exactly: dgrad reuses the forward's weight cast, so
  both GEMMs see the same quantized weight.
* With NVFP4's `rht`, both wgrad operands are rotated along M by the same orthogonal 16×16 transform T (signs
  stored in the layer's ScalingState): (dyᵀ·Tᵀ)·(xᵀ·Tᵀ)ᵀ = dyᵀ·x, so only the quantization changes. M is
  zero-padded to a multiple of 16 first.
* With NVFP4's `stochastic_rounding`, both casts of dy round stochastically, each drawing from the layer's stream.

Every cast goes through the layer's `LayerCaster` (which records amaxes and feeds telemetry); every GEMM is
`fp4_mm` (minifloat.fp8.fourbit.gemm): NVFP4 on Blackwell's FP4 tensor cores where it runs, else `scaled_mm` on
exact bfloat16 operands (E2M1 × E4M3 or × 2^k) with fp32 accumulation, scales applied to the output.
"""

from __future__ import annotations

import torch

from minifloat.fp8 import shared_input
from minifloat.fp8.autograd import refuse_double_backward
from minifloat.fp8.caster import LayerCaster
from minifloat.fp8.fourbit.gemm import fp4_mm
from minifloat.fp8.recipes import NVFP4Scaling, NVFP4Spec, Role
from minifloat.numerics.fp4 import NVFP4Quantized
from minifloat.numerics.quantize import Quantized


def wgrad_rht_signs(caster: LayerCaster) -> torch.Tensor | None:
    """The signs of the random Hadamard transform of the wgrad operands, or None when the recipe applies none."""
    recipe = caster.recipe
    return caster.state.rht_signs if isinstance(recipe, NVFP4Scaling) and recipe.rht else None


def weight_along_n(caster: LayerCaster, weight: torch.Tensor) -> Quantized:
    """Wᵀ scaled along N for dgrad. 16×16 NVFP4 tiles: the forward's cast transposed (the same numbers). Otherwise
    quantized from W along N, once per FP8 step when the layer caches its weight casts."""
    spec = caster.recipe.spec(Role.WEIGHT)
    if isinstance(spec, NVFP4Spec) and spec.block_2d:
        cached = None if caster.weights is None else caster.weights.peek("fprop", weight, caster.state.generation)
        return (cached if cached is not None else caster.cast(Role.WEIGHT, weight, record=False)).t()

    def make() -> Quantized:
        return caster.cast(Role.WEIGHT, weight, record=False, transposed=True)

    if caster.weights is None:
        return make()
    options = (caster.recipe, caster.backend, caster.state.generation)
    return caster.weights.get("dgrad", weight, options, make)[0]


class Fp4LinearFunction(torch.autograd.Function):
    """y = x @ Wᵀ + b with all three GEMMs on 4-bit operands (see the module docstring).

    Forward: quantize x along K (role input) and W (role weight), y = scaled_mm(x, W) + b; when W needs a gradient,
    quantize xᵀ along M from x (rotated under NVFP4's rht) and save it.
    Backward: quantize dy along N (role grad_output), dx = dy @ W; quantize dyᵀ along M from dy (rotated),
    dW = dyᵀ @ x; db = Σ dy in fp32.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, caster: LayerCaster, compute_dtype: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1])
        qx = caster.cast(Role.INPUT, x2)
        qw = caster.cast_weight(weight)
        # fprop: x @ Wᵀ = y
        y = fp4_mm(qx, qw, out_dtype=compute_dtype, bias=bias, backend=caster.backend)
        # Saved for backward: xᵀ quantized along M for wgrad (its bfloat16 operand and scales; for the native GEMM
        # its E2M1 elements, exact in bfloat16, and both levels of scales), and the weight parameter itself.
        qxt = None
        if ctx.needs_input_grad[1]:
            qxt = caster.cast(Role.INPUT, x2, record=False, transposed=True, rht_signs=wgrad_rht_signs(caster))
        if isinstance(qxt, NVFP4Quantized):
            ctx.save_for_backward(weight, qxt.data.to(torch.bfloat16), qxt.scale, qxt.global_scale, qxt.amax)
            ctx.meta = "nvfp4"
        else:
            ctx.save_for_backward(weight, *((qxt.operand, qxt.scale) if qxt is not None else (None, None)))
            ctx.meta = None if qxt is None else (qxt.fmt, qxt.granularity, qxt.scale_folded)
        ctx.caster, ctx.compute_dtype = caster, compute_dtype
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return y if y._base is None else y.clone()  # x is (tokens, in): the caller reshapes (Fp8Linear.forward)

    @staticmethod
    def backward(ctx, dy):
        shared_input.release()  # the forward's siblings are done: its last input cast need not be held
        refuse_double_backward(ctx.caster)
        weight, *saved_xt = ctx.saved_tensors
        caster, out_dtype = ctx.caster, ctx.compute_dtype
        dy2 = dy.reshape(-1, dy.shape[-1])
        qdy = caster.cast(Role.GRAD_OUTPUT, dy2)  # records dy's amax (and feeds telemetry) even without dgrad
        dx = dw = None

        if ctx.needs_input_grad[0]:
            # dgrad: dy @ W = dx
            dx = fp4_mm(qdy, weight_along_n(caster, weight), out_dtype=out_dtype, backend=caster.backend)
            dx = dx.reshape(*dy.shape[:-1], dx.shape[-1]).to(ctx.x_dtype)

        if ctx.needs_input_grad[1]:
            # wgrad: dyᵀ @ x = dW  — both along M, from high precision, rotated alike
            qdyt = caster.cast(Role.GRAD_OUTPUT, dy2, record=False, transposed=True, rht_signs=wgrad_rht_signs(caster))
            if ctx.meta == "nvfp4":
                data, scale, global_scale, amax = saved_xt
                qxt = NVFP4Quantized(data.float(), scale, global_scale, amax)
            else:
                (fmt, granularity, folded), (operand, scale) = ctx.meta, saved_xt
                qxt = Quantized(None, scale, fmt, granularity, operand=operand, scale_folded=folded)
            dw = fp4_mm(qdyt, qxt, out_dtype=out_dtype, backend=caster.backend)

        # db = Σ dy, accumulated in fp32 by torch and returned in dy's dtype (as F.linear's backward does)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None
