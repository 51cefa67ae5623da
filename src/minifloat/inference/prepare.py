"""prepare_inference: turn a model's linear layers into FP8 inference layers, in place.

    model = mf.prepare_inference(model, recipe=mf.BlockScaling())                              # dynamic activations
    model = mf.prepare_inference(model, recipe=mf.CurrentScaling(), activations="static",
                                 calibration=batches, clip="percentile", smooth=0.5)

Which layers: those `mf.convert` converts (minifloat.fp8.convert.fp8_plan: the input projections and the output head
stay high precision, by role; features must be multiples of 16), and every Fp8Linear a model was trained with, less
the `keep` patterns, less, with `keep_sensitive`, the layers whose FP8 rounding costs the model's output most (measured
on the calibration batches, minifloat.inference.calibrate.sensitive_layers). With dynamic activations, transformers'
stacked MoE experts too, one FP8 matrix per expert and projection (minifloat.inference.experts). Embeddings, norms
and everything else are left as they are.

Static activation scales come from calibration (minifloat.inference.calibrate), or, for a model trained with
minifloat (Fp8Linear layers), from training: a delayed-scaling layer's input scale as it stands, or the scale
delayed scaling would derive from the layer's amax history (fp8_max / max(history) / 2^margin).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Iterable

import torch
from torch import nn

from minifloat.core import roles
from minifloat.core.switch import ThreadSwitch
from minifloat.core.validate import check_bool, check_choice, check_number
from minifloat.fp8.convert import fp8_plan, other_projections, replace_module, stacked_note, unsupported_note
from minifloat.fp8.gemm import BACKENDS
from minifloat.fp8.modules import Fp8Linear
from minifloat.fp8.recipes import NVFP4Spec, Recipe, Role, check_recipe
from minifloat.fp8.scaling import ROLE_INDEX
from minifloat.inference.calibrate import (Clip, calibrated_amaxes, check_batches, combined_sqnr_db,
                                           layer_sensitivities, sensitive_layers, static_scale)
from minifloat.inference.experts import prepare_experts
from minifloat.inference.layers import Activations, Fp8InferenceLinear, LayerSpec

log = logging.getLogger("minifloat")

DEFAULT_PERCENTILE = 99.99  # of |x| over the calibration tokens (TensorRT's and ModelOpt's default)


def _patterns(keep) -> tuple[str, ...]:
    keep = (keep,) if isinstance(keep, str) else keep
    if not isinstance(keep, (list, tuple)) or not all(isinstance(p, str) for p in keep):
        raise ValueError(f"keep must be a module name / glob pattern or a list of them, got {keep!r}")
    return tuple(keep)


# on while an FP8 export plans or prepares its model: the export quantizes and reports the stacked MoE experts
# itself (minifloat.inference.hf_experts), so inference_plan's warning that they stay in high precision is left out
EXPORT_REPORTS_EXPERTS = ThreadSwitch()


def inference_experts(model: nn.Module, *, keep: Iterable[str] = ()) -> list[str]:
    """The transformers MoE experts modules prepare_inference stores in FP8 with dynamic activations
    (minifloat.inference.experts): those mf.convert would run in FP8, less the `keep` patterns."""
    keep = _patterns(keep)
    return [n for n in fp8_plan(model).experts if not any(fnmatch.fnmatchcase(n, p) for p in keep)]


def inference_plan(model: nn.Module, *, keep: Iterable[str] = (), keep_first_last: bool = True,
                   experts: bool = False) -> list[str]:
    """The layers prepare_inference converts, by name, in module order (see the module docstring). `experts`: the
    caller stores the supported MoE experts in FP8 too (`inference_experts`), so only the others are warned about.

    Raises:
        ValueError: a `keep` pattern that matches no linear layer (a typo would otherwise convert silently).
    """
    keep = _patterns(keep)
    linears = [n for n, _ in roles.named_linears(model)]
    stacked = list(roles.stacked_weights(model))
    if unmatched := [p for p in keep if not fnmatch.filter(linears + stacked, p)]:
        raise ValueError(f"keep pattern {unmatched[0]!r} matches no linear layer or MoE experts of the model")
    plan = fp8_plan(model, keep_first_last=keep_first_last)
    if plan.misshapen:
        log.warning("minifloat.prepare_inference: kept %d layer(s) in high precision, their features are not "
                    "multiples of %d: %s", len(plan.misshapen), roles.MIN_DIM_MULTIPLE, ", ".join(plan.misshapen))
    if plan.own_forward:
        log.warning("minifloat.prepare_inference: kept %d nn.Linear subclass(es) with a forward of their own as they "
                    "are: %s", len(plan.own_forward), ", ".join(plan.own_forward))
    left = plan.stacked + (() if experts else plan.experts)
    if not EXPORT_REPORTS_EXPERTS and left:
        log.warning("minifloat.prepare_inference: %s", stacked_note(model, left))
    if plan.unsupported:
        log.warning("minifloat.prepare_inference: %s", unsupported_note(plan.unsupported))
    chosen = set(plan.convert) | {n for n, m in roles.named_linears(model) if isinstance(m, Fp8Linear)}
    chosen -= roles.kept_in_fp32(model)
    return [n for n in linears if n in chosen and not any(fnmatch.fnmatchcase(n, p) for p in keep)]


def training_input_scale(layer: Fp8Linear, spec: LayerSpec) -> torch.Tensor | None:
    """The static input scale (dequantization) a layer trained with minifloat implies, or None without one: its
    delayed input scale, else the scale derived from its input amax history (which every recipe keeps)."""
    qscale = layer.fp8_state.scale_for(Role.INPUT)
    if layer.recipe.delayed and qscale is not None:
        return 1.0 / qscale  # what the layer's own forward quantizes with (quantize takes the dequantization scale)
    amax = layer.fp8_state.amax_history[:, ROLE_INDEX[Role.INPUT]].amax()
    return static_scale(amax, spec.input) if bool(amax > 0) else None


def sensitivity(model: nn.Module, calibration: Iterable, *, recipe: Recipe, keep: str | Iterable[str] = (),
                keep_first_last: bool = True, backend: str | None = None) -> dict[str, float]:
    """How much FP8 costs each layer prepare_inference would convert: {layer: the SQNR (dB) of the model's output,
    over the calibration batches, with that layer alone in FP8 (the recipe's weights, dynamic activations)}, least
    first. The model is left as it was.

    Args:
        model, recipe, keep, keep_first_last, backend: as prepare_inference.
        calibration: an iterable of model inputs, as prepare_inference's.
    """
    recipe = check_recipe(recipe)
    batches = check_batches(calibration)
    names = inference_plan(model, keep=keep, keep_first_last=keep_first_last)
    check_finite_weights(model, names)
    spec = LayerSpec.from_recipe(recipe, Activations.DYNAMIC)
    twins = {n: Fp8InferenceLinear.from_linear(model.get_submodule(n), spec, backend=backend, recipe=recipe).eval()
             for n in names}
    sqnrs = layer_sensitivities(model, batches, twins)
    return dict(sorted(sqnrs.items(), key=lambda item: item[1]))


def check_finite_weights(model: nn.Module, names: list[str]) -> None:
    """ValueError naming the layers whose weight holds NaN or infinity: FP8 would store a NaN code (every output
    NaN) or saturate an infinity at the format's largest value under a scale its other values never chose, a model
    that computes something else without an error. Before anything is replaced: the model stays as it was."""
    bad = {}
    for n in names:
        weight = model.get_submodule(n).weight.detach()
        if not weight.is_meta and not bool(torch.isfinite(weight).all()):
            bad[n] = int((~torch.isfinite(weight)).sum())
    if bad:
        raise nonfinite_weights(bad)


def check_finite_experts(model: nn.Module, names: list[str]) -> None:
    """check_finite_weights for MoE experts modules: their stacked parameters."""
    bad = {}
    for n in names:
        for p in model.get_submodule(n).parameters(recurse=False):
            if p.is_floating_point() and not p.is_meta and not bool(torch.isfinite(p).all()):
                bad[n] = bad.get(n, 0) + int((~torch.isfinite(p)).sum())
    if bad:
        raise nonfinite_weights(bad)


def nonfinite_weights(bad: dict[str, int]) -> ValueError:
    """The error for layers whose weights hold NaN or infinity ({layer: how many elements}): check_finite_weights'."""
    listed = ", ".join(f"{n} ({k} non-finite)" for n, k in list(bad.items())[:3])
    listed += ", ..." if len(bad) > 3 else ""
    return ValueError(f"the weights of {len(bad)} layer(s) hold NaN or infinity, which FP8 cannot store: {listed}; "
                      f"repair or reload the weights (a diverged run's checkpoint?), or keep those layers in high "
                      f"precision (keep=...)")


def prepare_inference(model: nn.Module, *, recipe: Recipe, calibration: Iterable | None = None,
                      activations: str = "dynamic", clip: str = "max", percentile: float = DEFAULT_PERCENTILE,
                      smooth: float | None = None, keep: str | Iterable[str] = (), keep_first_last: bool = True,
                      keep_sensitive: float | None = None, backend: str | None = None) -> nn.Module:
    """Replace the model's eligible linear layers (in place) by Fp8InferenceLinear layers whose weights are stored
    in FP8 under `recipe`'s weight granularity; returns the model.

    Args:
        model: any nn.Module (the reference Llama, an MLP, a Hugging Face model); Fp8Linear layers included.
        recipe: DelayedScaling / CurrentScaling (per tensor: weight per tensor, "row": per output channel),
            BlockScaling (128×128 weight blocks, 1×128 activation tiles), MXScaling (32-element E8M0 blocks) or
            NVFP4Scaling (E2M1 with E4M3 scales per 16 elements and an fp32 scale per tensor or token).
        calibration: an iterable of model inputs (a tensor, a tuple of positional arguments or a dict of keyword
            arguments each), for static scales and SmoothQuant.
        activations: "dynamic" (scaled per token at run time, at the recipe's activation granularity) or "static"
            (one calibrated scale per layer; without calibration only for a model trained with minifloat).
        clip: how calibration sets a static scale: "max", "percentile" or "mse" (minifloat.inference.calibrate).
        percentile: the percentile of |x| for clip="percentile", in (0, 100].
        smooth: SmoothQuant's migration strength α in [0, 1] (None: no smoothing); needs calibration.
        keep: module names or glob patterns ("blocks.0.*") of linear layers to keep in high precision.
        keep_first_last: keep the input projections and the output head in high precision (mf.convert's rule).
        keep_sensitive: a target output SQNR in dB, > 0 (None: off); needs calibration. Each layer's SQNR with it
            alone in FP8 is measured on the calibration batches (`sensitivity`: one pass per layer and batch);
            layers stay in high precision, most noise per weight element first, until the others' combined SQNR
            (their noise powers added) reaches the target (minifloat.inference.calibrate.sensitive_layers).
        backend: GEMM backend of the new layers ("auto", "native", "emulated"; None: auto).
    Returns:
        The model, with its mode unchanged.
    Raises:
        ValueError: an invalid argument, or static activations without calibration for a model whose layers have
            no training scales.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    recipe = check_recipe(recipe)
    check_choice("activations", activations, [a.value for a in Activations])
    check_choice("clip", clip, [c.value for c in Clip])
    check_number("percentile", percentile, low=0, high=100, low_open=True)
    check_number("smooth", smooth, low=0, high=1, allow_none=True)
    check_number("keep_sensitive", keep_sensitive, low=0, low_open=True, allow_none=True)  # an output SQNR in dB
    check_bool("keep_first_last", keep_first_last)
    check_choice("backend", backend, [None, *BACKENDS])
    activations, clip = Activations(activations), Clip(clip)
    static = activations == Activations.STATIC
    if clip != Clip.MAX and not (static and calibration is not None):
        raise ValueError(f"clip={clip.value!r} sets calibrated static scales; it needs activations='static' and "
                         f"calibration")
    if clip == Clip.MSE and isinstance(recipe.spec(Role.INPUT), NVFP4Spec):
        raise ValueError("clip='mse' fits one scale per tensor to a format's grid, but NVFP4 scales every 16 "
                         "elements at run time (its static scale only bounds them); use clip='max' or 'percentile'")
    if smooth is not None and calibration is None:
        raise ValueError("smooth needs calibration: SmoothQuant's scales come from activation statistics")
    if keep_sensitive is not None and calibration is None:
        raise ValueError("keep_sensitive needs calibration: each layer's sensitivity is measured on its batches")
    batches = check_batches(calibration) if calibration is not None else None

    with_experts = not static and smooth is None  # FP8 experts: dynamic activations only (minifloat.inference.experts)
    names = inference_plan(model, keep=keep, keep_first_last=keep_first_last, experts=with_experts)
    experts = inference_experts(model, keep=keep) if with_experts else []
    check_finite_weights(model, names)
    check_finite_experts(model, experts)
    if keep_sensitive is not None and names:
        sqnrs = sensitivity(model, batches, recipe=recipe, keep=keep, keep_first_last=keep_first_last,
                            backend=backend)
        kept = sensitive_layers(sqnrs, {n: model.get_submodule(n).weight.numel() for n in sqnrs}, keep_sensitive)
        names = [n for n in names if n not in kept]
        log.info("minifloat.prepare_inference: kept %d layer(s) in high precision for a %.1f dB output SQNR "
                 "(predicted %.1f dB): %s", len(kept), keep_sensitive, combined_sqnr_db(sqnrs[n] for n in names),
                 ", ".join(f"{n} ({sqnrs[n]:.1f} dB)" for n in kept) or "none")
    if not names and not experts:
        prepared = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8InferenceLinear)]
        asked = LayerSpec.from_recipe(recipe, activations)
        if other := [n for n, m in prepared if (m.spec.weight, m.spec.input, m.spec.activations)
                     != (asked.weight, asked.input, asked.activations)]:
            raise ValueError(f"the {type(model).__name__} is prepared for FP8 inference already, under another "
                             f"recipe or activation mode ({len(other)} layer(s): {', '.join(other[:3])}"
                             f"{', ...' if len(other) > 3 else ''}); prepare the unprepared model instead")
        log.warning("minifloat.prepare_inference: the %s has no linear layer left to convert%s", type(model).__name__,
                    " (it is prepared already)" if prepared else other_projections(model))
        return model
    specs = {n: LayerSpec.from_recipe(recipe, activations) for n in names}
    input_scales: dict[str, torch.Tensor] = {}
    if static and batches is None:
        for n in names:
            layer = model.get_submodule(n)
            scale = training_input_scale(layer, specs[n]) if isinstance(layer, Fp8Linear) else None
            if scale is None:
                raise ValueError(f"activations='static' needs calibration: layer {n!r} has no training scales "
                                 f"(only layers trained as Fp8Linear carry them)")
            input_scales[n] = scale
    divide: dict[str, torch.Tensor] = {}
    if batches is not None:
        if not static and smooth is None:
            if keep_sensitive is None:
                log.info("minifloat.prepare_inference: dynamic activations without smoothing use no calibration")
        else:
            amaxes, divide = calibrated_amaxes(model, batches, names, clip=clip, percentile=percentile, alpha=smooth,
                                               specs={n: specs[n].input for n in names}, static=static)
            input_scales = {n: static_scale(a, specs[n].input) for n, a in amaxes.items()}

    for n, old in [(n, model.get_submodule(n)) for n in names]:
        spec = LayerSpec.from_recipe(recipe, activations, smooth=n in divide)
        layer = Fp8InferenceLinear.from_linear(old, spec, input_scale=input_scales.get(n),
                                               smooth_scale=divide.get(n), backend=backend, recipe=recipe)
        replace_module(model, old, layer.train(old.training))  # under every name it has, with its hooks
    for n in experts:
        prepare_experts(model.get_submodule(n), LayerSpec.from_recipe(recipe, activations), backend=backend,
                        recipe=recipe)
    log.info("minifloat.prepare_inference: %d layer(s)%s in FP8 (%s, %s activations)", len(names),
             f" and {len(experts)} MoE experts module(s)" if experts else "", type(recipe).__name__,
             activations.value)
    refuse_save_pretrained(model)
    return model


class _SavePretrainedRefused:
    """A prepared Hugging Face model's `save_pretrained`: its state dict holds FP8 codes and scales under names
    transformers reads as plain weights, so a save would load back as a different model without a word."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise ValueError(f"this {self.name} is prepared for FP8 inference: save_pretrained would write its FP8 codes "
                         f"as plain weights, which from_pretrained loads as another model; save it with "
                         f"mf.save_quantized(model, path) and load it with mf.load_quantized(path, "
                         f"model={self.name}(config)), or save_pretrained the model before prepare_inference")


def refuse_save_pretrained(model: nn.Module) -> None:
    """Make a Hugging Face model's `save_pretrained` (and `push_to_hub`, which calls it) raise one clear error once
    its linear layers hold FP8 weights (prepare_inference, load_quantized)."""
    if callable(getattr(model, "save_pretrained", None)) and not isinstance(model.save_pretrained,
                                                                              _SavePretrainedRefused):
        model.save_pretrained = _SavePretrainedRefused(type(model).__name__)
