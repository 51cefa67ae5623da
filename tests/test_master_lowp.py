"""Tests for minifloat.amp.lowp_weights: bf16 weights updated by stochastic rounding or Kahan compensation."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.amp.lowp_weights import LowPrecisionWeightOptimizer
from minifloat.amp.master import MasterWeightOptimizer
from minifloat.amp.policy import PrecisionPolicy

BF16 = torch.bfloat16
Z_SIGMAS = 5.0  # z-test bound: a deviation beyond 5 standard errors has probability < 6e-7
TRAIN_FACTOR = 1.1  # final loss of the bf16 modes within 10% of fp32 master weights (measured: within 0.5%)


def constant_sgd_run(opt_factory, n: int, steps: int, lr: float) -> torch.Tensor:
    """`steps` SGD steps of gradient 1 on n bf16 weights starting at 1.0: the fp32 result is 1 - steps·lr."""
    w = nn.Parameter(torch.ones(n, dtype=BF16))
    opt = opt_factory([w], lr)
    for _ in range(steps):
        w.grad = torch.ones_like(w)
        opt.step()
        opt.zero_grad()
    return w.detach().float()


def test_stochastic_rounding_is_unbiased_where_nearest_stalls():
    """Each SR step adds a zero-mean error of variance <= ulp²/4 (ulp = 2^-8 just below 1), so after S steps each
    weight has std <= sqrt(S)·ulp/2 and the mean of n independent weights has standard error <= that / sqrt(n)."""
    n, steps, lr = 4096, 100, 1e-4
    expected = 1.0 - steps * lr
    sr = constant_sgd_run(lambda p, lr: LowPrecisionWeightOptimizer(torch.optim.SGD, p, lr=lr, seed=0), n, steps, lr)
    stderr = math.sqrt(steps) * 2.0**-8 / 2 / math.sqrt(n)
    assert abs(sr.mean().item() - expected) <= Z_SIGMAS * stderr
    nearest = constant_sgd_run(lambda p, lr: torch.optim.SGD(p, lr=lr), n, steps, lr)
    assert bool((nearest == 1.0).all()), "round to nearest drops every update of 1e-4 < 2^-9"
    assert abs(nearest.mean().item() - expected) > 5 * Z_SIGMAS * stderr


def fixed_gradient_run(make_opt, steps: int, seed: int = 0):
    """AdamW (no weight decay) driven by a fixed gradient sequence with a drift (mean 1), so every mode sees the same
    updates and they add up."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(2048, generator=gen)
    w = nn.Parameter(w0.to(BF16))
    opt = make_opt([w])
    for _ in range(steps):
        w.grad = (1.0 + torch.randn(2048, generator=gen)).to(BF16)
        opt.step()
        opt.zero_grad()
    return w, opt


def test_kahan_tracks_fp32_master_weights():
    """After 300 steps the Kahan weight w is within one bf16 ulp of the fp32 master m, and w + c misses m only by the
    compensation's own roundings: |c| <= ulp(w)/2, so each step loses <= ulp(c)/2 <= 2^-10·ulp(w) (measured: 0.05 ulp
    in all after 300 steps). Plain bf16 AdamW stalls and drifts away."""
    steps, lr = 300, 1e-4
    adamw = dict(lr=lr, weight_decay=0.0)
    w_k, opt_k = fixed_gradient_run(lambda p: LowPrecisionWeightOptimizer(torch.optim.AdamW, p, update="kahan",
                                                                          **adamw), steps)
    w_m, opt_m = fixed_gradient_run(lambda p: MasterWeightOptimizer(torch.optim.AdamW, p, **adamw), steps)
    w_b, _ = fixed_gradient_run(lambda p: torch.optim.AdamW(p, **adamw), steps)
    master = opt_m.master.pairs[0][1].detach()
    ulp = torch.exp2(torch.floor(torch.log2(master.abs())) - 7)
    assert bool(((w_k.float() - master).abs() <= ulp).all())
    tracked = w_k.float() + opt_k.compensation[0].float()
    assert bool(((tracked - master).abs() <= 2.0**-10 * ulp * steps).all())
    kahan_error, plain_error = (w_k.float() - master).abs().mean(), (w_b.float() - master).abs().mean()
    print(f"mean |w - m|: kahan {kahan_error:.2e}, plain bf16 {plain_error:.2e}, |w + c - m| max "
          f"{((tracked - master).abs() / ulp).max():.2e} ulp")
    assert plain_error > 5 * kahan_error  # plain bf16 AdamW stalls: updates of ~lr = 1e-4 are below half an ulp


@pytest.mark.parametrize("update", ["stochastic", "kahan"])
def test_resume_is_bitwise(update):
    def make(p):
        return LowPrecisionWeightOptimizer(torch.optim.AdamW, p, update=update, seed=5, lr=1e-3)

    def run(w, opt, gen, steps):
        for _ in range(steps):
            w.grad = torch.randn(w.shape, generator=gen).to(BF16)
            opt.step()
            opt.zero_grad()

    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(512, generator=gen).to(BF16))
    opt = make([w])
    run(w, opt, gen, 5)
    saved_w, saved_opt, saved_gen = w.detach().clone(), copy.deepcopy(opt.state_dict()), gen.get_state()
    run(w, opt, gen, 5)

    w2 = nn.Parameter(saved_w.clone())
    opt2 = make([w2])
    opt2.load_state_dict(saved_opt)
    gen.set_state(saved_gen)
    run(w2, opt2, gen, 5)
    assert torch.equal(w.view(torch.int16), w2.view(torch.int16))
    for c1, c2 in zip(opt.compensation, opt2.compensation):
        assert torch.equal(c1, c2)


@pytest.mark.parametrize("update", ["stochastic", "kahan"])
def test_fp8_step_ends_once_per_optimizer_step(update):
    model = nn.Sequential(mf.Fp8Linear(32, 32, recipe=mf.DelayedScaling()), nn.GELU(),
                          mf.Fp8Linear(32, 32, recipe=mf.DelayedScaling())).to(BF16)
    opt = LowPrecisionWeightOptimizer(torch.optim.AdamW, model, update=update, lr=1e-3)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).to(BF16)
    for step in range(3):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        # each layer's scaling state advanced exactly once per optimizer step (its generation counts the ends)
        assert [layer.fp8_state.generation for layer in (model[0], model[2])] == [step + 1, step + 1]


@pytest.mark.parametrize("update", ["stochastic", "kahan"])
def test_nonfinite_gradient_skips_the_step(update, caplog):
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(64, generator=gen).to(BF16))
    b = nn.Parameter(torch.randn(8, generator=gen))  # an fp32 parameter, stepped directly
    opt = LowPrecisionWeightOptimizer(torch.optim.AdamW, [w, b], update=update, lr=1e-2)
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    before = (w.detach().clone(), b.detach().clone(), copy.deepcopy(opt.state_dict()))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    w.grad[3] = float("nan")
    with caplog.at_level("WARNING", logger="minifloat"):
        opt.step()
    assert opt.skipped_steps == 1
    assert any("LowPrecisionWeightOptimizer skipped an optimizer step" in r.getMessage() for r in caplog.records)
    assert torch.equal(w, before[0]) and torch.equal(b, before[1])
    state = opt.state_dict()
    assert all(torch.equal(x, y) for x, y in zip(state["compensation"], before[2]["compensation"]))
    assert all(torch.equal(state["generators"][d], before[2]["generators"][d]) for d in state["generators"])
    for key, value in before[2]["optimizer"]["state"].items():
        assert all(torch.equal(value[k], state["optimizer"]["state"][key][k]) for k in value)


def train_toy(make_opt, steps: int = 300) -> tuple[float, float]:
    """A bf16 MLP regressing a fixed random teacher; returns the first loss and the mean of the last 20."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(BF16)
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=gen)
    opt = make_opt(model)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=gen)
        loss = (model(x.to(BF16)).float() - torch.tanh(x @ teacher)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses[0], sum(losses[-20:]) / 20


def test_toy_model_trains_like_fp32_master_weights():
    kwargs = dict(lr=1e-3)
    first, fp32 = train_toy(lambda m: MasterWeightOptimizer(torch.optim.AdamW, m, **kwargs))
    assert fp32 < 0.5 * first  # it learns
    for update in ("stochastic", "kahan"):
        _, lowp = train_toy(lambda m: LowPrecisionWeightOptimizer(torch.optim.AdamW, m, update=update, **kwargs))
        print(f"{update}: final loss {lowp:.4f}, fp32 master weights {fp32:.4f}")
        assert lowp <= TRAIN_FACTOR * fp32, (update, lowp, fp32)


@pytest.mark.parametrize("name, kwargs, match", [
    ("unknown update", dict(update="sr"), "update"),
    ("negative seed", dict(seed=-1), "seed"),
])
def test_invalid_options(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LowPrecisionWeightOptimizer(torch.optim.SGD, [nn.Parameter(torch.ones(2, dtype=BF16))], lr=1.0, **kwargs)


# ---------------------------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("mode, cls, update", [
    (True, MasterWeightOptimizer, None),
    ("fp32", MasterWeightOptimizer, None),
    ("bf16-sr", LowPrecisionWeightOptimizer, "stochastic"),
    ("bf16-kahan", LowPrecisionWeightOptimizer, "kahan"),
])
def test_policy_selects_the_master_weight_mode(mode, cls, update):
    policy = dataclasses.replace(PrecisionPolicy.preset("bf16"), param_dtype=BF16, master_weights=mode)
    model = policy.apply(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    opt = policy.optimizer(torch.optim.AdamW, model, lr=1e-3)
    assert type(opt) is cls and getattr(opt, "update", None) == update
    assert policy.state_dtype == torch.float32


@pytest.mark.parametrize("name, kwargs", [
    ("unknown mode", dict(param_dtype=BF16, compute_dtype=BF16, master_weights="bf16")),
    ("int is not a mode", dict(param_dtype=BF16, compute_dtype=BF16, master_weights=1)),
    ("bf16 modes need bf16 params", dict(param_dtype=torch.float16, compute_dtype=torch.float16,
                                         master_weights="bf16-sr")),
])
def test_policy_rejects_invalid_master_modes(name, kwargs):
    with pytest.raises(ValueError, match="master_weights"):
        PrecisionPolicy(**kwargs)
