"""Export a Hugging Face model folder shard by shard: `minifloat export --hf DIR` without loading the model.

    export_folder("path/to/model", "out/blk", format="hf-fp8-block")   # memory: about one shard, not the model

The model is built on the meta device from its config (no memory), which gives its tensor names, shapes, dtypes,
tied weights and linear layers, and so the layers `prepare_inference` would quantize (`inference_plan`). Then each
safetensors file of the folder is read a tensor at a time: a quantized layer's weight goes through the very calls
the whole-model path makes (`Fp8InferenceLinear.from_linear` with the layout's recipe, then export's
`quantized_weight`), every other tensor is cast to `dtype`, and the results are written as one output shard per
input file (`model.safetensors` for one, `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json` for
more) before the next file is read. The tensors, config.json and generation_config.json are bitwise those of
`export_hf(prepare_inference(load_pretrained(DIR), recipe), ...)` (tests/test_hf_stream.py); only their split into
files differs. Peak memory is about one input shard's tensors in the output's bytes plus the largest tensor, where
the whole-model path holds the model and its quantized copy.

A model whose checkpoint layout transformers converts on load (a Mixtral's or Qwen-MoE's per-expert matrices, which
it stacks: `hf_models.conversions`) is read as stored: each tensor of the meta model is mapped to the stored tensors
save_pretrained would write for it (`hf_models.checkpoint_layout`), which is also the layout the export writes, and
each expert matrix is quantized as prepare_inference's FP8 experts quantize it (minifloat.inference.experts).

The folder is streamed only where that is certain to read what `from_pretrained` reads; otherwise `export_folder`
loads the model whole and says why at info level (`stream_plan`'s reason): weights that are not safetensors, MoE
experts an FP8 export keeps in high precision (minifloat.inference.hf_experts), a tensor of the model stored under
another name or with another shape, or a
floating tensor stored in a dtype other than the one from_pretrained(dtype="auto") gives it (it would round it
first). Calibrated static input scales need the model run, so `minifloat export --hf --calibrate` loads it whole.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from minifloat.core.files import write_json
from minifloat.inference import hf, hf_experts, hf_models
from minifloat.inference.export import check_activations, export_dtype, quantized_weight, transformers_warnings
from minifloat.inference.export_files import INDEX_FILE, check_out, copy_into, shard_name, write_export
from minifloat.inference.layers import Activations, Fp8InferenceLinear, LayerSpec
from minifloat.inference.prepare import EXPORT_REPORTS_EXPERTS, inference_plan, nonfinite_weights

log = logging.getLogger("minifloat")


@dataclasses.dataclass
class StreamPlan:
    """What a streamed export reads and writes: the meta model, its quantized layers, and for each tensor the export
    writes (the first name of each group of tied tensors, in state_dict order) the file and key it is read from."""

    model: nn.Module
    layers: list[str]
    sources: dict[str, tuple[Path, str]]  # written key -> (input file, key in that file)
    origin: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # model key -> its written keys
    weights: set[str] = dataclasses.field(default_factory=set)  # the written keys quantized (weights)
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # written key -> stored shape

    def quantize(self, model_keys) -> None:
        """Quantize the tensors written for these model keys (a layer's weight, an experts module's stacked
        parameters: under a converted checkpoint layout, the matrices they are stored as)."""
        for key in model_keys:
            self.weights.update(self.origin[key])

    def files(self) -> list[Path]:
        """The input files that hold a written tensor, in the folder's order."""
        return list(dict.fromkeys(path for path, _ in self.sources.values()))


def _stored_keys(folder: Path) -> dict[str, Path] | str:
    """{key: the safetensors file holding it} for the folder's weights, or why they cannot be streamed."""
    single, index = folder / hf.WEIGHTS_FILE, folder / INDEX_FILE
    try:
        if single.is_file():
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), single)
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return {key: folder / name for key, name in weight_map.items()}
    except Exception as err:  # noqa: BLE001 - a damaged file raises safetensors' own error type, among others
        return f"its weights cannot be read a tensor at a time ({type(err).__name__})"
    return f"it holds neither {hf.WEIGHTS_FILE} nor {INDEX_FILE}"


def _headers(files: set[Path]) -> dict[tuple[Path, str], tuple[torch.dtype, tuple[int, ...]]] | str:
    """{(file, key): (dtype, shape)} of every tensor in `files`, read from their headers (nothing loaded)."""
    out = {}
    for path in sorted(files):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    out[path, key] = (getattr(torch, _SAFETENSORS_DTYPES.get(view.get_dtype(), "_"), None),
                                      tuple(view.get_shape()))
        except Exception as err:  # noqa: BLE001 - a missing or damaged shard: the whole-model path names it
            return f"{path.name} cannot be read a tensor at a time ({type(err).__name__})"
    return out


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _meta_model(folder: Path, config, auto, stored_dtype: torch.dtype | None) -> nn.Module:
    """The folder's model on the meta device, in the dtype from_pretrained(dtype="auto") loads it in (the config's
    dtype, else the checkpoint's), with the folder's generation config where it has one."""
    dtype = getattr(config, "dtype", None) or stored_dtype or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    build = getattr(auto, "from_config", None) or auto._from_config  # an auto class's, or a model class's own
    with torch.device("meta"):
        model = build(config, dtype=dtype)
    if (folder / hf.GENERATION_FILE).is_file() and getattr(model, "generation_config", None) is not None:
        import transformers

        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model.eval()


def stream_plan(folder: str | os.PathLike, quantize: bool) -> StreamPlan | str:
    """The plan of a streamed export of `folder` (see the module docstring), or why it cannot be streamed. Raises
    read_config's one-line errors (not a model folder, already quantized, ...)."""
    folder = Path(folder)
    config, auto = hf_models.read_config(folder)  # its errors first, whatever the weights are
    stored = _stored_keys(folder)
    if isinstance(stored, str):
        return stored
    headers = _headers(set(stored.values()))
    if isinstance(headers, str):
        return headers
    floating = [d for d, _ in headers.values() if d is not None and d.is_floating_point]
    model = _meta_model(folder, config, auto, floating[0] if floating else None)
    state = model.state_dict(keep_vars=True)  # tied tensors are one object under several names
    groups: dict[int, list[str]] = {}
    for key, tensor in state.items():
        groups.setdefault(id(tensor), []).append(key)
    sources, origin, shapes = {}, {}, {}
    for names in groups.values():
        # each tensor under the names save_pretrained writes (hf_models.checkpoint_layout: transformers'
        # conversions reverted on the meta tensor, a Mixtral's stacked experts split into their matrices)
        layouts = [hf_models.checkpoint_layout(model, {name: state[name].detach()}) for name in names]
        found = next((layout for layout in layouts if all(k in stored for k in layout)), None)
        if found is None:
            return f"the model's {names[0]} is not among its stored tensors under that name"
        for key, tensor in found.items():
            path = stored[key]
            if (path, key) not in headers:
                return f"{key} is not in {path.name}, where the index places it"
            dtype, shape = headers[path, key]
            if shape != tuple(tensor.shape):
                return f"{key} is stored with shape {shape}, the model's is {tuple(tensor.shape)}"
            if dtype != tensor.dtype:
                return f"{key} is stored in {dtype}, which from_pretrained loads as {tensor.dtype}"
            sources[key], shapes[key] = (path, key), shape
        origin[names[0]] = list(found)
    with EXPORT_REPORTS_EXPERTS.on():
        plan = StreamPlan(model, inference_plan(model) if quantize else [], sources, origin, shapes=shapes)
    plan.quantize(f"{layer}.weight" for layer in plan.layers)
    return plan


def _quantized(name: str, weight: torch.Tensor, recipe) -> Fp8InferenceLinear:
    """The layer prepare_inference makes of a linear with this weight (dynamic activations; the bias plays no part
    in the weight's quantization)."""
    if not bool(torch.isfinite(weight).all()):
        raise nonfinite_weights({name: int((~torch.isfinite(weight)).sum())})
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    spec = LayerSpec.from_recipe(recipe, Activations.DYNAMIC)
    return Fp8InferenceLinear.from_linear(linear, spec, recipe=recipe).eval()


def _write_shards(plan: StreamPlan, fmt: hf.ExportFormat, dtype: torch.dtype, tmp: Path,
                  progress: Callable[[int, int], None] | None) -> int:
    """Read, convert and write the tensors one input file at a time; returns how many tensors were written."""
    recipe = hf_models.FORMAT_RECIPES[fmt.name]
    files = plan.files()
    names = [hf.WEIGHTS_FILE] if len(files) == 1 else [shard_name(i + 1, len(files)) for i in range(len(files))]
    weight_map, total, done = {}, 0, 0
    for path, name in zip(files, names):
        out = {}
        with safe_open(str(path), framework="pt") as f:
            for key, (source, stored) in plan.sources.items():
                if source != path:
                    continue
                tensor = f.get_tensor(stored)
                if key in plan.weights:
                    layer = key.removesuffix(".weight")
                    q = quantized_weight(_quantized(layer, tensor, recipe), fmt)
                    out[key], out[f"{layer}.{fmt.scale_name}"] = q.data.contiguous(), q.scale.float().contiguous()
                else:
                    out[key] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
                del tensor
                done += 1
                if progress is not None:
                    progress(done, len(plan.sources))
        save_file(out, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
        total += sum(t.numel() * t.element_size() for t in out.values())
        del out
    if len(files) > 1:
        write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                   indent=2)
    return len(weight_map)


def export_folder(folder: str | os.PathLike, out_dir: str | os.PathLike, *, format: str = "hf",
                  dtype: str | torch.dtype = "bfloat16", overwrite: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> Path:
    """Export a Hugging Face model folder (or a Hub id's snapshot in the local cache) in `format`'s layout (dynamic activations), streamed shard by shard where
    `stream_plan` allows, else through the whole model (`export_hf(prepare_inference(load_pretrained(folder)))`);
    the folder's tokenizer files are copied. `progress(done, total)` is called after each tensor of a streamed
    export. Returns the export folder. Raises as export_hf and hf_models.read_config do."""
    from minifloat.inference.export import export_hf
    from minifloat.inference.prepare import prepare_inference

    check_activations(format, "dynamic", calibrated=False)
    fmt, dtype, folder, out = hf.FORMATS[format], export_dtype(dtype), hf_models.model_folder(folder), Path(out_dir)
    check_out(out, overwrite)
    plan = stream_plan(folder, quantize=fmt.granularity is not None)
    experts = None if isinstance(plan, str) else hf_experts.experts_plan(plan.model, fmt, static=False)
    if experts is not None and experts.kept:  # prepare_inference could still store some of them in FP8
        plan = f"its MoE experts {next(iter(experts.kept))} stay in {dtype}: {next(iter(experts.kept.values()))}"
    elif experts is not None:  # each expert matrix, as the whole-model export quantizes it (inference.experts)
        plan.quantize(f"{name}.{p}" for name, params in experts.quantized.items() for p in params)
    copied = hf_models.tokenizer_files(folder)
    if isinstance(plan, str):
        log.info("minifloat: exporting %s through the whole model, not shard by shard: %s", folder, plan)
        model = hf_models.load_pretrained(folder)
        if (recipe := hf_models.FORMAT_RECIPES[format]) is not None:
            with EXPORT_REPORTS_EXPERTS.on():
                model = prepare_inference(model, recipe=recipe)
        return export_hf(model, out, format=format, dtype=dtype, activations="dynamic", overwrite=overwrite,
                         copy_files=copied)
    hf_experts.note(plan.model, experts)
    files = {hf.CONFIG_FILE: hf_models.model_config(plan.model, fmt, dtype, plan.layers, static=False,
                                                    kept_experts=tuple(experts.kept))}
    if (generation := hf_models.generation_config(plan.model)) is not None:
        files[hf.GENERATION_FILE] = generation
    count = 0

    def fill(tmp: Path) -> None:
        nonlocal count
        count = _write_shards(plan, fmt, dtype, tmp, progress)
        for name, content in files.items():
            write_json(tmp / name, content, indent=2)
        copy_into(tmp, copied)

    kept = write_export(out, overwrite, fill)
    written = {key: torch.empty(plan.shapes[key], device="meta") for key in plan.weights}
    warnings = transformers_warnings(out, fmt, sorted(k.removesuffix(".weight") for k in plan.weights), written,
                                     name=lambda n: n)
    if kept:
        warnings.append(f"minifloat: {out} keeps {', '.join(kept)}, which this export does not write (an earlier "
                        f"export's, or yours): check that it matches these weights, or delete it")
    for warning in warnings:
        log.warning("%s", warning)
    log.info("minifloat: exported %s shard by shard (%s, %d tensors, %d FP8 linears, %d FP8 experts modules)", out,
             fmt.name, count, len(plan.layers), len(experts.quantized))
    return out
