"""minifloat.fp8.payoff: the predicted FP8 speed-up of a linear layer, and the filter that converts only where it pays.

The model is checked against the GPU's own measurements (docs/benchmarks.md), then as a filter of convert,
PrecisionPolicy.apply and the trainer's --fp8-layers.
"""

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.fp8.convert import fp8_plan
from minifloat.fp8.payoff import GPUS, WhereFp8Pays
from minifloat.training.config import TrainConfig
from minifloat.training.run import low_precision_layers

# One linear layer's forward + backward, speed-up over bf16 autocast, measured by benchmarks/gpu.py on an H200
# (docs/benchmarks.md, "Second run: NVIDIA H200, 2026-11-27"): (K, N, tokens) -> delayed, current, row, block
H200_MEASURED = {
    (8192, 8192, 8192): (1.48, 1.35, 1.13, 1.04),
    (4096, 6144, 16384): (1.33, 1.19, 1.01, 0.90),
    (4096, 4096, 16384): (1.28, 1.14, 0.94, 0.84),
    (4096, 14336, 16384): (1.39, 1.27, 1.07, 1.00),
    (14336, 4096, 16384): (1.48, 1.38, 1.11, 1.00),
}
RECIPES = (mf.DelayedScaling(), mf.CurrentScaling(), mf.CurrentScaling(granularity="row"), mf.BlockScaling())
# how far the model's prediction may be from a measured speed-up: the run-to-run spread of those rows on the GPU
# was ~0.03-0.1 (the same shapes in two calls), and the model leaves out host work and gradient adds
FIT_TOLERANCE = 0.15


@pytest.mark.parametrize("shape", list(H200_MEASURED), ids=lambda s: "x".join(map(str, s)))
def test_the_model_predicts_the_measured_speedups(shape):
    k, n, tokens = shape
    for recipe, measured in zip(RECIPES, H200_MEASURED[shape]):
        predicted = mf.fp8_speedup(recipe, tokens=tokens, in_features=k, out_features=n, gpu="h200")
        assert abs(predicted - measured) <= FIT_TOLERANCE, (type(recipe).__name__, predicted, measured)


def test_small_layers_do_not_pay_and_large_ones_do():
    recipe = mf.DelayedScaling()
    # the 100m preset's d 768 at 8k tokens, measured 0.26-0.45x bf16 on the H200
    assert mf.fp8_speedup(recipe, tokens=8192, in_features=768, out_features=768, gpu="h200") < 1.0
    assert mf.fp8_speedup(recipe, tokens=8192, in_features=8192, out_features=8192, gpu="h200") > 1.3
    # more tokens or wider layers: GEMM flops grow faster than cast bytes, so the speed-up grows
    for gpu in GPUS:
        by_tokens = [mf.fp8_speedup(recipe, tokens=m, in_features=4096, out_features=4096, gpu=gpu)
                     for m in (256, 2048, 16384, 131072)]
        assert by_tokens == sorted(by_tokens)
        by_width = [mf.fp8_speedup(recipe, tokens=16384, in_features=d, out_features=d, gpu=gpu)
                    for d in (512, 1024, 4096, 16384)]
        assert by_width == sorted(by_width)


@pytest.mark.parametrize("recipe", [mf.MXScaling(), mf.MXScaling(format="e2m1"), mf.NVFP4Scaling()],
                         ids=["mxfp8", "mxfp4", "nvfp4"])
def test_recipes_emulated_on_hopper_never_pay_there(recipe):
    for gpu in GPUS:
        assert mf.fp8_speedup(recipe, tokens=65536, in_features=16384, out_features=16384, gpu=gpu) < 1.0


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 64),
                         nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 10))


def test_convert_with_the_filter_converts_exactly_the_layers_that_pay():
    recipe = mf.DelayedScaling()
    pays = mf.where_fp8_pays(recipe, tokens=16384)
    net = model()
    expected = [name for name in fp8_plan(net).convert if pays.speedup(net.get_submodule(name)) >= pays.min_speedup]
    assert expected == ["2"]  # 4096x4096 pays at 16k tokens; the 4096x64 and 64x64 layers do not
    net = mf.convert(net, recipe=recipe, filter=pays)
    assert [name for name, m in net.named_modules() if isinstance(m, mf.Fp8Linear)] == expected
    # at 512 tokens nothing pays: the model stays in high precision and the warning says why
    few = mf.where_fp8_pays(recipe, tokens=512)
    assert not few("2", model()[2])


def test_the_policy_applies_the_filter_and_says_why_nothing_converted(caplog):
    policy = mf.PrecisionPolicy.preset("fp8-current")
    pays = mf.where_fp8_pays(policy.recipe, tokens=16384, gpu="h200")
    kinds = policy.plan(model(), filter=pays)
    assert [n for n, k in kinds.items() if k == "fp8"] == ["2"]
    net = policy.apply(model(), filter=pays)
    assert [n for n, m in net.named_modules() if isinstance(m, mf.Fp8Linear)] == ["2"]
    with caplog.at_level("WARNING", logger="minifloat"):
        policy.apply(model(), filter=mf.where_fp8_pays(policy.recipe, tokens=64))
    assert "refused by the FP8-pays filter" in caplog.text and "64 tokens" in caplog.text


@pytest.mark.parametrize("kwargs, field", [
    (dict(tokens=0), "tokens"), (dict(tokens=2.5), "tokens"), (dict(tokens=True), "tokens"),
    (dict(tokens=8, gpu="a100"), "gpu"), (dict(tokens=8, gpu=3), "gpu"),
    (dict(tokens=8, min_speedup=0), "min_speedup"), (dict(tokens=8, min_speedup="1"), "min_speedup"),
])
def test_bad_filter_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        mf.where_fp8_pays(mf.DelayedScaling(), **kwargs)


def test_a_filter_that_is_not_callable_is_one_clear_error():
    with pytest.raises(TypeError, match="filter must be a function"):
        mf.PrecisionPolicy.preset("fp8-delayed").apply(model(), filter="auto")
    with pytest.raises(TypeError, match="filter must be a function"):
        mf.convert(model(), filter=16384)


def test_the_trainer_converts_the_1b_presets_mlp_where_it_pays():
    # Llama-3.2-1B's body at 16k tokens per micro-batch on an H100: the MLP's 2048x8192 and 8192x2048 projections
    # pay (1.15x predicted), attention's 2048x2048 and 2048x512 ones do not
    config = TrainConfig(model="1b", preset="fp8-delayed", fp8_layers="auto", batch_size=8, seq_len=2048)
    with torch.device("meta"):
        from minifloat.training.model import Llama
        llama = Llama(config.model_config())
    kinds = config.policy().plan(llama, filter=config.layer_filter())
    fp8 = sorted(name for name, kind in kinds.items() if kind == "fp8")
    mlp = sorted(name for name, m in llama.named_modules()
                 if isinstance(m, nn.Linear) and m.in_features * m.out_features == 2048 * 8192)
    assert fp8 == mlp and len(fp8) == 3 * 16
    assert low_precision_layers(config)[0] == len(fp8)
    every = low_precision_layers(TrainConfig(model="1b", preset="fp8-delayed", batch_size=8, seq_len=2048))[0]
    assert every > len(fp8)


def test_fp8_layers_needs_a_low_precision_preset():
    with pytest.raises(ValueError, match="fp8_layers=auto .* has none"):
        TrainConfig(preset="bf16", fp8_layers="auto")
    with pytest.raises(ValueError, match="fp8_layers"):
        TrainConfig(preset="fp8-delayed", fp8_layers="everywhere")


def test_the_filter_is_a_value():
    a = mf.where_fp8_pays(mf.DelayedScaling(), tokens=4096, gpu="H100")
    assert isinstance(a, WhereFp8Pays) and a == mf.where_fp8_pays(mf.DelayedScaling(), tokens=4096)
    assert hash(a) == hash(mf.where_fp8_pays(mf.DelayedScaling(), tokens=4096))
