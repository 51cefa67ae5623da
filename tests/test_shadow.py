"""Tests for minifloat.safety.shadow: the FP8 ↔ BF16 shadow check and its automatic fallback and recovery."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minifloat as mf
from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.formats import E4M3
from minifloat.fp8.recipes import Role
from minifloat.safety.shadow import Mode, ShadowCheck, ShadowConfig, grad_cosine

IN, HIDDEN, OUT, BATCH = 32, 64, 16, 64
# DelayedScaling's scale is fp8_max / amax / 2^margin: with margin 24 every value x·scale ≤ 448·2^-24 lies below half
# E4M3's smallest subnormal (2^-10), so every FP8 GEMM operand flushes to zero — a sabotage that surely breaks FP8
SABOTAGE_MARGIN = 24
LR = 0.05
# targets small next to the untrained MLP's outputs, so that zeroed FP8 outputs change the loss by ~10%, not ~0.1%
TARGET_SCALE = 0.03
# a healthy FP8 loss on this MLP sits well within 5% of the BF16 loss (E4M3 operands: ~30 dB SQNR)
THRESHOLD = 0.05
ONE_STEP_GROWTH = 0.01  # one SGD step at LR moves a weight's amax by far less than 1% (observed ~2e-5)
# a new batch's input amax against the max of the recorded ones: maxima of BATCH×IN Gaussian samples differ by a few
# per cent from batch to batch (observed up to 4.9%)
NEW_BATCH_GROWTH = 0.10


@pytest.fixture(autouse=True)
def setup():
    torch.manual_seed(0)
    with eager_kernels():  # no compile time in unit tests
        yield


def make_model(margin: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, OUT))
    return mf.convert(model, recipe=mf.DelayedScaling(margin=margin), keep_first_last=False)


def make_batches(n: int):
    w = torch.randn(IN, OUT) * TARGET_SCALE
    out = []
    for _ in range(n):
        x = torch.randn(BATCH, IN)
        out.append((x, x @ w))
    return out


def loss_fn(output, batch):
    return F.mse_loss(output.float(), batch[1])


class Regression(nn.Module):
    """Wraps the MLP so that model(batch) works for an (x, y) batch."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return self.net(x)


def train(model, shadow, step, batch, opt):
    with torch.autocast("cpu", dtype=torch.bfloat16), shadow.context(step) as mode:
        loss = loss_fn(model(*batch), batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return mode, loss.item()


def train_step(model, shadow, step, batch, opt):
    event = shadow.maybe_check(step, model, loss_fn, batch)
    return (event, *train(model, shadow, step, batch, opt))


def test_fallback_fires_and_recovers_with_current_scales():
    model = Regression(make_model(SABOTAGE_MARGIN))
    layers = mf.fp8_layers(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shadow = ShadowCheck(ShadowConfig(interval=2, threshold=THRESHOLD, patience=2, recover_after=2))
    batches = make_batches(16)

    events, modes = [], []
    for step in range(4):  # checks at 0 and 2: two unhealthy checks in a row -> BF16 at step 2
        event, mode, _ = train_step(model, shadow, step, batches[step], opt)
        events.append(event)
        modes.append(mode)
    assert events[:2] == [None, None] and events[3] is None
    fallback = events[2]
    assert fallback is not None and fallback.switched_to == "bf16" and fallback.step == 2 and fallback.streak == 2
    assert fallback.check.rel_diff > THRESHOLD and "relative loss difference" in fallback.reason
    assert modes == [Mode.FP8, Mode.FP8, Mode.BF16, Mode.BF16]
    assert [c.healthy for c in shadow.checks] == [False, False]

    # BF16 steps calibrate: the last step's amax row (rolled in by opt.step) was filled from high-precision tensors
    for layer in layers:
        assert (layer.fp8_state.amax_history[-1] > 0).all(), layer.fp8_name

    # repair FP8 (the cause went away); the checks turn healthy and FP8 returns after `recover_after` of them
    for layer in layers:
        layer.recipe = mf.DelayedScaling()
    for step in range(4, 12):
        recovery = shadow.maybe_check(step, model, loss_fn, batches[step])
        if recovery is not None:
            break
        assert train(model, shadow, step, batches[step], opt)[0] == Mode.BF16
    # the repaired recipe's scales take effect when step 4 ends (scales advance once per optimizer step), so the
    # check at step 4 still sees the sabotaged scales and the checks at 6 and 8 are the healthy pair
    assert [c.healthy for c in shadow.checks[2:]] == [False, True, True]
    assert recovery is not None and recovery.switched_to == "fp8" and recovery.step == 8
    assert recovery.check.rel_diff < THRESHOLD and "healthy" in recovery.reason
    assert shadow.mode == Mode.FP8 and [e.switched_to for e in shadow.events] == ["bf16", "fp8"]

    # first FP8 step: delayed scales come from the amaxes the BF16 steps recorded (TE rule, margin 0)
    history = {id(layer): layer.fp8_state.amax_history.amax(0) for layer in layers}
    with torch.autocast("cpu", dtype=torch.bfloat16), shadow.context(step) as mode:
        loss = loss_fn(model(*batches[step]), batches[step])
    assert mode == Mode.FP8 and math.isfinite(loss.item())
    assert abs(loss.item() - recovery.check.ref_loss) <= THRESHOLD * recovery.check.ref_loss
    for layer in layers:
        scale, amax = layer.fp8_state.scale, history[id(layer)]
        assert torch.isfinite(scale).all() and (scale > 0).all()
        for role in (Role.INPUT, Role.WEIGHT):  # E4M3 roles under HYBRID
            col = list(Role).index(role)
            torch.testing.assert_close(scale[col], E4M3.max / amax[col])
            # this step's own amax fits the range those scales give: at most one SGD step's growth beyond it for
            # the weight, a new batch's for the input
            this_step = layer.fp8_state.amax_history[0, col]
            growth = ONE_STEP_GROWTH if role == Role.WEIGHT else NEW_BATCH_GROWTH
            assert E4M3.max / 4 <= float(this_step * scale[col]) <= E4M3.max * (1 + growth)


def test_healthy_fp8_never_switches():
    model = Regression(make_model(0))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shadow = ShadowCheck(ShadowConfig(interval=1, threshold=THRESHOLD, patience=1, recover_after=1))
    for step, batch in enumerate(make_batches(4)):
        event, mode, _ = train_step(model, shadow, step, batch, opt)
        assert event is None and mode == Mode.FP8
    assert all(c.healthy and c.rel_diff < THRESHOLD for c in shadow.checks)


def test_grad_cosine_flags_sabotage():
    shadow = ShadowCheck(ShadowConfig(interval=1, threshold=1e9, grad_cosine_min=0.9))  # loss alone always passes
    for margin, healthy in ((0, True), (SABOTAGE_MARGIN, False)):
        model = Regression(make_model(margin))
        batch = make_batches(1)[0]
        result = shadow.run_check(0, model, loss_fn, batch)
        assert result.healthy is healthy, result
        if healthy:
            assert result.grad_cosine > 0.99


def test_check_leaves_model_as_found():
    model = Regression(make_model(0))
    batch = make_batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # one training step seeds the scaling state
        loss_fn(model(*batch), batch).backward()
    model.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shadow = ShadowCheck(ShadowConfig(interval=1, grad_cosine_min=0.5))
    shadow.run_check(0, model, loss_fn, batch)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


def test_interval_skips_steps():
    model = Regression(make_model(0))
    shadow = ShadowCheck(ShadowConfig(interval=3))
    batch = make_batches(1)[0]
    assert [shadow.maybe_check(s, model, loss_fn, batch) for s in range(7)] == [None] * 7
    assert [c.step for c in shadow.checks] == [0, 3, 6]


def test_context_keeps_outer_recipe_and_calibrates():
    from minifloat.fp8.modules import current_autocast

    shadow = ShadowCheck()
    shadow.mode = Mode.BF16
    recipe = mf.CurrentScaling()
    with mf.autocast(recipe=recipe), shadow.context(0):
        state = current_autocast()
        assert state.calibrating and state.recipe == recipe


def test_state_dict_round_trips_as_json_after_a_fallback():
    model = Regression(make_model(SABOTAGE_MARGIN))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shadow = ShadowCheck(ShadowConfig(interval=1, threshold=THRESHOLD, patience=1, recover_after=3))
    for step, batch in enumerate(make_batches(2)):  # falls back at step 0, then one unhealthy check in BF16
        train_step(model, shadow, step, batch, opt)
    state = json.loads(json.dumps(shadow.state_dict()))  # plain data, as a checkpoint's extra stores it
    assert state["mode"] == "bf16" and state["streak"] == 0 and len(state["events"]) == 1

    restored = ShadowCheck(shadow.config)
    restored.load_state_dict(state)
    assert (restored.mode, restored.streak, restored.events) == (shadow.mode, shadow.streak, shadow.events)
    assert restored.state_dict() == state


# (name, state, field named in the error)
BAD_STATES = [
    ("missing key", {"mode": "fp8", "streak": 0}, "keys"),
    ("unknown mode", {"mode": "fp16", "streak": 0, "events": []}, "mode"),
    ("negative streak", {"mode": "fp8", "streak": -1, "events": []}, "streak"),
    ("events not a list", {"mode": "fp8", "streak": 0, "events": None}, "events"),
]


@pytest.mark.parametrize("name, state, field", BAD_STATES, ids=[c[0] for c in BAD_STATES])
def test_load_state_dict_rejects(name, state, field):
    shadow = ShadowCheck()
    with pytest.raises(ValueError, match=field):
        shadow.load_state_dict(state)
    assert shadow.mode == Mode.FP8 and shadow.streak == 0  # unchanged


# (field, bad value)
CONFIG_CASES = [
    ("interval", 0), ("interval", 1.5), ("patience", 0), ("recover_after", 0), ("threshold", 0.0),
    ("threshold", -1.0), ("threshold", math.inf), ("grad_cosine_min", 2.0), ("reference_dtype", "int8"),
]


@pytest.mark.parametrize("field, value", CONFIG_CASES, ids=[f"{f}={v}" for f, v in CONFIG_CASES])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        ShadowConfig(**{field: value})


def test_config_is_frozen_and_derivable():
    config = ShadowConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.interval = 5
    assert dataclasses.replace(config, interval=5).interval == 5


# (name, a, b, expected cosine)
COSINE_CASES = [
    ("same", [torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(2)], 1.0),
    ("opposite", [torch.ones(3)], [-torch.ones(3)], -1.0),
    ("orthogonal", [torch.tensor([1.0, 0.0])], [torch.tensor([0.0, 1.0])], 0.0),
    ("None is zero", [torch.ones(2), None], [torch.ones(2), torch.ones(2)], 2 / (math.sqrt(2) * 2)),
]


@pytest.mark.parametrize("name, a, b, expected", COSINE_CASES, ids=[c[0] for c in COSINE_CASES])
def test_grad_cosine(name, a, b, expected):
    assert grad_cosine(a, b) == pytest.approx(expected)
    assert math.isnan(grad_cosine([torch.zeros(2)], [torch.ones(2)]))
