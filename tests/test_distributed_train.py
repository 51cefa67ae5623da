"""Multi-process training (issue 10; docs/distributed.md): 2 gloo ranks on the CPU, each trained through
`minifloat.training.loop.train`. Identical FP8 scaling state on every rank with different data per rank; DDP and
FSDP2 losses against one process training on the same global batch; sharded (DCP) checkpoints across 2 -> 1 and
1 -> 2 ranks; `minifloat train --nproc 2` end to end, and a rank killed mid-run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from gloo_ranks import rendezvous
from minifloat.training import loop
from minifloat.training.loop import TrainConfig, build, train
from minifloat.training.parallel import Parallel, World
from minifloat.training.sharded import is_sharded, load_sharded, read_extra, save_sharded

NPROC = 2
SMALL = dict(model="tiny", preset="fp8-delayed", batch_size=2, seq_len=32, warmup=1, eval_every=100, eval_batches=1,
             max_bytes=100_000, checkpoint_every=0, seed=3)
# Per-step training loss of 2 ranks × grad_accum K against one process × grad_accum 2K on the same batches. Not
# bitwise: (1) the gradients differ in the order of fp32 sums (DDP averages two half-sums; one process sums all),
# ~1e-7 relative, and an FP8 cast a few AdamW steps later may round an element to a neighbouring grid point; (2) at
# step 0 delayed scaling seeds each role's scale from the first tensor a rank meets (docs/fp8.md), which is micro-batch
# 0 for one process but each rank's own first micro-batch for 2 ranks (from step 1 on, every rank's scales come from
# the MAX-reduced history). Measured: ~6e-6 relative at step 0 on AMD EPYC and Intel Xeon; at step 2 below 1e-4 on
# the AMD and 1.1e-4 on an Intel Xeon with AVX-512 (2026-12-02), where the grid-point flips come sooner. Step 0 is
# held tight: a rank that trains on the wrong half of the global batch moves it by 1.5e-2 (one process on half the
# batch: 5.478 against 5.397), 150× FIRST_LOSS_RTOL.
FIRST_LOSS_RTOL = 1e-4
LOSS_RTOL = 1e-3
# Tensor parallelism also splits the row-parallel GEMMs' K sums across ranks (another fp32 order inside every step),
# so FP8 casts round a neighbouring grid point more often: 1.1e-4 relative measured after 4 steps (tiny, current)
TP_LOSS_RTOL = 1e-3


def _worker(rank: int, init_method: str, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=NPROC)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _spawn(fn, *args) -> None:
    """Run fn(rank, *args) on NPROC gloo ranks (module-level functions only: the ranks are spawned)."""
    with rendezvous() as init_method:
        mp.spawn(_worker, args=(init_method, fn, args), nprocs=NPROC)


def _train_rank(rank: int, config: TrainConfig, folder: str) -> None:
    """Train `config` on this rank; write its losses (rank 0) and its model's state (every rank) into `folder`."""
    runs = []
    real_build = loop.build
    loop.build = lambda *a, **k: runs.append(real_build(*a, **k)) or runs[-1]  # keep the run to read its model
    result = train(config, progress=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(runs[0].model, options=StateDictOptions(full_state_dict=True))
    save_file({k: v.contiguous().clone() for k, v in state.items()}, f"{folder}/state{rank}.safetensors")
    if rank == 0:
        pathlib.Path(folder, "losses.json").write_text(json.dumps(result.losses))


def _fp8_buffers(state: dict) -> dict:
    return {k: v for k, v in state.items() if "amax_history" in k or "scale" in k}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """2 DDP ranks, 3 steps of grad_accum 1, a checkpoint at the end: (config, folder with losses and states)."""
    folder = tmp_path_factory.mktemp("ddp")
    config = TrainConfig(**{**SMALL, "checkpoint_every": 3}, steps=3, out=str(folder / "run"), nproc=NPROC,
                         parallel="ddp")
    _spawn(_train_rank, config, str(folder))
    return config, folder


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process on the same global batches: grad_accum = 2 (losses)."""
    folder = tmp_path_factory.mktemp("one")
    result = train(TrainConfig(**SMALL, steps=3, grad_accum=NPROC, out=str(folder / "run")), progress=False)
    return result.losses


def test_fp8_state_identical_on_all_ranks(ddp_run):
    _, folder = ddp_run
    states = [load_file(folder / f"state{r}.safetensors") for r in range(NPROC)]
    buffers = [_fp8_buffers(s) for s in states]
    assert buffers[0], "the fp8-delayed model has no FP8 scaling buffers"
    for key in buffers[0]:
        assert torch.equal(buffers[0][key], buffers[1][key]), f"{key} differs between rank 0 and rank 1"
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), f"{key} differs between rank 0 and rank 1"
    # the ranks saw different data: rank 0 alone would have recorded other amaxes than the MAX over both
    history = next(v for k, v in buffers[0].items() if "amax_history" in k)
    assert history.shape[0] > 1 and torch.isfinite(history).all()


def test_ddp_loss_equals_one_process_of_same_global_batch(ddp_run, one_process):
    _, folder = ddp_run
    ddp = json.loads((folder / "losses.json").read_text())
    assert len(ddp) == len(one_process) == 3
    assert ddp[0] == pytest.approx(one_process[0], rel=FIRST_LOSS_RTOL)
    assert ddp == pytest.approx(list(one_process), rel=LOSS_RTOL)


def _trains_as_one_process(tmp_path, one_process, **fields) -> None:
    """NPROC ranks under `fields` train as one process does on the same global batch (step 0 to FIRST_LOSS_RTOL,
    every step to LOSS_RTOL), and end with identical FP8 scaling state."""
    config = TrainConfig(**SMALL, steps=3, out=str(tmp_path / "run"), nproc=NPROC, **fields)
    _spawn(_train_rank, config, str(tmp_path))
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses[0] == pytest.approx(one_process[0], rel=FIRST_LOSS_RTOL)
    assert losses == pytest.approx(list(one_process), rel=LOSS_RTOL)
    states = [load_file(tmp_path / f"state{r}.safetensors") for r in range(NPROC)]
    for key, value in _fp8_buffers(states[0]).items():
        assert torch.equal(value, states[1][key]), f"{key} differs between rank 0 and rank 1"


@pytest.mark.slow  # 25 s
def test_fsdp_loss_equals_one_process_of_same_global_batch(tmp_path, one_process):
    _trains_as_one_process(tmp_path, one_process, parallel="fsdp")


def _load_on_rank(rank: int, config: TrainConfig, ckpt: str, folder: str) -> None:
    """Build `config`'s run on this rank, load the sharded checkpoint, write the full model state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    world = World(rank, NPROC, Parallel(config.parallel))
    run = build(config, torch.device("cpu"), world)
    extra = load_sharded(ckpt, model=run.model, optimizer=run.optimizer)
    state = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True))
    save_file({k: v.contiguous().clone() for k, v in state.items()}, f"{folder}/loaded{rank}.safetensors")
    if rank == 0:
        pathlib.Path(folder, "extra.json").write_text(json.dumps(extra["step"]))
    # and saved again from these ranks (under FSDP2 the FP8 weights' shards are FP8-gather wrappers)
    save_sharded(f"{folder}/ckpt2", model=run.model, optimizer=run.optimizer, world=world, extra=extra)


def test_sharded_checkpoint_2_to_1(ddp_run, tmp_path):
    config, folder = ddp_run
    ckpt = pathlib.Path(config.out) / "ckpt"
    assert is_sharded(ckpt) and read_extra(ckpt)["step"] == 3
    assert not list(ckpt.glob("*.metadata")) and not list(ckpt.glob("*.distcp"))  # no pickled DCP metadata
    trained = load_file(folder / "state0.safetensors")

    # 2 -> 1: one process, no process group
    single = dataclasses.replace(config, nproc=1, parallel=None, grad_accum=NPROC)
    run = build(single, torch.device("cpu"))
    load_sharded(ckpt, model=run.model, optimizer=run.optimizer)
    loaded = run.model.state_dict()
    assert _fp8_buffers(trained)
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), f"{key} differs after loading 2 ranks' checkpoint in one process"


# Slow: the spawned FSDP ranks once ended in SIGABRT at exit ("terminate called without an active exception") in a
# full-suite run; it passed on every rerun. Kept out of the default suite until that is understood.
@pytest.mark.slow
def test_sharded_checkpoint_1_to_2_fsdp_to_1(ddp_run, tmp_path):
    config, folder = ddp_run
    trained = load_file(folder / "state0.safetensors")
    single = dataclasses.replace(config, nproc=1, parallel=None, grad_accum=NPROC)
    run = build(single, torch.device("cpu"))
    load_sharded(pathlib.Path(config.out) / "ckpt", model=run.model, optimizer=run.optimizer)

    # 1 -> 2: what one process saves loads on 2 FSDP ranks, sharded differently
    one_ckpt = tmp_path / "ckpt1"
    save_sharded(one_ckpt, model=run.model, optimizer=run.optimizer, world=World(), extra={"step": 3})
    fsdp = dataclasses.replace(config, parallel="fsdp")
    _spawn(_load_on_rank, fsdp, str(one_ckpt), str(tmp_path))
    for rank in range(NPROC):
        again = load_file(tmp_path / f"loaded{rank}.safetensors")
        for key, value in trained.items():
            assert torch.equal(again[key], value), f"{key} differs on rank {rank} after 1 -> 2"
    assert json.loads((tmp_path / "extra.json").read_text()) == 3

    # 2 FSDP ranks -> 1: the checkpoint the FSDP ranks wrote loads in one process, bitwise
    run = build(single, torch.device("cpu"))
    load_sharded(tmp_path / "ckpt2", model=run.model, optimizer=run.optimizer)
    for key, value in trained.items():
        assert torch.equal(run.model.state_dict()[key], value), f"{key} differs after FSDP 2 -> 1"


def _cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minifloat.cli", "train", *args], capture_output=True, text=True,
                          timeout=240, **kwargs)


FLAGS = ("--model", "tiny", "--preset", "fp8-delayed", "--batch-size", "2", "--seq-len", "32", "--warmup", "1",
         "--eval-batches", "1", "--max-bytes", "100000")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> pathlib.Path:
    """`minifloat train --nproc 2`: 2 steps with a checkpoint at the end."""
    out = tmp_path_factory.mktemp("cli") / "run"
    done = _cli(*FLAGS, "--steps", "2", "--nproc", "2", "--out", str(out), "--checkpoint-every", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_cli_launches_ranks_rank_0_writes(cli_run):
    out = cli_run
    assert {p.name for p in out.iterdir()} >= {"ckpt", "log.csv", "run.json", "val.csv"}
    rows = (out / "log.csv").read_text().splitlines()
    assert len(rows) == 3  # header + one row per step: rank 0 alone writes
    assert json.loads((out / "run.json").read_text())["config"]["nproc"] == 2
    assert read_extra(out / "ckpt")["step"] == 2


def test_a_sharded_checkpoint_without_its_state_names_that_file(cli_run, tmp_path):
    # it was taken for a single-file checkpoint and reported "manifest.json is missing", a file it never has
    import shutil

    from minifloat.training.jsonstate import CheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(cli_run / "ckpt", ckpt)
    (ckpt / "state.json").unlink()
    assert is_sharded(ckpt)
    with pytest.raises(CheckpointError, match=r"state\.json is missing; .* holds shard files but is not a complete"):
        read_extra(ckpt)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_shard_is_one_error_naming_the_fix(cli_run, tmp_path, damage, caplog):
    """A truncated or deleted shard file ended a resume in DCP's tracebacks (its CheckpointException is a
    BaseException, which no `except Exception` caught): now one CheckpointError line with the fix."""
    import shutil

    from minifloat.training.checkpoint import CHECKPOINT_FIX
    from minifloat.training.jsonstate import CheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(cli_run / "ckpt", ckpt)
    shard = max(ckpt.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    if damage == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(1000)
    else:
        shard.unlink()
    config = TrainConfig(**SMALL, steps=3, grad_accum=2, out=str(tmp_path / "unused"))
    run = build(config, torch.device("cpu"))
    with pytest.raises(CheckpointError, match="cannot be loaded .* a shard is missing or damaged") as caught:
        load_sharded(ckpt, model=run.model, optimizer=run.optimizer)
    line = str(caught.value)
    assert line.endswith(CHECKPOINT_FIX) and "\n" not in line and "Traceback" not in line
    assert " ...)" in line or len(line.split("(", 1)[1].split(")")[0]) < 100  # the cause cut at a word, if at all
    # DCP's loader logs "Global metadata is not found" with a traceback to the root logger: none of it reaches you
    assert not [r for r in caplog.records if "distributed/checkpoint" in r.pathname]
    assert len(line) - len(str(ckpt)) < 310  # within the CLI's 400 characters for a path of up to 90


def test_rescaled_gradient_amaxes_follow_the_gradients_size():
    """Resuming with other micro-batches per rank changes each backward's gradients by old K / new K (each rank
    divides its losses by its own K): the delayed layers' output-gradient history and scale follow, nothing else."""
    from minifloat.fp8.scaling import ROLE_INDEX
    from minifloat.fp8.step import rescale_gradient_amaxes
    from minifloat.fp8.recipes import Role
    import minifloat as mf

    model = mf.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)),
                       recipe=mf.DelayedScaling(), keep_first_last=False)
    model(torch.randn(8, 32)).square().mean().backward()
    mf.fp8_step(model)
    state = model[1].fp8_state
    history, scale, generation = state.amax_history.clone(), state.scale.clone(), state.generation
    assert rescale_gradient_amaxes(model, 2.0) == 3
    col = ROLE_INDEX[Role.GRAD_OUTPUT]
    assert torch.equal(state.amax_history[:, col], history[:, col] * 2) and torch.equal(state.scale[col], scale[col] / 2)
    others = [c for c in range(len(scale)) if c != col]
    assert torch.equal(state.amax_history[:, others], history[:, others]) and torch.equal(state.scale[others],
                                                                                          scale[others])
    assert state.generation > generation
    current = mf.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)),
                         recipe=mf.CurrentScaling(), keep_first_last=False)
    assert rescale_gradient_amaxes(current, 2.0) == 0  # current scaling takes each step's own amax


@pytest.mark.slow  # 30 s: a one-process run, then 2 ranks
def test_a_delayed_run_resumed_on_two_ranks_continues_the_same_run(tmp_path):
    """A one-process --grad-accum 2 checkpoint continued by 2 ranks with --grad-accum 1: the gradients doubled against
    the stored history, and the first resumed step's gradient norm was 0.86% off the uninterrupted run's."""
    import shutil

    flags = (*FLAGS, "--steps", "5", "--checkpoint-every", "3", "--eval-every", "100")
    whole = _cli(*flags, "--grad-accum", "2", "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = _cli(*FLAGS, "--steps", "3", "--checkpoint-every", "3", "--eval-every", "100", "--grad-accum", "2",
                 "--lr-decay-steps", "5", "--out", str(tmp_path / "resumed"))
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.copytree(tmp_path / "resumed", tmp_path / "kept")
    resumed = _cli("--out", str(tmp_path / "resumed"), "--resume", "--steps", "5", "--nproc", "2", "--grad-accum", "1",
                   "--lr-decay-steps", "5")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    norms = [{int(r["step"]): float(r["grad_norm"]) for r in _rows_of(tmp_path / run)} for run in ("whole", "resumed")]
    assert norms[1][3] == pytest.approx(norms[0][3], rel=1e-3)


def _rows_of(out: pathlib.Path) -> list[dict]:
    import csv

    with open(out / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # 20 s
def test_cli_resumes_two_ranks_run_on_one_process(cli_run):
    out = cli_run
    # the run continues in one process with the same micro-batches per step (2 ranks × 1 = 1 process × 2)
    same = _cli("--out", str(out), "--resume", "--steps", "3", "--nproc", "1")
    assert same.returncode == 2 and "--grad-accum 2" in same.stderr and same.stderr.count("\n") == 1, same.stderr
    resumed = _cli("--out", str(out), "--resume", "--steps", "3", "--nproc", "1", "--grad-accum", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len((out / "log.csv").read_text().splitlines()) == 4


@pytest.mark.slow  # 40 s
def test_cli_fsdp_tp_trains_and_resumes_in_one_process(tmp_path):
    """2 ranks as one tensor-parallel group (fsdp+tp, --tp-size 2: one data rank); the 2-D sharded checkpoint
    continues in one process with the same micro-batches per step."""
    out = tmp_path / "run"
    done = _cli(*FLAGS, "--steps", "2", "--nproc", "2", "--parallel", "fsdp+tp", "--tp-size", "2", "--out", str(out),
                "--checkpoint-every", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_extra(out / "ckpt")["step"] == 2
    resumed = _cli("--out", str(out), "--resume", "--steps", "3", "--nproc", "1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Warning" not in resumed.stderr
    rows = (out / "log.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == [0, 1, 2]
    assert all(math.isfinite(float(r.split(",")[1])) for r in rows)


@pytest.mark.slow  # 50 s
def test_cli_fsdp_tp_current_scaling_accumulates_as_one_process(tmp_path):
    """fsdp+tp with current scaling and 2 micro-batches per step: the weight cache hit on one rank and missed on the
    other (FSDP2 gathers to the allocator's addresses), so the ranks' weight-amax all-reduces went out of step and gloo
    aborted the job; the losses now follow one process accumulating the same micro-batches."""
    flags = (*FLAGS[:2], "--preset", "fp8-current", *FLAGS[4:], "--steps", "4", "--grad-accum", "2")
    tp = _cli(*flags, "--nproc", "2", "--parallel", "fsdp+tp", "--tp-size", "2", "--out", str(tmp_path / "tp"))
    assert tp.returncode == 0, tp.stderr[-2000:]
    # torch's warnings of a view returned through FSDP2 and of two sequential all-reduces (the gradient norm over
    # dp and tp) reached the user on every fsdp+tp run
    assert "returned a view tensor" not in tp.stderr and "sequential all_reduce" not in tp.stderr, tp.stderr
    one = _cli(*flags, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    losses = [[float(r.split(",")[1]) for r in (tmp_path / run / "log.csv").read_text().splitlines()[1:]]
              for run in ("tp", "one")]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=TP_LOSS_RTOL)


@pytest.mark.parametrize("fields, words", [
    (dict(nproc=3, parallel="fsdp+tp", tp_size=2), ["nproc is 3", "--tp-size"]),
    # said "choose a --tp-size dividing it", which no size of 2 or more does
    (dict(nproc=1, parallel="fsdp+tp", tp_size=2), ["nproc is 1", "add --nproc N (a multiple of 2)"]),
    (dict(nproc=4, parallel="fsdp+tp", tp_size=2, seq_len=33), ["seq_len is 33"]),
])
def test_fsdp_tp_config_is_checked(tmp_path, fields, words):
    with pytest.raises(ValueError) as err:
        TrainConfig(**{**SMALL, **fields}, out=str(tmp_path))
    assert all(w in str(err.value) for w in words)


def test_data_ranks_count_tensor_parallel_groups_once(tmp_path):
    assert TrainConfig(**SMALL, nproc=4, parallel="fsdp+tp", tp_size=2, out=str(tmp_path)).data_ranks == 2
    assert TrainConfig(**SMALL, nproc=4, parallel="fsdp", out=str(tmp_path)).data_ranks == 4


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the process with RANK=rank among the launcher's children (Linux /proc)."""
    for child in pathlib.Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        environ = pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process through /proc")
def test_killed_rank_stops_job_with_one_line_and_loadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "minifloat.cli", "train", *FLAGS, "--steps", "400", "--nproc", "2",
                             "--out", str(out), "--checkpoint-every", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "ckpt" / "state.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("minifloat: error: rank 1 of 2: killed by SIGKILL"), err[-2000:]
    step = read_extra(out / "ckpt")["step"]
    assert step >= 2 and step % 2 == 0
    config = TrainConfig(**SMALL, steps=400, grad_accum=2, out=str(out))
    run = build(config, torch.device("cpu"))
    assert load_sharded(out / "ckpt", model=run.model, optimizer=run.optimizer)["step"] == step


@pytest.mark.slow  # 20 s each (each rank compiles); tests/test_fsdp_tp.py checks FSDP2 + compile in one process
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_compiled_blocks_train_as_eager_across_ranks(tmp_path, one_process, parallel):
    """`compile` (each block's forward compiled: the trainer's default scope) under DDP and FSDP2: the ranks train as
    one process does eagerly on the same global batch (to LOSS_RTOL), and keep identical FP8 scaling state. FSDP2's
    per-block gathers are module hooks, outside the compiled forwards (minifloat.training.compiled)."""
    _trains_as_one_process(tmp_path, one_process, parallel=parallel, compile=True)


def test_an_os_error_on_a_rank_names_the_option(tmp_path):
    # a rank's OSError reached the launcher as Python words it: "rank 0 of 2: [Errno 20] Not a directory: '.../run'"
    (tmp_path / "afile").write_text("mine")
    done = _cli(*FLAGS, "--steps", "1", "--nproc", "2", "--out", str(tmp_path / "afile" / "run"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--out {tmp_path / 'afile' / 'run'}: Not a directory" in done.stderr and "Errno" not in done.stderr
    assert (tmp_path / "afile").read_text() == "mine"
