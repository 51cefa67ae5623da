"""export_hf for Hugging Face transformers models: any architecture, trained with minifloat or prepared for FP8
inference, written in the layouts of minifloat.inference.export under the model's own tensor names and config.

    model = mf.prepare_inference(AutoModelForCausalLM.from_pretrained(...), recipe=mf.BlockScaling())
    export_hf(model, "out/fp8-block", format="hf-fp8-block")     # transformers' from_pretrained and vLLM read it
    export_hf(model, "out/fp8", format="hf-fp8")                  # vLLM's per-tensor FP8

What differs from the reference Llama's export (the layouts, the atomic write, the activation scales and the
tokenizer are export_hf's own):

* tensors: the model's state_dict under its own keys. A quantized linear's weight is written in the layout (its
  stored FP8 weight as it is where the layout matches, else re-quantized through minifloat.numerics.quantize) with
  the layout's scale names; its bias in `dtype`. An Fp8InferenceLinear's own buffers (weight_scale, input_scale,
  smooth_scale) and an Fp8Linear's scaling state (`fp8_state.*`) are not written as such. Other floating tensors are
  written in `dtype`, integer buffers as they are. A tensor that shares its storage with an earlier one (a head tied
  to the embedding) is written once, as save_pretrained does. The names and layout are then those save_pretrained
  writes (`checkpoint_layout`): where transformers converts a checkpoint on load (a Mixtral's or Qwen-MoE's experts,
  one matrix each on disk, one 3-D parameter in the model), the conversion is reverted, as readers expect it.
* config.json: `model.config.to_dict()` with `dtype`, `architectures` (the model's class when the config has none),
  `tie_word_embeddings` false where the head no longer shares the embedding's weight (prepare_inference quantized
  it), and the layout's quantization_config (the layers kept in high precision under "ignored_layers" and
  "modules_to_not_convert", as for the reference Llama).
* generation_config.json: the model's generation config, as save_pretrained writes it (none if it has none).

A model under PEFT adapters is not a transformers model here: merge them first (`merge_and_unload` on the
high-precision model), or save the adapters with PEFT.

`minifloat export --hf DIR` does it all for a Hugging Face model folder: `load_pretrained` (transformers, the folder's dtype),
`prepare_inference` with the layout's recipe (`FORMAT_RECIPES`: per-tensor current scaling for hf-fp8, BlockScaling
for hf-fp8-block), export_hf, and the folder's tokenizer files (`TOKENIZER_FILES`) copied beside it. With
`--calibrate N --data TEXT` (hf-fp8) the layers get static input scales from N batches of TEXT encoded by the
folder's tokenizer.json (`folder_calibration`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from minifloat.fp8.recipes import BlockScaling, CurrentScaling
from minifloat.inference import hf
from minifloat.inference.experts import expert_layer_names
from minifloat.inference.layers import Fp8InferenceLinear

# the recipe whose stored weights each layout holds as they are (minifloat.inference.export's quantized_weight)
FORMAT_RECIPES = {"hf": None, "hf-fp8": CurrentScaling(), "hf-fp8-block": BlockScaling()}
# a model folder's tokenizer, as AutoTokenizer reads it (fast tokenizer, its config, special tokens, SentencePiece)
TOKENIZER_FILES = (hf.TOKENIZER_FILE, hf.TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "tokenizer.model")


def is_transformers_model(model: object) -> bool:
    """Whether `model` is a transformers PreTrainedModel (checked by class name: transformers stays optional)."""
    return isinstance(model, nn.Module) and any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def _is_scaling_state(key: str) -> bool:
    return "fp8_state" in key.split(".")


def _head_still_tied(model: nn.Module) -> bool:
    """Whether the output head still shares the input embedding's weight (prepare_inference may have quantized it)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(head, "weight", None)
    return isinstance(weight, nn.Parameter) and embedding is not None and weight is embedding.weight


def model_tensors(model: nn.Module, fmt: hf.ExportFormat, dtype: torch.dtype, layers: list[str],
                  input_scales: dict[str, torch.Tensor] | None, quantized_weight, weight) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors (see the module docstring). `quantized_weight(module, fmt)` and `weight(module)`
    are export's: a layer's weight on the layout's grid, and in high precision."""
    quantized = set(layers) if fmt.granularity is not None else set()
    modules = dict(model.named_modules())
    out, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if _is_scaling_state(key):
            continue
        layer, _, leaf = key.rpartition(".")
        module = modules.get(layer)
        if layer in quantized:
            if leaf == "weight":
                q = quantized_weight(module, fmt)
                out[key] = q.data.cpu().contiguous()
                out[f"{layer}.{fmt.scale_name}"] = q.scale.float().cpu().contiguous()
                if input_scales is not None:
                    out[f"{layer}.input_scale"] = input_scales[layer].float().reshape(())
            elif leaf == "bias":
                out[key] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
            continue  # an Fp8InferenceLinear's own scales: written above under the layout's names
        if isinstance(module, Fp8InferenceLinear):  # a plain export of a prepared layer: its dequantized weight
            if leaf in ("weight", "bias"):
                value = weight(module) if leaf == "weight" else tensor.detach()
                out[key] = value.to(device="cpu", dtype=dtype).contiguous()
            continue
        where = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and where in seen:  # tied to an earlier tensor (the head to the embedding)
            continue
        seen.add(where)
        tensor = tensor.detach().to("cpu")
        out[key] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    return out


def conversions(model: nn.Module) -> list:
    """transformers' weight conversions between the model's tensor names and its checkpoint layout (renamed modules,
    MoE experts stored one matrix per expert but held stacked as 3-D parameters): the ones from_pretrained applied,
    else those transformers registers for the architecture (legacy renamings and prefix changes left out, as
    save_pretrained leaves them out). Empty for most dense models and for a transformers without the mechanism."""
    found = getattr(model, "_weight_conversions", None)
    if found is None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange
        except ImportError:
            return []
        found = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return list(found or [])


def checkpoint_layout(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (the model's names) under the names and layout save_pretrained writes for the model, the layout
    from_pretrained and serving stacks read: transformers' conversions reverted (a Mixtral's stacked experts become
    `block_sparse_moe.experts.<e>.w1.weight` ..., as its checkpoints on the Hub hold them). A quantized layer's
    scales are renamed with its weight. Unchanged for a model without conversions."""
    if not conversions(model):
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(tensors)))


def checkpoint_module(model: nn.Module, name: str) -> str:
    """Module `name` under its checkpoint name (transformers' renamings reverted: a Mixtral's `mlp` is
    `block_sparse_moe` there), as vLLM's ignored_layers names it."""
    probe = f"{name}.weight"
    try:
        (key,) = checkpoint_layout(model, {probe: torch.empty(1, 1, device="meta")})
    except (ValueError, RuntimeError, TypeError):
        return name
    return key.removesuffix(".weight")


def model_config(model: nn.Module, fmt: hf.ExportFormat, dtype: torch.dtype, layers: list[str],
                 static: bool, kept_experts: tuple[str, ...] = ()) -> dict:
    """config.json (see the module docstring). `kept_experts`: MoE experts modules an FP8 export keeps in `dtype`
    (minifloat.inference.hf_experts), listed with the kept linears: in `ignored_layers` under their checkpoint
    names (vLLM reads the checkpoint's), in `modules_to_not_convert` under the model's (transformers matches its
    modules)."""
    config = model.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    if config.get("tie_word_embeddings") and not _head_still_tied(model):
        config["tie_word_embeddings"] = False
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)  # where the model was read from on this machine: no part of the export
    if fmt.granularity is not None:
        inside = expert_layer_names(model)
        kept = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, Fp8InferenceLinear))
                and name not in layers and name not in inside] + list(kept_experts)
        config["quantization_config"] = {**dict(fmt.config), "activation_scheme": "static" if static else "dynamic",
                                         "ignored_layers": [checkpoint_module(model, n) for n in kept],
                                         "modules_to_not_convert": kept}
    return config


def generation_config(model: nn.Module) -> dict | None:
    """generation_config.json as save_pretrained writes it (the fields that differ from the defaults), or None."""
    config = getattr(model, "generation_config", None)
    return None if config is None else json.loads(config.to_json_string(use_diff=True))


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face Hub model id: owner/name


def model_folder(name: str | Path) -> Path:
    """The local folder of a model: `name` itself when it is a folder, else, for a Hub id (`owner/name`), its
    snapshot in the local Hugging Face cache (HF_HUB_CACHE; nothing is downloaded). FileNotFoundError in one line
    for a folder that does not exist or an id the cache does not hold."""
    path = Path(name).expanduser()
    if path.is_dir() or not _REPO_ID.fullmatch(str(name)):
        return path
    try:
        import huggingface_hub

        # HF_HUB_CACHE read now (the hub reads it once, at import)
        cache = os.environ.get("HF_HUB_CACHE") or None
        return Path(huggingface_hub.snapshot_download(str(name), local_files_only=True, cache_dir=cache))
    except ImportError:
        raise FileNotFoundError(f"{name} is no folder (and huggingface_hub, to look for it in the local Hugging "
                                f"Face cache, is not installed)") from None
    except Exception:  # noqa: BLE001 - the hub's errors for an id it does not hold locally, or a bad id
        raise FileNotFoundError(f"{name} is neither a folder nor a model in the local Hugging Face cache; download "
                                f"it first (hf download {name}) or give its folder") from None


def read_config(folder: str | Path):
    """The transformers config of a local Hugging Face model folder, and the class that builds its model: the one
    its config's `architectures` names (what saved it), else a causal LM where the config has one, else the base
    model. One-line errors: not a model folder, transformers
    missing, a config it cannot read, or a folder already quantized (export from the high-precision model)."""
    folder = model_folder(folder)
    if not (folder / hf.CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder} holds no {hf.CONFIG_FILE}: not a Hugging Face model folder")
    try:
        import transformers
    except ImportError:
        raise ImportError("reading a Hugging Face model folder needs transformers: pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{folder / hf.CONFIG_FILE}: transformers cannot read it ({_first_line(err)})") from None
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{folder} is already quantized (its config has a quantization_config); export from the "
                         f"high-precision model")
    named = [getattr(transformers, name, None) for name in (getattr(config, "architectures", None) or [])[:1]]
    if named and isinstance(named[0], type) and issubclass(named[0], transformers.PreTrainedModel):
        return config, named[0]  # the class that saved it: its heads are the folder's (AutoModel would drop them)
    auto = (transformers.AutoModelForCausalLM if type(config) in transformers.AutoModelForCausalLM._model_mapping
            else transformers.AutoModel)
    return config, auto


def load_pretrained(folder: str | Path) -> nn.Module:
    """The transformers model in a local Hugging Face model folder (or a Hub id's cached snapshot), in its own dtype and eval mode (`read_config`'s
    class). One-line errors: those of read_config, and a model transformers cannot build or load."""
    from transformers.utils import logging as hf_logging

    folder = model_folder(folder)  # a Hub id: its cached snapshot (from_pretrained would go online for it)
    _, auto = read_config(folder)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its per-tensor bar on stderr: a command's output is its own lines
    try:
        model = auto.from_pretrained(folder, dtype="auto")  # the folder's dtype: a bf16 model needs no fp32 copy
    except Exception as err:  # noqa: BLE001 - a damaged weights file raises safetensors' own error type, among others
        raise ValueError(f"{folder}: transformers cannot load the model ({type(err).__name__}: "
                         f"{_first_line(err)}); check or save again the folder's weights") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model.eval()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The tokenizer files (TOKENIZER_FILES) a model folder holds, to copy into its export."""
    return [Path(folder) / name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]


# calibration batches for a model folder: (B, T) token windows, T capped by the model's positions
CALIBRATION_BATCH, CALIBRATION_SEQ_LEN = 4, 512


def folder_calibration(folder: str | Path, data: str | Path, batches: int, model: nn.Module) -> list[torch.Tensor]:
    """`batches` (B, T) token batches of `data` (a folder of text files, or token shards) encoded by the model
    folder's tokenizer.json, for prepare_inference's calibration. ValueError for a folder without a tokenizer.json
    or data whose ids the model's vocabulary does not hold."""
    # imported here: minifloat.training pulls in the trainer, which an export without calibration never needs
    from minifloat.training.batches import val_batches
    from minifloat.training.data import load_corpus

    tokenizer = Path(folder) / hf.TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ValueError(f"{folder} has no {hf.TOKENIZER_FILE} to encode the calibration text with; export with "
                         f"dynamic activations (no --calibrate), or add the model's tokenizer.json to the folder")
    corpus = load_corpus(str(data), tokenizer=str(tokenizer))
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and corpus.vocab_size > vocab:
        raise ValueError(f"the tokenizer {tokenizer} has {corpus.vocab_size} ids, more than the model's vocabulary of "
                         f"{vocab}: not this model's tokenizer")
    positions = getattr(model.config, "max_position_embeddings", None) or CALIBRATION_SEQ_LEN
    out = [x for x, _ in val_batches(corpus.train, batch_size=CALIBRATION_BATCH,
                                     seq_len=min(CALIBRATION_SEQ_LEN, positions), max_batches=batches)]
    if not out:
        raise ValueError(f"{data} holds too little text for one calibration batch of {CALIBRATION_SEQ_LEN} tokens")
    return out
