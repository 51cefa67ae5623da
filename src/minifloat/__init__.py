"""minifloat: low-precision (FP8 / BF16 / FP16) training for PyTorch that runs anywhere and explains its numerics."""

from minifloat import telemetry
from minifloat.formats import BF16, E2M1, E4M3, E5M2, E8M0, FP16, FP32, FORMATS, NumberFormat, get_format
from minifloat.gemm import scaled_mm
from minifloat.guards import GuardConfig, StepGuard
from minifloat.master import MasterWeightOptimizer, MasterWeights
from minifloat.modules import Fp8Linear, autocast, convert, fp8_layers
from minifloat.norms import LayerNorm, RMSNorm
from minifloat.policy import PrecisionPolicy
from minifloat.quantize import Quantized, cast, quantize, sqnr_db
from minifloat.recipes import BlockScaling, CurrentScaling, DelayedScaling, MXScaling
from minifloat.scaler import LossScaler, StepRecord
from minifloat.scaling import ScalingState, reduce_amax
from minifloat.shadow import ShadowCheck, ShadowConfig
from minifloat.stability import StabilityConfig

__version__ = "0.1.0"

__all__ = [
    "E4M3", "E5M2", "E8M0", "E2M1", "BF16", "FP16", "FP32", "FORMATS", "NumberFormat", "get_format",
    "cast", "quantize", "Quantized", "sqnr_db", "scaled_mm",
    "DelayedScaling", "CurrentScaling", "BlockScaling", "MXScaling",
    "ScalingState", "reduce_amax",
    "Fp8Linear", "convert", "autocast", "fp8_layers", "telemetry",
    "PrecisionPolicy", "LossScaler", "StepRecord", "RMSNorm", "LayerNorm", "MasterWeights", "MasterWeightOptimizer",
    "StepGuard", "GuardConfig", "ShadowCheck", "ShadowConfig", "StabilityConfig",
]
# the reference model, data, trainer, checkpoints and comparison live in their modules: minifloat.model,
# minifloat.data, minifloat.train, minifloat.checkpoint, minifloat.compare
