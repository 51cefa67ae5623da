"""MoE experts in an FP8 export: each expert's projections quantized in the checkpoint layout serving stacks read.

transformers holds a Mixtral's or Qwen-MoE's experts stacked (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj`
(E, H, I)); their checkpoints, and the loaders of vLLM, SGLang and transformers itself, hold one matrix per expert
and projection (`block_sparse_moe.experts.<e>.w1.weight`, `mlp.experts.<e>.gate_proj.weight`). An FP8 export
(`export_hf`, `minifloat export --format hf-fp8 | hf-fp8-block`) reverts the stacked parameters to that layout
(`hf_models.checkpoint_layout`) and quantizes each expert matrix as it quantizes a linear layer's weight: E4M3 per
tensor with its `weight_scale` (hf-fp8), or per 128×128 block with its `weight_scale_inv` (hf-fp8-block), through
minifloat.numerics.quantize from the parameter's own precision. Expert biases stay in the export's dtype.

Which experts: those `mf.convert` would run in FP8 (minifloat.fp8.experts.experts_reason; the blocks convert keeps,
such as the first, keep theirs), or, for a model trained with minifloat, its FP8 experts (`Fp8Experts`). Kept in the
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
from minifloat.numerics.quantize import quantize

log = logging.getLogger("minifloat")

_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """An FP8 export's experts: `quantized` {experts module: its stacked parameters' names}, `kept` {experts module:
    why it stays in the export's dtype}."""

    quantized: dict[str, tuple[str, ...]]
    kept: dict[str, str]


def _stacked(module: nn.Module) -> tuple[str, ...]:
    return tuple(p for p in _PROJECTIONS if isinstance(getattr(module, p, None), nn.Parameter))


def _chosen(model: nn.Module) -> list[str]:
    """The experts modules an FP8 export quantizes where their layout allows (see the module docstring)."""
    trained = [n for n, m in model.named_modules() if isinstance(m, Fp8Experts)]
    if trained or any(isinstance(m, Fp8Linear) for m in model.modules()):
        return trained
    return list(fp8_plan(model).experts)


def _layout_reason(model: nn.Module, name: str, params: tuple[str, ...]) -> str | None:
    """Why the checkpoint layout of experts module `name` is not one quantizable linear weight per expert, or None.
    Read on meta tensors: transformers' reverse conversions only move and split."""
    module = model.get_submodule(name)
    for p in params:
        meta = {f"{name}.{p}": torch.empty(getattr(module, p).shape, device="meta")}
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
        params = _stacked(module)
        if not params or not hasattr(module, "num_experts"):
            continue
        if name not in chosen:
            kept[name] = "convert keeps it in high precision (see mf.fp8_plan)"
        elif static:
            kept[name] = "a static-activation export needs each expert's input scale, which is not calibrated"
        elif (reason := _layout_reason(model, name, params)) is not None:
            kept[name] = reason
        else:
            quantized[name] = params
    return ExpertsPlan(quantized, kept)


def quantize_experts(model: nn.Module, fmt: hf.ExportFormat, plan: ExpertsPlan,
                     tensors: dict[str, torch.Tensor]) -> list[str]:
    """Replace, in `tensors` (the checkpoint layout), the planned experts' weights by their FP8 data and add their
    scales; returns the quantized weights' names."""
    done = []
    for name, params in plan.quantized.items():
        module = model.get_submodule(name)
        stacked = {f"{name}.{p}": getattr(module, p).detach().float().cpu() for p in params}
        for key, weight in hf_models.checkpoint_layout(model, stacked).items():
            q = quantize(weight.contiguous(), hf.WEIGHT_FORMAT, granularity=fmt.granularity)
            tensors[key] = q.data.contiguous()
            tensors[f"{key.removesuffix('.weight')}.{fmt.scale_name}"] = q.scale.float().contiguous()
            done.append(key)
    return done


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
