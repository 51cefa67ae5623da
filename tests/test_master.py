"""Tests for minifloat.amp.master: float32 master weights keep updates that bfloat16 parameters round away."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.amp.lowp_weights import LowPrecisionWeightOptimizer
from minifloat.amp.master import MasterWeightOptimizer, MasterWeights

# the case: an update of 1e-4 relative to a weight of 1.0, for 100 steps
LR, STEPS = 1e-4, 100
# bf16 spacing in [0.5, 1) is 2^-(mbits+1); a write-back rounds to nearest, so it lands within half of that
BF16_HALF_ULP_BELOW_ONE = 2.0 ** -(mf.BF16.mbits + 1) / 2
# 100 fp32 subtractions of 1e-4 just below 1.0: each rounds by ≤ half an fp32 ulp (2^-25 in [0.5, 1), 2^-24 at 1.0);
# bounded by 100 · 2^-24 ≈ 6e-6, measured 1.7e-6
FP32_DRIFT = STEPS * 2.0 ** -(mf.FP32.mbits + 1)
# one SGD step (lr 0.1) in fp16 against fp32: weights of |w| < 1 rounded to fp16 (half an ulp, 2^-12) plus the
# update's error from fp16 activations and gradients (a few ulps of a gradient below 1, times lr): 1e-3
FP16_STEP_TOLERANCE = 1e-3


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def one_weight() -> nn.Linear:
    lin = nn.Linear(1, 1, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    return lin


def train(lin: nn.Linear, opt: torch.optim.Optimizer) -> None:
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    for _ in range(STEPS):
        opt.zero_grad()
        lin(x).sum().backward()  # d(w·1)/dw = 1, so SGD's update is exactly LR
        opt.step()


def test_small_updates_survive_with_master_weights():
    lin = one_weight()
    opt = MasterWeightOptimizer(torch.optim.SGD, lin, lr=LR)
    train(lin, opt)
    expected = 1.0 - STEPS * LR  # 0.99
    assert lin.weight.dtype == torch.bfloat16
    assert abs(lin.weight.item() - expected) <= BF16_HALF_ULP_BELOW_ONE
    (_, master), = opt.master.pairs
    assert master.dtype == torch.float32 and abs(master.item() - expected) <= FP32_DRIFT


def test_small_updates_vanish_without_master_weights():
    assert LR < BF16_HALF_ULP_BELOW_ONE  # the premise: 1 - 1e-4 rounds back to 1 in bf16
    lin = one_weight()
    train(lin, torch.optim.SGD(lin.parameters(), lr=LR))
    assert lin.weight.item() == 1.0


def test_building_block_loop_matches_wrapper(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).to(torch.bfloat16)
    twin = copy.deepcopy(model)
    wrapped = MasterWeightOptimizer(torch.optim.AdamW, model, lr=1e-2)
    master = MasterWeights(twin.parameters())
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    x = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    for _ in range(5):
        for net, o in ((model, wrapped), (twin, None)):
            net(x).float().pow(2).mean().backward()
            if o is not None:
                o.step()
                o.zero_grad()
            else:
                master.copy_grads()
                opt.step()
                master.copy_weights()
                opt.zero_grad()
                master.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert all(s["exp_avg"].dtype == torch.float32 for s in wrapped.state.values())


def test_float32_params_are_their_own_master():
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.LayerNorm(4))
    master = MasterWeights(model.parameters())
    assert len(master.pairs) == 2  # the bf16 weight and bias
    ln_params = {id(p) for p in model[1].parameters()}
    assert ln_params <= {id(p) for p in master.parameters()[0]["params"]}


def test_param_groups_and_lr_scheduler():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(torch.bfloat16)
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters()}]
    opt = MasterWeightOptimizer(torch.optim.SGD, groups, lr=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.05, 0.005]


def test_state_dict_round_trip(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(torch.bfloat16)
    x = torch.randn(16, 8, generator=gen).to(torch.bfloat16)

    def steps(net, opt, n):
        for _ in range(n):
            opt.zero_grad()
            net(x).float().pow(2).mean().backward()
            opt.step()

    opt = MasterWeightOptimizer(torch.optim.Adam, model, lr=1e-3)
    steps(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    steps(model, opt, 3)

    restored = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(torch.bfloat16)
    restored.load_state_dict(saved_model)
    opt2 = MasterWeightOptimizer(torch.optim.Adam, restored, lr=1e-3)
    opt2.load_state_dict(saved_opt)
    for (_, m1), m2 in zip(opt2.master.pairs, saved_opt["master"]):
        assert torch.equal(m1, m2)
    steps(restored, opt2, 3)
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)
    for (_, m1), (_, m2) in zip(opt.master.pairs, opt2.master.pairs):
        assert torch.equal(m1, m2)


BAD = [
    ("empty", lambda: MasterWeights([]), "params"),
    ("integer", lambda: MasterWeights([torch.zeros(2, dtype=torch.int64)]), "floating-point"),
]


@pytest.mark.parametrize("name,build,match", BAD, ids=[b[0] for b in BAD])
def test_invalid_params(name, build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_load_state_dict_rejects_other_model():
    opt = MasterWeightOptimizer(torch.optim.SGD, nn.Linear(2, 2).to(torch.bfloat16), lr=0.1)
    other = MasterWeightOptimizer(torch.optim.SGD, nn.Linear(3, 3).to(torch.bfloat16), lr=0.1)
    with pytest.raises(ValueError, match="shape"):
        opt.master.load_state_dict(other.state_dict())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_gradient_skips_the_step_and_says_so(gen, caplog, bad):
    """A NaN or inf gradient would reach the fp32 masters, the optimizer's moments and then the weights: the step is
    skipped whole, a warning says so, and `skipped_steps` (saved with the state) counts it."""
    w = nn.Parameter(torch.randn(64, generator=gen).to(torch.bfloat16))
    b = nn.Parameter(torch.randn(8, generator=gen))  # an fp32 parameter, its own master
    opt = MasterWeightOptimizer(torch.optim.AdamW, [w, b], lr=1e-2)
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    before = (w.detach().clone(), b.detach().clone(), copy.deepcopy(opt.state_dict()))
    for broken in (w, b):
        w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
        broken.grad[3] = bad
        with caplog.at_level("WARNING", logger="minifloat"):
            opt.step()
    assert opt.skipped_steps == 2
    assert sum("MasterWeightOptimizer skipped an optimizer step" in r.getMessage() for r in caplog.records) == 2
    assert torch.equal(w, before[0]) and torch.equal(b, before[1])
    state = opt.state_dict()
    assert all(torch.equal(m, n) for m, n in zip(state["master"], before[2]["master"]))
    for i, saved in before[2]["optimizer"]["state"].items():
        assert all(torch.equal(saved[k], state["optimizer"]["state"][i][k]) for k in saved)
    resumed = MasterWeightOptimizer(torch.optim.AdamW, [nn.Parameter(w.detach().clone()),
                                                        nn.Parameter(b.detach().clone())], lr=1e-2)
    resumed.load_state_dict(state)
    assert resumed.skipped_steps == 2
    legacy = {k: v for k, v in state.items() if k != "skipped_steps"}  # saved before it was counted
    resumed.load_state_dict(legacy)
    assert resumed.skipped_steps == 0


def test_check_finite_off_leaves_the_check_to_the_caller(gen):
    w = nn.Parameter(torch.randn(8, generator=gen).to(torch.bfloat16))
    opt = MasterWeightOptimizer(torch.optim.SGD, [w], lr=1e-2, check_finite=False)
    w.grad = torch.full_like(w, float("nan"))
    opt.step()
    assert opt.skipped_steps == 0 and torch.isnan(w).all()
    with pytest.raises(ValueError, match="check_finite must be a bool"):
        MasterWeightOptimizer(torch.optim.SGD, [w], lr=1e-2, check_finite="yes")


WRAPPERS = {
    "master": lambda params, **kw: MasterWeightOptimizer(torch.optim.SGD, params, lr=LR, **kw),
    "bf16-kahan": lambda params, **kw: LowPrecisionWeightOptimizer(torch.optim.SGD, params, update="kahan", lr=LR,
                                                                   **kw),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_group_added_later_keeps_small_updates_too(wrapper):
    # add_param_group went straight to the inner optimizer: the new bf16 weight got no master (or compensation),
    # and each 1e-4 update rounded away
    first, later = one_weight(), one_weight()
    opt = WRAPPERS[wrapper](first.parameters())
    opt.add_param_group({"params": list(later.parameters())})
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    for _ in range(STEPS):
        opt.zero_grad()
        (first(x) + later(x)).sum().backward()
        opt.step()
    assert first.weight.item() < 1.0 and first.weight.item() == later.weight.item()
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": list(later.parameters())})


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("params, error, match", [
    (lambda w: w, TypeError, "lone tensor"),
    (lambda w: [{"params": [w], "lr": 0.5}, {"params": [w], "lr": 0.0}], ValueError, "more than one parameter group"),
    (lambda w: [w, w], ValueError, "more than one parameter group"),
], ids=["lone-tensor", "two-groups", "twice-in-one"])
def test_params_torch_refuses_are_refused(wrapper, params, error, match):
    w = nn.Parameter(torch.ones(3, 4, dtype=torch.bfloat16))
    with pytest.raises(error, match=match):
        WRAPPERS[wrapper](params(w))


def test_weights_loaded_after_the_optimizer_was_built_are_the_ones_stepped():
    # the masters were copied at construction: a model.load_state_dict afterwards was overwritten by the first step
    torch.manual_seed(0)
    model = nn.Linear(8, 8).to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.SGD, model, lr=0.0)
    model.load_state_dict({k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()})
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    assert (model.weight == 0.5).all() and (model.bias == 0.5).all()
    # a load of the values the weights already hold (a checkpoint of this step) keeps the masters' extra bits
    w = one_weight()
    opt = MasterWeightOptimizer(torch.optim.SGD, w, lr=LR)
    train(w, opt)
    master = opt.master.pairs[0][1].detach().clone()
    w.load_state_dict(copy.deepcopy(w.state_dict()))
    opt.zero_grad()
    w(torch.zeros(1, 1, dtype=torch.bfloat16)).sum().backward()  # a zero gradient: the master must not move
    opt.step()
    assert torch.equal(opt.master.pairs[0][1], master)


def test_a_skipped_step_does_not_end_the_fp8_step():
    # the wrapper skipped a non-finite step, but torch's post-step hook still advanced the FP8 scales
    torch.manual_seed(0)
    model = mf.convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)), recipe=mf.DelayedScaling(),
                       keep_first_last=False).to(torch.bfloat16)
    opt = MasterWeightOptimizer(torch.optim.SGD, model, lr=1e-3)
    for step in range(2):
        model(torch.randn(8, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        if step == 1:
            scales = [m.fp8_state.scale.clone() for m in mf.fp8_layers(model)]
            model[2].weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    assert opt.skipped_steps == 1
    assert all(torch.equal(m.fp8_state.scale, s) for m, s in zip(mf.fp8_layers(model), scales))


def test_the_loss_scaler_unscales_the_gradients_master_weights_step():
    # the scaler walked the optimizer's own groups (the fp32 masters, gradient-less before step): the fp16 weights'
    # gradients reached the step still multiplied by the scale (a 65536x too large update)
    torch.manual_seed(0)
    policy = mf.PrecisionPolicy(param_dtype=torch.float16, compute_dtype=torch.float16, master_weights=True)
    model = policy.apply(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    reference = copy.deepcopy(model).float()
    opt = policy.optimizer(torch.optim.SGD, model, lr=0.1)
    scaler = mf.LossScaler()
    x = torch.randn(4, 8, dtype=torch.float16)
    scaler.scale(model(x).float().pow(2).mean()).backward()
    assert scaler.step(opt).stepped
    reference(x.float()).pow(2).mean().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    # fp16 forward and gradients against fp32 ones: a few fp16 ulps of the weights, nowhere near the scale
    torch.testing.assert_close(model[0].weight.float(), reference[0].weight, rtol=0, atol=FP16_STEP_TOLERANCE)
