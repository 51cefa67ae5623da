"""The FP8 step contract (minifloat.fp8.step): scaling state advances once per optimizer step.

What must hold, bitwise: activation checkpointing (reentrant and not) changes nothing; K micro-batches leave the same
scaling state as one batch of the same data; a layer used twice records once per step; evaluation records nothing;
the plain loop (forward, backward, optimizer.step()) needs no extra call; master-weight optimizers end the step once;
the weight is cast once per step and the cast is dropped when the weight changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.amp.master import MasterWeightOptimizer, MasterWeights
from minifloat.fp8 import step as fp8_step_module
from minifloat.fp8 import telemetry
from minifloat.fp8.recipes import Role
from minifloat.numerics.compiling import eager_kernels
from recipe_cases import RECIPES
from residual_mlp import MLP

RECIPE_IDS = [name for name, _ in RECIPES]
ALL_RECIPES = pytest.mark.parametrize("recipe", [r for _, r in RECIPES], ids=RECIPE_IDS)
DIM, HIDDEN, TOKENS = 128, 256, 64
STEPS = 3


@pytest.fixture(autouse=True)
def _eager():
    with eager_kernels():  # no compile time in unit tests; compiled kernels are checked in test_compile.py
        yield


def make_model(recipe, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return mf.convert(MLP(DIM, HIDDEN, **kwargs), recipe=recipe, keep_first_last=False)


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(TOKENS, DIM, generator=g) * (1 + i) for i in range(n)]  # growing: delayed scales must move


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return (y.float() ** 2).sum() * 2.0**-10  # a sum: a batch's gradient is the sum of its micro-batches' exactly


def fp8_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".fp8_state." in k}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def train(model: nn.Module, data, *, micro: int = 1, bf16: bool = False) -> nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in data:
        for chunk in x.chunk(micro):
            chunk = chunk.clone().requires_grad_(True)  # reentrant checkpointing needs an input that wants grad
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = model(chunk)
            loss_of(y).backward()
        opt.step()
        opt.zero_grad()
    return model


# ---------------------------------------------------------------------------------------------------- checkpointing


@ALL_RECIPES
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_is_bitwise_neutral(recipe, mode):
    data = batches(STEPS)
    plain = train(make_model(recipe), data, bf16=True)
    checkpointed = train(make_model(recipe, checkpoint=mode), data, bf16=True)
    assert_bitwise(plain.state_dict(), checkpointed.state_dict())  # weights and scaling state


# ---------------------------------------------------------------------------------------------------- micro-batches


# K = 1 (the identity) for one recipe; 2 and 4 for every recipe
MICRO_CASES = [pytest.param(k, r, id=f"{k}-{name}") for k in (1, 2, 4) for name, r in RECIPES
               if k > 1 or name == "delayed"]


@pytest.mark.parametrize("micro, recipe", MICRO_CASES)
def test_micro_batches_give_the_scaling_state_of_one_batch(recipe, micro):
    """From the same weights and scales, a step over K micro-batches ends with the scaling state of one step over
    the whole batch.

    Weights are re-synchronised before every step: accumulating K gradients sums in another order than one GEMM,
    so weights agree to rounding only, and this test is about the scaling state. Both runs share step 0, where a
    delayed role is seeded from the first tensor it meets (the first micro-batch). Delayed scales are fixed for the
    step, so every amax agrees; recipes with current scales quantize each micro-batch with its own scales, so only
    what does not depend on that agrees: the weights' amaxes and the first layer's input.
    """
    first, *rest = batches(3)
    whole, split = train(make_model(recipe), [first]), train(make_model(recipe), [first])
    for x in rest:
        split.load_state_dict(whole.state_dict())
        train(whole, [x])
        train(split, [x], micro=micro)
        a, b = fp8_buffers(whole), fp8_buffers(split)
        if recipe.delayed:
            assert_bitwise(a, b)
            continue
        for key in a:
            if key.endswith("amax_history"):
                assert torch.equal(a[key][:, 1], b[key][:, 1]), key  # the weight column
        first_input = "blocks.0.up.fp8_state.amax_history"
        assert torch.equal(a[first_input][:, 0], b[first_input][:, 0])


def test_micro_batches_cast_the_weight_once():
    model = make_model(mf.DelayedScaling())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = batches(1)[0]
    with telemetry.capture() as tel:
        for chunk in x.chunk(4):
            loss_of(model(chunk)).backward()
    weight_casts = [r for r in tel.records if r.role == Role.WEIGHT.value]
    assert len(weight_casts) == len(mf.fp8_layers(model))  # once per layer, not once per micro-batch
    opt.step()
    with telemetry.capture() as tel:
        loss_of(model(x)).backward()
    assert len([r for r in tel.records if r.role == Role.WEIGHT.value]) == len(mf.fp8_layers(model))  # recast


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "uncached"])
def test_block_dgrad_takes_the_forward_weight_cast_transposed(cache, monkeypatch):
    """128×128 block scales transpose exactly, so with the weight cast cached for the step the emulated dgrad reads
    the forward's operand transposed and casts W no second time (test_cached_weight_casts_equal_fresh_ones: the same
    bits); without the cache the backward re-quantizes W, which this spy sees."""
    from minifloat.fp8 import caster as caster_module

    layer = mf.Fp8Linear(DIM, HIDDEN, recipe=mf.BlockScaling(), cache_weight=cache)
    casts = []
    real = caster_module.quantize_t
    monkeypatch.setattr(caster_module, "quantize_t", lambda t, *a, **k: casts.append(t) or real(t, *a, **k))
    loss_of(layer(batches(1)[0].requires_grad_())).backward()  # an input that needs its gradient: dgrad runs
    assert any(t is layer.weight for t in casts) != cache
    assert layer.weight.grad is not None


@ALL_RECIPES
def test_cached_weight_casts_equal_fresh_ones(recipe):
    data = batches(STEPS)
    cached = train(make_model(recipe), data, micro=2)
    fresh = make_model(recipe)
    for layer in mf.fp8_layers(fresh):
        layer.cache_weight = False
    train(fresh, data, micro=2)
    assert_bitwise(cached.state_dict(), fresh.state_dict())


def test_weight_cache_follows_in_place_weight_changes():
    layer = mf.Fp8Linear(DIM, DIM, recipe=mf.CurrentScaling())
    x = batches(1)[0]
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # no optimizer: only the version counter tells the cache
        after = layer(x)
    uncached = copy.deepcopy(layer)
    uncached.cache_weight = False
    with torch.no_grad():
        assert torch.equal(after, uncached(x))
        assert not torch.equal(before, after)


# ---------------------------------------------------------------------------------------------------- reuse, eval


class Twice(nn.Module):
    def __init__(self, recipe):
        super().__init__()
        self.layer = mf.Fp8Linear(DIM, DIM, recipe=recipe)

    def forward(self, x):
        return self.layer(torch.relu(self.layer(x)))


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.CurrentScaling()], ids=["delayed", "current"])
def test_layer_used_twice_records_once_per_step(recipe):
    torch.manual_seed(0)
    model = Twice(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = model.layer.fp8_state
    for step, x in enumerate(batches(STEPS)):
        first_input = x.abs().max()
        loss_of(model(x)).backward()
        opt.step()
        opt.zero_grad()
        completed = state.amax_history[1:]
        assert int((completed[:, 0] > 0).sum()) == step + 1  # one row per optimizer step, not per use
        assert state.amax_history[-1, 0] >= first_input  # the max over both uses
        assert (state.amax_history[0] == 0).all()


def test_eval_forwards_record_nothing():
    model = train(make_model(mf.DelayedScaling()), batches(2))
    before = fp8_buffers(model)
    x = batches(1, seed=7)[0] * 100  # far outside the recorded range
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert_bitwise(before, fp8_buffers(model))


# ---------------------------------------------------------------------------------------------------- the loop


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(amax_history_len=4), mf.CurrentScaling()],
                         ids=["delayed", "current"])
def test_plain_loop_advances_once_per_optimizer_step(recipe):
    model = make_model(recipe)
    data = batches(6)
    train(model, data)
    for layer in mf.fp8_layers(model):
        h = layer.fp8_state.amax_history
        assert (h[0] == 0).all()  # the last step ended
        assert int((h[1:, 0] > 0).sum()) == min(len(data), h.shape[0] - 1)  # one completed row per step
        if recipe.delayed:
            # the TE rule over the history; the input of step 6 grows 6/5 over step 5: scales follow
            want = [mf.E4M3.max / h[:, 0].max(), mf.E4M3.max / h[:, 1].max(), mf.E5M2.max / h[:, 2].max()]
            torch.testing.assert_close(layer.fp8_state.scale, torch.stack(want), rtol=2.0**-23, atol=0)


def test_a_skipped_optimizer_step_does_not_end_the_fp8_step():
    model = make_model(mf.DelayedScaling())
    x1, x2 = batches(2)
    loss_of(model(x1)).backward()  # a step whose optimizer.step() a loss scaler or guard skipped
    loss_of(model(x2)).backward()
    layer = mf.fp8_layers(model)[0]
    assert layer.fp8_state.amax_history[0, 0] == x2.abs().max()  # both folded into the step in progress
    assert (layer.fp8_state.amax_history[1:] == 0).all()


def test_manual_step_on_and_fp8_step():
    model = make_model(mf.DelayedScaling())
    for layer in mf.fp8_layers(model):
        layer.step_on = "manual"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_of(model(batches(1)[0])).backward()
    opt.step()
    layers = mf.fp8_layers(model)
    assert all((layer.fp8_state.amax_history[1:] == 0).all() for layer in layers)  # not ended by the optimizer
    assert mf.fp8_step(model) == len(layers)
    assert all((layer.fp8_state.amax_history[0] == 0).all() for layer in layers)
    assert all((layer.fp8_state.amax_history[-1] > 0).all() for layer in layers)


def test_an_optimizer_over_other_parameters_ends_nothing():
    model = make_model(mf.DelayedScaling())
    other = nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    loss_of(model(batches(1)[0])).backward()
    torch.optim.SGD([other], lr=1.0).step()
    assert all((layer.fp8_state.amax_history[0] > 0).all() for layer in mf.fp8_layers(model))


def test_deep_copies_and_replaced_parameters_still_step():
    model = copy.deepcopy(make_model(mf.DelayedScaling()))  # no __init__ runs for the copy's layers
    layer = mf.fp8_layers(model)[0]
    layer.weight = nn.Parameter(layer.weight.detach().clone())  # a new Parameter after construction
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_of(model(batches(1)[0])).backward()
    opt.step()
    assert all((m.fp8_state.amax_history[0] == 0).all() and (m.fp8_state.amax_history[-1] > 0).all()
               for m in mf.fp8_layers(model))


def _bf16_model():
    return make_model(mf.DelayedScaling()).bfloat16()


@pytest.mark.parametrize("kind", ["MasterWeightOptimizer", "MasterWeights"])
def test_master_weight_optimizers_end_the_step_once(kind):
    model = _bf16_model()
    if kind == "MasterWeightOptimizer":
        opt = MasterWeightOptimizer(torch.optim.SGD, model, lr=1e-3)
    else:
        masters = MasterWeights(model.parameters())
        opt = torch.optim.SGD(masters.parameters(), lr=1e-3)
    for step, x in enumerate(batches(STEPS)):
        loss_of(model(x.bfloat16())).backward()
        if kind == "MasterWeights":
            masters.copy_grads()
        opt.step()
        if kind == "MasterWeights":
            masters.copy_weights()
        opt.zero_grad()
        model.zero_grad()
        for layer in mf.fp8_layers(model):
            assert int((layer.fp8_state.amax_history[1:, 0] > 0).sum()) == step + 1, (kind, step)


@pytest.mark.parametrize("master", [False, True], ids=["plain", "master-weights"])
def test_weight_casts_live_through_the_micro_batches_and_are_gone_when_the_optimizer_steps(master):
    """A layer's cached weight casts serve the micro-batches of one step; the optimizer's own step (its temporaries,
    the peak of a weight-heavy step) no longer holds them: they are dropped by a pre-step hook, not after."""
    torch.manual_seed(0)
    layer = mf.Fp8Linear(64, 32, recipe=mf.DelayedScaling())
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(len(layer._weights._entries))
            return super().step(closure)

    if master:
        opt = MasterWeightOptimizer(Spy, layer.to(torch.bfloat16), lr=0.1)
    else:
        opt = Spy(layer.parameters(), lr=0.1)
    x = torch.randn(3, 16, 64)
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for micro in x:  # three micro-batches: the weight is cast once and reused
                layer(micro).float().square().mean().backward()
                assert len(layer._weights._entries) >= 1
        opt.step()
        opt.zero_grad()
        assert not layer._weights._entries
        # the post-hook ended the step of the layers the pre-hook found, and kept nothing past it
        assert int((layer.fp8_state.amax_history[1:, 0] > 0).sum()) == step + 1
        assert not fp8_step_module._STEPPING
    assert seen == [0, 0]


@ALL_RECIPES
def test_two_optimizers_over_one_layer_end_one_fp8_step(recipe):
    # weights in one optimizer, biases in another (a no-decay group, Muon + AdamW): each step() rolled the history,
    # so every other row was empty and the history held half the steps it should
    data = batches(STEPS)
    one = make_model(recipe)
    two = make_model(recipe)
    opt = torch.optim.SGD(one.parameters(), lr=1e-3)
    weights = torch.optim.SGD([p for n, p in two.named_parameters() if n.endswith("weight")], lr=1e-3)
    biases = torch.optim.SGD([p for n, p in two.named_parameters() if not n.endswith("weight")], lr=1e-3)
    for x in data:
        loss_of(one(x)).backward()
        opt.step()
        opt.zero_grad()
        loss_of(two(x)).backward()
        weights.step()
        biases.step()
        weights.zero_grad()
        biases.zero_grad()
    assert_bitwise(fp8_buffers(one), fp8_buffers(two))


def test_an_fp8_step_end_that_met_no_forward_changes_nothing():
    model = make_model(mf.DelayedScaling())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x in batches(2):
        loss_of(model(x)).backward()
        opt.step()
    before = fp8_buffers(model)
    opt.zero_grad(set_to_none=True)
    opt.step()  # no forward since the last one: nothing recorded
    assert mf.fp8_step(model) > 0
    assert_bitwise(before, fp8_buffers(model))


def test_a_frozen_layer_trained_through_says_that_no_optimizer_ends_its_step(caplog, monkeypatch):
    # a frozen base under LoRA adapters: delayed scales never moved and the base's SQNR fell to 3 dB without a word
    from minifloat.fp8 import modules

    monkeypatch.setattr(modules, "_FROZEN_WARNED", False)
    monkeypatch.setattr(modules, "FROZEN_WARN_AFTER", 3)
    model = make_model(mf.DelayedScaling())
    for p in model.parameters():
        p.requires_grad_(False)
    held = torch.optim.SGD(model.parameters(), lr=1e-3)  # an optimizer holding the frozen parameters ends the step
    x = batches(1)[0].requires_grad_()
    with caplog.at_level("WARNING", logger="minifloat"):
        for _ in range(4):
            loss_of(model(x)).backward()
            held.step()
        assert "is frozen" not in caplog.text
        for _ in range(4):  # none does now
            loss_of(model(x)).backward()
    assert caplog.text.count("is frozen (no parameter requires grad) and 3 training forwards") == 1
    assert "mf.fp8_step(model)" in caplog.text
    before = fp8_buffers(model)
    assert mf.fp8_step(model) > 0
    assert not all(torch.equal(before[k], v) for k, v in fp8_buffers(model).items())  # the step did end


def _adapter_tuned(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A frozen FP8 base and a trainable high-precision adapter beside it (LoRA's shape of the problem)."""
    base = make_model(mf.DelayedScaling(), seed)
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed + 1)
    return base, nn.Linear(DIM, DIM, bias=False)


def test_any_optimizer_step_ends_the_step_of_the_frozen_layers_trained_through():
    """An optimizer over the adapters only (what transformers' Trainer builds under PEFT) ends the frozen base layers'
    FP8 steps too: their state is bitwise what an explicit mf.fp8_step(base) after each step gives; before, their
    delayed scales never moved (a 3-layer base: 1 history row recorded after 6 Trainer steps)."""
    runs = []
    for explicit in (False, True):
        base, adapter = _adapter_tuned()
        opt = torch.optim.SGD(adapter.parameters(), lr=1e-2)
        for x in batches(STEPS):
            loss_of(base(adapter(x))).backward()
            opt.step()
            opt.zero_grad()
            if explicit:
                assert mf.fp8_step(base) > 0  # a no-op where the optimizer's step already ended it
        runs.append(fp8_buffers(base))
    assert_bitwise(runs[0], runs[1])
    seeded = [v for k, v in runs[0].items() if k.endswith("amax_history")]
    assert seeded and all(int((h != 0).any(dim=1).sum()) >= STEPS for h in seeded), "the history did not roll"


def test_a_frozen_layer_is_not_stepped_by_a_skipped_step_or_when_not_trained_through():
    from minifloat.optim import SGD

    base, adapter = _adapter_tuned()
    opt = SGD(adapter.parameters(), lr=1e-2)  # skips a step whose gradients are not finite
    x = batches(1)[0]
    loss_of(base(adapter(x))).backward()
    opt.step()  # the first step seeds and rolls the base's histories
    before = fp8_buffers(base)
    base.eval()  # evaluation forwards record nothing and end no step
    with torch.no_grad():
        base(adapter(x))
    opt.step()
    assert_bitwise(before, fp8_buffers(base))
    base.train()
    loss_of(base(adapter(x * 4))).backward()
    adapter.weight.grad[0, 0] = float("inf")
    recorded = fp8_buffers(base)  # the forward's amaxes in row 0 of the histories, not yet in the scales
    opt.step()  # skipped: the FP8 step goes on into the next optimizer step, for the frozen layers too
    assert opt.skipped_steps == 1
    assert_bitwise(recorded, fp8_buffers(base))
    adapter.weight.grad.zero_()
    opt.step()  # the amaxes the skipped step's forward recorded enter the scales now
    assert not all(torch.equal(recorded[k], v) for k, v in fp8_buffers(base).items() if k.endswith(".scale"))


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.CurrentScaling()], ids=["delayed", "current"])
def test_training_in_eval_mode_says_that_delayed_scales_never_move(caplog, monkeypatch, recipe):
    """eval() forwards record no amax, so a model trained in eval mode (dropout off the wrong way) never seeded its
    delayed scales, without a word; later, prepare_inference(activations="static") found no training scales."""
    from minifloat.fp8 import autograd

    monkeypatch.setattr(autograd, "_EVAL_TRAINING_WARNED", False)
    model = make_model(recipe).eval()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with caplog.at_level("WARNING", logger="minifloat"):
        for x in batches(2):
            loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad()
    history = [v for k, v in fp8_buffers(model).items() if k.endswith("amax_history")]
    assert history and all(not h.any() for h in history)  # nothing recorded, under either recipe
    said = caplog.text.count("was trained through in eval() mode")
    assert said == (1 if recipe.spec(mf.fp8.recipes.Role.INPUT).delayed else 0), caplog.text
    if said:
        assert "call model.train()" in caplog.text
    caplog.clear()
    model.train()  # training mode: no warning, and the histories fill
    with caplog.at_level("WARNING", logger="minifloat"):
        loss_of(model(batches(1)[0])).backward()
    assert "eval() mode" not in caplog.text
    assert any(v[0].any() for k, v in fp8_buffers(model).items() if k.endswith("amax_history"))
