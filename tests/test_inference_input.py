"""FP8 inference beyond the FP8 recipes (minifloat.inference): NVFP4 layers (storage, the per-token cast, accuracy,
save / load), gradients through a frozen FP8 layer, non-finite calibration data, and the one-line errors of bad input
to prepare_inference, save_quantized and generate.

SQNR floors are measured on randomly initialised models (seeded) and set a few dB under the measured value.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.fp8.recipes import NVFP4Spec, Role
from minifloat.inference import nvfp4
from minifloat.inference.generate import generate
from minifloat.inference.layers import Activations, LayerSpec, inference_layers
from minifloat.inference.prepare import sensitivity
from minifloat.numerics.fp4 import quantize_nvfp4
from minifloat.numerics.quantize import abs_max
from test_inference import eager, features, mlp, output, storage_state, tiny_llama, tokens  # noqa: F401 - eager: its
# autouse fixture (seeded, eager kernels); the same models and inputs

SEED = 0
NVFP4 = {"nvfp4": mf.NVFP4Scaling(), "nvfp4-1x16": mf.NVFP4Scaling(weight_2d=False)}
# Logits (Llama) / outputs (MLP) of the NVFP4 model against the same model in fp32, tests/test_inference.py's inputs.
# Measured (dynamic / static): Llama tiny 22.5 / 22.8, MLP 26.9 / 27.2 dB (E2M1 keeps 1 mantissa bit: ~12 dB under
# E4M3's 35-38 dB). MXFP4 measures 21.7 / 19.0 and 25.5 / 22.2 dB (its static scale is one per tensor).
NVFP4_SQNR_FLOOR_DB = {"llama": 20.0, "mlp": 24.0}
# Weight bytes against bfloat16 on 256-wide layers: half a byte per element plus E4M3 scales, 0.252 (16×16 tiles),
# 0.281 (1×16 blocks)
NVFP4_MEMORY_RATIO_MAX = 0.29
# dx of an FP8 layer, computed in fp32, against dy @ Ŵ in float64: measured 136-137 dB for every recipe (fp32 has
# 24 significant bits, ~144 dB per element; a sum of 64 products loses a few); bfloat16 dx is one bf16 rounding
# (2^-9 relative, ~54 dB)
FP32_GRAD_SQNR_FLOOR_DB = 120.0
BF16_GRAD_SQNR_FLOOR_DB = 48.0


# ------------------------------------------------------------------------------------------------ NVFP4


@pytest.mark.parametrize("name", list(NVFP4))
def test_nvfp4_weights_are_stored_as_e2m1_codes_with_two_levels_of_scale(name):
    recipe = NVFP4[name]
    model = mlp(width=256)
    weights = {n: model.get_submodule(n).weight.detach().clone() for n in ("2", "4")}
    mf.prepare_inference(model, recipe=recipe)
    packed_bytes = bf16_bytes = 0
    for n, layer in inference_layers(model):
        out, k = weights[n].shape
        tiles = recipe.weight_2d
        assert layer.weight.dtype == torch.uint8 and tuple(layer.weight.shape) == (out, k // 2)  # two per byte
        assert layer.weight_scale.dtype == torch.float8_e4m3fn
        assert tuple(layer.weight_scale.shape) == ((out // 16) if tiles else out, k // 16)
        assert layer.weight_global_scale.dtype == torch.float32 and layer.weight_global_scale.shape == ()
        # the stored weight is minifloat's one NVFP4 cast of the weight, bit for bit
        expected = quantize_nvfp4(weights[n], block_2d=tiles).dequantize()
        assert torch.equal(layer.dequantized_weight(), expected)
        packed_bytes += layer.nbytes()
        bf16_bytes += 2 * weights[n].numel()
    assert packed_bytes / bf16_bytes <= NVFP4_MEMORY_RATIO_MAX


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("model_name", ["llama", "mlp"])
def test_nvfp4_outputs_match_the_high_precision_model(model_name, activations):
    build, data = (tiny_llama, tokens) if model_name == "llama" else (mlp, features)
    reference = build()
    x = data(1)[0]
    model = mf.prepare_inference(copy.deepcopy(reference), recipe=mf.NVFP4Scaling(), activations=activations,
                                 calibration=data(2) if activations == "static" else None)
    assert inference_layers(model) and all(layer.spec.is_nvfp4 for _, layer in inference_layers(model))
    assert mf.sqnr_db(output(reference, x), output(model, x)) >= NVFP4_SQNR_FLOOR_DB[model_name]


def test_nvfp4_dynamic_tokens_are_each_cast_alone():
    """Each token is cast with its own global amax, its amax rounded up to a power of two: bitwise the cast of the
    row alone, so a token's output never depends on the rest of its batch."""
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]  # tokens six decades apart
    q = nvfp4.quantize_input(x, None, keep_data=False)
    for r in range(x.shape[0]):
        _, e = torch.frexp(abs_max(x[r:r + 1], -1))
        alone = quantize_nvfp4(x[r:r + 1], global_amax=torch.ldexp(torch.ones(()), e.reshape(())),
                               operand_dtype=torch.bfloat16)
        assert torch.equal(q.operand[r:r + 1], alone.operand) and torch.equal(q.scale[r, 0], alone.global_scale)
    layer = mf.prepare_inference(mlp(), recipe=mf.NVFP4Scaling())[2]
    batch = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 1e3, 1.0, 1e-2])[:, None]
    together = layer(batch)
    assert all(torch.equal(together[r:r + 1], layer(batch[r:r + 1])) for r in range(5))


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_nvfp4_save_load_is_bitwise(tmp_path, activations):
    x = tokens(1)[0]
    model = mf.prepare_inference(tiny_llama(), recipe=mf.NVFP4Scaling(), activations=activations,
                                 calibration=tokens(2), smooth=0.5)
    y = output(model, x)
    path = mf.save_quantized(model, tmp_path / "q")
    for into in (None, tiny_llama()):  # rebuilt from the saved LlamaConfig, or a fresh unquantized model filled
        loaded = mf.load_quantized(path, model=into)
        assert torch.equal(output(loaded, x), y)
        assert storage_state(loaded).keys() == storage_state(model).keys()
        assert all(torch.equal(a, b) for a, b in zip(storage_state(loaded).values(), storage_state(model).values()))


def test_nvfp4_static_scales_come_from_training():
    torch.manual_seed(SEED)
    model = mf.convert(mlp(), recipe=mf.NVFP4Scaling())
    model.train()
    model(features(1)[0]).pow(2).mean().backward()  # records the input amaxes
    prepared = mf.prepare_inference(copy.deepcopy(model).eval(), recipe=mf.NVFP4Scaling(), activations="static")
    for n, layer in inference_layers(prepared):
        amax = model.get_submodule(n).fp8_state.amax_history[:, 0].amax()
        assert torch.equal(layer.input_scale, nvfp4.static_scale(amax)), n  # 1 / (2688 / amax)


# (name, spec, pattern of the ValueError)
BAD_SPECS = [
    ("mixed", lambda: LayerSpec(NVFP4Spec(), mf.CurrentScaling().spec(Role.INPUT), Activations.DYNAMIC),
     "casts both its weight and its input to NVFP4"),
    ("stochastic", lambda: LayerSpec(NVFP4Spec(), NVFP4Spec(rounding="stochastic"), Activations.DYNAMIC),
     "rounds to nearest"),
]


@pytest.mark.parametrize("name, build, pattern", BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_nvfp4_layer_specs_are_checked(name, build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


def test_nvfp4_layer_spec_json_round_trips():
    spec = LayerSpec.from_recipe(mf.NVFP4Scaling(), "static")
    assert spec.weight == NVFP4Spec(block_2d=True) and spec.input == NVFP4Spec()
    assert LayerSpec.from_json(spec.to_json()) == spec


# ------------------------------------------------------------------------------------------------ gradients

GRAD_CASES = {"tensor": (mf.CurrentScaling(), {}), "block static smoothed": (mf.BlockScaling(), {"smooth": 0.5}),
              "mx": (mf.MXScaling(), {}), "nvfp4": (mf.NVFP4Scaling(), {})}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_the_input_gradient_is_dy_times_the_dequantized_weight(name):
    recipe, options = GRAD_CASES[name]
    static = "smooth" in options
    model = mf.prepare_inference(mlp(), recipe=recipe, activations="static" if static else "dynamic",
                                 calibration=features(2) if static else None, **options)
    layer = model[2]
    assert layer.spec.smooth == static  # the layer divides its input by smooth_scale: dx includes 1/s
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), y)  # the same product with or without the gradient
    dy = torch.randn_like(y)
    y.backward(dy)
    # grad_output @ Ŵ = grad_input, in float64
    reference = (dy.double().reshape(-1, 64) @ layer.dequantized_weight(torch.float64)).reshape(x.shape)
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert mf.sqnr_db(reference, x.grad) >= FP32_GRAD_SQNR_FLOOR_DB
    assert all(t.grad is None for t in layer.buffers())  # the weight stays frozen

    xb = x.detach().to(torch.bfloat16).requires_grad_()
    layer(xb).backward(dy.to(torch.bfloat16))
    assert xb.grad.dtype == torch.bfloat16
    assert mf.sqnr_db(reference, xb.grad) >= BF16_GRAD_SQNR_FLOOR_DB


def test_adapters_train_on_a_frozen_fp8_model():
    """A LoRA-style adapter in front of an FP8 layer gets its gradient through the layer; the bias gets one when
    asked; without a gradient to compute the forward builds no graph."""
    model = mf.prepare_inference(mlp(), recipe=mf.CurrentScaling())
    adapter = nn.Linear(64, 64, bias=False)
    nn.init.zeros_(adapter.weight)
    x = torch.randn(4, 32)
    h = model[1](model[0](x))  # the first layer (kept in high precision) and its GELU
    model[2].bias.requires_grad_(True)
    out = model[2](h + adapter(h))
    out.square().sum().backward()
    assert adapter.weight.grad is not None and adapter.weight.grad.abs().sum() > 0
    assert torch.allclose(model[2].bias.grad, 2 * out.detach().sum(0))  # d/db Σ y² = 2 Σ_tokens y
    with torch.no_grad():
        assert model[2](h).grad_fn is None
    assert model[2](h.detach()).grad_fn is not None  # the bias asks for its gradient
    model[2].bias.requires_grad_(False)
    assert model[2](h.detach()).grad_fn is None


# ------------------------------------------------------------------------------------------------ non-finite data


def calibration_with_a_nan() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Four batches with one NaN in one token of the last, and the same batches without that token."""
    torch.manual_seed(SEED)
    batches = [torch.randn(4, 32) * 1000 for _ in range(4)]
    clean = [*batches[:3], batches[3][1:]]
    batches[3][0, 0] = float("nan")  # the first layer spreads it over the token's whole row
    return batches, clean


def nonfinite_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage() or "NaN" in r.getMessage()]


@pytest.mark.parametrize("clip", ["max", "percentile"])
def test_nonfinite_calibration_values_are_left_out_with_one_warning(caplog, clip):
    dirty, clean = calibration_with_a_nan()
    options = dict(recipe=mf.CurrentScaling(), activations="static", clip=clip)
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        expected = mf.prepare_inference(mlp(), calibration=clean, **options)
        assert not nonfinite_warnings(caplog)
        got = mf.prepare_inference(mlp(), calibration=dirty, **options)
    for (n, a), (_, b) in zip(inference_layers(got), inference_layers(expected)):
        assert torch.equal(a.input_scale, b.input_scale), n  # the scale of the finite values, never 1.0
    [warning] = nonfinite_warnings(caplog)
    assert "2 (1 of 4 batches)" in warning and "4 (1 of 4 batches)" in warning


def test_sensitivity_leaves_nonfinite_outputs_out(caplog):
    dirty, clean = calibration_with_a_nan()
    expected = sensitivity(mlp(), clean, recipe=mf.CurrentScaling())
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        got = sensitivity(mlp(), dirty, recipe=mf.CurrentScaling())
    assert got.keys() == expected.keys()
    # finite, not NaN or inf; the same up to the fp32 GEMMs of a 4-token and a 3-token batch (measured 2e-6 dB)
    assert all(got[n] == pytest.approx(expected[n], abs=1e-3) for n in got)
    [warning] = nonfinite_warnings(caplog)
    assert "1 of 4 calibration batches" in warning


# ------------------------------------------------------------------------------------------------ bad input


# (name, keyword arguments of prepare_inference, pattern of the one-line ValueError)
BAD_ARGUMENTS = [
    ("negative keep_sensitive", dict(keep_sensitive=-5.0, calibration=[torch.randn(2, 32)]),
     r"keep_sensitive must be a finite number > 0 or None, got -5\.0"),
    ("zero keep_sensitive", dict(keep_sensitive=0, calibration=[torch.randn(2, 32)]), r"keep_sensitive must be"),
    ("mse with NVFP4", dict(recipe=mf.NVFP4Scaling(), activations="static", clip="mse",
                            calibration=[torch.randn(2, 32)]), r"clip='mse' .* use clip='max' or 'percentile'"),
]


@pytest.mark.parametrize("name, kwargs, pattern", BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_raise_one_clear_line(name, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        mf.prepare_inference(mlp(), **{"recipe": mf.CurrentScaling(), **kwargs})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("under", [False, True], ids=["a file", "under a file"])
def test_save_quantized_into_a_file_is_one_clear_error(tmp_path, under):
    model = mf.prepare_inference(mlp(), recipe=mf.CurrentScaling())
    blocker = tmp_path / "a-file"
    blocker.write_text("mine\n")
    with pytest.raises(FileExistsError, match=f"{blocker} is a file; save_quantized writes a folder") as err:
        mf.save_quantized(model, blocker / "q" if under else blocker)
    assert "\n" not in str(err.value)
    assert blocker.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


# (name, prompt_ids, words of the one-line ValueError)
BAD_PROMPTS = [
    ("str", "def ", ["not str", "encode the text first", "run_tokenizer(run).encode(text)"]),
    ("bytes", b"def ", ["not bytes", "list(text.encode())"]),
    ("ragged", [[1, 2, 3], [4]], ["lists of ints of one length"]),
    ("words", ["def", "class"], ["integer token ids"]),
]


@pytest.mark.parametrize("name, prompt, words", BAD_PROMPTS, ids=[c[0] for c in BAD_PROMPTS])
def test_generate_refuses_a_prompt_that_is_not_token_ids(name, prompt, words):
    with pytest.raises(ValueError) as err:
        generate(tiny_llama(), prompt, max_new_tokens=2)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


# ------------------------------------------------------------------------------------------------ HF's kept layers

# T5's logits with FP8 layers against fp32: measured 24.7 dB (dynamic, the tiny random T5 below)
T5_SQNR_FLOOR_DB = 20.0


def test_a_hugging_face_models_fp32_modules_stay_in_high_precision():
    """T5 casts the input of its `wo` layers to `wo.weight.dtype` (transformers keeps them in fp32:
    `_keep_in_fp32_modules`). Stored as FP8 codes, that cast made the input float8 and the forward failed (dynamic)
    or returned float8 (static). Those layers now stay in high precision, and an FP8 input is refused clearly."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                                   vocab_size=128, decoder_start_token_id=0)
    torch.manual_seed(SEED)
    reference = transformers.T5ForConditionalGeneration(config).eval()
    model = mf.prepare_inference(copy.deepcopy(reference), recipe=mf.CurrentScaling())
    converted = dict(inference_layers(model))
    assert converted and not any(name.split(".")[-1] == "wo" for name in converted)
    x = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        ours = model(input_ids=x, decoder_input_ids=x[:, :4]).logits
        theirs = reference(input_ids=x, decoder_input_ids=x[:, :4]).logits
    assert mf.sqnr_db(theirs, ours) >= T5_SQNR_FLOOR_DB
    layer = next(iter(converted.values()))
    with pytest.raises(TypeError, match="got a torch.float8_e4m3fn input, which its model cast"):
        layer(torch.randn(2, layer.in_features).to(torch.float8_e4m3fn))


def test_load_quantized_errors_name_its_own_fix(tmp_path):
    """A damaged save_quantized folder said "start the run again (minifloat train --overwrite ...)", the training
    checkpoint's fix; a model that is not a module, or the manifest's path for the folder's, got other errors."""
    from minifloat.inference.quantized_io import QUANTIZED_FIX
    from minifloat.training.jsonstate import CheckpointError

    path = mf.save_quantized(mf.prepare_inference(tiny_llama(), recipe=mf.CurrentScaling()), tmp_path / "q")
    tensors = next(p for p in path.iterdir() if p.suffix == ".safetensors")
    tensors.write_bytes(tensors.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated") as caught:
        mf.load_quantized(path)
    assert str(caught.value).endswith(QUANTIZED_FIX) and "minifloat train" not in str(caught.value)
    with pytest.raises(TypeError, match="model must be a torch nn.Module or None, got str"):
        mf.load_quantized(path, model="foo")
    with pytest.raises(FileNotFoundError, match="load_quantized takes its folder"):
        mf.load_quantized(path / "manifest.json")


@pytest.mark.parametrize("batch, words", [("def ", "(a str)"), (torch.randn(2, 8), "(a torch.float32 tensor of shape"),
                                          (torch.full((2, 8), 999), "(IndexError: index out of range")],
                         ids=["text", "floats", "ids-past-the-vocabulary"])
def test_calibration_batches_the_model_cannot_take_are_named(batch, words):
    """A calibration batch the model's forward rejects surfaced as torch's own error from deep inside it."""
    with pytest.raises(ValueError, match=r"calibration batch 0 .*" + re.escape(words) + r".*give batches the model"):
        mf.prepare_inference(tiny_llama(), recipe=mf.CurrentScaling(), activations="static", calibration=[batch])
