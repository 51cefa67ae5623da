"""`minifloat train --master` (TrainConfig.master, minifloat.training.optimizer): bf16 weights without an fp32 master
in the trainer. The runs learn, their weights are bf16 outside the fp32 islands, a resume is bitwise, and the
clipping, the lr schedule and the low-precision AdamW's fp32-state rule reach through the wrapper."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch
from torch import nn
from safetensors.torch import load_file

from minifloat.amp.lowp_weights import LowPrecisionWeightOptimizer
from minifloat.cli import main
from minifloat.training.checkpoint import TENSORS_FILE
from minifloat.training.loop import TrainConfig, build, forward_backward, train
from minifloat.training.memory import first_batch
from minifloat.training.optimizer import grad_param_groups
from minifloat.training.rundir import CHECKPOINT_DIR

SMALL = dict(model="tiny", batch_size=4, seq_len=32, warmup=2, eval_every=100, eval_batches=1, max_bytes=100_000,
             checkpoint_every=0, device="cpu")
FP32_ISLANDS = ("wte.", "lm_head.", "norm.")  # parameters that stay fp32: the embedding, its tied head, the norms
USER_ERROR = 2


def _config(**fields) -> TrainConfig:
    return TrainConfig(**{**SMALL, **fields})


def _is_island(name: str) -> bool:
    return any(part in name for part in FP32_ISLANDS)


def _checkpoint_tensors(out: str) -> dict[str, torch.Tensor]:
    return load_file(str(pathlib.Path(out) / CHECKPOINT_DIR / TENSORS_FILE))


def _whole_and_resumed(tmp_path: pathlib.Path, **fields) -> tuple[TrainConfig, TrainConfig]:
    """4 steps in one go (run "a") against 2 + a resume to 4 (run "b"): asserts the loss falls and the resumed
    losses are the whole run's; returns both configs (their checkpoints are at step 4)."""
    whole = _config(steps=4, checkpoint_every=4, out=str(tmp_path / "a"), **fields)
    result = train(whole, progress=False)
    half = dataclasses.replace(whole, steps=2, checkpoint_every=2, lr_decay_steps=4, out=str(tmp_path / "b"))
    first = train(half, progress=False)
    second = train(dataclasses.replace(half, steps=4, lr_decay_steps=None, resume=True), progress=False)
    assert result.losses[-1] < result.losses[0]
    assert first.losses + second.losses == result.losses
    return whole, half


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in dtype or in any bit (every name must be in both)."""
    assert a.keys() == b.keys()
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731  (float8 has no ==; NaN == NaN bitwise)
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(bits(a[k]), bits(b[k]))]


@pytest.fixture(scope="module")
def half_run(tmp_path_factory) -> TrainConfig:
    """A bf16-sr run stopped at step 3 of a 6-step plan, with its checkpoint (left unchanged by the tests)."""
    config = _config(steps=3, checkpoint_every=3, lr_decay_steps=6, master="bf16-sr",
                     out=str(tmp_path_factory.mktemp("runs") / "half"))
    train(config, progress=False)
    return config


# (master, optimizer_state): each bf16 mode with torch's AdamW, and bf16-sr with low-precision moments
MODES = [("bf16-sr", "fp32,fp32"), ("bf16-kahan", "fp32,fp32"), ("bf16-sr", "e4m3,bf16")]


@pytest.mark.parametrize("master, states", MODES, ids=[f"{m}-{s}" for m, s in MODES])
def test_bf16_weights_train_and_resume_bitwise(tmp_path, master, states):
    """4 steps in one go against 2 + a resume to 4: the same losses, and the final checkpoints hold bitwise the same
    tensors (weights, inner AdamW state, compensation / generator state, in the same dtypes)."""
    whole, half = _whole_and_resumed(tmp_path, master=master, optimizer_state=states)
    a, b = _checkpoint_tensors(whole.out), _checkpoint_tensors(half.out)
    assert not _differing(a, b)
    weights = {k.removeprefix("model/"): t.dtype for k, t in a.items() if k.startswith("model/")}
    assert {k: d for k, d in weights.items() if _is_island(k)} == {k: torch.float32 for k in weights if _is_island(k)}
    assert {d for k, d in weights.items() if not _is_island(k)} == {torch.bfloat16}
    assert any(k.startswith("optim/compensation/") for k in a) == (master == "bf16-kahan")
    assert any(k.startswith("optim/generators/") for k in a) == (master == "bf16-sr")


def test_changing_master_on_resume_is_refused(half_run, capsys):
    for other in ("fp32", "bf16-kahan"):
        with pytest.raises(ValueError, match="--master bf16-sr"):
            train(dataclasses.replace(half_run, steps=6, resume=True, master=other), progress=False)
    status = main(["train", "--out", half_run.out, "--resume", "--steps", "6", "--master", "fp32"])
    err = capsys.readouterr().err
    assert status == USER_ERROR and err.count("\n") == 1 and "--master bf16-sr" in err, err


def test_a_checkpoint_without_master_counts_as_fp32():
    """Checkpoints written before TrainConfig.master existed ran with fp32 weights."""
    saved = _config(out="unused").flat()
    del saved["master"]
    _config(out="unused", steps=9).check_resume(saved, 3, where="ckpt")
    with pytest.raises(ValueError, match="--master fp32"):
        _config(out="unused", steps=9, master="bf16-sr").check_resume(saved, 3, where="ckpt")


# (name, TrainConfig fields, words of the error)
BAD = [
    ("unknown mode", dict(master="bf16"), ["master", "'bf16'", "bf16-sr"]),
    ("not a string", dict(master=None), ["master", "None"]),
    ("fp16 preset", dict(master="bf16-sr", preset="fp16"), ["master bf16-sr", "'fp16'", "float16"]),
    ("fp32 preset", dict(master="bf16-kahan", preset="fp32"), ["master bf16-kahan", "'fp32'"]),
    ("several ranks", dict(master="bf16-sr", nproc=2, parallel="ddp"), ["nproc=2", "--nproc 1"]),
]


@pytest.mark.parametrize("name, fields, words", BAD, ids=[c[0] for c in BAD])
def test_bad_master_values_are_refused(name, fields, words):
    with pytest.raises(ValueError) as err:
        _config(out="unused", **fields)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_cli_bad_master_is_one_error_line(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--master", "bf16", "--steps", "1"]) == USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("minifloat: error:") and err.count("\n") == 1 and "'bf16'" in err, err
    assert not any(tmp_path.iterdir())


def _stepped_run(**fields):
    """A bf16-sr run built as the trainer builds it, with one micro-batch's gradients."""
    config = _config(out="unused", master="bf16-sr", **fields)
    run = build(config)
    forward_backward(run, run.model, [first_batch(config, run.device)[0]], 0)
    return run


def test_clipping_reaches_the_bf16_gradients():
    """The wrapper's own groups hold fp32 temporaries without gradients; grad_param_groups holds the model's
    parameters, so the clip scales every gradient, bf16 ones included, to the limit."""
    run = _stepped_run(grad_clip=1e-3)
    assert isinstance(run.optimizer, LowPrecisionWeightOptimizer)
    assert all(t.grad is None for _, t in run.optimizer.pairs)
    groups = grad_param_groups(run.optimizer)
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in run.optimizer.param_groups]
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in run.model.parameters()}
    grads = [p.grad for p in run.model.parameters()]
    assert torch.bfloat16 in {g.dtype for g in grads}
    norms = run.stability.clip_grad_norms(groups)
    assert norms.total > 1e-3
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    assert clipped.item() == pytest.approx(1e-3, rel=0.01)  # bf16 gradients are rounded after the scaling


def test_lr_reaches_the_inner_adamw_before_and_after_a_load():
    run = _stepped_run()
    opt = run.optimizer
    for group in opt.param_groups:
        group["lr"] = 0.5
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.5] * len(opt.param_groups)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    for group in opt.param_groups:
        group["lr"] = 0.25
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.25] * len(opt.param_groups)


def test_low_precision_adamw_keeps_its_fp32_state_rule_behind_the_wrapper():
    """--optimizer-state e4m3,bf16 with bf16 weights: the norms and the embedding (fp32 islands, stepped directly)
    keep fp32 moments, the bf16 matrices (stepped through fp32 temporaries) get e4m3 / bf16 ones, and a state
    loaded into a fresh optimizer keeps those dtypes (the temporaries hold no data between steps)."""
    run = _stepped_run(optimizer_state="e4m3,bf16")
    run.optimizer.step()
    found = _moment_dtypes(run.model, run.optimizer)
    for name, dtypes in found.items():
        want = (torch.float32,) * 2 if _is_island(name) else (torch.float8_e4m3fn, torch.bfloat16)
        assert dtypes == want, name
    fresh = build(run.config)
    fresh.optimizer.load_state_dict(run.optimizer.state_dict())
    assert _moment_dtypes(fresh.model, fresh.optimizer) == found


def _moment_dtypes(model, optimizer: LowPrecisionWeightOptimizer) -> dict[str, tuple[torch.dtype, torch.dtype]]:
    """name -> (m, v) dtypes of each model parameter's moments in the inner AdamW (keyed by the tensor it steps)."""
    stepped = {id(p): t for p, t in optimizer.pairs}
    state = optimizer.state  # the inner optimizer's
    return {name: (state[stepped.get(id(p), p)]["exp_avg"].dtype, state[stepped.get(id(p), p)]["exp_avg_sq"].dtype)
            for name, p in model.named_parameters()}


def test_the_fp32_adamw_is_fused_only_where_every_parameter_is_on_cuda(monkeypatch):
    """CUDA parameters get torch's fused AdamW (one pass per tensor instead of foreach's several); CPU ones keep
    torch's default, so CPU runs keep their bits. CUDA is stood in for by the parameters' is_cuda."""
    from minifloat.training.optimizer import adamw, fused_on_cuda

    model = nn.Linear(4, 4)
    groups = [{"params": list(model.parameters())}]
    assert fused_on_cuda(groups) == {} and fused_on_cuda([]) == {}
    cpu = adamw(model, groups, lr=1e-3, state_formats=("fp32", "fp32"), master="fp32", seed=0)
    assert not cpu.defaults.get("fused")

    class OnCuda:  # a parameter that says it lives on a GPU
        is_cuda = True

    assert fused_on_cuda([{"params": [OnCuda(), OnCuda()]}]) == {"fused": True}
    assert fused_on_cuda([{"params": [OnCuda()]}, {"params": list(model.parameters())}]) == {}  # mixed: not fused
    monkeypatch.setattr("minifloat.training.optimizer.fused_on_cuda", lambda groups: {"fused": True})
    fused = adamw(model, groups, lr=1e-3, state_formats=("fp32", "fp32"), master="fp32", seed=0)
    assert fused.defaults["fused"] is True  # the run's optimizer takes what fused_on_cuda says


@pytest.mark.parametrize("master", ["fp32", "bf16-sr", "bf16-kahan"])
def test_every_master_mode_trains_and_resumes_bitwise_with_the_fused_adamw(tmp_path, monkeypatch, master):
    """The fused AdamW a CUDA run gets (forced here on the CPU, where torch has the kernel too) steps every master
    mode's weights (fp32 parameters, or the bf16 modes' fp32 temporaries) and resumes bitwise."""
    monkeypatch.setattr("minifloat.training.optimizer.fused_on_cuda", lambda groups: {"fused": True})
    whole, half = _whole_and_resumed(tmp_path, master=master)
    assert not _differing(_checkpoint_tensors(whole.out), _checkpoint_tensors(half.out))
    manifest = json.loads((pathlib.Path(whole.out) / CHECKPOINT_DIR / "manifest.json").read_text())
    assert '"fused": true' in json.dumps(manifest), "the run's optimizer was not the fused one"
