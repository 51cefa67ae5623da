"""FP8 scaling state across ranks (2 gloo processes on CPU): the end of each FP8 step MAX-reduces the step's amaxes,
so every rank holds bitwise the same scaling state after every step even when the ranks see different data; and
StepGuard reaches one verdict on all ranks. One spawn runs every scenario (process start-up dominates)."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import minifloat as mf
from gloo_ranks import rendezvous
from minifloat.fp8 import step as fp8_step_module
from minifloat.fp8.scaling import scaling_states

WORLD = 2
STEPS = 3
RECIPES = {"delayed": mf.DelayedScaling(), "current": mf.CurrentScaling(), "mx": mf.MXScaling()}


def _model(recipe) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    return mf.convert(model, recipe=recipe, keep_first_last=False)


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 64, generator=g) * (4.0 if rank == 1 else 1.0)  # rank 1's inputs 4x larger


def _state(model: nn.Module) -> torch.Tensor:
    """Every scaling buffer of the model, flattened to float64 (bitwise comparable across ranks)."""
    return torch.cat([t.detach().double().flatten() for s in scaling_states(model)
                      for t in (s.amax_history, s.scale, s.initialized, s.nonfinite)])


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t)
    return out


def _train(recipe, rank: int, *, ddp: bool) -> tuple[nn.Module, list[bool]]:
    """STEPS steps on this rank's data; returns the model and, per step, whether all ranks' states were equal."""
    model = _model(recipe)
    net = nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    agree = []
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(_batch(rank, step)).float().square().mean()
        loss.backward()
        opt.step()  # ends the FP8 step: amaxes reduced, then scales advanced
        opt.zero_grad()
        states = _gathered(_state(model))
        agree.append(all(torch.equal(states[0], s) for s in states[1:]))
    return model, agree


def _worker(rank: int, init_method: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        out = {}
        for name, recipe in RECIPES.items():
            for ddp in (False, True):
                _, agree = _train(recipe, rank, ddp=ddp)
                out[f"{name}-{'ddp' if ddp else 'plain'}"] = agree
        # the reduced amax is the max over ranks: rank 1's 4x larger inputs set the input scale of both
        model = _model(mf.DelayedScaling())
        model(_batch(rank, 0)).float().square().mean().backward()
        local = scaling_states(model)[0].amax_history[0, 0].clone()
        mf.fp8_step(model)
        both = _gathered(local.reshape(1))
        out["reduced_is_max"] = bool(scaling_states(model)[0].amax_history[-1, 0] == torch.cat(both).max())
        # without the reduction (set_amax_group(None)) the ranks' delayed scales drift apart: the test can fail
        fp8_step_module.set_amax_group(None)
        try:
            _, agree = _train(mf.DelayedScaling(), rank, ddp=False)
        finally:
            fp8_step_module.set_amax_group()
        out["unreduced"] = agree
        # StepGuard: an inf in rank 1's input only; both ranks skip, nothing changes anywhere
        model = _model(mf.DelayedScaling())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = mf.StepGuard(model, opt)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        x = _batch(rank, 0)
        if rank == 1:
            x[0, 0] = float("inf")
        guard.begin_step(0)
        model(x).float().square().mean().backward()
        report = guard.check(model(x).float().square().mean().detach())
        if not report.skipped:
            opt.step()
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        out["guard"] = (report.skipped, report.reason.value if report.reason else None, torch.equal(before, after))
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> dict:
    with mp.Manager() as manager:
        shared = manager.dict()
        with rendezvous() as init_method:
            mp.spawn(_worker, args=(init_method, shared), nprocs=WORLD, join=True)
        return dict(shared)


@pytest.mark.parametrize("case", [f"{r}-{m}" for r in RECIPES for m in ("plain", "ddp")])
def test_scaling_state_is_identical_on_all_ranks_after_every_step(results, case):
    for rank in range(WORLD):
        assert results[rank][case] == [True] * STEPS


def test_the_reduced_amax_is_the_max_over_ranks(results):
    assert all(results[rank]["reduced_is_max"] for rank in range(WORLD))


def test_without_the_reduction_the_ranks_drift_apart(results):
    assert results[0]["unreduced"] == results[1]["unreduced"] == [False] * STEPS


def test_step_guard_skips_on_every_rank_when_one_rank_meets_inf(results):
    for rank in range(WORLD):
        assert results[rank]["guard"] == (True, "nonfinite_fp8_operand", True)
