"""The autograd Function behind an FP8 linear layer: three FP8 GEMMs and an input saved in FP8.

    fprop:  x @ Wᵀ  = y        (M, K) · (K, N)
    dgrad:  dy @ W  = dx       (M, N) · (N, K)
    wgrad:  dyᵀ @ x = dW       (N, M) · (M, K)

Every operand of every GEMM is quantized through `minifloat.numerics.quantize.quantize` under the layer's recipe by a
`LayerCaster`, which also applies delayed scaling, records amaxes and feeds telemetry. With per-tensor scales the
backward GEMMs reuse the forward's FP8 tensors transposed (exact). With row, tile or MX scales the backward needs the
operands scaled along the other axis: the weight and the output gradient are re-quantized from high precision, the
input from its saved FP8 copy (a second rounding, lossless for power-of-two scales except for values that fall into
the new block's subnormal range). Only the input is saved (in FP8); the weight is re-quantized from the parameter in
backward — with the forward's own scale for per-tensor recipes, so dgrad sees exactly the forward's FP8 weight.

Output precision: each GEMM returns the compute dtype (torch.autocast's dtype inside an autocast region, else the
input's dtype); gradients are returned in the dtype of the tensor they belong to. Under bfloat16 autocast the
weight gradient is therefore produced in bfloat16 and widened to the parameter dtype, as bfloat16 autocast and
torchao.float8 do: its rounding (at most 2^-8) is far below the E5M2/E4M3 rounding of the operands it comes from (2^-3/2^-4).
"""

from __future__ import annotations

import dataclasses

import torch

from minifloat.fp8 import telemetry
from minifloat.fp8.gemm import native_fp8_available, operand, scaled_mm
from minifloat.numerics.quantize import Quantized, abs_max, quantize, quantize_t, scale_from_amax
from minifloat.fp8.recipes import ROLES, DelayedScaling, Recipe, Role
from minifloat.fp8.scaling import ScalingState

_OPERAND = torch.bfloat16  # FP8 values are exact bfloat16 values: the emulated GEMM's operand dtype


@dataclasses.dataclass
class LayerCaster:
    """Quantizes one layer's tensors under a recipe, keeping its ScalingState up to date."""

    recipe: Recipe
    state: ScalingState
    name: str = ""
    backend: str | None = None
    recording: bool = True  # False in evaluation: amaxes of eval batches do not enter the training history

    def formats(self) -> dict:
        return {role: self.recipe.spec(role).fmt for role in ROLES}

    def begin_step(self) -> None:
        """Start of a training step: delayed scaling turns last step's amaxes into scales; the history rolls.

        The history rolls under every recipe, so it always holds the last H steps' amaxes (telemetry, and current
        statistics when a run switches to DelayedScaling).
        """
        if self.recipe.delayed:
            self.state.resize(self.recipe.history_len)
            self.state.update(self.recipe, self.formats())
        else:
            self.state.roll()

    def _native(self, t: torch.Tensor, granularity: str) -> bool:
        return (self.backend != "emulated" and t.is_cuda and native_fp8_available(t.device.index or 0)
                and granularity in ("tensor", "row"))

    def cast(self, role: Role, t: torch.Tensor, *, record: bool = True, scale: torch.Tensor | None = None,
             keep_data: bool = False, transposed: bool = False) -> Quantized:
        """Quantize `t` (scaled along its last dim) for role `role`.

        The result carries what its GEMM needs: FP8 data for the native backend, a bfloat16 operand for the
        emulated one; `keep_data` also keeps the FP8 data (for tensors saved for backward). `scale` (a
        dequantization scale) repeats an earlier per-tensor cast exactly. `transposed` quantizes tᵀ (scaled along
        t's first dim) without copying t; it is for re-quantizations in backward and records nothing.
        """
        spec = self.recipe.spec(role)
        if transposed:
            return quantize_t(t, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                              power_of_two=spec.power_of_two, mx_rule=spec.mx_rule, operand_dtype=_OPERAND,
                              keep_data=False)
        native = self._native(t, "tensor" if scale is not None else spec.granularity)
        out = dict(operand_dtype=None if native else _OPERAND, keep_data=keep_data or native)
        if scale is not None:
            return quantize(t, spec.fmt, granularity="tensor", scale=scale, **out)
        qscale = self.state.scale_for(role) if spec.delayed else None
        if qscale is None:
            q = quantize(t, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                         power_of_two=spec.power_of_two, mx_rule=spec.mx_rule, **out)
            amax = q.amax
            seed = 1.0 / q.scale if spec.delayed else None  # DelayedScaling's first step: seed from current amax
        else:
            q = quantize(t, spec.fmt, granularity="tensor", scale=1.0 / qscale, **out)
            amax, seed = q.amax, None
        if record and self.recording:
            self.state.record(role, amax, seed_scale=seed)
        if record and telemetry.enabled():
            telemetry.observe(self.name, role.value, t, q)
        return q

    def observe_high_precision(self, role: Role, t: torch.Tensor) -> None:
        """Calibration: record `t`'s amax (and seed the scale) without quantizing anything."""
        spec = self.recipe.spec(role)
        amax = abs_max(t.detach(), None)
        self.state.record(role, amax, seed_scale=scale_from_amax(amax, spec.fmt, margin=spec.margin))


def _transposed(q: Quantized, caster: LayerCaster, role: Role, source: torch.Tensor | None) -> Quantized:
    """q scaled along its other axis: exact transpose when possible, else re-quantized (from `source` if given,
    else from q's own values: a bfloat16 operand for power-of-two scales, which holds them exactly)."""
    if q.granularity in ("tensor", "block"):
        return q.t()
    if source is None:
        source = operand(q) if q.scale_folded else q.dequantize()
    return caster.cast(role, source, record=False, transposed=True)


def _weight_along_n(caster: LayerCaster, weight: torch.Tensor, granularity: str,
                    scale: torch.Tensor | None) -> Quantized:
    """Wᵀ quantized along N for dgrad, from the weight parameter."""
    if granularity == "tensor":  # the forward's scale: the same FP8 values as in the forward, transposed
        return caster.cast(Role.WEIGHT, weight, scale=scale, record=False).t()
    if granularity == "block":  # 128×128 blocks transpose with their scales
        return caster.cast(Role.WEIGHT, weight, record=False).t()
    return caster.cast(Role.WEIGHT, weight, record=False, transposed=True)


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ Wᵀ + b with all three GEMMs in FP8.

    Forward: quantize x (role input) and W (role weight), y = scaled_mm(x, W) + b; save x in FP8 with its scale.
    Backward: quantize dy (role grad_output); dx = dy @ W and dW = dyᵀ @ x as FP8 GEMMs; db = Σ dy in fp32.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, caster: LayerCaster, compute_dtype: torch.dtype):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            qx = caster.cast(Role.INPUT, x2, keep_data=True)  # saved for backward in FP8
            qw = caster.cast(Role.WEIGHT, weight)
            # fprop: x @ Wᵀ = y
            y = scaled_mm(qx, qw, out_dtype=compute_dtype, bias=bias, backend=caster.backend)
        # Saved for backward: the input's FP8 bytes and scales, and the weight parameter itself (no copy: the
        # backward re-quantizes it, identically for per-tensor scales by reusing the forward's scale).
        ctx.save_for_backward(qx.data, qx.scale, weight, qw.scale if qw.granularity == "tensor" else None)
        ctx.meta = (qx.fmt, qx.granularity, qx.scale_folded, qw.granularity)
        ctx.caster, ctx.compute_dtype = caster, compute_dtype
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xd, xs, weight, ws = ctx.saved_tensors
        xf, xg, xfold, wg = ctx.meta
        qx = Quantized(xd, xs, xf, xg, scale_folded=xfold)
        caster, out_dtype = ctx.caster, ctx.compute_dtype
        dy2 = dy.reshape(-1, dy.shape[-1])
        with torch.autocast(dy.device.type, enabled=False):
            qdy = caster.cast(Role.GRAD_OUTPUT, dy2)

            # dgrad: dy @ W = dx   — needs W scaled along N (its rows' other axis)
            qwt = _weight_along_n(caster, weight, wg, ws)
            dx = scaled_mm(qdy, qwt, out_dtype=out_dtype, backend=caster.backend)

            # wgrad: dyᵀ @ x = dW  — needs dy and x scaled along M (the token axis)
            qdyt = _transposed(qdy, caster, Role.GRAD_OUTPUT, dy2)
            qxt = _transposed(qx, caster, Role.INPUT, None)
            dw = scaled_mm(qdyt, qxt, out_dtype=out_dtype, backend=caster.backend)

            # db = Σ dy, accumulated in fp32 by torch and returned in dy's dtype (as F.linear's backward does)
            db = dy2.sum(0) if ctx.has_bias else None
        dx = dx.reshape(*dy.shape[:-1], dx.shape[-1]).to(ctx.x_dtype)
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
