"""minifloat: low-precision (FP8 / BF16 / FP16) training for PyTorch that runs anywhere and explains its numerics.

The public names are imported on first use (PEP 562), so `import minifloat` (and `minifloat --help`) does not load
torch's compiler and every layer up front; `mf.convert`, `mf.E4M3`, ... work as plain attributes.
"""

import importlib

from minifloat.core.version import __version__

_HOMES = {  # public name -> the module that defines it
    "telemetry": "minifloat.fp8.telemetry",
    **dict.fromkeys(("BF16", "E2M1", "E4M3", "E5M2", "E8M0", "FP16", "FP32", "FORMATS", "NumberFormat", "get_format"),
                    "minifloat.numerics.formats"),
    "scaled_mm": "minifloat.fp8.gemm",
    **dict.fromkeys(("GuardConfig", "StepGuard"), "minifloat.safety.guards"),
    **dict.fromkeys(("MasterWeightOptimizer", "MasterWeights"), "minifloat.amp.master"),
    **dict.fromkeys(("convert", "fp8_layers"), "minifloat.fp8.convert"),
    **dict.fromkeys(("Fp8Linear", "autocast"), "minifloat.fp8.modules"),
    **dict.fromkeys(("fp8_speedup", "where_fp8_pays"), "minifloat.fp8.payoff"),
    **dict.fromkeys(("LayerNorm", "RMSNorm"), "minifloat.amp.norms"),
    "PrecisionPolicy": "minifloat.amp.policy",
    **dict.fromkeys(("Quantized", "cast", "quantize", "sqnr_db"), "minifloat.numerics.quantize"),
    **dict.fromkeys(("BlockScaling", "CurrentScaling", "DelayedScaling", "MXScaling", "NVFP4Scaling"),
                    "minifloat.fp8.recipes"),
    **dict.fromkeys(("LossScaler", "StepRecord"), "minifloat.amp.scaler"),
    **dict.fromkeys(("ScalingState", "reduce_amax"), "minifloat.fp8.scaling"),
    "fp8_step": "minifloat.fp8.step",
    **dict.fromkeys(("ShadowCheck", "ShadowConfig"), "minifloat.safety.shadow"),
    "StabilityConfig": "minifloat.safety.stability",
    "prepare_inference": "minifloat.inference.prepare",
    **dict.fromkeys(("load_quantized", "save_quantized"), "minifloat.inference.quantized_io"),
}

__all__ = [
    "E4M3", "E5M2", "E8M0", "E2M1", "BF16", "FP16", "FP32", "FORMATS", "NumberFormat", "get_format",
    "cast", "quantize", "Quantized", "sqnr_db", "scaled_mm",
    "DelayedScaling", "CurrentScaling", "BlockScaling", "MXScaling", "NVFP4Scaling",
    "ScalingState", "reduce_amax", "fp8_step",
    "Fp8Linear", "convert", "autocast", "fp8_layers", "where_fp8_pays", "fp8_speedup", "telemetry",
    "PrecisionPolicy", "LossScaler", "StepRecord", "RMSNorm", "LayerNorm", "MasterWeights", "MasterWeightOptimizer",
    "StepGuard", "GuardConfig", "ShadowCheck", "ShadowConfig", "StabilityConfig",
    "prepare_inference", "save_quantized", "load_quantized",
]
# the reference model, data, trainer, checkpoints and comparison live in their modules: minifloat.training.model,
# minifloat.training.data, minifloat.training.loop, minifloat.training.checkpoint, minifloat.training.compare


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'minifloat' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if name == "telemetry" else getattr(module, name)  # mf.telemetry is the module itself
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted({*globals(), *_HOMES})
