"""save_quantized / load_quantized: an FP8 inference model as a folder of safetensors and JSON, never pickled.

The folder is a minifloat checkpoint (minifloat.training.checkpoint) holding only the model:

    quantized/
        tensors.safetensors   the model's state dict: FP8 weight codes (float8_e4m3fn), their scales (float32;
                              float8_e8m0fnu for MX), static input scales, SmoothQuant scales, and every
                              high-precision tensor (embeddings, norms, head, biases); tied weights stored once
        manifest.json         sha256 and size of the tensor file, each tensor's dtype and shape, and under
                              "extra" / "quantized" this module's config (FORMAT_VERSION, the recipe, activations,
                              each FP8 layer's features and casts, the model's class and, for minifloat's Llama,
                              its LlamaConfig and dtype)

A load checks everything before the model is touched: the manifest's JSON and format versions, the tensor file's
size and hash, that the tensors are the ones listed, and every key, shape, dtype and tie against the model; any
problem raises a CheckpointError (a ValueError) of one line naming the file and the problem, and a model passed in
is left as it was.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path

import torch
from torch import nn

from minifloat.core.version import __version__
from minifloat.fp8.recipes import RECIPE_TYPES, Recipe
from minifloat.inference.experts import expert_layer_names
from minifloat.inference.layers import Fp8InferenceLinear, LayerSpec, inference_layers
from minifloat.inference.prepare import refuse_save_pretrained
from minifloat.training.checkpoint import (CHECKPOINT_FIX, MANIFEST_FILE, checkpoint_extra, load_checkpoint,
                                           save_checkpoint)
from minifloat.core.validate import check_module
from minifloat.training.jsonstate import CheckpointError
from minifloat.training.model import Llama, LlamaConfig

FORMAT = "minifloat-fp8-inference"
FORMAT_VERSION = 1
CONFIG_KEY = "quantized"  # the config's key in the checkpoint's `extra`
_RECIPES = {cls.__name__: cls for cls in RECIPE_TYPES}


def recipe_to_json(recipe: Recipe | None) -> dict | None:
    if recipe is None:
        return None
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    return {"type": type(recipe).__name__, **{k: v.value if isinstance(v, enum.Enum) else v for k, v in fields.items()}}


def recipe_from_json(d: dict | None) -> Recipe | None:
    if d is None:
        return None
    fields = dict(d)
    kind = fields.pop("type", None)
    if kind not in _RECIPES:
        raise ValueError(f"recipe type must be one of {list(_RECIPES)}, got {kind!r}")
    return _RECIPES[kind](**fields)


def _common(values: list):
    return values[0] if all(v == values[0] for v in values) else None


def quantized_config(model: nn.Module) -> dict:
    """The JSON config save_quantized writes for `model` (see the module docstring)."""
    layers = inference_layers(model)
    if experts := sorted({n.rpartition(".fp8_experts.")[0] for n in expert_layer_names(model)}):
        more = ", ..." if len(experts) > 1 else ""
        raise ValueError(f"save_quantized does not hold FP8 MoE experts ({experts[0]}{more}); export the model with export_hf(model, out, format='hf-fp8-block') (transformers and "
                         f"vLLM read it), or prepare_inference(..., keep=['*experts']) to keep the experts in high "
                         f"precision")
    if not layers:
        raise ValueError(f"the {type(model).__name__} has no FP8 inference layers: call prepare_inference first, "
                         f"or, if it ran, it converted no layer (its log says why: only torch.nn.Linear layers "
                         f"convert), and there is nothing quantized to save")
    recipes = [recipe_to_json(layer.recipe) for _, layer in layers]
    llama = isinstance(model, Llama)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "minifloat_version": __version__,
        "recipe": _common(recipes), "activations": _common([layer.spec.activations.value for _, layer in layers]),
        "layers": {name: {"in_features": layer.in_features, "out_features": layer.out_features,
                          "bias": layer.bias is not None, "recipe": recipe, **layer.spec.to_json()}
                   for (name, layer), recipe in zip(layers, recipes)},
        "model": {"class": f"{type(model).__module__}.{type(model).__qualname__}",
                  "llama_config": dataclasses.asdict(model.config) if llama else None,
                  "dtype": str(model.wte.weight.dtype).removeprefix("torch.") if llama else None},
    }


def save_quantized(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write an FP8 inference model (prepare_inference's) to the folder `path`, atomically (see the module docstring).

    Returns:
        The folder.
    Raises:
        ValueError: the model has no FP8 inference layers. FileExistsError: `path` is a file, lies under one, or is
            a folder of something else.
    """
    config = quantized_config(model)
    directory = Path(path)
    for p in (directory, *directory.parents):  # the nearest existing path must be a folder
        if p.exists():
            if not p.is_dir():
                raise FileExistsError(f"{p} is a file; save_quantized writes a folder (tensors.safetensors, "
                                      f"manifest.json): choose a new path or a folder")
            break
    if (directory / MANIFEST_FILE).exists() and not _holds_saved_model(directory):
        raise FileExistsError(f"{directory} holds a checkpoint that save_quantized did not write (a training run's?); "
                              f"it replaces only an earlier save_quantized folder: choose a new path")
    return save_checkpoint(directory, model=model, extra={CONFIG_KEY: config}, rng=False)


def _holds_saved_model(directory: Path) -> bool:
    """Whether `directory`'s manifest is a save_quantized one (which a new save may replace)."""
    try:
        config = checkpoint_extra(directory).get(CONFIG_KEY)
    except (OSError, CheckpointError):
        return False
    return isinstance(config, dict) and config.get("format") == FORMAT


def _read_config(directory: Path) -> tuple[dict, dict[str, tuple[int, int, bool, LayerSpec, Recipe | None]]]:
    """The config and each layer's (in, out, bias, spec, recipe), after checking the format and version."""
    where = directory / MANIFEST_FILE
    config = checkpoint_extra(directory).get(CONFIG_KEY)
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CheckpointError(f"{where} holds no FP8 inference model (a training checkpoint?); save_quantized "
                              f"writes one")
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: FP8 inference format version {config.get('format_version')!r}, but this "
                              f"minifloat reads format version {FORMAT_VERSION}")
    layers = {}
    try:
        for name, entry in config["layers"].items():
            entry = dict(entry)
            shape = tuple(entry.pop(k) for k in ("in_features", "out_features", "bias"))
            if not (isinstance(shape[0], int) and isinstance(shape[1], int) and isinstance(shape[2], bool)):
                raise ValueError(f"in_features, out_features and bias must be int, int, bool, got {shape}")
            recipe = recipe_from_json(entry.pop("recipe"))
            layers[name] = (*shape, LayerSpec.from_json(entry), recipe)
        recipe_from_json(config["recipe"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{where} is corrupt: its FP8 layer config is malformed ({type(err).__name__}: "
                              f"{err})") from None
    return config, layers


def _rebuild(directory: Path, config: dict) -> nn.Module:
    """minifloat's Llama of the saved LlamaConfig, unallocated (filled by the load)."""
    saved = config.get("model") or {}
    if saved.get("llama_config") is None:
        raise CheckpointError(f"{directory / MANIFEST_FILE}: the model was a {saved.get('class', 'model')}, not "
                              f"minifloat's Llama; pass model= an instance of its architecture to load into")
    try:
        llama_config = LlamaConfig(**saved["llama_config"])
        dtype = getattr(torch, saved["dtype"])
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype {saved['dtype']!r} is not a floating-point torch dtype")
    except (TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{directory / MANIFEST_FILE} is corrupt: its model config is malformed "
                              f"({type(err).__name__}: {err})") from None
    with torch.device("meta"):
        return Llama(llama_config).to(dtype)


def _convert(model: nn.Module, layers: dict, where: Path) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap the named linear layers for empty Fp8InferenceLinear layers; returns what to put back on failure."""
    plan = []
    for name, (n_in, n_out, bias, spec, recipe) in layers.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{where} quantized a layer {name!r}, which the {type(model).__name__} given lacks"
                                  ) from None
        if isinstance(module, Fp8InferenceLinear) and module.spec != spec:
            raise CheckpointError(f"{where} quantized {name!r} with another recipe or activation mode than the "
                                  f"model's {name!r} was prepared with; pass an unprepared instance of the "
                                  f"architecture (or none, for minifloat's Llama)")
        if isinstance(module, Fp8InferenceLinear):
            shape_ok = (module.in_features, module.out_features, module.bias is not None) == (n_in, n_out, bias)
        else:
            shape_ok = isinstance(module, nn.Linear) and (module.in_features, module.out_features,
                                                          module.bias is not None) == (n_in, n_out, bias)
        if not shape_ok:
            raise CheckpointError(f"{where} quantized {name!r} as a linear layer {n_in}->{n_out} (bias={bias}), but "
                                  f"the model's {name!r} is {module}")
        if isinstance(module, nn.Linear):
            new = Fp8InferenceLinear(n_in, n_out, bias, spec=spec, device=module.weight.device,
                                     dtype=module.bias.dtype if bias else None, recipe=recipe)
            parent_name, _, child = name.rpartition(".")
            plan.append((model.get_submodule(parent_name) if parent_name else model, child, new))
    undo = []
    for parent, child, new in plan:
        undo.append((parent, child, getattr(parent, child)))
        setattr(parent, child, new)
    return undo


def load_quantized(path: str | os.PathLike, model: nn.Module | None = None) -> nn.Module:
    """Load a save_quantized folder, bitwise: the FP8 codes, scales and high-precision tensors as saved.

    Args:
        path: the folder.
        model: an unquantized (or already converted) instance of the saved architecture, e.g. a freshly loaded
            Hugging Face model; its linear layers are converted and every tensor filled. None rebuilds minifloat's
            Llama from the saved LlamaConfig.
    Returns:
        The model, in eval mode.
    Raises:
        FileNotFoundError: no such folder.
        CheckpointError: another format or version, truncated or tampered files, or a model that does not fit
            (missing, extra, reshaped or retyped tensors); `model` is then left as it was.
    """
    directory = Path(path)
    if directory.is_file() and (directory.parent / MANIFEST_FILE).is_file():
        raise FileNotFoundError(f"{directory} is a file of the saved model: load_quantized takes its folder, "
                                f"{directory.parent}")
    check_module("load_quantized", model, allow_none=True)
    if not (directory / MANIFEST_FILE).exists() and (directory / "config.json").is_file() \
            and (directory / "model.safetensors").is_file():
        raise CheckpointError(f"{directory} is a Hugging Face export (config.json, model.safetensors), not a "
                              f"save_quantized folder; read it with minifloat.inference.load_hf_export, or with "
                              f"transformers")
    try:
        return _load_quantized(directory, model)
    except CheckpointError as err:  # the training checkpoint's fix does not apply to a saved inference model
        text = str(err)
        if not text.endswith(CHECKPOINT_FIX):
            raise
        raise CheckpointError(text.removesuffix(CHECKPOINT_FIX) + QUANTIZED_FIX) from None


# what a damaged save_quantized folder can do
QUANTIZED_FIX = "restore the folder from a copy, or save the model again with save_quantized"


def _load_quantized(directory: Path, model: nn.Module | None) -> nn.Module:
    config, layers = _read_config(directory)
    rebuilt = model is None
    if rebuilt:
        model = _rebuild(directory, config)
    undo = _convert(model, layers, directory / MANIFEST_FILE)
    if rebuilt:
        model = model.to_empty(device="cpu")
        # to_empty makes new Parameters off the meta device: tie them again, unless the head was quantized (its
        # own FP8 weight: prepare_inference(keep_first_last=False) untied it)
        if model.config.tie_embeddings and isinstance(model.lm_head, nn.Linear):
            model.lm_head.weight = model.wte.weight
    try:
        load_checkpoint(directory, model=model, restore_rng=False)
    except BaseException:
        for parent, child, old in undo:
            setattr(parent, child, old)
        raise
    refuse_save_pretrained(model)
    return model.eval()
