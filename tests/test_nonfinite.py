"""inf and NaN through FP8 training, stage by stage, as docs/fp8.md ("Non-finite values") describes it.

The stages: the cast (saturating: ±inf -> ±max, NaN stays NaN; the block falls back to scale 1), the amax history and
scale (a non-finite amax never enters; `nonfinite` counts the cast), the GEMM output, the loss and the gradients
(finite for a saturated inf, NaN for NaN), the loss scaler (parameter gradients only), StepGuard
(`nonfinite_fp8_operand`, state bitwise restored) and telemetry's non-finite column.

Models are small MLPs of Fp8Linear layers (every layer FP8: keep_first_last=False); the bad value goes into one
element of the first layer's input or of the gradient arriving at the last layer's output (its grad_output cast).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.utils.checkpoint import checkpoint

import minifloat as mf
from minifloat.amp.scaler import LossScaler
from minifloat.core.skip import SkipReason
from minifloat.fp8 import telemetry
from minifloat.fp8.caster import LayerCaster
from minifloat.fp8.recipes import ROLES, Role
from minifloat.fp8.nonfinite import NonfiniteWatch
from minifloat.fp8.scaling import ScalingState
from minifloat.fp8.step import fp8_step
from minifloat.numerics import compiling
from minifloat.numerics.compiling import compile_enabled, eager_kernels
from minifloat.numerics.granularity import Granularity
from minifloat.numerics.quantize import quantize
from minifloat.safety.guards import GuardConfig, StepGuard, nonfinite_reason
from recipe_cases import RECIPES

SEED = 20261104
D_IN, HIDDEN, D_OUT, BATCH = 64, 128, 64, 16
LR = 1e-2
BAD_AT = (3, 5)  # (token, feature) of the poisoned element
FIRST, LAST = "0", "2"  # the Fp8Linear layers of the MLP, by module name

BAD_VALUES = [("pos-inf", math.inf), ("neg-inf", -math.inf), ("nan", math.nan)]
ALL_RECIPES = pytest.mark.parametrize("recipe", [r for _, r in RECIPES], ids=[n for n, _ in RECIPES])
BAD = pytest.mark.parametrize("value", [v for _, v in BAD_VALUES], ids=[n for n, _ in BAD_VALUES])
COMPILED = {"delayed"}  # the others run with -m slow (a cold compile costs 10-40 s; MX alone took 18 s of the default tier)


def with_compiled_kernels(test):
    """Run `test` with minifloat's compiled kernels; the other tests here run them eagerly (compiled and eager kernels
    agree bitwise, tests/test_quantize.py) and pay no compile time. A compiled model inlines them either way."""
    test.compiled_kernels = True
    return test


@pytest.fixture(autouse=True)
def _kernels(request, monkeypatch):
    if getattr(request.function, "compiled_kernels", False):
        monkeypatch.setattr(compiling, "EAGER_BELOW", 0)  # this test's small tensors would run eagerly
        yield
        return
    with eager_kernels():
        yield


def make_model(recipe, *, bias: bool = True) -> nn.Module:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN, bias=bias), nn.ReLU(), nn.Linear(HIDDEN, D_OUT, bias=bias))
    return mf.convert(model, recipe=recipe, keep_first_last=False)


def get_batch(position: int, *, bad_input: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + position)
    x = torch.randn(BATCH, D_IN, generator=gen)
    y = torch.sin(x)
    if bad_input is not None:
        x[BAD_AT] = bad_input
    return x, y


def poison_grad_output(layer: nn.Module, value: float):
    """Put `value` into the gradient arriving at `layer`'s output, i.e. into its backward's grad_output cast."""
    def put(grad):
        grad = grad.clone()
        grad[BAD_AT] = value
        return grad

    def on_output(_module, _args, out):
        out.register_hook(put)  # returns None: the output itself stays as it is

    return layer.register_forward_hook(on_output)


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters, buffers (the FP8 scaling state) and optimizer state, cloned."""
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return state


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"changed: {differ}"


def assert_scaling_state_finite(model: nn.Module) -> None:
    for name, state in model.named_modules():
        if hasattr(state, "amax_history"):
            assert torch.isfinite(state.amax_history).all(), f"{name}.amax_history holds inf/NaN"
            assert torch.isfinite(state.scale).all() and (state.scale > 0).all(), f"{name}.scale is not finite"


def guarded_step(model, forward, guard, optimizer, step, x, y):
    """One step of the documented plain loop (docs/policy.md): begin_step, forward, backward, check, step or skip."""
    guard.begin_step(step, data_position=step)
    loss = nn.functional.mse_loss(forward(x), y)
    loss.backward()
    report = guard.check(loss)
    if not report.skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return report


def bad_step_is_skipped_and_harmless(model, forward, *, bad_input=None, bad_grad=None):
    """A clean step, a bad one, a clean one under StepGuard; returns the bad step's report after checking that the
    skip left the training state bitwise alone and that the next finite step was applied."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    guard = StepGuard(model, optimizer, config=GuardConfig(spike_signals=()))
    assert not guarded_step(model, forward, guard, optimizer, 0, *get_batch(0)).skipped  # seeds scales, Adam state

    before = training_state(model, optimizer)
    hook = poison_grad_output(model[int(LAST)], bad_grad) if bad_grad is not None else None
    report = guarded_step(model, forward, guard, optimizer, 1, *get_batch(1, bad_input=bad_input))
    if hook is not None:
        hook.remove()
    assert report.skipped
    assert_bitwise_equal(training_state(model, optimizer), before)

    after = guarded_step(model, forward, guard, optimizer, 2, *get_batch(2))
    assert not after.skipped and math.isfinite(after.loss)
    now = training_state(model, optimizer)
    assert not torch.equal(now[f"model.{FIRST}.weight"], before[f"model.{FIRST}.weight"])  # the update was applied
    assert all(torch.equal(now[k], before[k]) for k in now if k.endswith("fp8_state.nonfinite"))
    assert_scaling_state_finite(model)
    return report


# ---------------------------------------------------------------------------------------------------- the cast


@ALL_RECIPES
@pytest.mark.parametrize("role", [Role.INPUT, Role.GRAD_OUTPUT], ids=["input", "grad_output"])  # E4M3; E5M2 (hybrid)
@BAD
def test_cast_saturates_inf_keeps_nan_and_never_records_it(recipe, role, value):
    caster = LayerCaster(recipe, ScalingState())
    clean, _ = get_batch(0)
    bad, _ = get_batch(1, bad_input=value)
    bad[0, 0] = value  # two bad elements, one cast
    fmt, col = recipe.spec(role).fmt, ROLES.index(role)

    def check(q, expected_scale):
        got, block_scale = q.dequantize()[BAD_AT], q.expanded_scale().expand(bad.shape)[BAD_AT]
        assert block_scale == expected_scale
        assert math.isnan(got) if math.isnan(value) else got == math.copysign(fmt.max, value) * block_scale
        assert torch.isfinite(q.dequantize()).sum() == bad.numel() - (2 if math.isnan(value) else 0)

    # first cast: no finite scale fits the amax, so the block holding the value falls back to 1 (2^0 for E8M0) and a
    # delayed role stays unseeded
    check(caster.cast(role, bad, keep_data=True), 1.0)
    assert not caster.state.initialized[col] and caster.state.nonfinite[col] == 1
    assert not caster.state.amax_history.any()

    caster.cast(role, clean)  # finite: seeds a delayed role
    seeded = caster.state.amax_history.clone()
    q = caster.cast(role, bad, keep_data=True)
    check(q, 1.0 / caster.state.scale[col] if recipe.delayed else 1.0)  # delayed: the stored scale, in float32
    assert caster.state.nonfinite[col] == 2 and torch.equal(caster.state.amax_history, seeded)
    assert torch.isfinite(caster.state.scale).all()


@pytest.mark.skipif(not compile_enabled(), reason="MINIFLOAT_COMPILE disables torch.compile")
@BAD
@with_compiled_kernels
def test_compiled_kernels_propagate_nonfinite_amaxes(value):
    x, _ = get_batch(0, bad_input=value)
    for granularity in Granularity:
        q = quantize(x, mf.E4M3, granularity=granularity)
        assert not torch.isfinite(q.amax).all(), granularity
    q = quantize(x, mf.E4M3, scale=torch.tensor(0.01))  # the delayed path: the amax comes from the cast's own pass
    assert not torch.isfinite(q.amax).all()


# ---------------------------------------------------------------------------------------------------- scaling state


@ALL_RECIPES
@pytest.mark.parametrize("where", ["input", "grad_output"])
@BAD
def test_history_and_scales_never_hold_nonfinite_values(recipe, where, value):
    model = make_model(recipe)
    watch = NonfiniteWatch(model)
    for step in range(4):  # step 0 meets the bad value before any scale is seeded; the FP8 step ends each time
        watch.mark()
        bad = step in (0, 2)
        hook = poison_grad_output(model[int(LAST)], value) if bad and where == "grad_output" else None
        x, y = get_batch(step, bad_input=value if bad and where == "input" else None)
        nn.functional.mse_loss(model(x), y).backward()
        if hook is not None:
            hook.remove()
        layer = FIRST if where == "input" else LAST
        met = watch.operands(watch.rises().flatten().tolist())
        assert ((layer, Role(where)) in met) == bad
        fp8_step(model)
        model.zero_grad(set_to_none=True)
        assert_scaling_state_finite(model)
    assert all(s.initialized.all() for s in (model[0].fp8_state, model[2].fp8_state)) or not recipe.delayed


# ---------------------------------------------------------------------------------------------------- GEMM, loss, grads


@ALL_RECIPES
@BAD
def test_gemm_output_loss_and_gradients(recipe, value):
    model = make_model(recipe)
    x, y = get_batch(0, bad_input=value)
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    if math.isnan(value):  # NaN survives the cast: its token's output row is NaN, and so the loss and the gradients
        token = BAD_AT[0]
        assert out[token].isnan().all() and torch.isfinite(torch.cat([out[:token], out[token + 1:]])).all()
        assert loss.isnan() and grads.isnan().any()
    else:  # the saturated ±inf is a large finite operand: nothing downstream is non-finite
        assert torch.isfinite(out).all() and torch.isfinite(loss) and torch.isfinite(grads).all()


@ALL_RECIPES
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_inf_output_gradient_is_saturated_by_the_backward_cast(recipe, bias):
    model = make_model(recipe, bias=bias)
    hook = poison_grad_output(model[int(LAST)], math.inf)
    x, y = get_batch(0)
    x.requires_grad_(True)
    nn.functional.mse_loss(model(x), y).backward()
    hook.remove()
    assert torch.isfinite(model[2].weight.grad).all() and torch.isfinite(x.grad).all()  # dgrad, wgrad: saturated
    if bias:
        assert torch.isinf(model[2].bias.grad).any()  # db = Σ dy in high precision


# ---------------------------------------------------------------------------------------------------- the loss scaler


@BAD
def test_loss_scaler_sees_only_parameter_gradients(value):
    model = make_model(mf.DelayedScaling(), bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = LossScaler(init_scale=2.0**4)
    x, y = get_batch(0, bad_input=value)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    # a saturated inf left every gradient finite: no overflow to see; NaN reaches the gradients
    assert scaler.step(optimizer).stepped == (not math.isnan(value))


# ---------------------------------------------------------------------------------------------------- StepGuard


# (name, loss, grad_norm, FP8 operands that met NaN/inf, expected reason): the first place, in the step's order
REASONS = [
    ("finite", 1.0, 1.0, (), None),
    ("loss", math.nan, math.nan, (), SkipReason.NONFINITE_LOSS),
    ("grad", 1.0, math.inf, (), SkipReason.NONFINITE_GRAD),
    ("input-hidden", 1.0, 1.0, (("a", Role.INPUT),), SkipReason.NONFINITE_FP8_OPERAND),
    ("weight-hidden", 1.0, 1.0, (("a", Role.WEIGHT),), SkipReason.NONFINITE_FP8_OPERAND),
    ("input-before-loss", math.nan, math.nan, (("a", Role.INPUT),), SkipReason.NONFINITE_FP8_OPERAND),
    ("loss-before-grad-output", math.nan, math.nan, (("a", Role.GRAD_OUTPUT),), SkipReason.NONFINITE_LOSS),
    ("grad-output-hidden", 1.0, 1.0, (("a", Role.GRAD_OUTPUT),), SkipReason.NONFINITE_FP8_OPERAND),
    ("grad-output-before-bias-grad", 1.0, math.inf, (("a", Role.GRAD_OUTPUT),), SkipReason.NONFINITE_FP8_OPERAND),
]


@pytest.mark.parametrize("loss, grad_norm, operands, expected", [c[1:] for c in REASONS], ids=[c[0] for c in REASONS])
def test_nonfinite_reason_names_the_first_bad_place(loss, grad_norm, operands, expected):
    assert nonfinite_reason(loss, grad_norm, operands) == expected


@ALL_RECIPES
@BAD
def test_guard_skips_a_nonfinite_fp8_input(recipe, value, caplog):
    model = make_model(recipe)
    with caplog.at_level("WARNING", logger="minifloat"):
        report = bad_step_is_skipped_and_harmless(model, model, bad_input=value)
    assert report.reason == SkipReason.NONFINITE_FP8_OPERAND
    assert report.nonfinite_operands[0] == (FIRST, Role.INPUT)
    assert math.isfinite(report.loss) == (not math.isnan(value))  # a saturated inf leaves the loss finite
    assert any("nonfinite_fp8_operand" in m and f"{FIRST} (input)" in m for m in caplog.messages)


@ALL_RECIPES
@BAD
def test_guard_skips_a_nonfinite_gradient_at_a_backward_cast(recipe, value):
    model = make_model(recipe, bias=False)
    report = bad_step_is_skipped_and_harmless(model, model, bad_grad=value)
    assert report.reason == SkipReason.NONFINITE_FP8_OPERAND
    assert (LAST, Role.GRAD_OUTPUT) in report.nonfinite_operands
    if not math.isnan(value):  # saturated: it goes no further down, and nothing but the count shows it
        assert report.nonfinite_operands == ((LAST, Role.GRAD_OUTPUT),)
        assert math.isfinite(report.loss) and math.isfinite(report.grad_norm) and report.bad_params == ()


def test_guard_names_the_bias_gradient_next_to_the_bad_output_gradient():
    model = make_model(mf.DelayedScaling())
    report = bad_step_is_skipped_and_harmless(model, model, bad_grad=math.inf)
    assert report.reason == SkipReason.NONFINITE_FP8_OPERAND
    assert report.bad_params == (f"{LAST}.bias",) and math.isinf(report.grad_norm)


def test_guard_in_the_reference_loops_order_with_a_loss_scaler():
    """minifloat.training.loop's order: begin_step, forward, scaled backward, unscale_, check, then step or skip, and
    the scaler's update either way."""
    model = make_model(mf.DelayedScaling())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = LossScaler(init_scale=2.0**4)
    guard = StepGuard(model, optimizer, stateful={"scaler": scaler}, config=GuardConfig(spike_signals=()))
    reports, before = [], None
    for step, bad in enumerate((None, math.inf, None)):
        if bad is not None:
            before = training_state(model, optimizer)
        guard.begin_step(step, data_position=step)
        x, y = get_batch(step, bad_input=bad)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        reports.append(guard.check(loss))
        if not reports[-1].skipped:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if bad is not None:
            assert_bitwise_equal(training_state(model, optimizer), before)
    assert [r.reason for r in reports] == [None, SkipReason.NONFINITE_FP8_OPERAND, None]


def test_guard_catches_a_bad_micro_batch_of_an_accumulated_step():
    model = make_model(mf.CurrentScaling())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    guard = StepGuard(model, optimizer, config=GuardConfig(spike_signals=()))
    guard.begin_step(0)  # once per optimizer step, before the first micro-batch
    losses = []
    for micro, bad in enumerate((math.inf, None)):
        x, y = get_batch(micro, bad_input=bad)
        losses.append(nn.functional.mse_loss(model(x), y) / 2)
        losses[-1].backward()
    report = guard.check(sum(losses).detach())
    assert report.skipped and report.reason == SkipReason.NONFINITE_FP8_OPERAND


@pytest.mark.parametrize("reentrant, counted", [(False, 2), (True, 1)], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recompute_counts_a_cast_again(reentrant, counted):
    model = make_model(mf.DelayedScaling())
    watch = NonfiniteWatch(model)
    watch.mark()
    x, y = get_batch(0, bad_input=math.inf)
    nn.functional.mse_loss(checkpoint(model, x.requires_grad_(True), use_reentrant=reentrant), y).backward()
    assert watch.rises()[0].tolist() == [counted, 0, 0]  # reentrant: the first forward runs without grad, unrecorded


@ALL_RECIPES
def test_one_count_per_recording_cast(recipe):
    model = make_model(recipe)
    watch = NonfiniteWatch(model)
    watch.mark()
    hook = poison_grad_output(model[int(LAST)], math.inf)
    x, y = get_batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    hook.remove()
    # the backward's transposed re-quantizations of dy (row, tile, MX recipes) record nothing
    assert watch.rises().tolist() == [[0, 0, 0], [0, 0, 1]]
    model.eval()
    with torch.no_grad():
        model(get_batch(1, bad_input=math.inf)[0])  # evaluation records nothing
    assert watch.rises().tolist() == [[0, 0, 0], [0, 0, 1]]


def test_nonfinite_watch_names_layers_in_module_order():
    model = make_model(mf.DelayedScaling())
    watch = NonfiniteWatch(model)
    with pytest.raises(RuntimeError, match="mark"):
        watch.rises()
    watch.mark()
    assert watch.rises().shape == (2, len(ROLES)) and not watch.rises().any()
    assert watch.operands([0, 1, 0, 2, 0, 3]) == ((FIRST, Role.WEIGHT), (LAST, Role.INPUT), (LAST, Role.GRAD_OUTPUT))
    plain = NonfiniteWatch(nn.Linear(4, 4))
    plain.mark()
    assert plain.rises().shape == (0, len(ROLES)) and plain.operands([]) == ()


@pytest.mark.parametrize("recipe", [pytest.param(r, id=n, marks=() if n in COMPILED else pytest.mark.slow)
                                    for n, r in RECIPES])
def test_guard_skips_a_nonfinite_input_of_a_compiled_model(recipe):
    torch._dynamo.reset()
    model = make_model(recipe)
    try:
        report = bad_step_is_skipped_and_harmless(model, torch.compile(model, fullgraph=True), bad_input=math.inf)
    finally:
        torch._dynamo.reset()
    assert report.reason == SkipReason.NONFINITE_FP8_OPERAND and report.nonfinite_operands == ((FIRST, Role.INPUT),)


# ---------------------------------------------------------------------------------------------------- telemetry


def test_telemetry_counts_nonfinite_elements_and_outlives_the_skip():
    model = make_model(mf.DelayedScaling())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    guard = StepGuard(model, optimizer, config=GuardConfig(spike_signals=()))
    x, y = get_batch(0, bad_input=math.inf)
    x[0, 0] = math.nan
    with telemetry.capture() as tel:
        report = guarded_step(model, model, guard, optimizer, 0, x, y)
    assert report.skipped
    first_input = [r for r in tel.records if r.layer == model[0].fp8_name and r.role == "input"]
    assert [r.nonfinite for r in first_input] == [2]  # elements, not casts: the inf and the NaN
    assert model[0].fp8_state.nonfinite.tolist() == [0, 0, 0]  # the guard restored the counter with the state


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.CurrentScaling(), mf.CurrentScaling(granularity="row")],
                         ids=["delayed", "current", "row"])
def test_a_nonfinite_input_on_the_cpu_is_said_once(caplog, recipe):
    """On the CPU a cast that meets inf says so once per layer (a GPU leaves it to NonfiniteWatch, which reads the
    counters without a sync per cast), whether the cast recorded its amax itself (per tensor) or through `record`
    (rows); the history keeps only finite amaxes and the counter counts each such cast."""
    torch.manual_seed(SEED)
    layer = mf.Fp8Linear(D_IN, D_OUT, recipe=recipe)
    x = torch.randn(BATCH, D_IN)
    bad = x.clone()
    bad[BAD_AT] = math.inf
    with eager_kernels(), caplog.at_level("WARNING", logger="minifloat"):
        for inputs in (x, bad, bad):
            layer(inputs)
    said = [r for r in caplog.records if "non-finite values in the input of an FP8 layer" in r.getMessage()]
    assert len(said) == 1
    col = ROLES.index(Role.INPUT)
    assert int(layer.fp8_state.nonfinite[col]) == 2
    assert float(layer.fp8_state.amax_history[0, col]) == float(x.abs().amax())


def test_a_cached_weight_cast_is_recorded_once_per_step(monkeypatch):
    """A later micro-batch reuses the step's weight cast without recording it again (its amax is already in this
    step's row); the next step's first forward casts and records it anew."""
    from minifloat.fp8 import caster

    recorded = []
    real = caster.quantize

    def spy(t, *args, record=None, **kwargs):
        if record is not None:
            recorded.append(tuple(t.shape))
        return real(t, *args, record=record, **kwargs)

    monkeypatch.setattr(caster, "quantize", spy)
    monkeypatch.setattr(ScalingState, "record", lambda self, role, amax: recorded.append(role))  # any other route
    layer = mf.Fp8Linear(D_IN, D_OUT, recipe=mf.DelayedScaling(), bias=False)
    x = torch.randn(BATCH, D_IN)
    with eager_kernels():
        layer(x)
        layer(x.clone())  # a second micro-batch: x recorded again, the cached weight not
        fp8_step(layer)
        layer(x.clone())  # (new tensors: the same one would take its own earlier cast, minifloat.fp8.shared_input)
    weight = (D_OUT, D_IN)
    assert recorded == [(BATCH, D_IN), weight, (BATCH, D_IN), (BATCH, D_IN), weight]


def test_the_nonfinite_warning_names_the_layer(caplog):
    torch.manual_seed(SEED)
    model = mf.convert(nn.Sequential(nn.Linear(D_IN, D_IN), nn.Linear(D_IN, D_IN), nn.Linear(D_IN, D_OUT)),
                       recipe=mf.CurrentScaling(), keep_first_last=False)
    bad = torch.randn(BATCH, D_IN)
    bad[BAD_AT] = math.inf
    with eager_kernels(), caplog.at_level("WARNING", logger="minifloat"):
        model(bad)
    assert any("non-finite values in the input of layer '0'" in r.getMessage() for r in caplog.records)
