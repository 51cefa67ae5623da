"""Tests for minifloat.amp.scaler: GradScaler equivalence, hysteresis, bounds, records, state and the disabled no-op.

The reference for the scale sequence is torch.amp.GradScaler itself (device "cpu"), run on the same gradients; the
reference for hysteresis is Megatron-LM's DynamicGradScaler.update (megatron/core/optimizer/grad_scaler.py): an
overflow decrements a tracker that starts at `hysteresis` and backs off when it reaches 0; only a growth refills it.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.amp.scaler import LossScaler, SkipReason, StepRecord
from minifloat.amp.unscale import check_and_unscale_, check_and_unscale_fallback
from minifloat.fp8.recipes import Role
from minifloat.fp8.scaling import ROLE_INDEX

SEED = 0
INF = float("inf")
NAN = float("nan")
SMALL_INTERVAL = 3  # growth_interval short enough to see several growths in a 20-step run
# Steps (0-based) whose gradients get an inf: single overflows, back-to-back ones, and one right after a growth.
OVERFLOW_STEPS = {2, 3, 7, 11, 12, 13}
N_STEPS = 20


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(SEED)


def _model(dtype=torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    dtype = next(model.parameters()).dtype
    x = torch.randn(16, 4, generator=g).to(dtype)
    return model(x).float().pow(2).mean()


def _poison(model: nn.Module, value: float = INF) -> None:
    """Put a non-finite value into one gradient (as an fp16 overflow in backward would)."""
    model[2].weight.grad[0, 0] = value


def _drive(scaler: LossScaler, overflows: list[bool]) -> tuple[list[float], list[StepRecord]]:
    """Run one step per flag on a one-parameter optimizer; return the scale after each update() and the records."""
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scales, records = [], []
    for overflow in overflows:
        p.grad = torch.tensor([INF if overflow else 1.0, 1.0])
        records.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, records


# ---------------------------------------------------------------------------------------------- GradScaler parity

# (name, growth_factor, backoff_factor, optimizer, unscale_ and clip before step)
PARITY = [
    ("torch-defaults-sgd", 2.0, 0.5, "sgd", False),
    ("torch-defaults-adamw-clip", 2.0, 0.5, "adamw", True),
    ("odd-factors-adamw", 1.7, 0.3, "adamw", False),  # non-powers of two: float32 rounding of the scale matters
]


@pytest.mark.parametrize("growth, backoff, opt_name, clip", [c[1:] for c in PARITY], ids=[c[0] for c in PARITY])
def test_scale_sequence_and_parameters_match_grad_scaler(growth, backoff, opt_name, clip):
    ours_model = _model()
    ref_model = copy.deepcopy(ours_model)
    make = {
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        "adamw": lambda m: torch.optim.AdamW(m.parameters()),
    }
    ours_opt, ref_opt = make[opt_name](ours_model), make[opt_name](ref_model)
    kwargs = dict(growth_factor=growth, backoff_factor=backoff, growth_interval=SMALL_INTERVAL)
    ours = LossScaler(**kwargs)
    ref = torch.amp.GradScaler("cpu", **kwargs)

    seen_growth = seen_backoff = False
    for step in range(N_STEPS):
        before = ours.get_scale()
        for scaler, model, opt in ((ours, ours_model, ours_opt), (ref, ref_model, ref_opt)):
            opt.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            if step in OVERFLOW_STEPS:
                _poison(model)
            if clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == ref.get_scale(), f"step {step}"
        seen_growth |= ours.get_scale() > before
        seen_backoff |= ours.get_scale() < before
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), f"step {step}"
    assert seen_growth and seen_backoff  # the run exercised both branches


# ------------------------------------------------------------------------------------------------------ hysteresis

# (name, hysteresis, overflow flags, expected scale after each update) with init 1024, interval 4, factors 2 / 0.5
HYSTERESIS = [
    ("h1-every-overflow-backs-off", 1, [1, 0, 1], [512, 512, 256]),
    ("h3-two-overflows-tolerated", 3, [1, 1, 0], [1024, 1024, 1024]),
    ("h3-third-overflow-backs-off", 3, [1, 1, 1], [1024, 1024, 512]),
    ("h3-budget-spent-every-overflow-backs-off", 3, [1, 1, 1, 1], [1024, 1024, 512, 256]),
    ("h3-finite-steps-do-not-refill", 3, [1, 1, 0, 0, 1], [1024, 1024, 1024, 1024, 512]),
    ("h3-growth-refills", 3, [1, 1, 0, 0, 0, 0, 1, 1, 1],
     [1024, 1024, 1024, 1024, 1024, 2048, 2048, 2048, 1024]),
    ("h2-overflow-resets-growth-count", 2, [0, 0, 0, 1, 0, 0, 0, 0],
     [1024, 1024, 1024, 1024, 1024, 1024, 1024, 2048]),
]


@pytest.mark.parametrize("hysteresis, flags, expected", [c[1:] for c in HYSTERESIS], ids=[c[0] for c in HYSTERESIS])
def test_hysteresis_follows_megatron(hysteresis, flags, expected):
    scaler = LossScaler(init_scale=1024.0, growth_interval=4, hysteresis=hysteresis)
    scales, records = _drive(scaler, [bool(f) for f in flags])
    assert scales == expected
    # every overflowing step is skipped, whether or not the scale backs off
    assert [not r.stepped for r in records] == [bool(f) for f in flags]


# (name, options, overflow flags, expected scales)
BOUNDS = [
    ("min-scale-floor", dict(init_scale=512.0, min_scale=256.0), [1, 1, 1], [256, 256, 256]),
    ("max-scale-ceiling", dict(init_scale=1024.0, max_scale=2048.0, growth_interval=1), [0, 0, 0], [2048, 2048, 2048]),
    ("ceiling-not-a-power-of-growth", dict(init_scale=1024.0, max_scale=1500.0, growth_interval=1),
     [0, 1], [1500, 750]),
]


@pytest.mark.parametrize("options, flags, expected", [c[1:] for c in BOUNDS], ids=[c[0] for c in BOUNDS])
def test_scale_is_clamped_to_bounds(options, flags, expected):
    scales, _ = _drive(LossScaler(**options), [bool(f) for f in flags])
    assert scales == expected


# ------------------------------------------------------------------------------------------------- skips and records


def test_skipped_step_leaves_adamw_parameters_and_state_bitwise_unchanged():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = LossScaler(model=model)
    for step in range(2):  # populate AdamW's moments
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        assert scaler.step(opt).stepped
        scaler.update()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())

    opt.zero_grad()
    scaler.scale(_loss(model, 2)).backward()
    _poison(model, NAN)
    assert not scaler.step(opt).stepped
    scaler.update()

    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = opt.state_dict()
    for key, s in state["state"].items():
        for name, value in s.items():
            assert torch.equal(value, after["state"][key][name]), (key, name)


def _named_setups():
    """(name, scaler options builder, expected name of model[2].weight)"""
    return [
        ("model", lambda m: dict(model=m), "2.weight"),
        ("param-names", lambda m: dict(param_names={"head.w": m[2].weight}), "head.w"),
        ("unnamed", lambda m: {}, "group0.param2"),
    ]


@pytest.mark.parametrize("options, expected", [c[1:] for c in _named_setups()], ids=[c[0] for c in _named_setups()])
def test_record_names_the_nonfinite_parameter_and_warns(options, expected, caplog):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(**options(model))
    scaler.scale(_loss(model, 0)).backward()
    _poison(model)
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        record = scaler.step(opt)
    assert record == StepRecord(
        stepped=False, scale=2.0**16, reason=SkipReason.NONFINITE_GRAD.value, nonfinite_params=(expected,)
    )
    assert any("skipped" in r.getMessage() and expected in r.getMessage() for r in caplog.records)


def test_multiple_optimizers_are_checked_separately_and_back_off_once():
    model = _model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler = LossScaler(model=model, growth_interval=SMALL_INTERVAL)
    a_before = model[0].weight.detach().clone()
    b_before = model[2].weight.detach().clone()

    scaler.scale(_loss(model, 0)).backward()
    _poison(model)  # in opt_b's parameters only
    rec_a, rec_b = scaler.step(opt_a), scaler.step(opt_b)
    scaler.update()

    assert rec_a.stepped and not torch.equal(a_before, model[0].weight)  # as GradScaler: A's own grads are finite
    assert not rec_b.stepped and rec_b.nonfinite_params == ("2.weight",)
    assert torch.equal(b_before, model[2].weight)
    assert scaler.get_scale() == 2.0**15

    # both overflow in one iteration: still one back-off (one update per iteration)
    for opt in (opt_a, opt_b):
        opt.zero_grad()
    scaler.scale(_loss(model, 1)).backward()
    model[0].weight.grad[0, 0] = INF
    _poison(model)
    assert not scaler.step(opt_a).stepped and not scaler.step(opt_b).stepped
    scaler.update()
    assert scaler.get_scale() == 2.0**14


# ----------------------------------------------------------------------------------------- unscale_, dtypes, kernel


def test_unscale_then_clip_then_step_and_misuse_raises():
    model = _model()
    reference = copy.deepcopy(model)
    _loss(reference, 0).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()

    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(opt)
    # the scale is a power of two and nothing over/underflows in fp32: unscaling is exact
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, r.grad)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert scaler.step(opt).stepped
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="before any"):
        scaler.update()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_gradients_unscaled_in_fp32_and_overflow_skips(dtype):
    model = _model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(model=model, init_scale=2.0**10)
    scaler.scale(_loss(model, 0)).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    for p, g in zip(model.parameters(), scaled):
        assert p.grad.dtype == dtype
        assert torch.equal(p.grad, (g.float() * 2.0**-10).to(dtype))  # one rounding from fp32
    assert scaler.step(opt).stepped
    scaler.update()

    opt.zero_grad()
    # a loss large enough to overflow the scaled fp16 gradients in backward (bf16 gets the inf injected)
    loss = _loss(model, 1) * (2.0**20 if dtype == torch.float16 else 1.0)
    scaler.scale(loss).backward()
    if dtype == torch.bfloat16:
        _poison(model)
    record = scaler.step(opt)
    scaler.update()
    assert not record.stepped and record.nonfinite_params
    assert scaler.get_scale() == 2.0**9


def test_a_skipped_step_leaves_no_amax_in_the_fp8_history():
    """An overflowing loss-scaled backward can record finite but inflated output-gradient amaxes before a gradient
    overflows. The step is skipped (no FP8 step end), so those amaxes stayed in row 0 and entered the next step's
    scales. The scaler drops them: row 0 holds the forward's amaxes only, and the next step's scales equal those of
    a run that never met the bad batch."""
    def run(bad: bool):
        torch.manual_seed(0)
        model = mf.convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                         nn.Linear(64, 16)), recipe=mf.DelayedScaling(), keep_first_last=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights never move: the scales depend on data only
        scaler = LossScaler.for_dtype(torch.float16, model=model)
        x = torch.randn(8, 32)
        for mult in [1.0, 1e4, 1.0] if bad else [1.0, 1.0]:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x) * mult).float().square().mean()
            scaler.scale(loss).backward()
            record = scaler.step(opt)
            if mult != 1.0:
                assert not record.stepped
                rows = [m.fp8_state.amax_history[0] for m in mf.fp8_layers(model)]
                assert all(r[ROLE_INDEX[Role.GRAD_OUTPUT]] == 0 for r in rows), "the backward's amaxes stayed"
                assert all(r[ROLE_INDEX[Role.INPUT]] > 0 for r in rows), "the forward's amaxes are kept"
            scaler.update()
            scaler.update(new_scale=2.0**16)  # the same loss scale in both runs after the skip
            opt.zero_grad()
        return [m.fp8_state.scale.clone() for m in mf.fp8_layers(model)]
    for clean, after_skip in zip(run(False), run(True)):
        assert torch.equal(clean, after_skip)


# (name, dtype) — the dtypes whose kernel path the fallback must reproduce bit for bit
KERNEL_DTYPES = [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)]


@pytest.mark.parametrize("dtype", [c[1] for c in KERNEL_DTYPES], ids=[c[0] for c in KERNEL_DTYPES])
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "inf"])
def test_fallback_matches_foreach_kernel(dtype, poison):
    grads = [torch.randn(33).to(dtype) * 1000, torch.randn(5, 7).to(dtype)]
    if poison:
        grads[1][2, 3] = INF
    inv = 1.0 / 3.0
    kernel = [g.clone() for g in grads]
    fallback = [g.clone() for g in grads]
    found_kernel = check_and_unscale_(kernel, inv)
    found_fallback = torch.zeros(())
    check_and_unscale_fallback(fallback, found_fallback, torch.full((), inv, dtype=torch.float32))
    assert found_kernel.item() == found_fallback.item() == float(poison)
    for a, b in zip(kernel, fallback):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_scale_keeps_container_types():
    scaler = LossScaler(init_scale=4.0)
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    assert scaler.scale(a).item() == 4.0
    nested = scaler.scale((a, [b]))
    assert isinstance(nested, tuple) and isinstance(nested[1], list) and nested[1][0].item() == 8.0
    assert [t.item() for t in scaler.scale(t for t in (a, b))] == [4.0, 8.0]
    # a 0-d fp16 loss is scaled in fp32 so loss * scale cannot overflow fp16 (as GradScaler)
    assert LossScaler().scale(torch.tensor(2.0, dtype=torch.float16)).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------- state_dict


def test_state_dict_round_trip_continues_identical_sequence():
    flags = [bool(f) for f in (0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0)]
    options = dict(init_scale=1024.0, growth_interval=SMALL_INTERVAL, hysteresis=2, min_scale=4.0, max_scale=2.0**12)
    reference, _ = _drive(LossScaler(**options), flags)

    first = LossScaler(**options)
    head, _ = _drive(first, flags[:6])
    state = first.state_dict()
    assert all(type(v) in (int, float) for v in state.values()), state
    resumed = LossScaler()  # defaults: every option must come from the state dict
    resumed.load_state_dict(state)
    tail, _ = _drive(resumed, flags[6:])
    assert head + tail == reference
    assert resumed.state_dict() == _final_state(options, flags)


def _final_state(options, flags):
    scaler = LossScaler(**options)
    _drive(scaler, flags)
    return scaler.state_dict()


def test_loads_grad_scaler_state_dict():
    ref = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    ref.scale(torch.tensor(1.0))  # GradScaler initializes its scale lazily
    scaler = LossScaler(hysteresis=2)
    scaler.load_state_dict(ref.state_dict())
    assert scaler.get_scale() == 512.0 and scaler.config.growth_interval == 7 and scaler.config.hysteresis == 2
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})


@pytest.mark.parametrize("scale, fix", [(2.0**26, "max_scale=2.0\\*\\*26"), (0.25, "min_scale=0.25")])
def test_a_grad_scaler_state_beyond_the_bounds_names_the_bound(scale, fix):
    # a GradScaler's scale is unbounded (long runs grow past 2^24): the error named init_scale, never passed
    state = torch.amp.GradScaler("cpu", init_scale=scale).state_dict()
    with pytest.raises(ValueError, match=f"loaded scale .* outside .* {fix}"):
        LossScaler().load_state_dict(state)
    roomy = LossScaler(max_scale=2.0**26, min_scale=0.25)
    roomy.load_state_dict(state)
    assert roomy.get_scale() == scale


def test_step_without_gradients_is_refused_as_grad_scaler_does():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = LossScaler()
    scaler.scale(p.sum())  # backward() forgotten
    with pytest.raises(RuntimeError, match="no parameter of this optimizer has a gradient"):
        scaler.step(opt)
    assert torch.equal(p, torch.ones(2))


# ---------------------------------------------------------------------------------------------------- disabled


def test_disabled_scaler_is_a_noop_that_still_reports(caplog):
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler.for_dtype(torch.bfloat16, model=model)
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}

    loss = _loss(model, 0)
    assert scaler.scale(loss) is loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    scaler.unscale_(opt)  # no once-per-step bookkeeping when disabled
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    before = model[0].weight.detach().clone()
    assert scaler.step(opt) == StepRecord(stepped=True, scale=1.0)
    assert not torch.equal(before, model[0].weight)
    scaler.update()

    _poison(model)
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        record = scaler.step(opt)
    assert record.stepped and record.reason is None and record.nonfinite_params == ("2.weight",)
    assert any("2.weight" in r.getMessage() for r in caplog.records)


# (name, dtype, enabled)
FOR_DTYPE = [
    ("fp16", torch.float16, True),
    ("bf16", torch.bfloat16, False),
    ("fp32", torch.float32, False),
    ("format-fp16", mf.FP16, True),
    ("format-bf16", mf.BF16, False),
]


@pytest.mark.parametrize("dtype, enabled", [c[1:] for c in FOR_DTYPE], ids=[c[0] for c in FOR_DTYPE])
def test_for_dtype(dtype, enabled):
    assert LossScaler.for_dtype(dtype, growth_interval=5).is_enabled() is enabled


def test_for_dtype_rejects_other_dtypes():
    with pytest.raises(ValueError, match="dtype"):
        LossScaler.for_dtype(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------------- validation

# (name, keyword arguments, field the message must name, value the message must show)
INVALID = [
    ("enabled-int", {"enabled": 1}, "enabled", "1"),
    ("init-scale-zero", {"init_scale": 0.0}, "init_scale", "0.0"),
    ("init-scale-inf", {"init_scale": INF}, "init_scale", "inf"),
    ("init-scale-below-min", {"init_scale": 0.5}, "init_scale", "0.5"),
    ("init-scale-above-max", {"init_scale": 2.0**30}, "init_scale", "1073741824.0"),
    ("growth-factor-one", {"growth_factor": 1.0}, "growth_factor", "1.0"),
    ("growth-factor-below-one", {"growth_factor": 0.5}, "growth_factor", "0.5"),
    ("backoff-factor-one", {"backoff_factor": 1.0}, "backoff_factor", "1.0"),
    ("backoff-factor-zero", {"backoff_factor": 0.0}, "backoff_factor", "0.0"),
    ("backoff-factor-negative", {"backoff_factor": -0.5}, "backoff_factor", "-0.5"),
    ("growth-interval-negative", {"growth_interval": -1}, "growth_interval", "-1"),
    ("growth-interval-zero", {"growth_interval": 0}, "growth_interval", "0"),
    ("growth-interval-float", {"growth_interval": 2.5}, "growth_interval", "2.5"),
    ("hysteresis-zero", {"hysteresis": 0}, "hysteresis", "0"),
    ("hysteresis-negative", {"hysteresis": -2}, "hysteresis", "-2"),
    ("min-scale-negative", {"min_scale": -1.0}, "min_scale", "-1.0"),
    ("min-above-max", {"min_scale": 2.0**20, "max_scale": 2.0**10, "init_scale": 2.0**10}, "min_scale", "1048576.0"),
    ("max-scale-above-fp32", {"max_scale": 1e39}, "max_scale", "1e+39"),
]


@pytest.mark.parametrize("kwargs, field, value", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_raises_naming_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError) as info:
        LossScaler(**kwargs)
    message = str(info.value)
    assert message.startswith(field), message
    assert re.search(rf"(?<![\w.-]){re.escape(value)}(?![\w.])", message), message


def test_update_new_scale_sets_and_validates():
    scaler = LossScaler()
    scaler.update(new_scale=128.0)
    assert scaler.get_scale() == 128.0
    scaler.update(new_scale=torch.tensor(256.0))
    assert scaler.get_scale() == 256.0
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=0.5)


class _InfGradient(torch.autograd.Function):
    """Identity forward; backward puts +inf into the first element of the incoming gradient (an fp16 overflow)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


@pytest.mark.parametrize("given_model, backs_off", [(True, True), (False, False)])
def test_an_overflow_saturated_by_an_fp8_backward_cast_backs_off_the_scale(given_model, backs_off):
    """An inf output gradient entering an Fp8Linear's backward is saturated to E5M2's max, so the weight gradient
    stays finite; a scaler given the model still sees the overflow (skips, backs off), one without it cannot."""
    torch.manual_seed(0)
    layer = mf.Fp8Linear(32, 32, bias=False, recipe=mf.CurrentScaling())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0, model=layer if given_model else None)
    before = layer.weight.detach().clone()
    loss = _InfGradient.apply(layer(torch.randn(4, 32))).float().sum()
    scaler.scale(loss).backward()
    assert torch.isfinite(layer.weight.grad).all()  # the saturating cast hid the inf from the gradient
    record = scaler.step(opt)
    scaler.update()
    assert record.stepped is not backs_off
    assert scaler.get_scale() == (512.0 if backs_off else 1024.0)
    assert torch.equal(layer.weight.detach(), before) is backs_off
