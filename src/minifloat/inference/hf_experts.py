"""MoE experts in an FP8 export: each expert's projections quantized in the checkpoint layout serving stacks read.

transformers holds a Mixtral's or Qwen-MoE's experts stacked (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj`
(E, H, I)); their checkpoints, and the loaders of vLLM, SGLang and transformers itself, hold one matrix per expert
and projection (`block_sparse_moe.experts.<e>.w1.weight`, `mlp.experts.<e>.gate_proj.weight`). An FP8 export
(`export_hf`, `minifloat export --format hf-fp8 | hf-fp8-block`) reverts the stacked parameters to that layout
(`hf_models.checkpoint_layout`) and quantizes each expert matrix as it quantizes a linear layer's weight: E4M3 per
tensor with its `weight_scale` (hf-fp8), or per 128×128 block with its `weight_scale_inv` (hf-fp8-block), through
minifloat.numerics.quantize from the parameter's own precision. Expert biases stay in the export's dtype.
Experts prepared for FP8 inference (minifloat.inference.experts) are written from their stored matrices: the very
bytes where the layout matches their recipe, re-quantized from the dequantized matrices where it does not.

Which experts: prepared ones, those `mf.convert` would run in FP8 (minifloat.fp8.experts.experts_reason), or, for a
model trained with minifloat, its FP8 experts (`Fp8Experts`). Kept in the
export's dtype, and listed in the config's `ignored_layers` (vLLM, checkpoint names) and `modules_to_not_convert`
(transformers, the model's names), with the reason logged: experts whose checkpoint layout is not one linear
weight per expert, sizes that are not multiples of 16, and every expert of a static-activation export (vLLM reads a
static `input_scale` per expert, which no calibration here measures).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from minifloat.core.roles import MIN_DIM_MULTIPLE
from minifloat.fp8.convert import fp8_plan
from minifloat.fp8.experts import Fp8Experts
from minifloat.fp8.modules import Fp8Linear
from minifloat.inference import hf, hf_models
from minifloat.inference.experts import Fp8InferenceExperts, first_name
from minifloat.numerics.quantize import quantize

log = logging.getLogger("minifloat")

_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """An FP8 export's experts: `quantized` {experts module: its stacked parameters' names}, `kept` {experts module:
    why it stays in the export's dtype}."""

    quantized: dict[str, tuple[str, ...]]
    kept: dict[str, str]


def _stacked_shape(module: nn.Module, out_features: int, in_features: int) -> tuple[int, int, int]:
    if module.is_transposed:
        return module.num_experts, in_features, out_features
    return module.num_experts, out_features, in_features


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """{stacked parameter: its shape} of an experts module, prepared for FP8 inference (its parameters are gone:
    the shapes they had) or not."""
    if isinstance(module, Fp8InferenceExperts):
        *first, down = module.expert_layers(0)
        return {first_name(module): _stacked_shape(module, sum(m.out_features for m in first), first[0].in_features),
                "down_proj": _stacked_shape(module, down.out_features, down.in_features)}
    return {p: tuple(getattr(module, p).shape) for p in _PROJECTIONS
            if isinstance(getattr(module, p, None), nn.Parameter)}


def _chosen(model: nn.Module) -> list[str]:
    """The experts modules an FP8 export quantizes where their layout allows (see the module docstring)."""
    prepared = [n for n, m in model.named_modules() if isinstance(m, Fp8InferenceExperts)]
    trained = [n for n, m in model.named_modules() if isinstance(m, Fp8Experts)]
    if trained or any(isinstance(m, Fp8Linear) for m in model.modules()):
        return trained + prepared
    return prepared + list(fp8_plan(model).experts)


def _layout_reason(model: nn.Module, name: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why the checkpoint layout of experts module `name` is not one quantizable linear weight per expert, or None.
    Read on meta tensors: transformers' reverse conversions only move and split."""
    for p, shape in shapes.items():
        meta = {f"{name}.{p}": torch.empty(shape, device="meta")}
        for key, tensor in hf_models.checkpoint_layout(model, meta).items():
            if not key.endswith(".weight") or tensor.dim() != 2:
                return f"its checkpoint layout stores {key} {'x'.join(map(str, tensor.shape))}, not one weight " \
                       f"matrix per expert"
            if any(d % MIN_DIM_MULTIPLE for d in tensor.shape):
                return f"{key}'s features {tuple(tensor.shape)} are not multiples of {MIN_DIM_MULTIPLE}"
    return None


def experts_plan(model: nn.Module, fmt: hf.ExportFormat, *, static: bool) -> ExpertsPlan:
    """Which experts modules an export in `fmt` quantizes, and why the others stay in its dtype."""
    quantized, kept = {}, {}
    if fmt.granularity is None or not hf_models.is_transformers_model(model):
        return ExpertsPlan(quantized, kept)
    chosen = set(_chosen(model))
    for name, module in model.named_modules():
        shapes = _shapes(module) if hasattr(module, "num_experts") else {}
        if not shapes:
            continue
        if name not in chosen:
            kept[name] = "convert keeps it in high precision (see mf.fp8_plan)"
        elif static:
            kept[name] = "a static-activation export needs each expert's input scale, which is not calibrated"
        elif (reason := _layout_reason(model, name, shapes)) is not None:
            kept[name] = reason
        else:
            quantized[name] = tuple(shapes)
    return ExpertsPlan(quantized, kept)


def _layer_of_each_matrix(model: nn.Module, name: str, module: Fp8InferenceExperts) -> dict[str, nn.Module]:
    """{checkpoint weight: the prepared module's Fp8InferenceLinear holding it}: a tensor of layer indices shaped
    like the stacked parameters with one element per matrix is put through the checkpoint layout's conversions,
    which move and split it as they move and split the weights."""
    per, n = module.per_expert, module.num_experts
    index = torch.arange(n * per, dtype=torch.float32).reshape(n, per, 1)
    first, down = index[:, :per - 1], index[:, per - 1:]
    if module.is_transposed:
        first, down = first.transpose(1, 2), down.transpose(1, 2)
    mapped = hf_models.checkpoint_layout(model, {f"{name}.{first_name(module)}": first, f"{name}.down_proj": down})
    return {key: module.fp8_experts[int(i.reshape(-1)[0])] for key, i in mapped.items()}


def quantize_experts(model: nn.Module, fmt: hf.ExportFormat, plan: ExpertsPlan, tensors: dict[str, torch.Tensor],
                     quantized_weight) -> list[str]:
    """Replace, in `tensors` (the checkpoint layout), the planned experts' weights by their FP8 data and add their
    scales; returns the quantized weights' names. A prepared module's matrices are written as
    `quantized_weight(layer, fmt)` gives them (export's: the stored bytes where the layout matches)."""
    done = []
    for name in plan.quantized:
        module = model.get_submodule(name)
        if isinstance(module, Fp8InferenceExperts):
            found = {key: quantized_weight(layer, fmt) for key, layer in _layer_of_each_matrix(model, name,
                                                                                            module).items()}
        else:
            stacked = {f"{name}.{p}": getattr(module, p).detach().float().cpu() for p in plan.quantized[name]}
            found = {key: quantize(weight.contiguous(), hf.WEIGHT_FORMAT, granularity=fmt.granularity)
                     for key, weight in hf_models.checkpoint_layout(model, stacked).items()}
        for key, q in found.items():
            tensors[key] = q.data.cpu().contiguous()
            tensors[f"{key.removesuffix('.weight')}.{fmt.scale_name}"] = q.scale.float().cpu().contiguous()
            done.append(key)
    return done


def restacked(model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`tensors` (the model's names) with each prepared experts module's FP8 layers replaced by the stacked
    parameters the module had, dequantized into `dtype` (and biases), which the checkpoint layout then splits."""
    prepared = {n: m for n, m in model.named_modules() if isinstance(m, Fp8InferenceExperts)}
    if not prepared:
        return tensors
    out = {k: v for k, v in tensors.items() if not any(k.startswith(f"{n}.fp8_experts.") for n in prepared)}
    for name, module in prepared.items():
        rows, biases = {first_name(module): [], "down_proj": []}, {first_name(module): [], "down_proj": []}
        for e in range(module.num_experts):
            *first, down = module.expert_layers(e)
            for p, layers in ((first_name(module), first), ("down_proj", [down])):
                rows[p].append(torch.cat([m.dequantized_weight(torch.float32) for m in layers]))
                if all(m.bias is not None for m in layers):
                    biases[p].append(torch.cat([m.bias.detach().float() for m in layers]))
        for p, weights in rows.items():
            stacked = torch.stack(weights)
            out[f"{name}.{p}"] = (stacked.transpose(1, 2) if module.is_transposed else stacked).to(dtype).contiguous()
            if biases[p]:
                out[f"{name}.{p}_bias"] = torch.stack(biases[p]).to(dtype).contiguous()
    return out


def note(model: nn.Module, plan: ExpertsPlan) -> None:
    """Log what the export does with the model's experts."""
    if plan.quantized:
        log.info("minifloat: FP8 export of %d MoE experts module(s), one FP8 matrix per expert and projection: %s",
                 len(plan.quantized), ", ".join(list(plan.quantized)[:4]) + (", ..." if len(plan.quantized) > 4
                                                                            else ""))
    reasons = {}
    for name, why in plan.kept.items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        log.warning("minifloat: the export keeps %d MoE experts module(s) in high precision (%s): %s", len(names), why,
                    ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""))
