"""The public names DESIGN.md fixes, and every name in minifloat.__all__, resolve to the objects they promise."""

import torch

import minifloat as mf
from minifloat.numerics.formats import NumberFormat

FIXED = ["E4M3", "E5M2", "E8M0", "E2M1", "BF16", "FP16", "FP32", "cast", "quantize", "Quantized", "DelayedScaling",
         "CurrentScaling", "BlockScaling", "MXScaling", "Fp8Linear", "convert", "autocast", "PrecisionPolicy",
         "LossScaler"]


def test_fixed_names_exist_and_are_exported():
    missing = [n for n in FIXED if n not in mf.__all__ or not hasattr(mf, n)]
    assert not missing


def test_every_exported_name_resolves():
    assert [n for n in mf.__all__ if getattr(mf, n, None) is None] == []
    assert len(set(mf.__all__)) == len(mf.__all__)


def test_formats_are_number_formats_and_loss_scaler_mirrors_grad_scaler():
    assert all(isinstance(getattr(mf, n), NumberFormat) for n in ("E4M3", "E5M2", "E8M0", "E2M1", "BF16", "FP16", "FP32"))
    for method in ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict"):
        assert callable(getattr(mf.LossScaler, method)) and callable(getattr(torch.amp.GradScaler, method))
