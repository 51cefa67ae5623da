"""The reference Llama in Hugging Face's terms: config.json fields, tensor names and FP8 layouts, both ways, and
the reader of an export folder (minifloat.inference.export writes them).

    model = load_hf_export("out/fp8")      # minifloat's Llama; FP8 layers stay FP8 (Fp8InferenceLinear)
    export = read_hf_export("out/fp8")     # the tensors under our names: HfExport

minifloat's Llama (minifloat.training.model) is Hugging Face's `LlamaForCausalLM` with other names; every
convention was checked against transformers' modeling_llama, and tests/test_export.py checks the logits:

    ours                                   Hugging Face                              the same because
    wte                                    model.embed_tokens                        -
    blocks.N.attn_norm / mlp_norm          model.layers.N.input_layernorm /          RMSNorm y = x / rms(x) · w
                                           post_attention_layernorm                  (w, not 1 + w), eps = norm_eps
    blocks.N.attn.{q,k,v,o}_proj           model.layers.N.self_attn.{q,k,v,o}_proj   separate projections, no bias;
                                                                                     n_kv_head = num_key_value_heads,
                                                                                     query head h reads kv head
                                                                                     h // (n_head / n_kv_head)
                                                                                     (repeat_kv)
    RoPE: pairs (i, i + hd/2)              rotate_half                               same pairing, same inv_freq
                                                                                     theta^(-2i/hd): no permutation
    attention scale                        1/sqrt(head_dim)                          -
    blocks.N.mlp.{gate,up,down}_proj       model.layers.N.mlp.{gate,up,down}_proj    down(silu(gate(x)) · up(x))
    norm, lm_head                          model.norm, lm_head                       lm_head = embed_tokens when tied

A model with QK-norm (RMSNorm on each head's queries and keys before RoPE) is Qwen3's architecture instead
(`Qwen3ForCausalLM`, self_attn.{q,k}_norm over head_dim, the same eps); everything else is as above.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from minifloat.fp8.recipes import CastSpec
from minifloat.inference.layers import Activations, Fp8InferenceLinear, LayerSpec
from minifloat.numerics.formats import E4M3
from minifloat.numerics.granularity import TILE, Granularity
from minifloat.numerics.quantize import Quantized
from minifloat.training.model import Llama, LlamaConfig, swiglu_hidden

CONFIG_FILE, GENERATION_FILE, WEIGHTS_FILE = "config.json", "generation_config.json", "model.safetensors"
TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"  # a run with a tokenizer
WEIGHT_FORMAT = E4M3  # the element format of every FP8 serving layout

# (architecture, model_type) of a plain Llama and of one with QK-norm
LLAMA = ("LlamaForCausalLM", "llama")
QWEN3 = ("Qwen3ForCausalLM", "qwen3")


@dataclasses.dataclass(frozen=True)
class ExportFormat:
    """One export layout (minifloat.inference.export's module docstring shows them).

    Attributes:
        name: "hf", "hf-fp8" or "hf-fp8-block".
        granularity: the weights' scaling granularity, None for unquantized weights.
        scale_name: the tensor that holds a quantized weight's dequantization scale.
        dynamic_input: how a serving stack scales the input of a layer without a static input_scale: per token
            (vLLM's per-tensor FP8 with CUTLASS) or per 1×128 tile (DeepSeek-V3 §3.3, vLLM's block FP8).
        static: whether the layout stores static input scales (`input_scale`).
        config: the fixed fields of quantization_config.
    """

    name: str
    granularity: Granularity | None
    scale_name: str = ""
    dynamic_input: Granularity | None = None
    static: bool = False
    config: tuple[tuple[str, object], ...] = ()

    def layer_spec(self, static: bool) -> LayerSpec:
        """The Fp8InferenceLinear spec that computes what a serving stack does with this layout."""
        weight = CastSpec(WEIGHT_FORMAT, self.granularity)
        inp = CastSpec(WEIGHT_FORMAT, Granularity.TENSOR if static else self.dynamic_input)
        return LayerSpec(weight, inp, Activations.STATIC if static else Activations.DYNAMIC)


_FP8 = (("quant_method", "fp8"), ("fmt", WEIGHT_FORMAT.name))
# hf-fp8's quantization_config carries this as `expert_dtype`, a field transformers' FP8 config (5.24) checks and
# vLLM's does not read: transformers' from_pretrained then refuses the export with it in its error line, where it
# loaded the FP8 values unscaled without an error (it reads per-tensor scales under other names)
TRANSFORMERS_REFUSAL = ("not for transformers: hf-fp8 is vLLM's per-tensor FP8 layout, whose weight_scale transformers "
                        "would ignore; serve it with vLLM, or export hf or hf-fp8-block for transformers")
FORMATS = {f.name: f for f in (
    ExportFormat("hf", None),
    # vLLM's per-tensor names. transformers reads the same quant_method "fp8" under its own (weight_scale_inv,
    # activation_scale); one file cannot hold both, as vLLM's Llama loader fails on a tensor it has no parameter for
    ExportFormat("hf-fp8", Granularity.TENSOR, "weight_scale", Granularity.ROW, True,
                 _FP8 + (("weight_block_size", None), ("expert_dtype", TRANSFORMERS_REFUSAL))),
    ExportFormat("hf-fp8-block", Granularity.BLOCK, "weight_scale_inv", Granularity.TILE, False,
                 _FP8 + (("weight_block_size", [TILE, TILE]),)),
)}

# our module path -> Hugging Face's, as (pattern, replacement) pairs, tried in order on a name's start
_TO_HF = (
    (r"wte(?=\.|$)", "model.embed_tokens"),
    (r"norm(?=\.|$)", "model.norm"),
    (r"lm_head(?=\.|$)", "lm_head"),
    (r"blocks\.(\d+)\.attn_norm(?=\.|$)", r"model.layers.\1.input_layernorm"),
    (r"blocks\.(\d+)\.mlp_norm(?=\.|$)", r"model.layers.\1.post_attention_layernorm"),
    (r"blocks\.(\d+)\.attn(?=\.|$)", r"model.layers.\1.self_attn"),
    (r"blocks\.(\d+)\.mlp(?=\.|$)", r"model.layers.\1.mlp"),
)
_FROM_HF = (
    (r"model\.embed_tokens(?=\.|$)", "wte"),
    (r"model\.norm(?=\.|$)", "norm"),
    (r"lm_head(?=\.|$)", "lm_head"),
    (r"model\.layers\.(\d+)\.input_layernorm(?=\.|$)", r"blocks.\1.attn_norm"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm(?=\.|$)", r"blocks.\1.mlp_norm"),
    (r"model\.layers\.(\d+)\.self_attn(?=\.|$)", r"blocks.\1.attn"),
    (r"model\.layers\.(\d+)\.mlp(?=\.|$)", r"blocks.\1.mlp"),
)
# config fields our Llama has one value of: field -> the only value it can load
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def _rename(name: str, table) -> str | None:
    for pattern, replacement in table:
        new, n = re.subn(f"^{pattern}", replacement, name)
        if n:
            return new
    return None


def hf_name(name: str) -> str:
    """Our module path or state-dict key -> Hugging Face's ("blocks.0.attn.q_proj.weight" ->
    "model.layers.0.self_attn.q_proj.weight"). ValueError for a name outside the reference Llama."""
    new = _rename(name, _TO_HF)
    if new is None:
        raise ValueError(f"{name!r} is not a module or tensor of minifloat's reference Llama")
    return new


def minifloat_name(name: str) -> str:
    """Hugging Face's module path or tensor name -> ours (the inverse of `hf_name`)."""
    new = _rename(name, _FROM_HF)
    if new is None:
        raise ValueError(f"{name!r} is not a tensor of a Hugging Face Llama")
    return new


def architecture(config: LlamaConfig) -> tuple[str, str]:
    """(architectures[0], model_type) of the Hugging Face model that computes what `config`'s Llama does."""
    return QWEN3 if config.qk_norm else LLAMA


def special_ids(eot_id: int | None) -> dict:
    """The bos / eos / pad ids of config.json and generation_config.json. A run's tokenizer puts its end-of-text id
    after every file (minifloat.training.tokenizer), so that id is eos (where the model learnt a text ends) and bos
    too (what the model saw before every file but the first: a new text's context, as GPT-2's config has it; training
    never adds another begin token). Bytes (eot_id None) have no such token: a byte corpus joins its files with
    nothing between them, so all three are null. pad stays null (transformers' generate pads with eos)."""
    return {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": None}


def hf_config(config: LlamaConfig, *, dtype: str, eot_id: int | None = None) -> dict:
    """config.json of the Hugging Face model equal to Llama(config), its tensors stored in `dtype` ("bfloat16").

    rope_theta is written both at the top level (transformers 4.x, vLLM) and in `rope_parameters` (transformers 5);
    the dtype both as `dtype` (transformers 5) and `torch_dtype` (earlier readers). bos / eos / pad: `special_ids`
    of the tokenizer's end-of-text id `eot_id` (None: bytes, all null).
    """
    arch, model_type = architecture(config)
    out = {
        "architectures": [arch], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_scaling": None, "tie_word_embeddings": config.tie_embeddings,
        **_FIXED, "attention_dropout": 0.0, "initializer_range": 0.02,
        **special_ids(eot_id), "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,
    }
    if config.qk_norm:  # Qwen3's sliding window off: every layer attends to all earlier positions, as ours
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layer,
                   layer_types=["full_attention"] * config.n_layer)
    return out


def generation_config(config: LlamaConfig, *, eot_id: int | None = None) -> dict:
    """generation_config.json: generate up to the context length, stopping at the end-of-text id `eot_id` (bos / eos
    / pad as `special_ids`; None: bytes, no end token)."""
    return {"max_length": config.max_seq_len, **special_ids(eot_id)}


def tokenizer_config(eot_token: str | None = None) -> dict:
    """tokenizer_config.json beside a copied tokenizer.json: it names the class, PreTrainedTokenizerFast (the
    tokenizer.json as it is, no BOS token added), so that AutoTokenizer need not guess one from config.json's
    model_type (transformers 5.24 reads the folder the same without it, measured; older versions guess), and the
    end-of-text token as bos_token and eos_token (`special_ids`; transformers 5.24 still adds no BOS, tested)."""
    tokens = {"bos_token": eot_token, "eos_token": eot_token} if eot_token is not None else {}
    return {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}


def llama_config(hf: dict) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face config.json written by `hf_config` (or any Llama / Qwen3 config that our
    Llama can express: no biases, SiLU, plain RoPE; grouped-query attention included).

    Raises:
        ValueError naming the field that our Llama cannot express.
    """
    arch = (hf.get("architectures") or [None])[0]
    if arch not in (LLAMA[0], QWEN3[0]):
        raise ValueError(f"architectures must be [{LLAMA[0]!r}] or [{QWEN3[0]!r}], got {hf.get('architectures')!r}")
    for field, value in _FIXED.items():
        if hf.get(field, value) != value:
            raise ValueError(f"config field {field}={hf[field]!r} is not supported (minifloat's Llama has {value!r})")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads  # absent or null in older configs: multi-head attention
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads!r}")
    if hf.get("head_dim", hf["hidden_size"] // heads) != hf["hidden_size"] // heads:
        raise ValueError(f"head_dim={hf['head_dim']!r} must be hidden_size / num_attention_heads")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"rope scaling {rope!r} is not supported (plain RoPE only)")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    d_ff = hf["intermediate_size"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=None if kv_heads == heads else kv_heads, d_model=hf["hidden_size"],
        d_ff=None if d_ff == swiglu_hidden(hf["hidden_size"]) else d_ff, max_seq_len=hf["max_position_embeddings"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), qk_norm=arch == QWEN3[0],
        tie_embeddings=hf.get("tie_word_embeddings", False), norm_eps=hf["rms_norm_eps"])


# ------------------------------------------------------------------------------------------------------- read


@dataclasses.dataclass
class HfExport:
    """An export folder read back, under minifloat's names.

    Attributes:
        config: the LlamaConfig.
        format: the ExportFormat (FORMATS["hf"], ["hf-fp8"] or ["hf-fp8-block"]).
        tensors: every unquantized tensor by state-dict key ("wte.weight", "blocks.0.attn_norm.weight", ...).
        quantized: the FP8 weights by layer ("blocks.1.attn.q_proj"): E4M3 data and dequantization scales.
        input_scales: static input scales (dequantization multipliers, fp32 scalars) by layer; empty when dynamic.
    """

    config: LlamaConfig
    format: ExportFormat
    tensors: dict[str, torch.Tensor]
    quantized: dict[str, Quantized]
    input_scales: dict[str, torch.Tensor]


def _export_format(quant: dict | None, where: Path) -> ExportFormat:
    if quant is None:
        return FORMATS["hf"]
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: quantization_config {quant!r} is not one minifloat reads (quant_method 'fp8', "
                         f"fmt 'e4m3')")
    block = quant.get("weight_block_size")
    if block is not None and list(block) != [TILE, TILE]:
        raise ValueError(f"{where}: weight_block_size {block!r} is not supported (only [{TILE}, {TILE}])")
    return FORMATS["hf-fp8" if block is None else "hf-fp8-block"]


def read_hf_export(path: str | os.PathLike) -> HfExport:
    """Read an export folder of any of the formats (an FP8 one by its quantization_config).

    Raises:
        FileNotFoundError: config.json or model.safetensors is missing.
        ValueError: a config our Llama cannot express, or tensors the layout does not explain.
    """
    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} is missing; {path} is not a Hugging Face export")
    fix = "export it again (minifloat export --overwrite) or restore the folder from a copy"
    try:
        config_json = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path / CONFIG_FILE} is not valid JSON ({err}); {fix}") from None
    if not isinstance(config_json, dict):
        raise ValueError(f"{path / CONFIG_FILE} holds no config object; {fix}")
    config = llama_config(config_json)
    fmt = _export_format(config_json.get("quantization_config"), path / CONFIG_FILE)
    try:
        loaded = load_file(str(path / WEIGHTS_FILE))
    except Exception as err:  # noqa: BLE001 - safetensors' own error type (a header it cannot read)
        raise ValueError(f"{path / WEIGHTS_FILE} is truncated or not a safetensors file ({err}); {fix}") from None
    raw = {minifloat_name(name): t for name, t in loaded.items()}
    tensors, quantized, input_scales = {}, {}, {}
    for key, tensor in raw.items():
        layer, _, leaf = key.rpartition(".")
        if fmt.granularity is not None and leaf == "input_scale":
            _check_scale_shape(path, key, tensor, ())
            input_scales[layer] = tensor.float().reshape(())
        elif fmt.granularity is not None and leaf == fmt.scale_name:
            continue  # read with its weight
        elif fmt.granularity is not None and tensor.dtype == WEIGHT_FORMAT.torch_dtype:
            if f"{layer}.{fmt.scale_name}" not in raw:
                raise ValueError(f"{path / WEIGHTS_FILE}: {hf_name(key)} is FP8 but has no {fmt.scale_name}")
            scale = raw[f"{layer}.{fmt.scale_name}"].float()
            blocks = () if fmt.granularity == "tensor" else tuple(-(-d // TILE) for d in tensor.shape)
            _check_scale_shape(path, f"{layer}.{fmt.scale_name}", scale, blocks)
            quantized[layer] = Quantized(tensor, scale.reshape(()) if fmt.granularity == "tensor" else scale,
                                         WEIGHT_FORMAT, fmt.granularity)
        else:
            tensors[key] = tensor
    if input_scales and set(input_scales) != set(quantized):
        raise ValueError(f"{path / WEIGHTS_FILE}: static input scales for some FP8 layers only")
    return HfExport(config, fmt, tensors, quantized, input_scales)


def _check_scale_shape(path: Path, key: str, scale: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A scale of the layout's shape: () per tensor (a 1-element tensor too), else one per 128×128 block."""
    if tuple(scale.shape) != shape and not (shape == () and scale.numel() == 1):
        what = "one per tensor" if shape == () else f"one per 128×128 block, {tuple(shape)}"
        raise ValueError(f"{path / WEIGHTS_FILE}: {hf_name(key)} has shape {tuple(scale.shape)}, but this layout's "
                         f"scales are {what} (a per-channel or other layout minifloat does not read)")


def load_hf_export(path: str | os.PathLike, *, fp8: bool = True) -> Llama:
    """minifloat's Llama (eval mode) from an export folder.

    Args:
        path: the folder.
        fp8: FP8 layers become Fp8InferenceLinear layers holding the stored FP8 weights and scales, their inputs
            quantized as a serving stack does (the static input_scale, else dynamically per token for "hf-fp8" and
            per 1×128 tile for "hf-fp8-block"); False loads the dequantized weights (data · scale, per tensor or
            128×128 block) into plain fp32 nn.Linear layers, as transformers does on a CPU.
    Returns:
        The model, fp32 parameters.
    """
    export = read_hf_export(path)
    state = {key: t.float() for key, t in export.tensors.items()}
    if export.config.tie_embeddings and "wte.weight" in state:
        state["lm_head.weight"] = state["wte.weight"]
    if not fp8:
        state.update({f"{layer}.weight": q.dequantize(torch.float32) for layer, q in export.quantized.items()})
    model = Llama(export.config)
    own = model.state_dict()
    if fp8:
        own = {k: v for k, v in own.items() if k.removesuffix(".weight") not in export.quantized}
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    reshaped = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    if missing or unexpected or reshaped:
        raise ValueError(f"{path} does not fit minifloat's Llama ({export.config}): missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}, other shapes {reshaped[:3]}")
    model.load_state_dict(state, strict=False)
    if fp8:
        for layer, q in export.quantized.items():
            linear = model.get_submodule(layer)
            scale = export.input_scales.get(layer)
            new = Fp8InferenceLinear(linear.in_features, linear.out_features, bias=False,
                                     spec=export.format.layer_spec(static=scale is not None))
            if tuple(q.data.shape) != tuple(new.weight.shape) or q.scale.shape != new.weight_scale.shape:
                raise ValueError(f"{path}: {hf_name(layer)} has shape {tuple(q.data.shape)} and scales "
                                 f"{tuple(q.scale.shape)}, the model needs {tuple(new.weight.shape)} and "
                                 f"{tuple(new.weight_scale.shape)}")
            new.load_state_dict({"weight": q.data, "weight_scale": q.scale,
                                 **({"input_scale": scale} if scale is not None else {})})
            parent, _, child = layer.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    return model.eval()
