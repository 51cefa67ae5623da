"""Tests for minifloat.fp8.modules (with minifloat.fp8.autograd and minifloat.fp8.telemetry behind it): Fp8Linear, convert, autocast.

References are float64 matmuls of exactly what the layer quantized, rebuilt here with minifloat.numerics.quantize.quantize
under the recipe's spec and following autograd.py's documented transposes:
    fprop:  x @ Wᵀ  = y      x, W quantized along K
    dgrad:  dy @ W  = dx     dy along N; W along N: the forward's FP8 W transposed for "tensor"/"block" scales,
                             else W re-quantized from the parameter along N
    wgrad:  dyᵀ @ x = dW     dy along M: transposed for "tensor" scales, else re-quantized from dy;
                             x along M: transposed for "tensor" scales, else re-quantized from its saved FP8 copy
In float32 without autocast the GEMMs multiply exactly and accumulate in fp32, so the layer matches those
references to fp32-accumulation accuracy; accuracy against the unquantized layer is checked as SQNR floors.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from torch import nn

import minifloat as mf
from recipe_cases import RECIPES
from minifloat.fp8 import telemetry
from minifloat.numerics.quantize import Quantized, quantize, sqnr_db
from minifloat.fp8.recipes import ROLES, Role

# fp32 accumulation over K = 192 exact FP8 products (and fp32 dequantization of the operands in the reference):
# measured ≤ 1.2e-7 of max|ref|
FP32_ACC_RTOL = 1e-6
# SQNR floors against nn.Linear in float64 (measured on these shapes: forward 27.4–28.8 dB, E4M3 gradients
# 27.1–28.7 dB, E5M2 gradients 24.0–24.8 dB); E4M3 keeps 3 mantissa bits (≈ 31 dB per cast), E5M2 2 bits (≈ 25 dB)
SQNR_FORWARD_DB = 25.0
SQNR_GRAD_E4M3_DB = 24.0
SQNR_GRAD_E5M2_DB = 20.0
# a cast's own SQNR, reported by telemetry: E4M3 ≈ 31 dB and E5M2 ≈ 25 dB on Gaussian data
SQNR_CAST_DB = {"e4m3": 28.0, "e5m2": 22.0}
# bf16 autocast vs an fp32 run on identical FP8 operands: the outputs differ only by their rounding to bfloat16
# (unit roundoff 2^-8, at most twice where per-row scales are applied after the GEMM's own rounding)
BF16_OUT_RTOL = 2.0**-7
# FP8 activation storage: 1 byte per element (+ scales) against bf16 autocast's 2 bytes for x and for W's copy
SAVED_BYTES_RATIO = 0.55

M, K, N = 160, 192, 144  # tokens, in_features, out_features: ragged for 128-tiles along every axis

RECIPE_IDS = [name for name, _ in RECIPES]
ALL_RECIPES = pytest.mark.parametrize("recipe", [r for _, r in RECIPES], ids=RECIPE_IDS)
TENSOR_SCALED = [(n, r) for n, r in RECIPES if r.spec(Role.INPUT).granularity == "tensor"]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20240501)


def make_layer(recipe, gen, *, bias=True, in_features=K, out_features=N) -> mf.Fp8Linear:
    layer = mf.Fp8Linear(in_features, out_features, bias=bias, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen) * 0.1)
    return layer


def twin(layer: mf.Fp8Linear) -> mf.Fp8Linear:
    """A layer with the same weights, recipe and scaling state (deep copy)."""
    return copy.deepcopy(layer)


def data(gen, *lead, scale_x=1.0, scale_dy=1e-3):
    x = torch.randn(*lead, K, generator=gen) * scale_x
    dy = torch.randn(*lead, N, generator=gen) * scale_dy
    return x, dy


def run(layer, x, dy):
    """One training step's forward and backward, then the end of its FP8 step (as an optimizer step would);
    returns (y, dx, dW, db) and leaves grads zeroed on the layer."""
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy.to(y.dtype))
    dw, db = layer.weight.grad, None if layer.bias is None else layer.bias.grad
    layer.zero_grad(set_to_none=True)
    layer.fp8_step()
    return y.detach(), x.grad, dw, db


# ---------------------------------------------------------------------------------------------------- references


def q(recipe, role: Role, t: torch.Tensor, *, scale: torch.Tensor | None = None) -> Quantized:
    spec = recipe.spec(role)
    if scale is not None:
        return quantize(t, spec.fmt, granularity="tensor", scale=scale)
    return quantize(t, spec.fmt, granularity=spec.granularity, margin=spec.margin, power_of_two=spec.power_of_two,
                    mx_rule=spec.mx_rule)


def along_other_axis(recipe, role: Role, qt: Quantized, source: torch.Tensor | None) -> torch.Tensor:
    """Dequantized transpose of a cast, as the backward builds it (see module docstring)."""
    if qt.granularity == "tensor" or (role == Role.WEIGHT and qt.granularity == "block"):
        return qt.dequantize().T
    src = source if source is not None else qt.dequantize()
    return q(recipe, role, src.T).dequantize()


def reference(recipe, x, w, b, dy, *, scales: dict | None = None):
    """float64 y, dx, dW, db of the quantized operands; `scales` gives delayed dequantization scales per role."""
    scales = scales or {}
    qx = q(recipe, Role.INPUT, x, scale=scales.get(Role.INPUT))
    qw = q(recipe, Role.WEIGHT, w, scale=scales.get(Role.WEIGHT))
    qdy = q(recipe, Role.GRAD_OUTPUT, dy, scale=scales.get(Role.GRAD_OUTPUT))
    y = qx.dequantize().double() @ qw.dequantize().double().T  # x @ Wᵀ
    if b is not None:
        y = y + b.double()
    wt = along_other_axis(recipe, Role.WEIGHT, qw, w)  # (K, N), scaled along N
    dx = qdy.dequantize().double() @ wt.double().T  # dy @ W
    dyt = along_other_axis(recipe, Role.GRAD_OUTPUT, qdy, dy)  # (N, M), scaled along M
    xt = along_other_axis(recipe, Role.INPUT, qx, None)  # (K, M), re-quantized from FP8 x
    dw = dyt.double() @ xt.double().T  # dyᵀ @ x
    db = dy.double().sum(0) if b is not None else None
    return y, dx, dw, db


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def assert_matches(got, ref, rtol=FP32_ACC_RTOL):
    for name, g, r in zip(("y", "dx", "dW", "db"), got, ref):
        if r is None:
            assert g is None, name
            continue
        assert g.shape == r.shape, name
        assert rel_err(g, r) <= rtol, (name, rel_err(g, r))


# ---------------------------------------------------------------------------------------------------- numerics


@ALL_RECIPES
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_first_step_matches_float64_of_quantized_operands(recipe, bias, gen):
    # DelayedScaling's first step seeds every scale from the current amax: the same casts as current scaling
    layer = make_layer(recipe, gen, bias=bias)
    x, dy = data(gen, M)
    got = run(layer, x, dy)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    assert_matches(got, reference(recipe, x, layer.weight.detach(), layer.bias, dy))


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.DelayedScaling(format="e4m3", amax_history_len=2)],
                         ids=["delayed", "delayed-e4m3-h2"])
def test_delayed_steps_use_previous_amaxes(recipe, gen):
    layer = make_layer(recipe, gen)
    w = layer.weight.detach()
    fmts = {role: recipe.spec(role).fmt for role in ROLES}
    # a large step followed by smaller ones: a 2-step history must still see it one step later, not two
    steps = [data(gen, M), data(gen, M, scale_x=3.0, scale_dy=1e-2), data(gen, M, scale_x=0.5, scale_dy=1e-4),
             data(gen, M, scale_x=1.0, scale_dy=1e-3)]
    amaxes = []
    for i, (x, dy) in enumerate(steps):
        used = layer.fp8_state.scale.clone()  # fixed for the whole step
        got = run(layer, x, dy)
        if i == 0:
            scales = None  # seeded from the current amax
        else:
            # TE rule: scale = fmt.max / max(amaxes of the last H steps)
            window = amaxes[-recipe.amax_history_len:]
            for c, role in enumerate(ROLES):
                expect = fmts[role].max / max(a[c] for a in window)
                assert used[c].item() == pytest.approx(expect, rel=2.0**-22), (i, role)  # float / tensor: 2 roundings
            scales = {role: 1.0 / used[c] for c, role in enumerate(ROLES)}
        assert_matches(got, reference(recipe, x, w, layer.bias, dy, scales=scales))
        amaxes.append([x.abs().max().item(), w.abs().max().item(), dy.abs().max().item()])
        # the step's amaxes, rolled into the newest completed row by the step's end
        assert layer.fp8_state.amax_history[-1].tolist() == pytest.approx(amaxes[-1], rel=0, abs=0)


def test_delayed_scaling_saturates_when_tensor_outgrows_history(gen):
    recipe = mf.DelayedScaling()
    layer = make_layer(recipe, gen)
    x, dy = data(gen, M)
    run(layer, x, dy)
    with telemetry.capture() as tel:
        run(layer, 4.0 * x, dy)  # the input grew 4×: its delayed scale clips the top of the range
    rec = next(r for r in tel.records if r.role == "input")
    assert rec.saturated > 0.0
    got_y = run(layer, 4.0 * x, dy)[0]  # the history has caught up: back to current-scaling accuracy
    ref_y = reference(mf.CurrentScaling(), 4.0 * x, layer.weight.detach(), layer.bias, dy)[0]
    assert sqnr_db(ref_y, got_y) >= SQNR_FORWARD_DB


def test_telemetry_reports_the_weight_of_a_step_whose_weight_cast_was_cached(gen):
    # a forward earlier in the FP8 step cached the weight's cast; the captured forward took it from the cache and
    # telemetry's table had no weight row
    layer = make_layer(mf.DelayedScaling(), gen)
    x, dy = data(gen, M)
    run(layer, x, dy)  # a first step: the delayed scales exist
    y_cached = layer(x)  # a forward of the next step: its weight cast is cached until the step ends
    y_cached.backward(dy)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with telemetry.capture() as tel:
        y_captured = layer(x)
        y_captured.backward(dy)
    assert {r.role for r in tel.records} == {"input", "weight", "grad_output"}
    assert torch.equal(y_captured, y_cached)  # the same bits as the cached cast's
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())  # its amaxes were in row 0


def _high_precision(layer, x, dy):
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    return x.double() @ w.T + b, dy.double() @ w, dy.double().T @ x.double()


@ALL_RECIPES
def test_sqnr_against_float64_linear(recipe, gen):
    layer = make_layer(recipe, gen)
    x, dy = data(gen, M)
    y_ref, dx_ref, dw_ref = _high_precision(layer, x, dy)
    for _ in range(2):  # the second step runs on delayed scales
        y, dx, dw, _ = run(layer, x, dy)
    grad_floor = SQNR_GRAD_E5M2_DB if recipe.spec(Role.GRAD_OUTPUT).fmt == mf.E5M2 else SQNR_GRAD_E4M3_DB
    assert sqnr_db(y_ref, y) >= SQNR_FORWARD_DB
    assert sqnr_db(dx_ref, dx) >= grad_floor
    assert sqnr_db(dw_ref, dw) >= grad_floor


# ---------------------------------------------------------------------------------------------------- bf16 autocast


@ALL_RECIPES
def test_bf16_autocast_dtypes_and_values(recipe, gen):
    layer = make_layer(recipe, gen)
    layer32 = twin(layer)
    x, dy = data(gen, M)
    dy = dy.bfloat16()  # the output gradient is bf16 under autocast: give the fp32 run the same values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, dw, db = run(layer, x, dy)
    y32, dx32, dw32, db32 = run(layer32, x, dy.float())
    assert y.dtype == torch.bfloat16
    assert dx.dtype == torch.float32  # the input's dtype
    assert dw.dtype == layer.weight.dtype == torch.float32  # the parameter's dtype
    assert db.dtype == torch.float32
    # identical FP8 operands: only the rounding of each GEMM's output to bf16 differs
    for name, a, b in (("y", y, y32), ("dx", dx, dx32), ("dW", dw, dw32), ("db", db, db32)):
        assert rel_err(a, b) <= BF16_OUT_RTOL, name


# ---------------------------------------------------------------------------------------------------- saved tensors


def _saved_bytes(module, x, params):
    """(non-parameter bytes saved for backward, list of saved tensors) of one forward of `module`."""
    ptrs = {p.data_ptr() for p in params}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    own = [t for t in saved if t.data_ptr() not in ptrs]
    return sum(t.numel() * t.element_size() for t in own), own


@ALL_RECIPES
def test_input_is_saved_in_fp8(recipe, gen):
    layer = make_layer(recipe, gen)
    x = torch.randn(M, K, generator=gen, requires_grad=True)
    fp8_bytes, fp8_saved = _saved_bytes(layer, x, list(layer.parameters()))

    activation = [t for t in fp8_saved if tuple(t.shape) == (M, K)]
    assert len(activation) == 1
    assert activation[0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    linear = nn.Linear(K, N)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_bytes, _ = _saved_bytes(linear, x, list(linear.parameters()))
    assert bf16_bytes > 0
    assert fp8_bytes <= SAVED_BYTES_RATIO * bf16_bytes


# ---------------------------------------------------------------------------------------------------- shapes


@ALL_RECIPES
def test_3d_input_equals_flattened(recipe, gen):
    layer = make_layer(recipe, gen)
    flat = twin(layer)
    x, dy = data(gen, 4, 40)
    y3, dx3, dw3, db3 = run(layer, x, dy)
    y2, dx2, dw2, db2 = run(flat, x.reshape(-1, K), dy.reshape(-1, N))
    assert y3.shape == (4, 40, N) and dx3.shape == (4, 40, K)
    assert torch.equal(y3.reshape(-1, N), y2)
    assert torch.equal(dx3.reshape(-1, K), dx2)
    assert torch.equal(dw3, dw2) and torch.equal(db3, db2)


@ALL_RECIPES
def test_non_contiguous_input_equals_contiguous(recipe, gen):
    layer = make_layer(recipe, gen)
    other = twin(layer)
    base = torch.randn(K, M, generator=gen)
    x = base.t()  # (M, K) view with strides (1, M)
    assert not x.is_contiguous()
    dy = torch.randn(M, N, generator=gen) * 1e-3
    got, want = run(layer, x, dy), run(other, x.contiguous(), dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@ALL_RECIPES
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0xK", "2x0xK"])
def test_zero_token_input(recipe, lead, gen):
    layer = make_layer(recipe, gen)
    x = torch.randn(*lead, K, generator=gen, requires_grad=True)
    y = layer(x)
    assert y.shape == (*lead, N)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
    assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))
    assert torch.isfinite(layer.fp8_state.scale).all()


# ---------------------------------------------------------------------------------------------------- bad values

# (name, where the bad value goes, the value)
NONFINITE = [
    ("input-nan", "input", float("nan")),
    ("input-inf", "input", float("inf")),
    ("input-neg-inf", "input", float("-inf")),
    ("grad-nan", "grad_output", float("nan")),
    ("grad-inf", "grad_output", float("inf")),
]


@ALL_RECIPES
@pytest.mark.parametrize("where, value", [c[1:] for c in NONFINITE], ids=[c[0] for c in NONFINITE])
def test_nonfinite_never_reaches_a_scale(recipe, where, value, gen):
    layer = make_layer(recipe, gen)
    col = ROLES.index(Role(where))
    x, dy = data(gen, M)
    run(layer, x, dy)  # a clean step first (seeds delayed scales)

    bad_x, bad_dy = x.clone(), dy.clone()
    (bad_x if where == "input" else bad_dy)[3, 5] = value
    with telemetry.capture() as tel:
        run(layer, bad_x, bad_dy)
    assert torch.isfinite(layer.fp8_state.scale).all()
    assert layer.fp8_state.nonfinite[col].item() >= 1
    assert [r.nonfinite for r in tel.records if r.role == where] and \
        all(r.nonfinite > 0 for r in tel.records if r.role == where)

    for _ in range(2):  # clean steps afterwards are finite (delayed scales included)
        y, dx, dw, db = run(layer, x, dy)
        assert all(torch.isfinite(t).all() for t in (y, dx, dw, db))
        assert torch.isfinite(layer.fp8_state.scale).all()
    y_ref, _, _ = _high_precision(layer, x, dy)
    assert sqnr_db(y_ref, y) >= SQNR_FORWARD_DB


@pytest.mark.parametrize("recipe", [r for _, r in TENSOR_SCALED], ids=[n for n, _ in TENSOR_SCALED])
def test_nonfinite_first_step_keeps_scales_finite(recipe, gen):
    layer = make_layer(recipe, gen)
    x, dy = data(gen, M)
    bad = x.clone()
    bad[0, 0] = float("nan")
    run(layer, bad, dy)
    assert torch.isfinite(layer.fp8_state.scale).all()
    for _ in range(2):
        y, dx, dw, _ = run(layer, x, dy)
        assert all(torch.isfinite(t).all() for t in (y, dx, dw))


# ---------------------------------------------------------------------------------------------------- state_dict


def test_state_dict_holds_fp8_state_as_plain_tensors(gen):
    layer = make_layer(mf.DelayedScaling(), gen)
    sd = layer.state_dict()
    for key in ("amax_history", "scale", "initialized", "nonfinite"):
        assert type(sd[f"fp8_state.{key}"]) is torch.Tensor
    assert {"weight", "bias"} <= set(sd)
    assert all(type(v) is torch.Tensor for v in sd.values())


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.DelayedScaling(amax_compute="most_recent", margin=1)],
                         ids=["delayed", "delayed-most-recent-margin1"])
def test_state_dict_round_trip_is_bit_exact(recipe, gen):
    layer = make_layer(recipe, gen)
    steps = [data(gen, M, scale_x=s) for s in (1.0, 2.0, 0.5, 1.5)]
    for x, dy in steps[:3]:
        run(layer, x, dy)

    fresh = mf.Fp8Linear(K, N, recipe=recipe)
    fresh.load_state_dict(layer.state_dict())
    for key, value in layer.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    for x, dy in steps[3:] + steps[:2]:  # keep training both: they stay identical
        for a, b in zip(run(layer, x, dy), run(fresh, x, dy)):
            assert torch.equal(a, b)


def test_the_state_dict_of_the_unconverted_model_loads_strictly(gen, caplog):
    """The usual flow: convert a model, then load its pretrained (plain) weights. Its FP8 layers have no scaling
    state in that dict: they keep a fresh one instead of failing with torch's missing keys."""
    build = lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    torch.manual_seed(1)
    pretrained = build().state_dict()
    model = mf.convert(build(), recipe=mf.DelayedScaling())
    fresh = {k: v.clone() for k, v in model[2].fp8_state.state_dict().items()}
    with caplog.at_level("INFO", logger="minifloat"):
        result = model.load_state_dict(pretrained)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(model[2].weight, pretrained["2.weight"]) and torch.equal(model[2].bias, pretrained["2.bias"])
    assert all(torch.equal(fresh[k], v) for k, v in model[2].fp8_state.state_dict().items())
    assert any("2.fp8_state is not in the state dict" in r.getMessage() for r in caplog.records)
    # a dict that holds part of a layer's scaling state is a broken one: a strict load still says what is missing
    partial = {**pretrained, **{f"2.{k}": v for k, v in model[2].state_dict().items() if k != "fp8_state.scale"}}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2.fp8_state.scale"'):
        model.load_state_dict(partial)


# ---------------------------------------------------------------------------------------------------- eval


def test_eval_forward_leaves_scaling_state_alone(gen):
    layer = make_layer(mf.DelayedScaling(), gen)
    x, dy = data(gen, M)
    run(layer, x, dy)
    before = {k: v.clone() for k, v in layer.fp8_state.state_dict().items()}
    layer.eval()
    with torch.no_grad():
        layer(10.0 * x)
    for key, value in layer.fp8_state.state_dict().items():
        assert torch.equal(value, before[key]), key


# ---------------------------------------------------------------------------------------------------- from_linear, convert


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_from_linear_shares_parameters(bias):
    linear = nn.Linear(32, 48, bias=bias)
    linear.eval()
    layer = mf.Fp8Linear.from_linear(linear, recipe=mf.CurrentScaling(), name="proj")
    assert layer.weight is linear.weight
    assert layer.bias is linear.bias
    assert not layer.training
    assert layer.fp8_name == "proj"
    assert layer.recipe == mf.CurrentScaling()
    assert all(t.device.type == "cpu" for t in layer.state_dict().values())  # no meta tensors left


@pytest.mark.parametrize("layer", [nn.Conv1d(8, 8, 1), nn.Embedding(8, 8)], ids=["conv1d", "embedding"])
def test_from_linear_refuses_other_layers(layer):
    with pytest.raises(TypeError, match=f"takes a torch.nn.Linear, got {type(layer).__name__}"):
        mf.Fp8Linear.from_linear(layer)


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.NVFP4Scaling()], ids=["fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn, torch.int64], ids=str)
def test_an_input_the_layer_cannot_compute_in_is_named(recipe, dtype):
    """A float64 model (model.double()), an FP8 or an integer input: one TypeError naming the layer, the dtype and
    the fix, rather than a message about a GEMM argument the user never passed; the state records nothing."""
    model = mf.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), recipe=recipe, keep_first_last=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 32).to(dtype) if dtype.is_floating_point else torch.ones(4, 32, dtype=dtype)
    if dtype == torch.float64:
        model.double()
    with pytest.raises(TypeError, match=rf"FP8 layer '0' got a {dtype} input: .* float32, bfloat16 or float16"):
        model(x)
    for key, value in model.state_dict().items():
        assert torch.equal(value.to(before[key].dtype), before[key]), key
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast a float64 input computes in bfloat16
        if dtype == torch.float64:
            assert model(x).dtype == torch.bfloat16


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 16))


LINEAR_NAMES = ["0", "2", "4", "6"]

# (name, convert kwargs, names expected to become Fp8Linear)
CONVERT_CASES = [
    ("default-keeps-first-last", {}, ["2", "4"]),
    ("all", {"keep_first_last": False}, LINEAR_NAMES),
    ("filter", {"keep_first_last": False, "filter": lambda name, lin: name != "4"}, ["0", "2", "6"]),
    ("filter-and-keep", {"filter": lambda name, lin: lin.out_features == 64}, ["2"]),
]


@pytest.mark.parametrize("kwargs, converted", [c[1:] for c in CONVERT_CASES], ids=[c[0] for c in CONVERT_CASES])
def test_convert_selects_layers(kwargs, converted):
    model = _mlp()
    params = {name: (model.get_submodule(name).weight, model.get_submodule(name).bias) for name in LINEAR_NAMES}
    out = mf.convert(model, recipe=mf.CurrentScaling(), **kwargs)
    assert out is model
    for name in LINEAR_NAMES:
        module = model.get_submodule(name)
        assert isinstance(module, mf.Fp8Linear) == (name in converted), name
        assert module.weight is params[name][0] and module.bias is params[name][1]
        if name in converted:
            assert module.fp8_name == name
            assert module.recipe == mf.CurrentScaling()
    assert [m.fp8_name for m in mf.fp8_layers(model)] == converted


def test_convert_default_recipe_is_delayed():
    model = mf.convert(_mlp())
    assert all(m.recipe == mf.DelayedScaling() for m in mf.fp8_layers(model))


def test_convert_keeps_odd_sized_layer_and_warns_once(caplog):
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(10, 30), nn.Linear(32, 32), nn.Linear(32, 16))
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        mf.convert(model, keep_first_last=False)
    assert type(model[1]) is nn.Linear
    assert all(isinstance(model[i], mf.Fp8Linear) for i in (0, 2, 3))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "1 (10->30)" in warnings[0].getMessage()


def test_convert_then_optimizer_built_before_still_trains(gen):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mf.convert(model, recipe=mf.CurrentScaling(), keep_first_last=False)
    before = model[2].weight.detach().clone()
    model(torch.randn(8, 32, generator=gen)).square().mean().backward()
    opt.step()
    assert not torch.equal(model[2].weight, before)


# ---------------------------------------------------------------------------------------------------- autocast


def test_autocast_disabled_is_nn_linear(gen):
    layer = make_layer(mf.DelayedScaling(), gen)
    x, dy = data(gen, M)
    with mf.autocast(enabled=False):
        y, dx, dw, db = run(layer, x, dy)
    xr = x.clone().requires_grad_(True)
    y_ref = nn.functional.linear(xr, layer.weight, layer.bias)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref.detach())
    assert torch.equal(dx, xr.grad) and torch.equal(dw, layer.weight.grad) and torch.equal(db, layer.bias.grad)
    assert not layer.fp8_state.initialized.any()
    assert not layer.fp8_state.amax_history.any()


@pytest.mark.parametrize("override", [mf.MXScaling(), mf.CurrentScaling(granularity="row")], ids=["mx", "row"])
def test_autocast_recipe_overrides_layer_recipe(override, gen):
    layer = make_layer(mf.DelayedScaling(), gen)
    same = make_layer(override, gen)
    same.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("fp8_state")}, strict=False)
    x, dy = data(gen, M)
    with mf.autocast(recipe=override), telemetry.capture() as tel:
        got = run(layer, x, dy)
    want = run(same, x, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert {r.granularity for r in tel.records} == {override.spec(Role.INPUT).granularity}
    assert layer.recipe == mf.DelayedScaling()  # the layer's own recipe is untouched


def test_autocast_calibrating_is_high_precision_and_records_amaxes(gen):
    layer = make_layer(mf.DelayedScaling(), gen)
    x, dy = data(gen, M)
    with mf.autocast(calibrating=True):
        y, dx, dw, db = run(layer, x, dy)
    xr = x.clone().requires_grad_(True)
    y_ref = nn.functional.linear(xr, layer.weight, layer.bias)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref.detach())
    assert torch.equal(dx, xr.grad) and torch.equal(dw, layer.weight.grad) and torch.equal(db, layer.bias.grad)
    row = layer.fp8_state.amax_history[-1]  # the step's amaxes, rolled in at its end
    expect = [x.abs().max().item(), layer.weight.abs().max().item(), dy.abs().max().item()]
    assert row.tolist() == pytest.approx(expect, rel=0, abs=0)
    assert (row > 0).all()
    assert layer.fp8_state.initialized.all()

    # FP8 switched back on: its first scales come from the calibrated statistics, not from scale 1
    with telemetry.capture() as tel:
        y8 = run(layer, x, dy)[0]
    assert all(r.saturated == 0.0 for r in tel.records)
    assert sqnr_db(y_ref.detach(), y8) >= SQNR_FORWARD_DB


# (name, autocast kwargs, text the message must contain)
BAD_AUTOCAST = [
    ("recipe-string", {"recipe": "delayed"}, "recipe"),
    ("recipe-class", {"recipe": mf.DelayedScaling}, "recipe"),
    ("backend", {"backend": "bogus"}, "bogus"),
    ("enabled-string", {"enabled": "yes"}, "enabled"),
    ("calibrating-int", {"calibrating": 1}, "calibrating"),
]


@pytest.mark.parametrize("kwargs, text", [c[1:] for c in BAD_AUTOCAST], ids=[c[0] for c in BAD_AUTOCAST])
def test_autocast_bad_arguments_raise(kwargs, text):
    with pytest.raises(ValueError, match=text):
        with mf.autocast(**kwargs):
            pass


# (name, Fp8Linear kwargs)
BAD_LAYER = [("recipe", {"recipe": "delayed"}), ("backend", {"backend": "bogus"})]


@pytest.mark.parametrize("kwargs", [c[1] for c in BAD_LAYER], ids=[c[0] for c in BAD_LAYER])
def test_fp8linear_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        mf.Fp8Linear(16, 16, **kwargs)


# ---------------------------------------------------------------------------------------------------- telemetry


def test_telemetry_disabled_outside_capture():
    assert not telemetry.enabled()
    with telemetry.capture():
        assert telemetry.enabled()
    assert not telemetry.enabled()


@pytest.mark.parametrize("recipe", [mf.CurrentScaling(), mf.CurrentScaling(granularity="row"), mf.BlockScaling(),
                                    mf.MXScaling()], ids=["current", "current-row", "block", "mx"])
def test_telemetry_records_each_cast(recipe, gen):
    layer = make_layer(recipe, gen)
    x, dy = data(gen, M)
    w = layer.weight.detach()
    with telemetry.capture() as tel:
        run(layer, x, dy)
    by_role = {r.role: r for r in tel.records}
    assert sorted(r.role for r in tel.records) == sorted(role.value for role in ROLES)  # one record per role
    for role, source in ((Role.INPUT, x), (Role.WEIGHT, w), (Role.GRAD_OUTPUT, dy)):
        rec = by_role[role.value]
        spec = recipe.spec(role)
        assert (rec.fmt, rec.granularity) == (spec.fmt.name, spec.granularity)
        assert rec.amax == source.abs().max().item()
        if recipe.spec(role).mx_rule == "up":  # current scaling never clips (MX "floor" may, by design)
            assert rec.saturated == 0.0
        assert rec.nonfinite == 0
        assert 0.0 <= rec.underflow < 1e-3
        assert rec.sqnr_db >= SQNR_CAST_DB[spec.fmt.name]
        assert rec.scale > 0


def test_telemetry_names_layers_of_converted_model(gen):
    model = mf.convert(_mlp(), recipe=mf.CurrentScaling(), keep_first_last=False)
    with telemetry.capture() as tel:
        model(torch.randn(16, 32, generator=gen)).square().mean().backward()
    assert set(tel.by_layer()) == {(name, role.value) for name in LINEAR_NAMES for role in ROLES}
    assert all(len(recs) == 1 for recs in tel.by_layer().values())
    assert all(r.saturated == 0.0 and r.amax > 0 for r in tel.records)
    records = json.loads(tel.to_json(), parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert len(records) == len(tel.records) and all(r["block_scale_min"] is None for r in records)


FOUR_BIT = [("mxfp4", mf.MXScaling(format="e2m1")), ("nvfp4", mf.NVFP4Scaling())]


@pytest.mark.parametrize("name, recipe", RECIPES + FOUR_BIT, ids=[n for n, _ in RECIPES + FOUR_BIT])
def test_flop_counter_counts_an_fp8_layer_as_its_linear(name, recipe):
    """torch.utils.flop_counter.FlopCounterMode (what MFU tools count with) gives a converted layer's forward and
    backward the FLOPs of the nn.Linear it replaced, 3 GEMMs of 2·M·K·N: the emulated GEMMs are custom ops, which a
    dispatch mode sees as one op each (0 FLOPs without minifloat's formulas)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    lin = nn.Linear(256, 384)
    fp8 = mf.convert(copy.deepcopy(lin), recipe=recipe, keep_first_last=False)
    assert isinstance(fp8, mf.Fp8Linear)
    x = torch.randn(64, 256, requires_grad=True)
    counts = []
    for layer in (lin, fp8):
        with FlopCounterMode(display=False) as counter:
            layer(x).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == 3 * 2 * 64 * 256 * 384
    assert counts[1] == counts[0], counts


def test_a_tensor_parallel_layer_hits_its_weight_cache_whatever_the_weights_address():
    # under FSDP2 each micro-batch gathers the weight into a buffer at the allocator's address, rank by rank: keyed
    # by address, one rank hit the cache and skipped the weight's amax all-reduce while another ran it (gloo aborted
    # fsdp+tp with current scaling and grad_accum 2). A TP layer's cache keys by version and shape, so every rank
    # hits or misses together; an unsharded layer still misses on a new storage (a .data swap)
    calls = []
    for sharded in (True, False):
        torch.manual_seed(0)
        layer = mf.Fp8Linear(64, 64, recipe=mf.CurrentScaling())
        if sharded:
            layer.amax_reduce = lambda amax: calls.append(amax) or amax  # a one-rank group's MAX all-reduce
        x = torch.randn(16, 64)
        first = layer(x)
        layer.weight.data = layer.weight.data.clone()  # the same values gathered elsewhere
        hit = layer._weights.peek("fprop", layer.weight, layer.fp8_state.generation)
        assert (hit is not None) == sharded
        assert torch.equal(layer(x), first)
    assert len(calls) == 3  # input, weight, then input again: the second forward's weight came from the cache


def test_telemetry_numbers_the_steps_of_a_capture():
    # every record said step 0: nothing advanced the capture's step counter
    torch.manual_seed(0)
    model = mf.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), keep_first_last=False)
    opt = torch.optim.AdamW(model.parameters())
    with telemetry.capture() as tel:
        for _ in range(3):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    steps = [r.step for r in tel.records]
    assert sorted(set(steps)) == [0, 1, 2] and steps == sorted(steps)
    assert all(steps.count(s) == 6 for s in range(3))  # 2 layers × 3 roles a step


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.BlockScaling(), mf.NVFP4Scaling()],
                         ids=["delayed", "block", "nvfp4"])
@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 64)], ids=["2d", "3d"])
def test_a_layers_output_can_be_modified_in_place(recipe, shape):
    # the autograd Function returned a view it made (its reshape), which autograd forbids modifying in place:
    # "Output 0 of Fp8LinearFunction is a view and is being modified inplace" (HF Falcon's `mlp_output += attn`)
    torch.manual_seed(0)
    layer = mf.convert(nn.Linear(64, 64), recipe=recipe, keep_first_last=False)
    x = torch.randn(*shape, requires_grad=True)
    plain = layer(x)
    (plain * 1).sum().backward()
    expected, x.grad = x.grad.clone(), None
    y = layer(x)
    y += 1  # d(y + 1)/dy = 1: the same gradient
    y.sum().backward()
    assert torch.equal(x.grad, expected) and torch.equal(y, plain + 1)
    frozen = mf.prepare_inference(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), recipe=recipe,
                                  keep_first_last=False)
    out = frozen(x)
    out += 1  # a prepared model's layers pass gradients to their inputs (adapters): the same rule
    out.sum().backward()


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.NVFP4Scaling()], ids=["delayed", "nvfp4"])
def test_a_model_built_on_meta_gets_a_fresh_scaling_state_from_to_empty(recipe):
    # to_empty left uninitialised memory: scales like -1e24 marked as seeded, NaN losses; with assign=True the
    # state stayed on meta and torch's device error came from inside a cast
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    fresh = mf.convert(copy.deepcopy(reference), recipe=recipe, keep_first_last=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    model = mf.convert(model, recipe=recipe, keep_first_last=False).to_empty(device="cpu")
    model.load_state_dict(reference.state_dict(), strict=False)  # weights saved before conversion
    for built, new in zip(mf.fp8_layers(model), mf.fp8_layers(fresh)):
        assert not built.fp8_state.initialized.any() and torch.equal(built.fp8_state.scale, new.fp8_state.scale)
        assert not built.fp8_state.amax_history.any()
    x = torch.randn(4, 64)
    assert torch.equal(model(x), fresh(x))
    with torch.device("meta"):
        assigned = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    assigned = mf.convert(assigned, recipe=recipe, keep_first_last=False)
    assigned.load_state_dict(reference.state_dict(), strict=False, assign=True)
    with pytest.raises(ValueError, match="scaling state is on the meta device .* call model.to_empty"):
        assigned(x)


# ---------------------------------------------------------------------------------------------------- user code


def test_an_evaluation_after_an_edit_through_data_uses_the_new_weight(gen):
    # an EMA swap or pruning mask written through `.data` bumps no version counter: the cached weight cast kept
    # the old weight (0.1 dB from the swapped-in weights)
    layer = make_layer(mf.CurrentScaling(), gen)
    x = torch.randn(M, K, generator=gen)
    with torch.no_grad():
        layer(x)
        layer.weight.data.mul_(0.5)
        y = layer(x)
        ref = nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert sqnr_db(ref, y) >= SQNR_FORWARD_DB


def test_reuse_weight_casts_casts_an_evaluations_weights_once(gen, monkeypatch):
    # an evaluation's batches cast every weight afresh (the test above): inside reuse_weight_casts() each layer casts
    # it once, the same bits, and an in-place change (which bumps the version counter) is still seen
    from minifloat.fp8 import caster as fp8_caster
    from minifloat.fp8.modules import reuse_weight_casts

    layer = make_layer(mf.DelayedScaling(), gen)
    xs = [torch.randn(M, K, generator=gen) for _ in range(3)]
    casts = []
    real = fp8_caster.LayerCaster.cast
    monkeypatch.setattr(fp8_caster.LayerCaster, "cast",
                        lambda self, role, *a, **k: (role is Role.WEIGHT and casts.append(1))
                        or real(self, role, *a, **k))
    with torch.no_grad():
        fresh = [layer(x) for x in xs]
        assert len(casts) == 3
        casts.clear()
        with reuse_weight_casts():
            with reuse_weight_casts():  # nesting keeps it on
                pass
            reused = [layer(x) for x in xs]
            assert len(casts) == 1
            layer.weight.mul_(0.5)
            halved = layer(xs[0])
        assert len(casts) == 2
        casts.clear()
        layer(xs[0])
        assert len(casts) == 1  # off again after the block
    assert all(torch.equal(a, b) for a, b in zip(fresh, reused))
    ref = nn.functional.linear(xs[0].double(), layer.weight.double(), layer.bias.double())
    assert sqnr_db(ref, halved) >= SQNR_FORWARD_DB


@ALL_RECIPES
def test_a_create_graph_backward_is_refused_in_one_line(recipe, gen):
    # a gradient penalty silently lost the second-order terms through the layer (its dx is not differentiable)
    layer = make_layer(recipe, gen)
    x = torch.randn(M, K, generator=gen, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True .* cannot differentiate through FP8/FP4 layers"):
        torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)


@ALL_RECIPES
def test_a_frozen_weight_runs_no_wgrad_and_saves_no_input(recipe, gen, monkeypatch):
    from minifloat.fp8 import autograd as fp8_autograd
    from minifloat.fp8.fourbit import linear as fp4_linear

    layer = make_layer(recipe, gen)
    layer.weight.requires_grad_(False)
    x = torch.randn(M, K, generator=gen, requires_grad=True)
    twin_layer = twin(layer)
    gemms = []
    for module, name in ((fp8_autograd, "scaled_mm"), (fp4_linear, "fp4_mm")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: gemms.append(1) or real(*a, **k))
    saved, _ = _saved_bytes(layer, x, list(layer.parameters()))
    assert saved < M * K // 8  # no copy of x (of M·K bytes in FP8) is kept; a per-tensor weight scale may be
    gemms.clear()
    layer(x).backward(torch.ones(M, N))
    assert len(gemms) == 2  # fprop and dgrad
    twin_layer.weight.requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    twin_layer(x2).backward(torch.ones(M, N))
    assert torch.equal(x.grad, x2.grad)  # dx as when the weight trains
    gemms.clear()
    x3 = x.detach()  # an input that needs no gradient: no dgrad either
    layer.bias.grad = None
    layer(x3).backward(torch.ones(M, N))
    assert len(gemms) == 1 and layer.bias.grad is not None


def test_a_float64_layer_is_left_in_high_precision(caplog):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).double()
    with caplog.at_level("WARNING", logger="minifloat"):
        mf.convert(model, keep_first_last=False)
    assert type(model[0]) is nn.Linear and "float64 weight" in caplog.text
    model(torch.randn(4, 32, dtype=torch.float64))
