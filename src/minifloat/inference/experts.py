"""FP8 inference for transformers' stacked MoE experts: each expert matrix stored in FP8, as an Fp8InferenceLinear.

`prepare_inference` turns a transformers experts module (`gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), or
transposed; the modules `mf.convert` runs in FP8, minifloat.fp8.experts.experts_reason) into a subclass of its own
class (`Fp8Inference<Class>`) whose stacked parameters are replaced by `fp8_experts`, an nn.ModuleList of
Fp8InferenceLinear layers, per expert e:

    gated (gate_up_proj):  [3e] gate (I, H)   [3e + 1] up (I, H)   [3e + 2] down (H, I)
    ungated (up_proj):     [2e] up (I, H)     [2e + 1] down (H, I)

The gate and up halves of `gate_up_proj` are two matrices, each with its own scales, as the checkpoints on the Hub
and the loaders of vLLM and transformers hold them (Mixtral's w1 and w3): an FP8 export writes these very bytes
(minifloat.inference.hf_experts). The forward is transformers' eager routing with each projection an FP8 GEMM
(dynamic activations: each token's input scaled at run time); `_apply_gate` sees the gate and up outputs side by
side, as the stacked projection gave them. Biases stay in high precision.

Only dynamic activations: a static export or model would need each expert's input scale, which calibration here
does not measure; such experts stay in high precision (prepare_inference says so).
"""

from __future__ import annotations

import torch
from torch import nn

from minifloat.fp8.experts import rebuild, routes
from minifloat.fp8.recipes import Recipe
from minifloat.inference.layers import Fp8InferenceLinear, LayerSpec


def first_name(module: nn.Module) -> str:
    """The experts module's first stacked projection: gate_up_proj (gated) or up_proj."""
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear viewing `weight` (out, in) and `bias`, for Fp8InferenceLinear.from_linear to read."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return linear


class Fp8InferenceExperts:
    """The mixin `prepare_experts` puts in front of a transformers experts class (see the module docstring)."""

    def __reduce_ex__(self, protocol):
        return rebuild, (inference_class, type(self).__mro__[2], self.__dict__.copy())

    @property
    def per_expert(self) -> int:
        return 3 if self.has_gate else 2

    def expert_layers(self, e: int) -> list[Fp8InferenceLinear]:
        """Expert e's FP8 matrices, in the order of the module docstring."""
        return list(self.fp8_experts[self.per_expert * e:self.per_expert * (e + 1)])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, token, slot in routes(top_k_index, self.num_experts):
            x = hidden_states[token]
            if self.has_gate:
                gate, up, down = self.expert_layers(e)
                h = self._apply_gate(torch.cat([gate(x), up(x)], dim=-1))
            else:
                up, down = self.expert_layers(e)
                h = self.act_fn(up(x))
            y = down(h)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def expert_layer_names(model: nn.Module) -> set[str]:
    """Names of the Fp8InferenceLinear layers that hold prepared experts' matrices (they are no layers of the model's
    own: an export writes them under the experts' names)."""
    prefixes = tuple(f"{n}.fp8_experts." for n, m in model.named_modules() if isinstance(m, Fp8InferenceExperts))
    return {n for n, _ in model.named_modules() if prefixes and n.startswith(prefixes)}


_CLASSES: dict[type, type] = {}


def inference_class(base: type) -> type:
    """The FP8 inference subclass of a transformers experts class (made once per class)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Fp8Inference{base.__name__}", (Fp8InferenceExperts, base), {"__module__": __name__})
    return _CLASSES[base]


@torch.no_grad()
def prepare_experts(module: nn.Module, spec: LayerSpec, *, backend: str | None, recipe: Recipe) -> None:
    """Store a supported experts module's matrices in FP8 (see the module docstring), in place: its stacked
    parameters are dropped."""
    first_param = first_name(module)
    first, down = getattr(module, first_param), module.down_proj
    first_bias = getattr(module, f"{first_param}_bias", None) if module.has_bias else None
    down_bias = getattr(module, "down_proj_bias", None) if module.has_bias else None
    layers = []
    for e in range(module.num_experts):
        w1 = first[e].t() if module.is_transposed else first[e]  # (out, in), as an nn.Linear holds it
        w2 = down[e].t() if module.is_transposed else down[e]
        b1 = None if first_bias is None else first_bias[e]
        parts = [(w1, b1)]
        if module.has_gate:  # gate rows first, up rows second: transformers' _apply_gate chunks them so
            half = w1.shape[0] // 2
            parts = [(w1[:half], None if b1 is None else b1[:half]), (w1[half:], None if b1 is None else b1[half:])]
        parts.append((w2, None if down_bias is None else down_bias[e]))
        for weight, bias in parts:
            layer = Fp8InferenceLinear.from_linear(_linear(weight.detach(), None if bias is None else bias.detach()),
                                                   spec, backend=backend, recipe=recipe)
            layers.append(layer.train(module.training))
    for name in (first_param, "down_proj", f"{first_param}_bias", "down_proj_bias"):
        if name in module._parameters:
            del module._parameters[name]
    module.__class__ = inference_class(type(module))
    module.fp8_experts = nn.ModuleList(layers)
