"""Block-wise low-precision optimizer states (minifloat.optim) under FSDP2 and in DCP checkpoints, on 2 gloo ranks.

Claims checked (docs/optim.md, "Sharded states (FSDP2, DCP)"):
  * each rank's states are the ones a BlockwiseOptimizer keeps for its local slice alone, bitwise, step after step:
    parameters, codes and scales, with uneven shards, a shard that starts inside a block and an empty shard; the
    fp32-by-rule is decided on the global numel;
  * where every shard starts at a multiple of the block, the sharded states are the one-process optimizer's, shard by
    shard. Elsewhere they need not be: a block straddling the boundary has one scale in one process and two (one per
    rank's partial block) under FSDP2, so its codes, its decoded moments and the update may differ by rounding (they
    agree when both scales happen to be equal, e.g. a power of two of the same amax binade), which is why the
    per-slice property is the one tested for every parameter;
  * a non-finite gradient on one rank skips the step on every rank; DDP ranks keep identical states;
  * DCP: the same 2 ranks load what they saved bitwise; `minifloat train --nproc 2 --parallel fsdp` resumes bitwise
    (e4m3,bf16 and int8,int8-dynamic); a checkpoint of block-quantized states is refused in another sharding with a
    one-line error naming the fix, while parameter-shaped states (bf16) reshard.
"""

from __future__ import annotations

import copy
import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from gloo_ranks import spawn_ranks
from minifloat.optim import AdamW
from minifloat.training.jsonstate import CheckpointError
from minifloat.training.loop import TrainConfig, build, train
from minifloat.training.parallel import Parallel, World
from minifloat.training.sharded import load_sharded, save_sharded

WORLD = 2
STEPS = 3
BLOCK = 128
HYPER = dict(lr=1e-2, weight_decay=0.1)
# (name, state formats, COAT expansion): float8, 8-bit linear and dynamic, 4-bit with the expansion's extra tensors
CASES = [("e4m3-bf16", ("e4m3", "bf16"), False), ("int8-int8dyn", ("int8", "int8-dynamic"), False),
         ("int4-int4dyn-expand", ("int4", "int4-dynamic"), True), ("bf16-bf16", ("bf16", "bf16"), False)]
QUANTIZED_CASES = [c for c in CASES if c[1] != ("bf16", "bf16")]
# parameters whose 2 shards start at a multiple of BLOCK: (100, 128) -> 2 × 50 blocks; (1, 4160) -> all on rank 0
ALIGNED = ("aligned.weight", "lonely")


class _Net(nn.Module):
    """Shapes chosen for their shards on 2 ranks (FSDP2 splits dim 0 as torch.chunk does)."""

    def __init__(self):
        super().__init__()
        self.aligned = nn.Linear(128, 100)  # weight (100, 128): 6400 = 50 blocks per rank
        self.uneven = nn.Linear(100, 75)  # (75, 100): 38 and 37 rows; rank 1 starts inside block 29
        self.narrow = nn.Linear(75, 64)  # (64, 75): 4800 elements, 2400 per rank; quantized by the global numel
        self.lonely = nn.Parameter(torch.randn(1, 4160) * 0.1)  # one row: rank 1's shard is empty
        # the biases (100, 75, 64 elements) keep fp32 states by rule, sharded unevenly too

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 128) -> scalar loss
        y = self.narrow(torch.tanh(self.uneven(torch.tanh(self.aligned(x)))))
        return y.square().mean() + self.lonely.pow(3).mean()


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batch(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(16, 128, generator=torch.Generator().manual_seed(100 * rank + step))


def _local_states(opt, params: dict) -> dict:
    """{parameter name: {state key: local tensor clone}}."""
    return {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in params.items() if opt.state[p]}


def _fsdp_case(rank: int, formats, expand: bool, ckpt: str) -> dict:
    """STEPS FSDP2 steps beside (1) an optimizer of each rank's local slices and (2) the one-process optimizer, both
    stepping FSDP2's gradients (the one-process one diverges on the parameters whose blocks differ; only the
    block-aligned and fp32-state ones are compared with it)."""
    mesh = init_device_mesh("cpu", (WORLD,))
    net = _net()
    ref = copy.deepcopy(net)
    fully_shard(net, mesh=mesh)
    opt = AdamW(net.parameters(), state_formats=formats, expand=expand, **HYPER)
    ref_opt = AdamW(ref.parameters(), state_formats=formats, expand=expand, **HYPER)
    params, ref_params = dict(net.named_parameters()), dict(ref.named_parameters())
    # the slices: quantized where the sharded optimizer decides so on the global numel (min_quantized_numel=0 here)
    slices = {name: nn.Parameter(p.to_local().detach().clone()) for name, p in params.items()}
    quantized = [name for name, p in params.items() if not opt.keeps_fp32_state(p)]
    slice_opts = [AdamW([slices[n] for n in quantized], state_formats=formats, expand=expand, min_quantized_numel=0,
                        **HYPER),
                  AdamW([s for n, s in slices.items() if n not in quantized], state_formats="fp32", **HYPER)]
    out = {"quantized": quantized, "local_numel": {n: p.to_local().numel() for n, p in params.items()},
           "slice": [], "one_process": []}
    for step in range(STEPS):
        net(_batch(step)).backward()
        for name, p in params.items():  # both references step FSDP2's gradients, whole or sliced
            ref_params[name].grad = p.grad.full_tensor()
            slices[name].grad = p.grad.to_local().clone()
        opt.step(), ref_opt.step(), [o.step() for o in slice_opts]
        opt.zero_grad(), ref_opt.zero_grad(), [o.zero_grad() for o in slice_opts]
        ours = _local_states(opt, params)
        slice_states = {**_local_states(slice_opts[0], {n: slices[n] for n in quantized}),
                        **_local_states(slice_opts[1], {n: s for n, s in slices.items() if n not in quantized})}
        out["slice"].append({name: torch.equal(params[name].to_local(), slices[name])
                             and all(_leading_equal(ours[name][k], v) for k, v in slice_states[name].items())
                             for name in params})
        one = {}
        for name in [*ALIGNED, *(n for n in params if n not in quantized)]:
            whole = _local_states(ref_opt, {name: ref_params[name]})[name]
            same = torch.equal(params[name].full_tensor(), ref_params[name])
            for key, value in whole.items():
                if key == "step":
                    same = same and torch.equal(ours[name][key], value)
                elif name not in quantized:  # fp32 states: the parameter's rows
                    same = same and torch.equal(ours[name][key], value[_param_rows(params[name], rank)])
                else:  # aligned: the rank's blocks are blocks r·n .. of the whole tensor (n: the padded count)
                    used = -(-params[name].to_local().numel() // BLOCK)
                    first = rank * ours[name][key].shape[0]
                    same = same and torch.equal(ours[name][key][:used], value[first: first + used])
            one[name] = same
        out["one_process"].append(one)

    # state_dict: DTensors on the parameter's mesh; block-wise ones evenly sharded over the padded block count
    state = opt.state_dict()["state"]
    index = {name: i for i, name in enumerate(params)}
    out["dtensors"] = all(isinstance(v, DTensor) for s in state.values() for k, v in s.items() if k != "step")
    name = "aligned.weight"
    out["codes_global_shape"] = tuple(state[index[name]]["exp_avg"].shape)
    out["codes_local_rows"] = opt.state[params[name]]["exp_avg"].shape[0]

    # DCP: saved by these 2 ranks and loaded by them again, bitwise (padding blocks and the empty shard included)
    world = World(rank, WORLD, Parallel.FSDP)
    save_sharded(ckpt, model=net, optimizer=opt, world=world, extra={"step": STEPS})
    again = _net()
    fully_shard(again, mesh=mesh)
    again_opt = AdamW(again.parameters(), state_formats=formats, expand=expand, **HYPER)
    load_sharded(ckpt, model=again, optimizer=again_opt)
    loaded = _local_states(again_opt, dict(again.named_parameters()))
    out["dcp_round_trip"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                                zip(net.parameters(), again.parameters())) and all(
        loaded[n].keys() == s.keys() and all(torch.equal(s[k], loaded[n][k]) for k in s)
        for n, s in _local_states(opt, params).items())
    out["local_params"] = {n: p.to_local().clone() for n, p in params.items()}
    out["local_states"] = _local_states(opt, params)
    return out


def _leading_equal(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether `ours` starts with `ref` (the rows past it are the padding blocks of a shorter shard)."""
    return torch.equal(ours[: ref.shape[0]] if ref.dim() else ours, ref)


def _param_rows(p: DTensor, rank: int) -> slice:
    """The rows of the whole parameter that `rank` holds (FSDP2: torch.chunk of dim 0)."""
    per = -(-p.shape[0] // WORLD)
    return slice(min(rank * per, p.shape[0]), min(rank * per + per, p.shape[0]))


def _skip_and_rollback(rank: int) -> dict:
    """A NaN in rank 1's gradient shard only: both ranks skip the step. Then StepGuard's rollback: a deep copy of
    state_dict() (DTensors) loaded back after a step restores the local states."""
    net = _net()
    fully_shard(net, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = AdamW(net.parameters(), state_formats=("e4m3", "bf16"), **HYPER)
    net(_batch(0)).backward()
    opt.step(), opt.zero_grad()
    before = [p.to_local().clone() for p in net.parameters()]
    net(_batch(1)).backward()
    if rank == 1:
        net.uneven.weight.grad.to_local()[0, 0] = float("nan")
    opt.step(), opt.zero_grad()
    out = {"skipped": opt.skipped_steps,
           "unchanged": all(torch.equal(b, p.to_local()) for b, p in zip(before, net.parameters()))}
    params = dict(net.named_parameters())
    saved, snapshot = _local_states(opt, params), copy.deepcopy(opt.state_dict())
    net(_batch(2)).backward()
    opt.step()
    opt.load_state_dict(snapshot)
    restored = _local_states(opt, params)
    out["rolled back"] = all(torch.equal(v, restored[n][k]) for n, s in saved.items() for k, v in s.items())
    return out


def _ddp_states(rank: int) -> dict:
    """DDP with different data per rank: every rank's full states after STEPS steps."""
    net = _net()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = AdamW(net.parameters(), state_formats=("int8", "int8-dynamic"), **HYPER)
    for step in range(STEPS):
        ddp(_batch(step, rank)).backward()
        opt.step(), opt.zero_grad()
    return _local_states(opt, dict(net.named_parameters()))


def _worker(rank: int, world: int, folder: str) -> dict:
    out = {name: _fsdp_case(rank, formats, expand, f"{folder}/ckpt-{name}") for name, formats, expand in CASES}
    out["nonfinite"] = _skip_and_rollback(rank)
    out["ddp"] = _ddp_states(rank)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], pathlib.Path]:
    """Every 2-rank scenario of the FSDP and DDP tests, in one spawn (process start-up dominates)."""
    folder = tmp_path_factory.mktemp("optim_fsdp")
    return spawn_ranks(functools.partial(_worker, folder=str(folder)), folder, WORLD), folder


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_each_rank_holds_the_states_of_its_local_slice(ranks, case):
    results, _ = ranks
    for rank, result in enumerate(results):
        for step, same in enumerate(result[case]["slice"]):
            differ = [name for name, ok in same.items() if not ok]
            assert not differ, f"rank {rank}, step {step}: {differ} differ from an optimizer of the local slice"


def test_fp32_rule_decides_on_the_global_numel(ranks):
    results, _ = ranks
    for rank, result in enumerate(results):
        case = result["e4m3-bf16"]
        assert sorted(case["quantized"]) == ["aligned.weight", "lonely", "narrow.weight", "uneven.weight"]
        assert case["local_numel"]["narrow.weight"] == 2400  # below min_quantized_numel (4096) on each rank
        assert case["local_numel"]["lonely"] == (4160 if rank == 0 else 0)  # an empty shard


@pytest.mark.parametrize("case", [c[0] for c in QUANTIZED_CASES])
def test_block_aligned_shards_equal_the_one_process_optimizer(ranks, case):
    results, _ = ranks
    for rank, result in enumerate(results):
        for step, same in enumerate(result[case]["one_process"]):
            differ = [name for name, ok in same.items() if not ok]
            assert set(same) >= set(ALIGNED) and not differ, f"rank {rank}, step {step}: {differ} differ"


def test_state_dict_holds_dtensors_of_padded_blocks(ranks):
    results, _ = ranks
    rows = [r["e4m3-bf16"]["codes_local_rows"] for r in results]
    assert rows == [50, 50]  # aligned.weight: 6400 elements per rank
    for result in results:
        assert result["e4m3-bf16"]["dtensors"]
        assert result["e4m3-bf16"]["codes_global_shape"] == (WORLD * 50, BLOCK)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_dcp_checkpoint_loads_bitwise_on_the_same_ranks(ranks, case):
    results, _ = ranks
    assert all(r[case]["dcp_round_trip"] for r in results)


def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all(ranks):
    results, _ = ranks
    assert [r["nonfinite"] for r in results] == [{"skipped": 1, "unchanged": True, "rolled back": True}] * WORLD


def test_ddp_ranks_keep_identical_states(ranks):
    results, _ = ranks
    states = [r["ddp"] for r in results]
    assert states[0].keys() == states[1].keys() and states[0]
    for name, state in states[0].items():
        for key, value in state.items():
            assert torch.equal(value, states[1][name][key]), f"{name}.{key} differs between the DDP ranks"
    assert states[0]["aligned.weight"]["exp_avg_sq"].dtype == torch.uint8  # int8-dynamic codes, not fp32


def test_parameter_shaped_states_reshard_to_one_process(ranks):
    results, folder = ranks
    net = _net()
    opt = AdamW(net.parameters(), state_formats=("bf16", "bf16"), **HYPER)
    load_sharded(folder / "ckpt-bf16-bf16", model=net, optimizer=opt)
    for name, p in net.named_parameters():
        assert torch.equal(p.detach(), torch.cat([r["bf16-bf16"]["local_params"][name] for r in results]))
        for key, value in opt.state[p].items():
            if key == "step":
                assert value.item() == STEPS
            else:
                whole = torch.cat([r["bf16-bf16"]["local_states"][name][key] for r in results])
                assert torch.equal(value, whole), f"{name}.{key} differs after 2 FSDP ranks -> 1 process"


@pytest.mark.parametrize("case", [c[0] for c in QUANTIZED_CASES])
def test_block_states_refuse_another_sharding(ranks, case):
    _, folder = ranks
    formats, expand = next((c[1], c[2]) for c in CASES if c[0] == case)
    net = _net()
    opt = AdamW(net.parameters(), state_formats=formats, expand=expand, **HYPER)
    with pytest.raises(CheckpointError) as err:
        load_sharded(folder / f"ckpt-{case}", model=net, optimizer=opt)
    message = str(err.value)
    assert "\n" not in message and message.endswith("resume it with --nproc 2 --parallel fsdp"), message
    assert "2 shards per parameter" in message and "whole parameters" in message
    assert not opt.state  # refused before anything was loaded


# ---------------------------------------------------------------------------------------------- the trainer

TRAIN = dict(model="tiny", preset="fp8-delayed", batch_size=2, seq_len=32, warmup=1, eval_every=100, eval_batches=1,
             max_bytes=100_000, seed=3, nproc=WORLD, parallel="fsdp")
TRAIN_FORMATS = ("e4m3,bf16", "int8,int8-dynamic")
CODE_DTYPES = {"e4m3,bf16": torch.float8_e4m3fn, "int8,int8-dynamic": torch.int8}


def _train_worker(rank: int, world: int, folder: str) -> dict:
    """Per format: 3 steps in one run; 2 steps, then resumed to 3 from the checkpoint."""
    out = {}
    for formats in TRAIN_FORMATS:
        base = dict(TRAIN, optimizer_state=formats)
        whole = train(TrainConfig(**base, steps=3, checkpoint_every=3, out=f"{folder}/{formats}/whole"),
                      progress=False)
        # the first part follows the 3-step schedule (lr_decay_steps), as a run cut short would
        train(TrainConfig(**base, steps=2, checkpoint_every=2, lr_decay_steps=3, out=f"{folder}/{formats}/resumed"),
              progress=False)
        resumed = train(TrainConfig(**base, steps=3, checkpoint_every=3, out=f"{folder}/{formats}/resumed",
                                    resume=True), progress=False)
        out[formats] = {"whole": whole.losses, "resumed": resumed.losses}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[list[dict], pathlib.Path]:
    folder = tmp_path_factory.mktemp("optim_fsdp_train")
    return spawn_ranks(functools.partial(_train_worker, folder=str(folder)), folder, WORLD), folder


@pytest.mark.slow  # the spawn runs the trainer 6 times: 21-35 s on 2 cores
@pytest.mark.parametrize("formats", TRAIN_FORMATS)
def test_trainer_fsdp_resume_is_bitwise(trained, formats):
    results, folder = trained
    losses = results[0][formats]
    assert losses["resumed"] == losses["whole"][2:]
    whole, resumed = (sorted((folder / formats / run / "ckpt").glob("*.safetensors")) for run in ("whole", "resumed"))
    assert len(whole) == WORLD and [p.name for p in whole] == [p.name for p in resumed]
    for a, b in zip(whole, resumed):
        tensors, again = load_file(a), load_file(b)
        assert tensors.keys() == again.keys()
        codes = [k for k, v in tensors.items() if k.endswith("exp_avg") and v.dtype == CODE_DTYPES[formats]]
        assert codes, f"no {formats} moment codes in {a.name}"
        for key, value in tensors.items():
            assert torch.equal(value, again[key]), f"{key} differs in {a.name} after the resume"


@pytest.mark.slow  # shares the trainer spawn above
def test_trainer_checkpoint_refused_in_one_process(trained):
    _, folder = trained
    config = TrainConfig(**{**TRAIN, "nproc": 1, "parallel": None}, grad_accum=WORLD, optimizer_state="e4m3,bf16",
                         steps=3, out=str(folder / "one"))
    run = build(config, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"resume it with --nproc 2 --parallel fsdp$"):
        load_sharded(folder / "e4m3,bf16" / "whole" / "ckpt", model=run.model, optimizer=run.optimizer)


# ---------------------------------------------------------------------------------------------- FSDP2 over TP

def _mlp_2d(mesh) -> nn.Module:
    """A column-parallel then row-parallel MLP on the mesh's "tp" dim, fully_shard-ed over "dp" (the placements of
    --parallel fsdp+tp: _StridedShard and Shard over a 2-D mesh)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(96, 200), nn.ReLU(), nn.Linear(200, 72))
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(net, mesh=mesh["dp"])
    return net


def _fsdp_over_tp_worker(rank: int, world: int, folder: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = _mlp_2d(mesh)
    opt = AdamW(net.parameters(), state_formats=("e4m3", "int8-dynamic"), **HYPER)
    for step in range(STEPS):
        net(_batch(step)[:, :96]).square().mean().backward()
        opt.step(), opt.zero_grad()
    save_sharded(f"{folder}/ckpt", model=net, optimizer=opt, world=World(rank, world, Parallel.FSDP_TP, 2))
    again = _mlp_2d(mesh)
    again_opt = AdamW(again.parameters(), state_formats=("e4m3", "int8-dynamic"), **HYPER)
    load_sharded(f"{folder}/ckpt", model=again, optimizer=again_opt)
    saved, loaded = _local_states(opt, dict(net.named_parameters())), _local_states(again_opt,
                                                                                     dict(again.named_parameters()))
    return {"layout": opt.block_layout(),
            "round trip": all(torch.equal(v, loaded[n][k]) for n, s in saved.items() for k, v in s.items())}


@pytest.mark.slow  # 4 ranks: 23-40 s on 2 cores
def test_fsdp_over_tp_states_load_bitwise_on_the_same_mesh(tmp_path):
    results = spawn_ranks(functools.partial(_fsdp_over_tp_worker, folder=str(tmp_path)), tmp_path, 4)
    assert all(r["round trip"] for r in results)
    assert results[0]["layout"][0].startswith("4 shards per parameter (mesh (2, 2), _StridedShard")
