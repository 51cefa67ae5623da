"""No lost work (issue 22): what a run needs is checked before step 1, and a failure after training started keeps the
steps done in a checkpoint the run continues from with --resume, bitwise as if it had never failed."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from minifloat.cli import main
from minifloat.training import loop
from minifloat.training.checkpoint import TENSORS_FILE, checkpoint_extra
from minifloat.training.loop import TrainConfig, TrainingFailed, train

STEPS = 6
# checkpoint_every=STEPS: a run writes its checkpoint at the end only, so a failing one has only the failure's
SMALL = dict(model="tiny", batch_size=4, seq_len=32, warmup=2, eval_every=2, eval_batches=1, max_bytes=100_000,
             checkpoint_every=STEPS, steps=STEPS)
FAIL_AT = 3  # the step whose forward raises


def _config(tmp_path: pathlib.Path, name: str, **fields) -> TrainConfig:
    return TrainConfig(**{**SMALL, **fields, "out": str(tmp_path / name)})


def test_a_validation_split_too_short_is_refused_before_step_1(tmp_path, capsys):
    """--max-bytes 100 leaves validation 10 bytes, fewer than one 65-byte sequence: one line, and no run folder."""
    out = tmp_path / "short"
    code = main(["train", "--model", "tiny", "--steps", "5", "--seq-len", "64", "--max-bytes", "100",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "validation split" in err and "--seq-len 64" in err and "--max-bytes" in err, err
    assert not out.exists() or not any(out.iterdir())  # nothing to refuse a corrected rerun with


def test_a_training_split_too_short_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    for name, size in (("a.txt", 20), ("b.txt", 20)):
        (tmp_path / "data" / name).write_text("x" * size)
    with pytest.raises(ValueError, match="split of --data .* holds 20 bytes, but one sequence needs 33"):
        train(_config(tmp_path, "run", data=str(tmp_path / "data")), progress=False)


# the evaluation case under -m slow: the default suite's 10-minute budget (the forward case checks the same rewind)
@pytest.mark.parametrize("where", ["forward", pytest.param("evaluation", marks=pytest.mark.slow)])
def test_a_failure_keeps_the_steps_done_and_resume_continues_bitwise(tmp_path, monkeypatch, where):
    """A failure in step 3's forward (before its update) checkpoints 3 steps; one in the evaluation after step 4's
    update (eval_every 2) checkpoints 4. Resuming then ends bitwise where an uninterrupted run ends."""
    whole = _config(tmp_path, "whole")
    train(whole, progress=False)

    broken = _config(tmp_path, "broken")
    real_forward_backward, real_evaluate = loop.forward_backward, loop.evaluate
    calls = {"evaluate": 0}

    def failing_forward_backward(run, forward, batches, step, **kwargs):
        if where == "forward" and step == FAIL_AT:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_forward_backward(run, forward, batches, step, **kwargs)

    def failing_evaluate(*args, **kwargs):
        calls["evaluate"] += 1
        if where == "evaluation" and calls["evaluate"] == 2:  # the evaluation after step 4 (steps done: 4)
            raise OSError("No space left on device")
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "forward_backward", failing_forward_backward)
    monkeypatch.setattr(loop, "evaluate", failing_evaluate)
    with pytest.raises(TrainingFailed) as info:
        train(broken, progress=False)
    done = FAIL_AT if where == "forward" else 4
    message = str(info.value)
    assert "\n" not in message and f"the {done} steps done are saved" in message and "--resume" in message
    assert checkpoint_extra(pathlib.Path(broken.out) / "ckpt")["step"] == done

    monkeypatch.setattr(loop, "forward_backward", real_forward_backward)
    monkeypatch.setattr(loop, "evaluate", real_evaluate)
    result = train(dataclasses.replace(broken, resume=True), progress=False)
    assert result.first_step == done and result.last_step == STEPS
    # the whole training state at the end (model, optimizer, scaler, guard, FP8 state): bitwise the uninterrupted run's
    expected, got = (load_file(pathlib.Path(c.out) / "ckpt" / TENSORS_FILE) for c in (whole, broken))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("full", [True, False], ids=["disk-full", "other"])
def test_a_checkpoint_that_cannot_be_written_names_what_is_kept_and_the_fix(tmp_path, monkeypatch, full):
    """The disk fills up after the step-2 checkpoint: the step-4 checkpoint and the one written on failure both fail.
    One line says so (the file system of --out is full: free space), and that the step-2 checkpoint is kept, which
    still loads; any other write error names the cause and the same checkpoint."""
    import errno

    from minifloat.training import checkpoint as ckpt_module

    real_save, calls = ckpt_module.save_file, {"n": 0}

    def save_file(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise (OSError(errno.ENOSPC, "No space left on device") if full
                   else PermissionError(errno.EACCES, "Permission denied"))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_module, "save_file", save_file)
    config = _config(tmp_path, "run", checkpoint_every=2)
    with pytest.raises(TrainingFailed) as info:
        train(config, progress=False)
    message = str(info.value)
    ckpt = pathlib.Path(config.out) / "ckpt"
    assert "\n" not in message and f"the last checkpoint written, {ckpt}, is kept" in message, message
    assert ("is full" in message and "free space" in message) == full, message
    assert checkpoint_extra(ckpt)["step"] == 2
    assert not [p for p in ckpt.parent.iterdir() if ".tmp-" in p.name]  # the failed writes left nothing
