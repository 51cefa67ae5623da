"""The autograd Function behind an FP8 linear layer: three FP8 GEMMs and an input saved in FP8.

    fprop:  x @ Wᵀ  = y        (M, K) · (K, N)
    dgrad:  dy @ W  = dx       (M, N) · (N, K)
    wgrad:  dyᵀ @ x = dW       (N, M) · (M, K)

Every operand of every GEMM is quantized under the layer's recipe by its `LayerCaster` (minifloat.fp8.caster), which
also applies delayed scaling, records amaxes and feeds telemetry. With per-tensor scales the
backward GEMMs reuse the forward's FP8 tensors transposed (exact). With row, tile or MX scales the backward needs the
operands scaled along the other axis: the weight and the output gradient are re-quantized from high precision, the
input from its saved FP8 copy (a second rounding, lossless for power-of-two scales except for values that fall into
the new block's subnormal range). Only the input is saved (in FP8); the weight is re-quantized from the parameter in
backward — with the forward's own scale for per-tensor recipes, so dgrad sees exactly the forward's FP8 weight.

Output precision: each GEMM returns the compute dtype (torch.autocast's dtype inside an autocast region, else the
input's dtype); gradients are returned in the dtype of the tensor they belong to. On the emulated path, under
bfloat16 autocast, the weight gradient is therefore produced in bfloat16 and widened to the parameter dtype, as
bfloat16 autocast and torchao.float8 do: its rounding (at most 2^-8) is far below the E5M2/E4M3 rounding of the
operands it comes from (2^-3/2^-4). On the native path dgrad and wgrad write the gradient in its own dtype (an
fp32 master weight's dW in fp32): the tensor core's epilogue rounds the fp32 accumulator once, and neither the
bfloat16 copy nor the pass that widens it exists (Transformer Engine writes wgrad into fp32 likewise). So a native
gradient is rounded once where the emulated one is rounded twice, a difference below the bfloat16 rounding.
"""

from __future__ import annotations

import logging

import torch

from minifloat.fp8 import shared_input
from minifloat.fp8.caster import LayerCaster
from minifloat.fp8.gemm import scaled_mm
from minifloat.fp8.native import OUT_DTYPES as NATIVE_OUT_DTYPES
from minifloat.fp8.recipes import Role
from minifloat.numerics.granularity import Granularity, granularity_info
from minifloat.numerics.quantize import Quantized

# The GEMMs a native tensor-wise or row-wise kernel runs with fast accumulation: Transformer Engine's choice, fprop
# fast, dgrad and wgrad (sums over the token axis, long and with gradients of mixed size) with fp32 promotion.
FAST_ACCUM = frozenset({"fprop"})

log = logging.getLogger("minifloat")
_EVAL_TRAINING_WARNED = False  # once per process


def warn_if_trained_in_eval(caster: LayerCaster) -> None:
    """One warning (per process) when a backward runs through a layer whose forward was an evaluation one (`eval()`
    mode, grad enabled: training in eval mode, say to switch dropout off) under a recipe with delayed roles: such
    forwards record no amax, so the delayed scales never seed or move (each cast falls back to its own amax)."""
    global _EVAL_TRAINING_WARNED
    if torch.compiler.is_compiling() or caster.recording or _EVAL_TRAINING_WARNED:  # no guard on the flag
        return
    if not any(getattr(caster.recipe.spec(role), "delayed", False) for role in Role):
        return
    _EVAL_TRAINING_WARNED = True
    log.warning("minifloat: %s was trained through in eval() mode: FP8 layers record amaxes only in training mode, "
                "so its delayed scales never seed or move (each cast takes its tensor's own amax instead, and "
                "prepare_inference finds no training scales; said once); call model.train() before training (turn "
                "dropout off in the model, not with eval())", caster.name or "an FP8 layer")


def _weight_along_n(caster: LayerCaster, weight: torch.Tensor, granularity: Granularity,
                    scale: torch.Tensor | None) -> Quantized:
    """Wᵀ quantized along N for dgrad, from the weight parameter (once per FP8 step when the layer caches)."""
    precast = caster.precast_weight(weight)
    if precast is not None:
        return precast.t()  # per-tensor: the forward's FP8 weight, gathered again for backward (the same bytes)
    if caster.weights is None:
        return _requantize_weight_t(caster, weight, granularity, scale)
    forward = caster.weights.peek("fprop", weight, caster.state.generation)
    info = granularity_info(granularity)
    if forward is not None and (info.per_tensor or forward.data_t is not None
                                or (info.transposes_exactly and forward.operand is not None)):
        # the forward's own FP8 weight: what re-quantizing (per tensor: with its scale) would give; 128×128 blocks
        # on the native path, cast with their transposed copy, too, and on the emulated one as a bfloat16 operand
        # that the GEMM reads transposed
        return forward.t()
    options = (caster.recipe, caster.backend, granularity, caster.state.generation)
    return caster.weights.get("dgrad", weight, options,
                              lambda: _requantize_weight_t(caster, weight, granularity, scale))[0]


def _requantize_weight_t(caster: LayerCaster, weight: torch.Tensor, granularity: Granularity,
                         scale: torch.Tensor | None) -> Quantized:
    if granularity_info(granularity).per_tensor:  # the forward's scale: its FP8 values, transposed
        return caster.cast(Role.WEIGHT, weight, scale=scale, record=False, with_t=True).t()
    # 128×128 blocks transpose with their scales (quantize_t does that); rows, tiles and MX blocks re-quantize
    return caster.cast(Role.WEIGHT, weight, record=False, transposed=True)


def _gemm(caster: LayerCaster, which: str, a: Quantized, b: Quantized, out_dtype: torch.dtype,
          bias: torch.Tensor | None = None, grad_of: torch.dtype | None = None) -> torch.Tensor:
    """scaled_mm under the layer's backend; an error (backend="native" forced on a product it cannot run) names the
    layer and the GEMM. `grad_of`: the dtype of the tensor a backward GEMM's gradient belongs to, which the native
    path writes directly (see the module docstring)."""
    native_out = grad_of if grad_of in NATIVE_OUT_DTYPES else None
    try:
        return scaled_mm(a, b, out_dtype=out_dtype, bias=bias, backend=caster.backend, fast_accum=which in FAST_ACCUM,
                         native_out_dtype=native_out)
    except ValueError as exc:
        raise ValueError(f"{caster.name or 'an FP8 layer'} ({which}): {exc}") from None


def refuse_double_backward(caster: LayerCaster) -> None:
    """RuntimeError in a backward run with create_graph=True (grad mode on): the low-precision GEMMs' gradients are
    not differentiable, so the second-order terms through the layer would silently be zero."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"{caster.name or 'a low-precision layer'}: a backward with create_graph=True (a gradient "
                           f"penalty, a Hessian-vector product) cannot differentiate through FP8/FP4 layers, whose "
                           f"gradients are not differentiable; run that part under mf.autocast(enabled=False)")


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ Wᵀ + b with all three GEMMs in FP8.

    Forward: quantize x (role input) and W (role weight), y = scaled_mm(x, W) + b; save x in FP8 with its scale.
    Backward: quantize dy (role grad_output); dx = dy @ W and dW = dyᵀ @ x as FP8 GEMMs; db = Σ dy in fp32.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, caster: LayerCaster, compute_dtype: torch.dtype):
        # No autocast switch is needed in here (nor traceable inside a compiled autograd.Function): every op is
        # elementwise, a reduction, or a GEMM whose operands already have the dtype autocast would pick.
        x2 = x.reshape(-1, x.shape[-1])
        qx = caster.cast(Role.INPUT, x2, keep_data=True, with_t=True)  # saved for backward in FP8
        qw = caster.cast_weight(weight)
        # fprop: x @ Wᵀ = y
        y = _gemm(caster, "fprop", qx, qw, compute_dtype, bias)
        # Saved for backward: the input's FP8 bytes (only xᵀ's row-major copy where the cast made one: wgrad reads
        # that) and scales, and the weight parameter itself (no copy: the backward re-quantizes it, identically for
        # per-tensor scales by reusing the forward's scale).
        # Only wgrad reads x: a frozen weight (LoRA, fine-tuning a part) saves none of it.
        transposed = qx.data_t is not None
        wants_dw = ctx.needs_input_grad[1]
        ctx.save_for_backward((qx.data_t if transposed else qx.data) if wants_dw else None,
                              qx.scale if wants_dw else None, weight,
                              qw.scale if granularity_info(qw.granularity).per_tensor else None)
        ctx.meta = (qx.fmt, qx.granularity, qx.scale_folded, qw.granularity, transposed)
        ctx.caster, ctx.compute_dtype = caster, compute_dtype
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return y if y._base is None else y.clone()  # x is (tokens, in): the caller reshapes (Fp8Linear.forward)

    @staticmethod
    def backward(ctx, dy):
        shared_input.release()  # the forward's siblings are done: its last input cast need not be held
        refuse_double_backward(ctx.caster)
        warn_if_trained_in_eval(ctx.caster)
        xd, xs, weight, ws = ctx.saved_tensors
        xf, xg, xfold, wg, transposed = ctx.meta
        caster, out_dtype = ctx.caster, ctx.compute_dtype
        wants_dx, wants_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if wants_dw:
            qdy, qdyt = caster.cast_both(Role.GRAD_OUTPUT, dy2)  # scaled along N for dgrad, along M for wgrad
        else:
            qdy = caster.cast(Role.GRAD_OUTPUT, dy2)  # records dy's amax, as every backward does

        if wants_dx:
            # dgrad: dy @ W = dx   — needs W scaled along N (its rows' other axis)
            qwt = _weight_along_n(caster, weight, wg, ws)
            dx = _gemm(caster, "dgrad", qdy, qwt, out_dtype, grad_of=ctx.x_dtype)
            dx = dx.reshape(*dy.shape[:-1], dx.shape[-1]).to(ctx.x_dtype)
            del qwt
        # dy's layout for dgrad is not needed again: released before wgrad allocates dW (a transposed cast holds
        # both layouts, so the other one's reference goes too)
        del qdy

        if wants_dw:
            qdyt = Quantized(qdyt.data, qdyt.scale, qdyt.fmt, qdyt.granularity, qdyt.amax, qdyt.operand,
                             qdyt.scale_folded)
            qx = (Quantized(xd.t(), xs, xf, xg, scale_folded=xfold, data_t=xd) if transposed
                  else Quantized(xd, xs, xf, xg, scale_folded=xfold))
            # wgrad: dyᵀ @ x = dW  — needs dy and x scaled along M (the token axis)
            qxt = caster.cast_t_of(Role.INPUT, qx)
            dw = _gemm(caster, "wgrad", qdyt, qxt, out_dtype, grad_of=weight.dtype)

        # db = Σ dy, accumulated in fp32 by torch and returned in dy's dtype (as F.linear's backward does)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


def recording_linear(x, weight, bias, caster: LayerCaster) -> torch.Tensor:
    """y = x @ Wᵀ + b in high precision while recording amax(x), amax(W) and, in backward, amax(dy).

    Calibration and BF16 fallback run through here, so the FP8 scales stay current while FP8 is off.
    """
    caster.observe_high_precision(Role.INPUT, x)
    caster.observe_high_precision(Role.WEIGHT, weight)
    y = torch.nn.functional.linear(x, weight, bias)
    if y.requires_grad:
        y.register_hook(lambda dy: caster.observe_high_precision(Role.GRAD_OUTPUT, dy))
    return y
