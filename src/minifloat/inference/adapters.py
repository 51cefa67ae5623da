"""LoRA adapters (PEFT) over a model prepared for FP8 or 4-bit inference: adapter tuning on frozen quantized weights.

`mf.prepare_inference` stores each linear layer's weight in FP8 (or NVFP4/MXFP4) as an `Fp8InferenceLinear`, a
quarter to an eighth of the fp32 bytes. Its weight is frozen and the gradient flows to its input
(minifloat.inference.layers), which is what adapter tuning needs: the base's weights are never trained, only the
adapters beside them. `peft.get_peft_model` wraps torch's own layer types, and refuses others; `lora_config(config)`
registers `Fp8InferenceLinear` with a `peft.LoraConfig` (PEFT's custom-module mapping), so that

    model = mf.prepare_inference(model, recipe=mf.CurrentScaling())
    model = peft.get_peft_model(model, lora_config(peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"])))

wraps the FP8 layers in PEFT's own LoRA layer. The adapters are ordinary high-precision nn.Linear layers, trained and
saved by PEFT as usual (`save_pretrained` writes only them); `PeftModel.from_pretrained(prepared, folder,
config=lora_config(peft.LoraConfig.from_pretrained(folder)))` loads them back onto a prepared model.

Merging is refused: an FP8 weight cannot absorb W + B·A without rounding it again, so `merge_adapter` and
`merge_and_unload` raise a ValueError naming the way that keeps the bits honest: load the adapter onto the
high-precision model, merge there, and prepare the merged model for inference.

PEFT is an optional dependency (`pip install peft`), imported only here.
"""

from __future__ import annotations

import functools
import warnings

from minifloat.inference.layers import Fp8InferenceLinear

MERGE_REFUSED = ("an adapter over a prepared FP8/4-bit layer cannot be merged into its quantized weight (that would "
                 "round it again); load the adapter onto the high-precision model, merge there "
                 "(merge_and_unload), then mf.prepare_inference the merged model")


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("minifloat.inference.adapters needs PEFT: pip install peft") from None
    return peft


def lora_config(config):
    """Register minifloat's quantized inference layers with `config` (a peft.LoraConfig), in place, and return it.

    Then `peft.get_peft_model(prepared_model, config)` puts LoRA adapters on `Fp8InferenceLinear` layers as on
    nn.Linear ones (see the module docstring).
    """
    peft = _peft()
    if not isinstance(config, peft.LoraConfig):
        raise TypeError(f"lora_config takes a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module({Fp8InferenceLinear: lora_layer_class()})
    return config


@functools.cache
def lora_layer_class() -> type:
    """PEFT's LoRA Linear for an `Fp8InferenceLinear` base layer: forward and training as PEFT's own; merging
    refused with one line (MERGE_REFUSED). Built on first use, so that PEFT stays optional."""
    from peft.tuners.lora.layer import Linear

    class QuantizedBaseLoraLinear(Linear):
        def __init__(self, base_layer, adapter_name, **kwargs):
            if not isinstance(base_layer, Fp8InferenceLinear):
                raise TypeError(f"{type(self).__name__} wraps an Fp8InferenceLinear, got {type(base_layer).__name__}")
            with warnings.catch_warnings():  # PEFT's "unsupported layer type": its in/out features are read all right
                warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
                super().__init__(base_layer, adapter_name, **kwargs)

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise ValueError(MERGE_REFUSED)

    return QuantizedBaseLoraLinear
