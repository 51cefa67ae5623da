"""FSDP2 with FP8 all-gather (minifloat.distributed.fsdp), on 2 gloo processes on CPU.

One spawn runs every FSDP scenario (process start-up and imports dominate); each rank saves what it saw and the tests
below read it. Claims checked:
  * a sharded converted model computes bitwise what the unsharded one does, step after step: outputs, gradients
    (reduce-scattered in fp32; averaging two equal fp32 values is exact), updated weights and FP8 scaling state, for
    recipes gathered in FP8 (delayed, current per tensor) and in high precision (block 128×128, MX), with precomputed
    and with on-the-fly scales, and with an unevenly sharded layer;
  * FP8 all-gather moves at most 0.55× the bytes of a bf16 all-gather;
  * `precompute_fp8_scales` replaces the per-layer all-reduces of the gathers with one;
  * with different data per rank, every rank holds bitwise the same scaling state after every step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import minifloat as mf
from gloo_ranks import spawn_ranks
from minifloat.distributed.fsdp import (Fp8GatheredWeight, Fp8ShardedWeight, count_fsdp_bytes, precompute_fp8_scales,
                                        shard)
from minifloat.fp8.recipes import Role
from minifloat.fp8.scaling import ROLE_INDEX, scaling_states

WORLD = 2
STEPS = 3
RECIPES = {"delayed": mf.DelayedScaling(), "current": mf.CurrentScaling(), "block": mf.BlockScaling(),
           "mx": mf.MXScaling()}
FP8_GATHERED = ("delayed", "current")  # per-tensor weight scales: the gather moves FP8 bytes
MAX_FP8_TO_BF16_BYTES = 0.55  # issue 10's target: FP8 all-gather about half of bf16's


def _spawn(worker, tmp_path, world: int = WORLD) -> list[dict]:
    return spawn_ranks(worker, tmp_path, world)


class _Unit(nn.Sequential):
    """Linear + GELU: an FSDP unit whose output is not a view (FSDP2 warns about views)."""


def _model(recipe) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(_Unit(nn.Linear(64, 64), nn.GELU()), _Unit(nn.Linear(64, 48), nn.GELU()))
    model = mf.convert(model, recipe=recipe, keep_first_last=False)
    model.append(_Unit(mf.Fp8Linear(48, 25, recipe=recipe), nn.GELU()))  # 25 rows: shards of 13 and 12 (padded)
    return model


def _state(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for s in scaling_states(model)
                      for t in (s.amax_history, s.scale, s.initialized)])


def _equal_to_unsharded(rank: int, world: int, recipe) -> list[dict]:
    mesh = init_device_mesh("cpu", (world,))
    model = _model(recipe)
    ref = copy.deepcopy(model)
    shard(model, mesh=mesh, units=list(model))
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    steps = []
    for step in range(STEPS):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))  # the same batch on every rank
        y, ref_y = model(x), ref(x)
        y.pow(2).mean().backward()
        ref_y.pow(2).mean().backward()
        grads = [torch.equal(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), ref.parameters())]
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        if step % 2 == 0:  # odd steps gather with scales all-reduced on the fly
            precompute_fp8_scales(model)
        steps.append({
            "output": torch.equal(y, ref_y),
            "grads": all(grads),
            "weights": all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), ref.parameters())),
            "state": torch.equal(_state(model), _state(ref)),
        })
    return steps


def _gathered_type(recipe) -> str:
    """The type of the weight an Fp8Linear sees inside a sharded forward."""
    model = _model(recipe)
    shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), units=list(model))
    seen = []
    model[0][0].register_forward_pre_hook(lambda m, args: seen.append(type(m.weight).__name__))
    model(torch.randn(4, 64))
    return seen[0]


def _other_uses(recipe) -> dict:
    """Evaluation forwards, and FP8 switched off (the gathered weight is used as a plain tensor, dequantized)."""
    model = _model(recipe)
    ref = copy.deepcopy(model)
    shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), units=list(model))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    model.eval(), ref.eval()
    with torch.no_grad():
        evaluation = torch.equal(model(x), ref(x))
        with mf.autocast(enabled=False):
            disabled = model(x)
    # the FP8-gathered weight is its cast, dequantized: compare with plain layers over dequantized weights
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(m[0].in_features, m[0].out_features), nn.GELU()) for m in ref])
    with torch.no_grad():
        for unit, ref_unit in zip(plain, ref):
            w = ref_unit[0].weight
            spec = recipe.spec(Role.WEIGHT)
            unit[0].weight.copy_(mf.quantize(w, spec.fmt, granularity=spec.granularity).dequantize())
            unit[0].bias.copy_(ref_unit[0].bias)
        return {"evaluation": evaluation, "fp8 off": torch.equal(disabled, plain(x))}


def _bytes(fp8_all_gather: bool) -> dict:
    """All-gather / reduce-scatter bytes of one training step of a 4-layer FP8 MLP (bf16 params, fp32 grads)."""
    model = nn.Sequential(*[_Unit(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
    mf.convert(model, recipe=mf.CurrentScaling(), keep_first_last=False)
    shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), units=list(model),
          fp8_all_gather=fp8_all_gather, param_dtype=torch.bfloat16)
    counts = count_fsdp_bytes(model)
    model(torch.randn(8, 256)).float().pow(2).mean().backward()
    return dict(counts)


def _all_reduces_per_step(precompute: bool) -> int:
    """all_reduce calls made inside forward + backward of a current-scaling model (3 FP8-gathered layers)."""
    model = _model(mf.CurrentScaling())
    shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), units=list(model))
    if precompute:
        precompute_fp8_scales(model)
    real, calls = dist.all_reduce, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        model(torch.randn(4, 64)).pow(2).mean().backward()
    finally:
        dist.all_reduce = real
    return len(calls)


def _different_data(rank: int, world: int) -> list[torch.Tensor]:
    model = _model(mf.DelayedScaling())
    shard(model, mesh=init_device_mesh("cpu", (world,)), units=list(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for step in range(STEPS):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + rank)) * (4.0 if rank else 1.0)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        states.append(_state(model))
    return states


def _fsdp_worker(rank: int, world: int) -> dict:
    return {
        "equal": {name: _equal_to_unsharded(rank, world, recipe) for name, recipe in RECIPES.items()},
        "gathered_type": {name: _gathered_type(recipe) for name, recipe in RECIPES.items()},
        "other_uses": _other_uses(mf.CurrentScaling()),
        "bytes": {"fp8": _bytes(True), "bf16": _bytes(False)},
        "all_reduces": {"precomputed": _all_reduces_per_step(True), "on the fly": _all_reduces_per_step(False)},
        "different_data": _different_data(rank, world),
    }


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory) -> list[dict]:
    return _spawn(_fsdp_worker, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_sharded_model_computes_what_the_unsharded_one_does(fsdp_results, recipe):
    for rank, result in enumerate(fsdp_results):
        for step, checks in enumerate(result["equal"][recipe]):
            assert all(checks.values()), f"rank {rank} step {step}: {checks}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_per_tensor_recipes_gather_fp8_and_others_high_precision(fsdp_results, recipe):
    expected = Fp8GatheredWeight.__name__ if recipe in FP8_GATHERED else nn.Parameter.__name__
    assert fsdp_results[0]["gathered_type"][recipe] == expected


def test_evaluation_and_fp8_off_use_the_gathered_weight(fsdp_results):
    checks = fsdp_results[0]["other_uses"]
    assert checks["evaluation"]  # eval casts exactly as the unsharded layer
    assert checks["fp8 off"]  # nn.Linear over the gathered weight: its FP8 cast, dequantized


def test_fp8_all_gather_halves_the_bytes(fsdp_results):
    counts = fsdp_results[0]["bytes"]
    ratio = counts["fp8"]["all_gather"] / counts["bf16"]["all_gather"]
    assert ratio <= MAX_FP8_TO_BF16_BYTES, counts
    assert counts["fp8"]["reduce_scatter"] == counts["bf16"]["reduce_scatter"]  # gradients: fp32 either way


def test_precomputed_scales_leave_the_gathers_without_collectives(fsdp_results):
    counts = fsdp_results[0]["all_reduces"]
    assert counts["precomputed"] == 0
    assert counts["on the fly"] == 2 * 3  # 3 FP8-gathered layers, gathered for forward and again for backward


def test_every_rank_holds_the_same_scaling_state(fsdp_results):
    for step, (a, b) in enumerate(zip(*(r["different_data"] for r in fsdp_results))):
        assert torch.equal(a, b), f"step {step}"


def _compiled_gathered(rank: int, world: int) -> dict:
    """The tiny Llama, fp8-delayed, sharded with FP8 all-gather, each block's forward compiled (the trainer's default
    scope), against the same sharded model eager: 2 steps of forward, backward and AdamW. Counts the gathered
    weights' dequantizations (a use that is not their FP8 cast, eager or traced)."""
    from torch._dynamo.utils import counters

    from minifloat.training.compiled import compile_forward
    from minifloat.training.model import Llama, LlamaConfig

    dequantized = [0]
    real = Fp8GatheredWeight.dequantize

    def counted(self):
        dequantized[0] += 1
        return real(self)

    Fp8GatheredWeight.dequantize = counted

    def build():
        torch.manual_seed(0)
        model = mf.convert(Llama(LlamaConfig.preset("tiny")), recipe=mf.DelayedScaling())
        shard(model, units=list(model.blocks))
        return model, sum(isinstance(m.weight.to_local(), Fp8ShardedWeight) for m in model.modules()
                          if isinstance(m, mf.Fp8Linear))

    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    result = {}
    counters.clear()
    for mode in ("eager", "compiled"):
        model, gathered_layers = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forward = compile_forward(model, "default", "blocks") if mode == "compiled" else model
        losses = []
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = forward(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        weight_scales = torch.stack([st.scale[ROLE_INDEX[Role.WEIGHT]] for st in scaling_states(model)])
        result[mode] = {"losses": losses, "state": _state(model), "gathered_layers": gathered_layers,
                        "weight_scales": weight_scales}
    result.update(graph_breaks=sum(counters["graph_break"].values()), graphs=counters["stats"]["unique_graphs"],
                  dequantized=dequantized[0])
    return result


# compiled against eager: not bitwise for the Llama on a CPU (inductor fuses and orders the fp32 reductions of the
# norms, softmax and loss its own way); the sharded 2-rank runs (tests/test_distributed_train.py) use the same loss
# bound. The weights' delayed scales stay within COMPILED_WEIGHT_SCALE_RTOL; the inputs' and gradients' follow amaxes
# of activations that drift further (up to 4% apart after 2 steps, measured), so only their finiteness is checked.
COMPILED_LOSS_RTOL = 1e-4
COMPILED_WEIGHT_SCALE_RTOL = 1e-3


def test_the_gathered_weight_flattens_into_its_tensors():
    """What dynamo needs of a tensor subclass it takes as a graph input: every tensor it holds listed by
    `__tensor_flatten__` (they become the graph's inputs; one held elsewhere reached the compiled forward as a real
    tensor and dynamo stopped), and `__tensor_unflatten__` rebuilding the same weight from them."""
    x = torch.randn(32, 16)
    amax = x.abs().amax()
    q = mf.quantize(x, mf.E4M3, amax=amax)
    spec = mf.DelayedScaling().spec(Role.WEIGHT)
    w = Fp8GatheredWeight(q.data, q.scale, amax, spec, torch.float32)
    names, meta = w.__tensor_flatten__()
    inner = {name: getattr(w, name) for name in names}
    assert all(isinstance(t, torch.Tensor) for t in inner.values())
    # every tensor the weight holds, directly or inside an attribute (a Quantized, a dataclass)
    held = [t for v in vars(w).values()
            for t in ([v] if isinstance(v, torch.Tensor) else
                      [f for f in vars(v).values() if isinstance(f, torch.Tensor)] if hasattr(v, "__dict__") else [])]
    assert held and all(any(t is h for t in inner.values()) for h in held)
    again = Fp8GatheredWeight.__tensor_unflatten__(inner, meta, w.shape, w.stride())
    assert again.fp8_spec == spec and again.dtype == w.dtype and again.shape == w.shape
    assert torch.equal(again.fp8_cast.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(again.dequantize(), q.dequantize(torch.float32))


@pytest.mark.slow  # 17-20 s: the block compiles in the spawned rank
def test_a_compiled_block_takes_the_fp8_gathered_weight(tmp_path):
    """torch.compile of each block (the trainer's default scope) under FSDP2 with FP8 all-gather: the gathered weight
    (an `Fp8GatheredWeight`, a traceable wrapper subclass) enters the compiled forward as an input, with no graph
    break, and is used through its FP8 cast, never dequantized; the compiled model trains as the eager one does.
    (The gathered weight once carried its tensors outside `__tensor_flatten__`, and dynamo stopped at the first
    block.)"""
    (result,) = _spawn(_compiled_gathered, tmp_path, world=1)
    assert result["eager"]["gathered_layers"] > 0
    assert result["graph_breaks"] == 0 and result["graphs"] >= 1, result
    assert result["dequantized"] == 0
    assert result["compiled"]["losses"] == pytest.approx(result["eager"]["losses"], rel=COMPILED_LOSS_RTOL)
    assert torch.isfinite(result["compiled"]["state"]).all()
    assert torch.allclose(result["compiled"]["weight_scales"], result["eager"]["weight_scales"],
                          rtol=COMPILED_WEIGHT_SCALE_RTOL)
