"""The trainer's promises about a user's runs (issue 9): a run folder is never replaced by accident, a resumed run
keeps its schedule and refuses another run's checkpoint, logs survive a kill, SIGTERM / SIGINT stop with a checkpoint,
gradient accumulation, and the device / MFU plumbing (tested on CPU and meta: no GPU here)."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from minifloat.cli import main
from minifloat.training import throughput
from minifloat.training.checkpoint import checkpoint_extra
from minifloat.training.loop import TrainConfig, build, forward_backward, train
from minifloat.training.rundir import RUN_ITEMS, CsvLog, RunExistsError
from minifloat.training.schedule import Schedule

SMALL = dict(model="tiny", batch_size=4, seq_len=32, warmup=2, eval_every=100, eval_batches=1, max_bytes=100_000,
             checkpoint_every=0)
LR_TOL = 1e-12  # log.csv stores the lr with repr precision: equal up to float formatting


def _config(**fields) -> TrainConfig:
    return TrainConfig(**{**SMALL, **fields})


def _rows(out) -> list[dict]:
    with open(pathlib.Path(out) / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_error_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.startswith("minifloat: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> TrainConfig:
    """A finished 8-step run with a checkpoint, shared by the tests that must not change it."""
    config = _config(steps=8, checkpoint_every=8, out=str(tmp_path_factory.mktemp("runs") / "done"))
    train(config, progress=False)
    return config


# --- run folders -------------------------------------------------------------------------------------------------

def test_an_existing_run_is_refused_and_left_byte_identical(finished, capsys):
    out = pathlib.Path(finished.out)
    before = _snapshot(out)
    with pytest.raises(RunExistsError, match="--resume.*--overwrite"):
        train(dataclasses.replace(finished, steps=3), progress=False)
    assert main(["train", "--out", str(out), "--steps", "3", "--max-bytes", "100000"]) == 2
    _one_error_line(capsys, "--resume", "--overwrite", str(out))
    assert _snapshot(out) == before


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    config = _config(steps=3, checkpoint_every=3, out=str(tmp_path / "run"))
    train(config, progress=False)
    mine = pathlib.Path(config.out) / "notes.txt"
    mine.write_text("the user's own file")
    result = train(dataclasses.replace(config, steps=2, overwrite=True), progress=False)
    assert result.first_step == 0 and len(_rows(config.out)) == 2
    assert mine.read_text() == "the user's own file"
    assert checkpoint_extra(pathlib.Path(config.out) / "ckpt")["step"] == 2
    assert {p.name for p in pathlib.Path(config.out).iterdir()} <= {*RUN_ITEMS, "notes.txt"}


def test_a_folder_without_a_run_is_used_as_is(tmp_path):
    (tmp_path / "README").write_text("x")
    train(_config(steps=1, out=str(tmp_path)), progress=False)
    assert (tmp_path / "README").read_text() == "x" and (tmp_path / "log.csv").is_file()


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="choose one"):
        _config(out=str(tmp_path), resume=True, overwrite=True)


# --- resume --------------------------------------------------------------------------------------------------------

def test_extending_a_run_continues_its_schedule_and_the_lr_never_rises(tmp_path):
    """A 6-step run extended to 10 (the issue's 50 -> 80): the lr of every step equals the 6-step plan, which is at
    its floor from step 6 on, so it never rises."""
    config = _config(steps=6, checkpoint_every=6, out=str(tmp_path / "run"))
    train(config, progress=False)
    train(dataclasses.replace(config, steps=10, resume=True), progress=False)
    lrs = [float(r["lr"]) for r in _rows(config.out)]
    plan = Schedule.from_config(config)
    assert len(lrs) == 10
    assert all(abs(lr - plan.lr_at(s)) <= LR_TOL for s, lr in enumerate(lrs))
    after_warmup = lrs[config.warmup:]
    assert all(b <= a + LR_TOL for a, b in zip(after_warmup, after_warmup[1:])), lrs
    assert lrs[6:] == [config.min_lr] * 4


def test_a_stated_decay_end_replans_from_the_lr_reached(tmp_path):
    """A run planned to decay over 20 steps, stopped at 6, resumed to end its decay at 12 instead."""
    config = _config(steps=6, checkpoint_every=6, lr_decay_steps=20, out=str(tmp_path / "run"))
    train(config, progress=False)
    train(dataclasses.replace(config, steps=12, lr_decay_steps=12, resume=True), progress=False)
    lrs = [float(r["lr"]) for r in _rows(config.out)]
    reached = Schedule.from_config(config).lr_at(6)
    assert abs(lrs[6] - reached) <= LR_TOL  # no jump at the resume step
    assert all(b < a for a, b in zip(lrs[6:], lrs[7:])) and lrs[-1] > config.min_lr  # decays to min_lr at step 12
    saved = checkpoint_extra(pathlib.Path(config.out) / "ckpt")["schedule"]
    assert Schedule(**saved).replans == ((6, reached, 12),)  # a later resume follows the same plan


def test_a_run_shorter_than_its_warmup_continues_as_one_run_of_the_new_length(tmp_path):
    """A run of 3 steps under a warm-up of 5 planned its decay to end at step 3, inside the warm-up: resumed to 8
    steps it climbed to lr at step 5, then dropped to min_lr at once. Its decay now ends at the new --steps, as in
    an uninterrupted run of 8 steps."""
    config = _config(steps=3, checkpoint_every=3, warmup=5, out=str(tmp_path / "run"))
    train(config, progress=False)
    train(dataclasses.replace(config, steps=8, resume=True), progress=False)
    lrs = [float(r["lr"]) for r in _rows(config.out)]
    whole = Schedule.from_config(dataclasses.replace(config, steps=8))
    assert len(lrs) == 8 and all(abs(lr - whole.lr_at(s)) <= LR_TOL for s, lr in enumerate(lrs)), lrs
    assert max(lrs) == lrs[5] and lrs[5] > lrs[6] > lrs[7] > config.min_lr, lrs


def test_replanned_resume_is_bitwise_with_the_replanned_run(tmp_path):
    """Resuming a re-planned run again continues the re-planned schedule exactly (the checkpoint keeps it)."""
    config = _config(steps=4, checkpoint_every=2, lr_decay_steps=20, out=str(tmp_path / "run"))
    train(config, progress=False)
    train(dataclasses.replace(config, steps=6, lr_decay_steps=8, resume=True), progress=False)
    train(dataclasses.replace(config, steps=8, lr_decay_steps=None, resume=True), progress=False)
    lrs = [float(r["lr"]) for r in _rows(config.out)]
    replanned = Schedule.from_config(config).replan(4, 8)
    assert len(lrs) == 8 and replanned.lr_at(4) > replanned.lr_at(6) > replanned.lr_at(7) > config.min_lr
    assert [abs(lr - replanned.lr_at(s)) <= LR_TOL for s, lr in enumerate(lrs)] == [True] * 8, lrs


@pytest.mark.parametrize("change, words", [
    (dict(steps=5), ["--steps 5", "already at step 8"]),
    (dict(steps=8), ["--steps 8", "already at step 8"]),
    (dict(steps=12, batch_size=8), ["--batch-size 4", "tokens per step"]),
    (dict(steps=12, seq_len=16), ["--seq-len 32"]),
    (dict(steps=12, grad_accum=2), ["--grad-accum 1"]),
    (dict(steps=12, seed=3), ["--seed 0", "order"]),
    (dict(steps=12, model="small"), ["is a tiny model", "--model tiny"]),
    (dict(steps=12, preset="fp8-delayed"), ["preset bf16", "--preset bf16"]),
])
def test_resume_refuses_another_run(finished, change, words):
    before = _snapshot(pathlib.Path(finished.out))
    with pytest.raises(ValueError) as err:
        train(dataclasses.replace(finished, resume=True, **change), progress=False)
    for word in words:
        assert word in str(err.value)
    assert _snapshot(pathlib.Path(finished.out)) == before


def test_cli_resume_into_another_model_says_which_model_it_holds(finished, capsys):
    status = main(["train", "--out", finished.out, "--resume", "--model", "small", "--steps", "12"])
    err = _one_error_line(capsys, "is a tiny model", "--model tiny")
    assert status == 2 and len(err) < 400


def test_cli_resume_takes_the_checkpoints_flags(finished, tmp_path, capsys):
    """`--resume --steps N` alone continues the run as set up (batch size, seq len, max bytes from the checkpoint)."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(finished.out, out)
    assert main(["train", "--out", str(out), "--resume", "--steps", "10"]) == 0
    rows = _rows(out)
    assert [int(r["step"]) for r in rows] == list(range(10))
    assert float(rows[9]["lr"]) == pytest.approx(finished.min_lr, abs=LR_TOL)


# --- logs and signals ----------------------------------------------------------------------------------------------

def test_csv_log_is_on_disk_after_every_row(tmp_path):
    path = tmp_path / "log.csv"
    with CsvLog(path, ("step", "loss")) as log:
        log.write({"step": 0, "loss": 1.5})
        assert path.read_text().splitlines() == ["step,loss", "0,1.5"]  # read while the log is still open


def _wait_for_rows(path: pathlib.Path, n: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if path.is_file() and len(path.read_text().splitlines()) > n:
            return
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"{path} did not reach {n} rows")


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_run_checkpoints_and_exits_cleanly(tmp_path, sig, status):
    """A real `minifloat train` process gets the signal mid-run: it finishes the step, writes a checkpoint, prints
    one line and exits with 128 + the signal; log.csv holds every step up to the checkpoint; --resume continues."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "minifloat.cli", "train", "--out", str(out), "--steps", "100000",
            "--batch-size", "4", "--seq-len", "32", "--max-bytes", "100000", "--checkpoint-every", "0",
            "--eval-every", "100000"]
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for_rows(out / "log.csv", 3, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, (stdout, stderr)
    assert "Traceback" not in stderr and f"stopped by {sig.name}" in stdout
    step = checkpoint_extra(out / "ckpt")["step"]
    assert [int(r["step"]) for r in _rows(out)] == list(range(step))
    assert all(math.isfinite(float(r["loss"])) for r in _rows(out))
    assert main(["train", "--out", str(out), "--resume", "--steps", str(step + 2)]) == 0
    assert [int(r["step"]) for r in _rows(out)] == list(range(step + 2))


# --- gradient accumulation -----------------------------------------------------------------------------------------

def test_grad_accum_gradient_is_the_mean_over_micro_batches():
    """fp32: two micro-batches of 2 give the gradient of the one batch of 4 (equal-sized micro-batches, mean loss)."""
    config = _config(preset="fp32", out="unused", device="cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 32), generator=g)
    y = torch.randint(0, 256, (4, 32), generator=g)
    grads = []
    for batches in ([(x, y)], [(x[:2], y[:2]), (x[2:], y[2:])]):
        run = build(config)
        loss, _ = forward_backward(run, run.model, batches, 0)
        grads.append([p.grad.clone() for p in run.model.parameters()])
    for one, two in zip(*grads):
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-7)


def test_grad_accum_advances_the_fp8_step_once_per_optimizer_step(tmp_path):
    """3 optimizer steps of 3 micro-batches each: the amax histories rolled 3 times (one row per step), not 9."""
    from minifloat.fp8.scaling import ScalingState
    from minifloat.training.checkpoint import load_checkpoint

    steps = 3
    config = _config(steps=steps, grad_accum=3, checkpoint_every=steps, preset="fp8-delayed",
                         out=str(tmp_path))
    result = train(config, progress=False)
    assert len(result.losses) == steps and all(math.isfinite(v) for v in result.losses)
    run = build(config)
    load_checkpoint(tmp_path / "ckpt", model=run.model, restore_rng=False)
    states = [m for m in run.model.modules() if isinstance(m, ScalingState)]
    assert states
    for state in states:
        filled = (state.amax_history[:, :2] > 0).all(dim=1)  # input and weight roles see every step
        history = state.amax_history.shape[0]  # rolled towards the end: the newest step is the last row
        assert filled.tolist() == [False] * (history - steps) + [True] * steps


# --- device and throughput -----------------------------------------------------------------------------------------

def test_auto_device_follows_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert throughput.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert throughput.resolve_device("auto") == torch.device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_is_one_clear_line(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--device", "cuda", "--steps", "1"]) == 2
    _one_error_line(capsys, "--device cuda", "--device cpu")
    assert not (tmp_path / "log.csv").exists()


def test_device_names_are_checked(tmp_path):
    for bad in ("gpu", "cuda:x", "", 0):
        with pytest.raises(ValueError, match="device must be"):
            TrainConfig(out=str(tmp_path), device=bad)


@pytest.mark.parametrize("preset", ["bf16", "fp16", "fp8-delayed", "fp8-current", "fp8-block", "mxfp8"])
def test_a_run_builds_and_steps_on_the_meta_device(preset):
    """Every parameter, buffer and gradient lands on the run's device; the step's tensors stay there."""
    config = _config(preset=preset, out="unused", device="meta")
    run = build(config, torch.device("meta"))
    assert {t.device.type for t in [*run.model.parameters(), *run.model.buffers()]} == {"meta"}
    x = torch.zeros(2, 32, dtype=torch.long, device="meta")
    loss, _ = forward_backward(run, run.model, [(x, x), (x, x)], 0)
    assert loss.device.type == "meta"
    assert {p.grad.device.type for p in run.model.parameters()} == {"meta"}


def test_training_on_the_meta_device_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="--device meta builds a run with shapes only and cannot train"):
        train(_config(steps=1, out=str(out), device="meta"), progress=False)
    assert not out.exists()


def test_cpu_run_records_its_device(tmp_path):
    result = train(_config(steps=3, out=str(tmp_path), device="cpu"), progress=False)
    assert result.device == "cpu" and result.mfu is None
    assert result.warmup_steps == 1 and result.tokens_per_s > 0
    assert '"device": "cpu"' in (tmp_path / "run.json").read_text()


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                          ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA H200", 989.4),
                                          ("Some Future GPU", None)])
def test_peak_flops_by_gpu_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: name)
    peak = throughput.peak_bf16_flops(torch.device("cuda"))
    assert peak == (tflops * 1e12 if tflops else None)
    assert throughput.peak_bf16_flops(torch.device("cpu")) is None


def test_mfu_counts_six_flops_per_linear_weight_plus_attention():
    from minifloat.training.model import Llama, LlamaConfig

    cfg = LlamaConfig.preset("tiny")
    model = Llama(cfg)
    d, L, V, f = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.ffn_dim
    per_layer = 4 * d * d + 3 * d * f  # q, k, v, o and the SwiGLU's three matrices
    expected = 6 * (L * per_layer + V * d) + 12 * L * 64 * d  # the tied head counts: its GEMM runs
    assert throughput.flops_per_token(model, n_layers=L, d_model=d, seq_len=64) == expected
    assert throughput.mfu(1000.0, expected, 1e12) == pytest.approx(1000.0 * expected / 1e12)
    assert throughput.mfu(1000.0, expected, None) is None


# --- low-precision optimizer state ---------------------------------------------------------------------------------

def test_low_precision_optimizer_state_trains_and_resumes_bitwise(tmp_path):
    """--optimizer-state e4m3,bf16: the run learns, its checkpoint holds the quantized moments as plain tensors, and
    a resume continues bitwise; another state format on resume is refused."""
    states = dict(optimizer_state="e4m3,bf16", preset="fp8-delayed")
    whole = train(_config(steps=6, out=str(tmp_path / "a"), **states), progress=False)
    half = _config(steps=3, checkpoint_every=3, lr_decay_steps=6, out=str(tmp_path / "b"), **states)
    first = train(half, progress=False)
    second = train(dataclasses.replace(half, steps=6, lr_decay_steps=None, resume=True), progress=False)
    assert first.losses + second.losses == whole.losses
    assert whole.losses[-1] < whole.losses[0]
    with pytest.raises(ValueError, match="optimizer-state e4m3,bf16"):
        train(dataclasses.replace(half, steps=9, resume=True, optimizer_state="fp32,fp32"), progress=False)


def test_optimizer_state_formats_are_checked(tmp_path):
    for bad in ("e4m3", "e4m3,fp7", "e4m3,bf16,bf16", 8):
        with pytest.raises(ValueError, match="optimizer_state"):
            _config(out=str(tmp_path), optimizer_state=bad)
