"""minifloat: low-precision (FP8 / BF16 / FP16) training for PyTorch that runs anywhere and explains its numerics."""

from minifloat.core.version import __version__
from minifloat.fp8 import telemetry
from minifloat.numerics.formats import BF16, E2M1, E4M3, E5M2, E8M0, FP16, FP32, FORMATS, NumberFormat, get_format
from minifloat.fp8.gemm import scaled_mm
from minifloat.safety.guards import GuardConfig, StepGuard
from minifloat.amp.master import MasterWeightOptimizer, MasterWeights
from minifloat.fp8.convert import convert, fp8_layers
from minifloat.fp8.modules import Fp8Linear, autocast
from minifloat.amp.norms import LayerNorm, RMSNorm
from minifloat.amp.policy import PrecisionPolicy
from minifloat.numerics.quantize import Quantized, cast, quantize, sqnr_db
from minifloat.fp8.recipes import BlockScaling, CurrentScaling, DelayedScaling, MXScaling, NVFP4Scaling
from minifloat.amp.scaler import LossScaler, StepRecord
from minifloat.fp8.scaling import ScalingState, reduce_amax
from minifloat.fp8.step import fp8_step
from minifloat.safety.shadow import ShadowCheck, ShadowConfig
from minifloat.safety.stability import StabilityConfig
from minifloat.inference.prepare import prepare_inference
from minifloat.inference.quantized_io import load_quantized, save_quantized


__all__ = [
    "E4M3", "E5M2", "E8M0", "E2M1", "BF16", "FP16", "FP32", "FORMATS", "NumberFormat", "get_format",
    "cast", "quantize", "Quantized", "sqnr_db", "scaled_mm",
    "DelayedScaling", "CurrentScaling", "BlockScaling", "MXScaling", "NVFP4Scaling",
    "ScalingState", "reduce_amax", "fp8_step",
    "Fp8Linear", "convert", "autocast", "fp8_layers", "telemetry",
    "PrecisionPolicy", "LossScaler", "StepRecord", "RMSNorm", "LayerNorm", "MasterWeights", "MasterWeightOptimizer",
    "StepGuard", "GuardConfig", "ShadowCheck", "ShadowConfig", "StabilityConfig",
    "prepare_inference", "save_quantized", "load_quantized",
]
# the reference model, data, trainer, checkpoints and comparison live in their modules: minifloat.training.model,
# minifloat.training.data, minifloat.training.loop, minifloat.training.checkpoint, minifloat.training.compare
