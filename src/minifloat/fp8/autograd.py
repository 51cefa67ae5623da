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
torchao.float8 do: its rounding (at most 2^-8) is far below the E5M2/E4M3 rounding of the operands it comes from
(2^-3/2^-4).

A weight may arrive already cast: FSDP2's FP8 all-gather (minifloat.distributed.fsdp) gathers each rank's shard cast
by `LayerCaster.cast_weight_shard`, and the gathered weight carries that cast as `weight.fp8_cast` (a `Quantized`)
with the spec it was cast under as `weight.fp8_spec`. When that spec is the layer's weight spec, fprop and dgrad use
the gathered cast as they would use the layer's own cast of the whole weight (it is bitwise that cast).

The `LayerCaster` also casts for the 4-bit recipes (minifloat.fp8.fp4linear runs their GEMMs): an NVFP4 role
(`NVFP4Spec`) goes through `numerics.fp4.quantize_nvfp4`, from the high-precision tensor, optionally rotated by the
random Hadamard transform and rounded stochastically from the layer's stream, and comes back as its GEMM operand.

A layer may see only a shard of its tensors: under tensor parallelism (minifloat.distributed.tp) a row- or
column-parallel layer's weight, input or output gradient is a slice of the unsharded one. Its `LayerCaster` then
carries `amax_reduce`, which turns a shard's amax into the whole tensor's (a MAX all-reduce over the TP group), and
every per-tensor scale taken from a tensor (current scaling, a delayed role's seed, calibration) comes from that
whole amax: each shard is cast with the unsharded cast's scale, so its FP8 values are the unsharded cast's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from minifloat.fp8 import telemetry
from minifloat.fp8.gemm import native_granularity, operand, scaled_mm
from minifloat.numerics.fp4 import NVFP4Quantized, quantize_nvfp4, quantize_nvfp4_t
from minifloat.numerics.granularity import Granularity, granularity_info, pad_to_multiple
from minifloat.numerics.hadamard import RHT_BLOCK, rht
from minifloat.numerics.quantize import Quantized, abs_max, quantize, quantize_t
from minifloat.fp8.recipes import NVFP4Spec, Recipe, Role
from minifloat.fp8.scaling import ROLE_INDEX, ScalingState

_OPERAND = torch.bfloat16  # FP8 values are exact bfloat16 values: the emulated GEMM's operand dtype
# The GEMMs a native tensor-wise or row-wise kernel runs with fast accumulation: Transformer Engine's choice, fprop
# fast, dgrad and wgrad (sums over the token axis, long and with gradients of mixed size) with fp32 promotion.
FAST_ACCUM = frozenset({"fprop"})


class WeightCache:
    """A layer's weight casts for the current FP8 step (Transformer Engine's `is_first_microbatch`).

    The weight does not change between the micro-batches of an optimizer step, so its casts are made once. An entry
    is keyed by the weight's version counter and storage (an optimizer step, `load_state_dict` or a `.data`
    swap invalidate it) and the casting options; `clear()` runs at every FP8 step, when delayed scales change.
    Compiled graphs do not use it (the cast is part of the graph; keying on Python state would add guards).
    """

    def __init__(self):
        self._entries: dict[str, tuple[tuple, Quantized]] = {}

    def get(self, kind: str, weight: torch.Tensor, options: tuple, make: Callable[[], Quantized]
            ) -> tuple[Quantized, bool]:
        """(the cast, whether it came from the cache)."""
        if torch.compiler.is_compiling():
            return make(), False
        key = (weight._version, weight.data_ptr(), weight.dtype, weight.device, options)
        entry = self._entries.get(kind)
        if entry is not None and entry[0] == key:
            return entry[1], True
        q = make()
        self._entries[kind] = (key, q)
        return q, False

    def peek(self, kind: str, weight: torch.Tensor, generation: int) -> Quantized | None:
        """The `kind` cast of this very weight in this scaling generation (whatever its other options), else None."""
        entry = self._entries.get(kind)
        if torch.compiler.is_compiling() or entry is None:
            return None
        same_weight = entry[0][:4] == (weight._version, weight.data_ptr(), weight.dtype, weight.device)
        return entry[1] if same_weight and entry[0][4][-1] == generation else None

    def clear(self) -> None:
        self._entries.clear()


@dataclasses.dataclass
class LayerCaster:
    """Quantizes one layer's tensors under a recipe and records their amaxes in its ScalingState.

    `recording` is False for evaluation forwards (their amaxes stay out of the training history); casts then
    still use the stored delayed scales but never seed them. `amax_reduce`, for a layer that sees shards of its
    tensors, maps a shard's amax to the whole tensor's (see the module docstring); only per-tensor casts take it.
    """

    recipe: Recipe
    state: ScalingState
    name: str = ""
    backend: str | None = None
    recording: bool = True
    weights: WeightCache | None = None
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _whole_amax(self, t: torch.Tensor) -> torch.Tensor:
        """amax(|t|) of the whole tensor `t` is a shard of (t's own without `amax_reduce`)."""
        amax = abs_max(t.detach(), None)
        return amax if self.amax_reduce is None else self.amax_reduce(amax)

    def cast(self, role: Role, t: torch.Tensor, *, record: bool = True, scale: torch.Tensor | None = None,
             keep_data: bool = False, transposed: bool = False, rht_signs: torch.Tensor | None = None,
             with_t: bool = False) -> Quantized:
        """Quantize `t` (scaled along its last dim) for role `role`.

        The result carries what its GEMM needs: FP8 data for the native backend, a bfloat16 operand for the
        emulated one; `keep_data` also keeps the FP8 data (for tensors saved for backward). `scale` (a
        dequantization scale) repeats an earlier per-tensor cast exactly. `transposed` quantizes tᵀ (scaled along
        t's first dim) without copying t; it is for re-quantizations in backward and records nothing. `rht_signs`
        (NVFP4 only) rotates the blocks of the quantized axis first: the wgrad's operands. `with_t` asks for the FP8
        data's row-major transpose as well (`Quantized.data_t`, the same pass on a GPU) where the cast is for the native
        backend and its scales transpose with it: the backward GEMM then reads it without a copy.
        """
        spec = self.recipe.spec(role)
        if isinstance(spec, NVFP4Spec):
            return self._cast_nvfp4(role, spec, t, record=record, transposed=transposed, rht_signs=rht_signs)
        # FP8 data for the native backend, a bfloat16 operand for the emulated one (gemm decides, once)
        native = native_granularity(t.device, Granularity.TENSOR if scale is not None else spec.granularity,
                                    self.backend)
        out = dict(operand_dtype=None if native else _OPERAND, keep_data=keep_data or native)
        if with_t and native and not transposed and granularity_info(spec.granularity).per_tensor:
            out["with_t"] = True
        if transposed:
            return quantize_t(t, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                              power_of_two=spec.power_of_two, mx_rule=spec.mx_rule, **out)
        if scale is not None:
            return quantize(t, spec.fmt, granularity=Granularity.TENSOR, scale=scale, **out)
        if spec.delayed:
            qscale, amax = self.state.delayed_scale(ROLE_INDEX[role], lambda: self._whole_amax(t), spec.fmt,
                                                    margin=spec.margin, store=record and self.recording)
            q = quantize(t, spec.fmt, granularity=Granularity.TENSOR, scale=1.0 / qscale, amax=amax, **out)
        else:
            if self.amax_reduce is not None and not granularity_info(spec.granularity).per_tensor:
                raise ValueError(f"a sharded (tensor-parallel) layer casts per tensor only, not "
                                 f"'{spec.granularity}' ({role.value} of {self.name or 'a layer'})")
            q = quantize(t, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                         power_of_two=spec.power_of_two, mx_rule=spec.mx_rule,
                         amax=None if self.amax_reduce is None else self._whole_amax(t), **out)
        if record:
            self._observe(role, t, q)
        return q

    def _cast_nvfp4(self, role: Role, spec: NVFP4Spec, t: torch.Tensor, *, record: bool, transposed: bool,
                    rht_signs: torch.Tensor | None) -> Quantized:
        """An NVFP4 cast (always from `t` itself, never from a quantized copy), returned as its GEMM operand."""
        if self.amax_reduce is not None:
            raise ValueError(f"a sharded (tensor-parallel) layer casts per tensor only, not NVFP4 ({role.value} of "
                             f"{self.name or 'a layer'})")
        seed = self.state.sr_next_seed() if spec.rounding == "stochastic" else None
        # the GEMM needs only the operand; telemetry also reads the E2M1 elements
        keep_data = record and self.recording and telemetry.enabled()
        if transposed and t.dim() == 2 and not spec.block_2d:  # tᵀ blocked down t's columns, no copy of tᵀ
            q = quantize_nvfp4_t(t, rounding=spec.rounding, seed=seed, operand_dtype=_OPERAND,
                                 rht_signs=rht_signs, keep_data=keep_data)
        else:
            source = t.t() if transposed else t
            if rht_signs is not None:  # zero rows pad the token axis to whole blocks: they add nothing to the product
                source = rht(pad_to_multiple(source.float(), RHT_BLOCK), rht_signs)
            q = quantize_nvfp4(source, block_2d=spec.block_2d, rounding=spec.rounding, seed=seed,
                               operand_dtype=_OPERAND, keep_data=keep_data)
        if record:
            self._observe(role, t, q)
        return q.gemm_operand(_OPERAND)

    def _observe(self, role: Role, t: torch.Tensor, q: Quantized | NVFP4Quantized) -> None:
        if self.recording:
            self.state.record(role, q.amax)
        if telemetry.enabled():
            telemetry.observe(self.name, role.value, t, q)

    def precast_weight(self, weight: torch.Tensor) -> Quantized | None:
        """The cast a weight arrived with (see the module docstring) when it is the one this layer would make, else
        None (no cast attached, or another recipe in force: the weight's values are then cast as usual)."""
        q = getattr(weight, "fp8_cast", None)
        return q if q is not None and weight.fp8_spec == self.recipe.spec(Role.WEIGHT) else None

    def cast_weight_shard(self, shard: torch.Tensor, amax: torch.Tensor) -> Quantized:
        """One shard (rows) of the weight cast exactly as `cast_weight` casts the whole weight, per-tensor recipes only.

        `amax` is the whole weight's amax (the MAX of the shards' amaxes) or, once a delayed role is seeded, anything
        (the stored scale decides; the amax is only recorded). The state is only read: the forward that uses the
        gathered cast records its amax and seeds a delayed role (`cast_weight`). Returns FP8 data (kept) and the
        dequantization scale the whole weight's cast has.
        """
        spec = self.recipe.spec(Role.WEIGHT)
        if not granularity_info(spec.granularity).per_tensor:
            raise ValueError(f"only per-tensor weight casts can be made shard by shard, not '{spec.granularity}'")
        if spec.delayed:
            qscale, _ = self.state.delayed_scale(ROLE_INDEX[Role.WEIGHT], lambda: amax, spec.fmt, margin=spec.margin,
                                                 store=False)
            return quantize(shard, spec.fmt, granularity=Granularity.TENSOR, scale=1.0 / qscale, amax=amax)
        # current scaling: the scale from the whole weight's amax, by the same rule (not a scale passed in: 1/(1/s) is
        # not s in float32), so every FP8 value is the unsharded cast's
        return quantize(shard, spec.fmt, granularity=Granularity.TENSOR, margin=spec.margin,
                        power_of_two=spec.power_of_two, amax=amax)

    def cast_weight(self, weight: torch.Tensor) -> Quantized:
        """The forward's weight cast, made once per FP8 step when the layer caches (its amax recorded each time)."""
        precast = self.precast_weight(weight)
        if precast is not None:
            spec = self.recipe.spec(Role.WEIGHT)
            if self.recording:
                if spec.delayed:  # a first step seeds from the whole weight's amax, which the gather was cast with
                    self.state.delayed_scale(ROLE_INDEX[Role.WEIGHT], lambda: precast.amax, spec.fmt,
                                             margin=spec.margin)
                self.state.record(Role.WEIGHT, precast.amax)
            return precast
        if self.weights is None:
            return self.cast(Role.WEIGHT, weight, with_t=True)
        options = (self.recipe, self.backend, self.recording, self.state.generation)  # generation last: see peek
        q, hit = self.weights.get("fprop", weight, options, lambda: self.cast(Role.WEIGHT, weight, with_t=True))
        if hit and self.recording:
            self.state.record(Role.WEIGHT, q.amax)  # a reentrant checkpoint's first recording forward may hit
        return q

    def observe_high_precision(self, role: Role, t: torch.Tensor) -> None:
        """Calibration: record `t`'s amax (and seed the scale) without quantizing anything."""
        spec = self.recipe.spec(role)
        amax = self._whole_amax(t)
        self.state.record(role, amax)
        self.state.delayed_scale(ROLE_INDEX[role], lambda: amax, spec.fmt, margin=spec.margin)


def _transposed(q: Quantized, caster: LayerCaster, role: Role, source: torch.Tensor | None) -> Quantized:
    """q scaled along its other axis: exact transpose when possible, else re-quantized (from `source` if given,
    else from q's own values: a bfloat16 operand for power-of-two scales, which holds them exactly)."""
    if granularity_info(q.granularity).transposes_exactly:
        return q.t()
    if source is None:
        source = operand(q) if q.scale_folded else q.dequantize()
    return caster.cast(role, source, record=False, transposed=True)


def _weight_along_n(caster: LayerCaster, weight: torch.Tensor, granularity: Granularity,
                    scale: torch.Tensor | None) -> Quantized:
    """Wᵀ quantized along N for dgrad, from the weight parameter (once per FP8 step when the layer caches)."""
    precast = caster.precast_weight(weight)
    if precast is not None:
        return precast.t()  # per-tensor: the forward's FP8 weight, gathered again for backward (the same bytes)
    if caster.weights is None:
        return _requantize_weight_t(caster, weight, granularity, scale)
    forward = caster.weights.peek("fprop", weight, caster.state.generation)
    if forward is not None and granularity_info(granularity).per_tensor:
        return forward.t()  # the forward's own FP8 weight: what re-quantizing with its scale would give
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
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_mm under the layer's backend; an error (backend="native" forced on a product it cannot run) names the
    layer and the GEMM."""
    try:
        return scaled_mm(a, b, out_dtype=out_dtype, bias=bias, backend=caster.backend, fast_accum=which in FAST_ACCUM)
    except ValueError as exc:
        raise ValueError(f"{caster.name or 'an FP8 layer'} ({which}): {exc}") from None


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
        transposed = qx.data_t is not None
        ctx.save_for_backward(qx.data_t if transposed else qx.data, qx.scale, weight,
                              qw.scale if granularity_info(qw.granularity).per_tensor else None)
        ctx.meta = (qx.fmt, qx.granularity, qx.scale_folded, qw.granularity, transposed)
        ctx.caster, ctx.compute_dtype = caster, compute_dtype
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xd, xs, weight, ws = ctx.saved_tensors
        xf, xg, xfold, wg, transposed = ctx.meta
        qx = (Quantized(xd.t(), xs, xf, xg, scale_folded=xfold, data_t=xd) if transposed
              else Quantized(xd, xs, xf, xg, scale_folded=xfold))
        caster, out_dtype = ctx.caster, ctx.compute_dtype
        dy2 = dy.reshape(-1, dy.shape[-1])
        qdy = caster.cast(Role.GRAD_OUTPUT, dy2, with_t=True)

        # dgrad: dy @ W = dx   — needs W scaled along N (its rows' other axis)
        qwt = _weight_along_n(caster, weight, wg, ws)
        dx = _gemm(caster, "dgrad", qdy, qwt, out_dtype)

        # wgrad: dyᵀ @ x = dW  — needs dy and x scaled along M (the token axis)
        qdyt = _transposed(qdy, caster, Role.GRAD_OUTPUT, dy2)
        qxt = _transposed(qx, caster, Role.INPUT, None)
        dw = _gemm(caster, "wgrad", qdyt, qxt, out_dtype)

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
