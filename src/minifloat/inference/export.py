"""Export the reference Llama as a Hugging Face checkpoint, in bf16 or in the FP8 layouts serving stacks read.

    export_hf(model, "out/hf")                                   # bf16: LlamaForCausalLM.from_pretrained reads it
    export_hf("runs/a", "out/fp8", format="hf-fp8")              # a run folder's latest checkpoint, per-tensor FP8
    model = load_hf_export("out/fp8")                            # back to minifloat's Llama (minifloat.inference.hf)

An export is a folder: config.json (transformers' LlamaConfig fields, or Qwen3's for a QK-norm model: see
minifloat.inference.hf), generation_config.json and model.safetensors with Hugging Face's tensor names; for a run
that trained with a tokenizer (minifloat.inference.tokenizer.run_tokenizer) also its tokenizer.json and a
tokenizer_config.json naming PreTrainedTokenizerFast, so that AutoTokenizer reads the folder, and the tokenizer's
end-of-text id as eos_token_id / bos_token_id in both configs (hf.special_ids; a byte run has no tokenizer file and no
such id: its ids are UTF-8 bytes). In the FP8 formats each quantized linear layer stores

    format          tensors of <layer>                                      quantization_config
    hf              weight (bf16)                                           -
    hf-fp8          weight  float8_e4m3fn (out, in)                         quant_method "fp8", weight_block_size null,
                    weight_scale  fp32 ()   W ≈ weight · weight_scale       activation_scheme "static" (with
                    input_scale   fp32 ()   static: x_fp8 = x / input_scale  input_scale) or "dynamic" (without)
    hf-fp8-block    weight  float8_e4m3fn (out, in)                         quant_method "fp8", fmt "e4m3",
                    weight_scale_inv  fp32 (ceil(out/128), ceil(in/128))    weight_block_size [128, 128],
                    W ≈ weight · weight_scale_inv per 128×128 block         activation_scheme "dynamic"

hf-fp8 is vLLM's / AutoFP8's per-tensor "fp8" checkpoint; hf-fp8-block is DeepSeek-V3's, whose `weight_scale_inv`
is, despite its name, the dequantization multiplier (transformers' finegrained_fp8 multiplies by it). transformers
reads hf, and hf-fp8-block whose sizes are multiples of 128 (or at most 128), right; it refuses hf-fp8 in one line
(hf.TRANSFORMERS_REFUSAL: it would load its weights unscaled, its per-tensor names not being vLLM's), and the export
logs one warning line for a block file it would load wrong (`transformers_warnings`; docs/inference.md, "What
transformers loads").

Embeddings, norms and lm_head stay in `dtype`; the linears kept in high precision are listed under both
"ignored_layers" (vLLM) and "modules_to_not_convert" (transformers). Weights are cast through minifloat's one
rounding path (minifloat.numerics.quantize, E4M3, "tensor" / "block" granularity). A static input scale comes from
calibration batches (amax / 448) or, for a model trained with delayed scaling, from its delayed input scale.

Which linears are quantized: a model trained in FP8 keeps its own choice (its Fp8Linear layers), a model prepared
for FP8 inference its Fp8InferenceLinear layers (their stored weights are written as they are when the layout
matches); any other model gets the choice `convert` would make (minifloat.fp8.convert.fp8_plan: the first block's
q/k/v and lm_head stay in high precision). A transformers MoE model's stacked experts are quantized too, one matrix
per expert and projection in the checkpoint layout (minifloat.inference.hf_experts).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from minifloat.core.validate import check_choice
from minifloat.fp8.modules import Fp8Linear
from minifloat.inference import hf, hf_experts, hf_models
from minifloat.inference.calibrate import Clip, calibrated_amaxes, check_batches, static_scale
from minifloat.inference.export_files import check_out, copy_into, write_export
from minifloat.inference.experts import expert_layer_names
from minifloat.inference.layers import Activations, Fp8InferenceLinear, LayerSpec
from minifloat.inference.prepare import (DEFAULT_PERCENTILE, EXPORT_REPORTS_EXPERTS, inference_plan,
                                         training_input_scale)
from minifloat.inference.runs import LOW_PRECISION_RUN, load_run, run_calibration, run_checkpoint  # noqa: F401
from minifloat.numerics.granularity import TILE, Granularity
from minifloat.numerics.quantize import Quantized, quantize
from minifloat.core.files import write_json
from minifloat.training.model import Llama, LlamaConfig
from minifloat.training.tokenizer import LoadedTokenizer, load_tokenizer

log = logging.getLogger("minifloat")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ACTIVATIONS = ("auto", "static", "dynamic")


def export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    check_choice("dtype", dtype, list(DTYPES))
    return DTYPES[dtype]


# ------------------------------------------------------------------------------------------------------ runs


# ------------------------------------------------------------------------------------------------ activations


def quantized_layers(model: Llama) -> list[str]:
    """The linears an FP8 export quantizes, in module order: a model trained in FP8 its Fp8Linear layers (those kept
    in BF16, by --keep-blocks, --fp8-layers or a 4-bit preset's last block, stay so), any other its
    Fp8InferenceLinear layers and those prepare_inference would convert (minifloat.inference.prepare.inference_plan;
    see the module docstring)."""
    trained = [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
    # a run with a low-precision recipe keeps its own choice even when it is none (--fp8-layers where none paid)
    planned = set() if trained or getattr(model, LOW_PRECISION_RUN, False) else set(inference_plan(model))
    inside = expert_layer_names(model)  # prepared MoE experts' matrices: written as the experts (hf_experts)
    return [name for name, m in model.named_modules()
            if (isinstance(m, (Fp8Linear, Fp8InferenceLinear)) or name in planned) and name not in inside]


def model_input_scales(model: Llama, layers: list[str], spec: LayerSpec) -> dict[str, torch.Tensor] | None:
    """The static input scales (dequantization multipliers) the model's own FP8 layers imply: a static
    Fp8InferenceLinear's input_scale, or a layer trained with minifloat's (prepare.training_input_scale: its delayed
    input scale, else one from its input amax history). None unless every one of `layers` has one."""
    scales = {}
    for name in layers:
        module = model.get_submodule(name)
        scale = training_input_scale(module, spec) if isinstance(module, Fp8Linear) else None
        if (isinstance(module, Fp8InferenceLinear) and module.spec.activations == Activations.STATIC
                and module.spec.input.fmt == spec.input.fmt and not module.spec.smooth):
            scale = module.input_scale
        if scale is None:
            return None
        scales[name] = scale.detach().float().cpu().reshape(())
    return scales


def check_activations(format: str, activations: str, *, calibrated: bool, clip: str = "max") -> None:
    """An export's activation options, checked before any work (export_hf; `minifloat export` before it reads its
    calibration batches): static scales need a format that stores them, calibration needs them written."""
    check_choice("format", format, list(hf.FORMATS))
    check_choice("activations", activations, ACTIVATIONS)
    check_choice("clip", clip, [c.value for c in Clip])
    if (calibrated or activations == "static") and not hf.FORMATS[format].static:
        given = "calibration gives" if calibrated else "activations='static' asks for"
        raise ValueError(f"{given} static activation scales, which format {format!r} does not store "
                         f"(only 'hf-fp8' does)")
    if calibrated and activations == "dynamic":  # the batches would be read, their scales never written
        raise ValueError("calibration gives static activation scales, which activations='dynamic' does not write; "
                         "drop the calibration, or use activations='auto' or activations='static'")


def _input_scales(model: Llama, fmt: hf.ExportFormat, layers: list[str], activations: str,
                  calibration: Iterable | None, clip: str, percentile: float) -> dict[str, torch.Tensor] | None:
    if activations == "dynamic" or not fmt.static or not layers:
        return None
    spec = fmt.layer_spec(static=True)
    if calibration is None:
        scales = model_input_scales(model, layers, spec)
    else:  # minifloat.inference.calibrate's pass, as prepare_inference calibrates
        amaxes, _ = calibrated_amaxes(model, check_batches(calibration), layers, clip=Clip(clip),
                                      percentile=percentile, alpha=None, specs=dict.fromkeys(layers, spec.input),
                                      static=True)
        scales = {n: static_scale(a, spec.input).float().cpu().reshape(()) for n, a in amaxes.items()}
    if scales is None and activations == "static":
        raise NeedsCalibration("static activation scales need calibration batches (calibration=) or a model whose "
                               "FP8 layers carry them (trained in FP8 with minifloat, or prepared with static "
                               "activations); use dynamic activations otherwise")
    return scales


# ------------------------------------------------------------------------------------------------------ write


def _weight(module: nn.Module) -> torch.Tensor:
    """A linear's weight in high precision (an Fp8InferenceLinear's dequantized)."""
    if isinstance(module, Fp8InferenceLinear):
        return module.dequantized_weight(torch.float32)
    return module.weight.detach()


def quantized_weight(module: nn.Module, fmt: hf.ExportFormat) -> Quantized:
    """The layer's weight on the layout's grid: an Fp8InferenceLinear's stored weight and scales as they are when
    they are E4M3 at the layout's granularity (any fp32 scales: a margin or power-of-two scales change nothing
    the layout records), else the weight quantized through minifloat.numerics.quantize."""
    weight = module.spec.weight if isinstance(module, Fp8InferenceLinear) else None
    if weight is not None and not module.spec.smooth and weight.fmt == hf.WEIGHT_FORMAT \
            and weight.granularity == fmt.granularity:
        return module.quantized_weight()
    return quantize(_weight(module).float().cpu(), hf.WEIGHT_FORMAT, granularity=fmt.granularity)


def exported_config(model: Llama) -> LlamaConfig:
    """The model's LlamaConfig as the export writes it: untied when the config ties the head to the embedding but
    the head no longer shares its weight (prepare_inference quantized it, keep_first_last=False), so the export
    keeps the head the model computes with."""
    config = model.config
    if config.tie_embeddings and getattr(model.lm_head, "weight", None) is not model.wte.weight:
        return dataclasses.replace(config, tie_embeddings=False)
    return config


def hf_tensors(model: Llama, fmt: hf.ExportFormat, dtype: torch.dtype, layers: list[str],
               input_scales: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors under Hugging Face's names (see the module docstring)."""
    config = exported_config(model)
    with torch.device("meta"):
        keys = list(Llama(config).state_dict())  # the reference Llama's own tensors: no FP8 scaling buffers
    modules = dict(model.named_modules())
    quantized = set(layers) if fmt.granularity is not None else set()
    out = {}
    for key in keys:
        if key == "lm_head.weight" and config.tie_embeddings:
            continue  # tied to embed_tokens (tie_word_embeddings), as save_pretrained leaves it out
        layer, _, leaf = key.rpartition(".")
        name = hf.hf_name(key)
        if layer not in quantized:
            module = modules.get(layer)
            if module is None or not isinstance(getattr(module, leaf, None), torch.Tensor):
                raise ValueError(f"the model lacks {key}, a tensor of minifloat's reference Llama")
            tensor = _weight(module) if leaf == "weight" else getattr(module, leaf).detach()
            out[name] = tensor.to(device="cpu", dtype=dtype).contiguous()
            continue
        q = quantized_weight(modules[layer], fmt)
        prefix = name.removesuffix(".weight")
        out[name] = q.data.cpu().contiguous()
        out[f"{prefix}.{fmt.scale_name}"] = q.scale.float().cpu().contiguous()
        if input_scales is not None:
            out[f"{prefix}.input_scale"] = input_scales[layer].float().reshape(())
    return out


def _config_json(model: Llama, fmt: hf.ExportFormat, dtype: torch.dtype, layers: list[str], static: bool,
                 eot_id: int | None) -> dict:
    config = hf.hf_config(exported_config(model), dtype=str(dtype).removeprefix("torch."), eot_id=eot_id)
    if fmt.granularity is not None:
        kept = [hf.hf_name(name) for name, m in model.named_modules()
                if isinstance(m, (nn.Linear, Fp8InferenceLinear)) and name not in layers]
        config["quantization_config"] = {**dict(fmt.config), "activation_scheme": "static" if static else "dynamic",
                                         "ignored_layers": kept, "modules_to_not_convert": kept}
    return config


def transformers_warnings(out: Path, fmt: hf.ExportFormat, layers: list[str], tensors: dict[str, torch.Tensor],
                           name=hf.hf_name) -> list[str]:
    """One line for each way transformers' from_pretrained would load the export wrong without raising (measured
    with transformers 5.24 on a CPU, tests/test_export.py): partial 128×128 blocks, which its CPU dequantization
    places at size // blocks (vLLM reads them as written). (hf-fp8, which it read unscaled, it now refuses:
    hf.TRANSFORMERS_REFUSAL.)"""
    lines = []
    ragged = [n for n in layers if fmt.granularity == Granularity.BLOCK
              and any(d > TILE and d % TILE for d in tensors[name(f"{n}.weight")].shape)]
    if ragged:
        lines.append(f"minifloat: {out} ({fmt.name}): {len(ragged)} layer(s) have a size over {TILE} that {TILE} "
                     f"does not divide (e.g. {name(ragged[0])}): vLLM reads their partial blocks, transformers' "
                     f"CPU dequantization misplaces their scales without an error (docs/inference.md)")
    return lines


class NeedsCalibration(ValueError):
    """Static activation scales were asked for, and neither calibration batches nor the model's layers give them."""


def _tokenizer(model_or_run, model: Llama, checkpoint: str, tokenizer: str | os.PathLike | None,
               warnings: list[str]) -> LoadedTokenizer | None:
    """The tokenizer.json an export copies: `tokenizer` (checked against the model's vocabulary), else a run's own;
    None for a byte run, or (a line in `warnings`) a token run whose tokenizer cannot be found."""
    # imported here: minifloat.inference.tokenizer finds a run's checkpoint with this module's run_checkpoint
    from minifloat.inference.tokenizer import TextTokenizer, run_tokenizer

    if isinstance(model_or_run, nn.Module):
        if tokenizer is None:
            return None
        loaded = load_tokenizer(tokenizer)
        if loaded.vocab_size != model.config.vocab_size:
            raise ValueError(f"the tokenizer {loaded.path} has a vocabulary of {loaded.vocab_size} ids, but the "
                             f"model has {model.config.vocab_size}; pass the tokenizer it trained with")
        return loaded
    try:
        found = run_tokenizer(model_or_run, checkpoint, tokenizer=tokenizer)
        return found.loaded if isinstance(found, TextTokenizer) else None
    except ValueError as err:
        if tokenizer is not None:
            raise
        warnings.append(f"minifloat: the export has no tokenizer.json: {err}")
        return None


def export_hf(model_or_run: Llama | str | os.PathLike, out_dir: str | os.PathLike, *, format: str = "hf",
              dtype: str | torch.dtype = "bfloat16", checkpoint: str = "latest", activations: str = "auto",
              calibration: Iterable | None = None, clip: str = "max", percentile: float = DEFAULT_PERCENTILE,
              tokenizer: str | os.PathLike | None = None, overwrite: bool = False,
              copy_files: Iterable[str | os.PathLike] = ()) -> Path:
    """Write a Hugging Face checkpoint of the reference Llama or of a transformers model (see the module docstring
    for the layouts, and minifloat.inference.hf_models for a transformers model's names and config).

    Args:
        model_or_run: a minifloat Llama (under any precision policy, or prepared for FP8 inference), a transformers
            model (trained with minifloat, prepared for FP8 inference, or neither), or a run folder.
        out_dir: the export folder: written in a temporary sibling, then renamed into place.
        format: "hf" (plain `dtype` tensors), "hf-fp8" (vLLM's per-tensor FP8, which transformers loads wrong: a
            warning is logged) or "hf-fp8-block" (128×128 block FP8).
        dtype: of the unquantized tensors: "bfloat16", "float16" or "float32".
        checkpoint: with a run folder, "latest" or another checkpoint folder (see `run_checkpoint`).
        activations: "hf-fp8" only: "static" (input scales from `calibration` or the model's own static / delayed
            scales, else an error), "dynamic" (none written; no calibration), or "auto" (static when such scales exist).
        calibration: model inputs (e.g. a list of (B, T) token batches) for static input scales: amax / 448 of each
            quantized layer's input over them, amax as `clip` ("max", "percentile" or "mse") and `percentile` set
            it (minifloat.inference.calibrate, as prepare_inference calibrates).
        tokenizer: a tokenizer.json to copy into the export, checked against the model's vocabulary; None for a
            run's own (found as minifloat generate finds it; a warning when a token run's cannot be found).
        overwrite: write into a non-empty `out_dir`, replacing an earlier export's files there once the new
            export is complete (other files stay; a folder holding a run or checkpoint is refused anyway).
        copy_files: files copied into the export as they are, each named like one of EXPORT_FILES (a Hugging Face
            model folder's tokenizer files: minifloat.inference.hf_models.tokenizer_files).
    Returns:
        The export folder.
    Raises:
        FileExistsError: `out_dir` is a file, holds a run or checkpoint, or is non-empty and not `overwrite`.
        FileNotFoundError: no such run folder or checkpoint.
        ValueError: an unknown format / dtype / activations, static scales that cannot be had, another model.
    """
    check_activations(format, activations, calibrated=calibration is not None, clip=clip)  # the format's too
    fmt, dtype = hf.FORMATS[format], export_dtype(dtype)
    out = Path(out_dir)
    check_out(out, overwrite)
    model = model_or_run if isinstance(model_or_run, nn.Module) else load_run(model_or_run, checkpoint=checkpoint)
    theirs = hf_models.is_transformers_model(model)  # a transformers model: its own names and config
    if not theirs and not isinstance(model, Llama):
        raise ValueError(f"export_hf exports minifloat's reference Llama or a transformers model, got a "
                         f"{type(model).__name__}; save another model with its own save_pretrained (high precision) "
                         f"or, prepared for FP8 inference, with mf.save_quantized(model, path) (under PEFT adapters: "
                         f"merge_and_unload the high-precision model first)")
    with EXPORT_REPORTS_EXPERTS.on():
        layers = quantized_layers(model) if fmt.granularity is not None else []
    input_scales = _input_scales(model, fmt, layers, activations, calibration, clip, percentile)
    if theirs:
        tensors = hf_models.model_tensors(model, fmt, dtype, layers, input_scales, quantized_weight, _weight)
        tensors = hf_experts.restacked(model, tensors, dtype)  # prepared experts: the parameters they replaced
    else:
        tensors = hf_tensors(model, fmt, dtype, layers, input_scales)
    warnings = transformers_warnings(out, fmt, layers, tensors, name=(lambda n: n) if theirs else hf.hf_name)
    experts = hf_experts.experts_plan(model, fmt, static=input_scales is not None)
    if theirs:  # the checkpoint layout save_pretrained writes (MoE experts one matrix each), which readers expect
        tensors = hf_models.checkpoint_layout(model, tensors)
        hf_experts.note(model, experts)
        expert_weights = hf_experts.quantize_experts(model, fmt, experts, tensors, quantized_weight)
        warnings += transformers_warnings(out, fmt, [k.removesuffix(".weight") for k in expert_weights], tensors,
                                          name=lambda n: n)
    loaded = _tokenizer(model_or_run, model, checkpoint, tokenizer, warnings)
    eot_id = loaded.eot_id if loaded is not None else None  # bos / eos: hf.special_ids
    if theirs:
        files = {hf.CONFIG_FILE: hf_models.model_config(model, fmt, dtype, layers, input_scales is not None,
                                                        tuple(experts.kept))}
        if (generation := hf_models.generation_config(model)) is not None:
            files[hf.GENERATION_FILE] = generation
    else:
        files = {hf.CONFIG_FILE: _config_json(model, fmt, dtype, layers, input_scales is not None, eot_id),
                 hf.GENERATION_FILE: hf.generation_config(model.config, eot_id=eot_id)}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / hf.WEIGHTS_FILE), metadata={"format": "pt"})
        for name, content in files.items():
            write_json(tmp / name, content, indent=2)
        copy_into(tmp, copy_files)
        if loaded is not None:
            shutil.copyfile(loaded.path, tmp / hf.TOKENIZER_FILE)
            eot = loaded.tokenizer.id_to_token(eot_id) if eot_id is not None else None
            write_json(tmp / hf.TOKENIZER_CONFIG_FILE, hf.tokenizer_config(eot), indent=2)

    kept = write_export(out, overwrite, fill)
    if kept:  # an earlier export's tokenizer, or one the user put there: either way not ours to delete
        warnings.append(f"minifloat: {out} keeps {', '.join(kept)}, which this export does not write (an earlier "
                        f"export's, or yours): check that it matches these weights, or delete it")
    for warning in warnings:  # once the export exists: what transformers would load from it without an error
        log.warning("%s", warning)
    log.info("minifloat: exported %s (%s, %d tensors, %d FP8 linears, %d FP8 experts modules)", out, fmt.name,
             len(tensors), len(layers), len(experts.quantized))
    return out
