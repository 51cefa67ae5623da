"""The FP8 inference linear layer: the weight is stored quantized, with its scales, and no high-precision copy.

    y = x̂ @ Ŵᵀ + b      Ŵ = weight · weight_scale        (one scale per tensor, row, 128×128 block or 32-element
                                                           MX block, as the recipe scales its weights)
                        x̂ = quantize(x / smooth_scale)   (dynamic: scales from each token at run time, per row,
                                                           1×128 tile or MX block; static: one calibrated input_scale)

The product runs through minifloat's scaled GEMM (minifloat.fp8.gemm.scaled_mm): torch._scaled_mm on SM 8.9+ GPUs
for per-tensor and per-row scales, elsewhere the exact emulation (FP8 values are bfloat16 values, so one bfloat16
GEMM with fp32 accumulation multiplies them exactly). Activations are quantized by minifloat.numerics.quantize, the
one rounding path. The bias stays in high precision and is added to the fp32 accumulator. NVFP4 (E2M1 with E4M3
block scales and an fp32 tensor scale) has its own casts and buffers: minifloat.inference.nvfp4.

The weight is frozen, but the gradient flows to the input (`FrozenWeightLinear`), so adapters can be trained on a
model whose linear layers are stored in FP8:

    input @ Ŵᵀ = output                   (the FP8 product above)
    grad_output @ Ŵ = grad_input          (fp32, Ŵ dequantized: the layer's own function, the input's rounding
                                           passed straight through, as quantization-aware training does)
"""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

from minifloat.core.autocast import compute_dtype
from minifloat.core.validate import check_bool, check_choice, check_int
from minifloat.fp8 import shared_input
from minifloat.fp8.fourbit.gemm import fp4_mm
from minifloat.fp8.gemm import BACKENDS, native_granularity, scaled_mm
from minifloat.fp8.native import native_nvfp4
from minifloat.fp8.recipes import CastSpec, NVFP4Spec, Recipe, Role
from minifloat.inference import nvfp4, storage
from minifloat.numerics.formats import E4M3, NumberFormat, get_format
from minifloat.numerics.fp4 import NVFP4Quantized
from minifloat.numerics.granularity import Granularity, granularity_info, scale_shape
from minifloat.numerics.quantize import MX_RULES, Quantized, quantize

_OPERAND = torch.bfloat16  # the emulated GEMM's operand dtype: FP8 values (times powers of two) are bfloat16 values


class Activations(str, enum.Enum):
    """How a layer's input is scaled: from each token at run time, or by one scale calibrated beforehand."""

    DYNAMIC = "dynamic"
    STATIC = "static"


# A dynamic scale never spans tokens (a batch's outlier token would coarsen every other token's grid): recipes that
# scale activations per tensor in training scale them per token (row) at inference. Other granularities stay.
PER_TOKEN = {Granularity.TENSOR: Granularity.ROW}


def _spec_json(spec: CastSpec | NVFP4Spec) -> dict:
    if isinstance(spec, NVFP4Spec):
        return {"fmt": nvfp4.JSON_FMT, "block_2d": spec.block_2d, "rounding": spec.rounding}
    return {"fmt": spec.fmt.name, "granularity": spec.granularity.value, "power_of_two": spec.power_of_two,
            "margin": spec.margin, "mx_rule": spec.mx_rule}


def _spec_from_json(d: dict) -> CastSpec | NVFP4Spec:
    if isinstance(d, dict) and d.get("fmt") == nvfp4.JSON_FMT:
        if set(d) != {"fmt", "block_2d", "rounding"}:
            raise ValueError(f"an NVFP4 cast spec has the keys fmt, block_2d, rounding; got {d!r}")
        return NVFP4Spec(block_2d=d["block_2d"], rounding=d["rounding"])
    if not isinstance(d, dict) or set(d) != {"fmt", "granularity", "power_of_two", "margin", "mx_rule"}:
        raise ValueError(f"a cast spec has the keys fmt, granularity, power_of_two, margin, mx_rule; got {d!r}")
    check_bool("power_of_two", d["power_of_two"])
    check_choice("mx_rule", d["mx_rule"], MX_RULES)
    check_int("margin", d["margin"], low=0)
    return CastSpec(get_format(d["fmt"]), Granularity.parse(d["granularity"]), power_of_two=d["power_of_two"],
                    margin=d["margin"], mx_rule=d["mx_rule"])


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """How one inference layer quantizes its weight and its input.

    Attributes:
        weight: the weight's cast (format, granularity, power-of-two scales, MX rule), from the recipe; an
            NVFP4Spec for NVFP4 (minifloat.inference.nvfp4).
        input: the input's cast; granularity "tensor" for static activations (NVFP4: static is its global scale,
            its block scales stay dynamic).
        activations: Activations.DYNAMIC or STATIC.
        smooth: the layer divides its input by `smooth_scale` (SmoothQuant scales not folded into a norm).
    """

    weight: CastSpec | NVFP4Spec
    input: CastSpec | NVFP4Spec
    activations: Activations
    smooth: bool = False

    def __post_init__(self):
        if not isinstance(self.activations, Activations):  # frozen: from_recipe / from_json convert strings
            raise ValueError(f"activations must be an Activations member, got {self.activations!r}")
        if isinstance(self.weight, NVFP4Spec) != isinstance(self.input, NVFP4Spec):
            raise ValueError("an NVFP4 layer casts both its weight and its input to NVFP4")
        if self.is_nvfp4:
            if "stochastic" in (self.weight.rounding, self.input.rounding):
                raise ValueError("an NVFP4 inference layer rounds to nearest (stochastic rounding is for gradients)")
            return
        if self.activations == Activations.STATIC and self.input.granularity != Granularity.TENSOR:
            raise ValueError(f"static activations have one scale per layer (granularity 'tensor'), "
                             f"got '{self.input.granularity}'")

    @classmethod
    def from_recipe(cls, recipe: Recipe, activations: Activations | str, *, smooth: bool = False) -> "LayerSpec":
        """The inference casts of `recipe`: its forward casts, current (never delayed), activations per token when
        dynamic and per layer when static."""
        activations = Activations(activations)
        if isinstance(recipe.spec(Role.WEIGHT), NVFP4Spec):  # forward casts round to nearest; NVFP4 is never delayed
            return cls(recipe.spec(Role.WEIGHT), recipe.spec(Role.INPUT), activations, smooth)
        weight = dataclasses.replace(recipe.spec(Role.WEIGHT), delayed=False)
        inp = recipe.spec(Role.INPUT)
        granularity = (Granularity.TENSOR if activations == Activations.STATIC
                       else PER_TOKEN.get(inp.granularity, inp.granularity))
        return cls(weight, dataclasses.replace(inp, granularity=granularity, delayed=False), activations, smooth)

    @property
    def is_nvfp4(self) -> bool:
        """E2M1 with E4M3 block scales and a float32 tensor scale (minifloat.inference.nvfp4)."""
        return isinstance(self.weight, NVFP4Spec)

    def to_json(self) -> dict:
        return {"weight": _spec_json(self.weight), "input": _spec_json(self.input),
                "activations": self.activations.value, "smooth": self.smooth}

    @classmethod
    def from_json(cls, d: dict) -> "LayerSpec":
        """Inverse of `to_json`; ValueError naming what is wrong."""
        if not isinstance(d, dict) or set(d) != {"weight", "input", "activations", "smooth"}:
            raise ValueError(f"a layer spec has the keys weight, input, activations, smooth; got {d!r}")
        check_choice("activations", d["activations"], [a.value for a in Activations])
        check_bool("smooth", d["smooth"])
        return cls(_spec_from_json(d["weight"]), _spec_from_json(d["input"]), Activations(d["activations"]),
                   d["smooth"])


def _scale_fmt(spec: CastSpec):
    return granularity_info(spec.granularity).scale_fmt  # FP32, or E8M0 for MX


def _scale_layout(shape: tuple[int, int], spec: CastSpec | NVFP4Spec) -> tuple[tuple[int, ...], NumberFormat]:
    """The stored weight scales' shape and format: per granularity (FP32, E8M0 for MX), or NVFP4's E4M3 blocks."""
    if isinstance(spec, NVFP4Spec):
        return nvfp4.scale_shape(shape, spec), E4M3
    fmt = _scale_fmt(spec)
    return storage.storage_shape(scale_shape(shape, spec.granularity), fmt), fmt


def _describe(spec: CastSpec | NVFP4Spec) -> str:
    if isinstance(spec, NVFP4Spec):
        return f"nvfp4/{'16x16' if spec.block_2d else '1x16'}"
    return f"{spec.fmt.name}/{spec.granularity}"


def _as_rows(q: Quantized, rows: int) -> Quantized:
    """A per-tensor operand written as per-row (the same scale on every row): torch._scaled_mm scales both operands
    the same way, and per-token activations meet per-tensor weights (or the other way round)."""
    if q.granularity != Granularity.TENSOR:
        return q
    return Quantized(q.data, q.scale.reshape(1, 1).expand(rows, 1), q.fmt, Granularity.ROW, None, q.operand)


class FrozenWeightLinear(torch.autograd.Function):
    """An Fp8InferenceLinear's product with its weight frozen and the gradient flowing to its input (and bias).

    Forward: input @ Ŵᵀ + b = output, the layer's quantized product (Fp8InferenceLinear.product).
    Backward: the input's rounding passed straight through (the gradient of round(x) taken as 1);
        grad_output @ Ŵ = grad_input, in fp32 with Ŵ the layer's dequantized weight (times 1/smooth_scale per
        column when the layer smooths: the function it computes);
        grad_output summed over the tokens = grad_bias.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, layer: "Fp8InferenceLinear") -> torch.Tensor:
        ctx.layer, ctx.x_dtype = layer, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        y = layer.product(x)
        return y if y._base is None else y.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shared_input.release()  # the forward's siblings are done: its last input cast need not be held
        layer = ctx.layer
        dy = grad_output.reshape(-1, layer.out_features).float()  # (tokens, out)
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            # grad_output @ Ŵ = grad_input: (tokens, out) @ (out, in)
            grad_x = (dy @ layer.dequantized_weight(torch.float32)).to(ctx.x_dtype)
            grad_x = grad_x.reshape(*grad_output.shape[:-1], layer.in_features)
        if ctx.needs_input_grad[1]:
            grad_bias = dy.sum(0).to(ctx.bias_dtype)  # (out,)
        return grad_x, grad_bias, None


class Fp8InferenceLinear(nn.Module):
    """A linear layer for inference whose weight is stored in FP8 (see the module docstring).

    Buffers (all in `state_dict`): `weight` (out, in) in the weight format's storage dtype (torch.float8_e4m3fn;
    packed uint8 codes for formats torch lacks), `weight_scale` (dequantization scales shaped per granularity:
    tensor (), row (out, 1), block (⌈out/128⌉, ⌈in/128⌉), mx (out, ⌈in/32⌉) as torch.float8_e8m0fnu; NVFP4's E4M3
    block scales), `weight_global_scale` () float32 for NVFP4 only, `input_scale` () float32 for static
    activations, `smooth_scale` (in,) float32 when `spec.smooth`. `bias` is a high-precision parameter
    (requires_grad False). `.to(dtype)` / `.half()` move these buffers but never recast them: their dtypes are the
    storage format. The weight is frozen; gradients flow to the input (and to the bias if it requires them).

    Args:
        in_features, out_features, bias: as nn.Linear.
        spec: the layer's LayerSpec.
        device: of the buffers; dtype: of the bias.
        backend: GEMM backend ("auto", "native", "emulated"); None means auto / $MINIFLOAT_GEMM_BACKEND.
        recipe: the recipe the spec came from, if any (recorded by save_quantized).
    """

    FIXED_DTYPE_BUFFERS = ("weight", "weight_scale", "weight_global_scale", "input_scale", "smooth_scale")
    WEIGHT_BUFFERS = ("weight", "weight_scale", "weight_global_scale")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, spec: LayerSpec, device=None,
                 dtype: torch.dtype | None = None, backend: str | None = None, recipe: Recipe | None = None):
        super().__init__()
        if not isinstance(spec, LayerSpec):
            raise ValueError(f"spec must be a LayerSpec, got {type(spec).__name__}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.in_features, self.out_features, self.spec, self.backend = in_features, out_features, spec, backend
        self.recipe = recipe
        shape = (out_features, in_features)
        wfmt = spec.weight.fmt
        self.register_buffer("weight", torch.empty(storage.storage_shape(shape, wfmt),
                                                   dtype=storage.storage_dtype(wfmt), device=device))
        scales, sfmt = _scale_layout(shape, spec.weight)
        self.register_buffer("weight_scale", torch.empty(scales, dtype=storage.storage_dtype(sfmt), device=device))
        if spec.is_nvfp4:
            self.register_buffer("weight_global_scale", torch.ones((), dtype=torch.float32, device=device))
        if spec.activations == Activations.STATIC:
            self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        if spec.smooth:
            self.register_buffer("smooth_scale", torch.ones(in_features, dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, spec: LayerSpec, *, input_scale: torch.Tensor | None = None,
                    smooth_scale: torch.Tensor | None = None, backend: str | None = None,
                    recipe: Recipe | None = None) -> "Fp8InferenceLinear":
        """The inference twin of `linear`: its weight quantized by `spec.weight` (through minifloat's quantize, or
        quantize_nvfp4 for NVFP4).

        Args:
            linear: an nn.Linear (or Fp8Linear); its weight is read, not kept.
            spec: the layer's casts.
            input_scale: the static input's dequantization scale (x ≈ q · input_scale; NVFP4: its global scale);
                needed for static specs.
            smooth_scale: (in,) SmoothQuant scales s, needed when `spec.smooth`; the weight must already be W·s.
        """
        if (input_scale is None) == (spec.activations == Activations.STATIC):
            raise ValueError("input_scale is needed for static activations, and only for them")
        if (smooth_scale is None) == spec.smooth:
            raise ValueError("smooth_scale is needed when spec.smooth, and only then")
        weight = linear.weight.detach()
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, spec=spec, device=weight.device,
                  dtype=linear.bias.dtype if linear.bias is not None else None, backend=backend, recipe=recipe)
        w = spec.weight
        if spec.is_nvfp4:
            q = nvfp4.quantize_weight(weight, w)
            new.weight_scale.copy_(q.scale)  # E4M3 already
            new.weight_global_scale.copy_(q.global_scale)
        else:
            q = quantize(weight, w.fmt, granularity=w.granularity, margin=w.margin, power_of_two=w.power_of_two,
                         mx_rule=w.mx_rule)
            new.weight_scale.copy_(storage.encode(q.scale, _scale_fmt(w)))
        new.weight.copy_(storage.encode(q.data, w.fmt))
        if input_scale is not None:
            new.input_scale.copy_(input_scale.reshape(()))
        if smooth_scale is not None:
            new.smooth_scale.copy_(smooth_scale.reshape(-1))
        if linear.bias is not None:
            new.bias.copy_(linear.bias.detach())
        return new

    def quantized_weight(self) -> Quantized | NVFP4Quantized:
        """The stored weight as a Quantized (FP8 data, float32 scales) for scaled_mm; NVFP4: an NVFP4Quantized."""
        w = self.spec.weight
        shape = (self.out_features, self.in_features)
        if self.spec.is_nvfp4:
            return nvfp4.stored_weight(self.weight, self.weight_scale, self.weight_global_scale, shape, w)
        scale_fmt = _scale_fmt(w)
        scales = storage.decode(self.weight_scale, scale_fmt, scale_shape(shape, w.granularity)).float()
        return Quantized(storage.decode(self.weight, w.fmt, shape), scales, w.fmt, w.granularity,
                         scale_folded=granularity_info(w.granularity).folds(w.power_of_two))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ = weight · weight_scale in `dtype` (times 1/smooth_scale per column when the layer smooths)."""
        w = self.quantized_weight().dequantize(dtype)
        return w / self.smooth_scale.to(dtype) if self.spec.smooth else w

    def quantize_input(self, x2: torch.Tensor) -> Quantized | NVFP4Quantized:
        """The (tokens, in) input quantized as the spec says: its own scales (dynamic) or input_scale (static)."""
        spec = self.spec.input
        if self.spec.smooth:
            x2 = x2.float() / self.smooth_scale
        static = self.spec.activations == Activations.STATIC
        native = not self.spec.is_nvfp4 and native_granularity(x2.device, spec.granularity, self.backend)
        # dynamic scales are the input's own: q, k and v (gate and up) reading one tensor share its cast
        # (minifloat.fp8.shared_input); not a static scale (the layer's own, calibrated) nor after a smoothing (which
        # divides by this layer's own scales)
        options = ("inference", spec, native, self.backend) if not (static or self.spec.smooth) else None
        q = shared_input.lookup(x2, options) if options else None
        if q is not None:
            return q
        if self.spec.is_nvfp4:
            q = nvfp4.quantize_input(x2, self.input_scale if static else None,
                                     keep_data=static and native_nvfp4(x2.device, self.backend))
        else:
            out = dict(operand_dtype=None if native else _OPERAND, keep_data=native)
            q = (quantize(x2, spec.fmt, granularity=Granularity.TENSOR, scale=self.input_scale, **out) if static
                 else quantize(x2, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                               power_of_two=spec.power_of_two, mx_rule=spec.mx_rule, **out))
        if options:
            shared_input.remember(x2, options, q)
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype.itemsize == 1:  # a forward that casts its input to `layer.weight.dtype` (an FP8 code buffer)
            raise TypeError(f"{type(self).__name__}({self.in_features} -> {self.out_features}) got a {x.dtype} input, "
                            f"which its model cast to the stored weight's dtype; keep this layer in high precision "
                            f"(prepare_inference's keep=[its name])")
        if torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            # (tokens, in) in, (tokens, out) out: reshaped out here, so the output is no view made inside the
            # Function, which a caller could not modify in place
            y = FrozenWeightLinear.apply(x.reshape(-1, self.in_features), self.bias, self)
            return y.reshape(*x.shape[:-1], self.out_features)
        return self.product(x)

    @torch.no_grad()
    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x̂ @ Ŵᵀ + b in the compute dtype, outside autograd (`forward` adds the input's gradient)."""
        out_dtype = compute_dtype(x)
        x2 = x.reshape(-1, self.in_features)  # (tokens, in)
        if x2.shape[0] == 0:
            return x.new_zeros((*x.shape[:-1], self.out_features), dtype=out_dtype)
        qx, qw = self.quantize_input(x2), self.quantized_weight()
        if self.spec.is_nvfp4:  # FP4 tensor cores where they run, else the exact emulation
            y = fp4_mm(qx, qw, out_dtype=out_dtype, bias=self.bias, backend=self.backend)
            return y.reshape(*x.shape[:-1], self.out_features)
        native = native_granularity(x2.device, qx.granularity, self.backend)
        if native and {qx.granularity, qw.granularity} == {"tensor", "row"}:
            qx, qw = _as_rows(qx, x2.shape[0]), _as_rows(qw, self.out_features)
        # x̂ @ Ŵᵀ + b: (tokens, out)
        y = scaled_mm(qx, qw, out_dtype=out_dtype, bias=self.bias, backend=self.backend)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse: bool = True):
        # the storage buffers keep their dtypes: .to(device) moves them, .half() / .to(dtype) leave their dtype
        fixed = {n: self._buffers.pop(n) for n in self.FIXED_DTYPE_BUFFERS if n in self._buffers}
        try:
            super()._apply(fn, recurse)
            for name, buf in fixed.items():
                moved = fn(buf)
                fixed[name] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
        finally:
            self._buffers.update(fixed)
        return self

    def nbytes(self) -> int:
        """Bytes of the stored weight and its scales."""
        return sum(t.numel() * t.element_size() for n, t in self._buffers.items() if n in self.WEIGHT_BUFFERS)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={_describe(self.spec.weight)}, activations={self.spec.activations.value} "
                f"{_describe(self.spec.input)}{', smoothed' if self.spec.smooth else ''}")


def inference_layers(model: nn.Module) -> list[tuple[str, Fp8InferenceLinear]]:
    """(name, layer) of the model's Fp8InferenceLinear layers, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8InferenceLinear)]
