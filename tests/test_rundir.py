"""minifloat.training.rundir: what a run's folder refusal offers (--resume only where a checkpoint exists), and the
permissions of what a run writes (the umask's, as for any new file or folder, not a temporary file's 0600)."""

from __future__ import annotations

import os
import pathlib
import stat

import pytest

from minifloat.cli import main
from minifloat.training.checkpoint import checkpoint_extra
from minifloat.training.rundir import CHECKPOINT_DIR, CsvLog, RunExistsError, prepare_run_dir

USER_ERROR = 2
UMASK = 0o027  # not the usual 022, so a mode that ignores the umask cannot pass by chance
FILE_MODE, FOLDER_MODE = 0o666 & ~UMASK, 0o777 & ~UMASK  # 0o640, 0o750
# a tiny run on a small slice of the standard library
RUN = ["train", "--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
       "--eval-batches", "1", "--max-bytes", "20000", "--device", "cpu"]


@pytest.fixture
def umask():
    """The process's umask set to UMASK while the test runs."""
    old = os.umask(UMASK)
    yield UMASK
    os.umask(old)


def _modes(folder: pathlib.Path) -> dict[str, int]:
    """{path relative to folder: permission bits} of everything under it, the folder itself as '.'."""
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("minifloat: error:"), lines
    return lines[0]


# --- the refusal ---------------------------------------------------------------------------------------------------

# (name, what the folder holds, flags the refusal names, flags it must not name)
REFUSALS = [
    ("logs only", ("log.csv", "val.csv", "run.json"), ("--overwrite", "another --out"), ("--resume",)),
    ("logs and a checkpoint", ("log.csv", "run.json", CHECKPOINT_DIR), ("--resume", "--overwrite"), ()),
]


@pytest.mark.parametrize("name, items, named, unnamed", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_the_refusal_offers_resume_only_with_a_checkpoint(tmp_path, name, items, named, unnamed):
    for item in items:
        (tmp_path / item).mkdir() if item == CHECKPOINT_DIR else (tmp_path / item).write_text("x\n")
    with pytest.raises(RunExistsError) as info:
        prepare_run_dir(tmp_path, resume=False, overwrite=False)
    for flag in named:
        assert flag in str(info.value), (flag, str(info.value))
    for flag in unnamed:
        assert flag not in str(info.value), (flag, str(info.value))


def test_a_run_without_a_checkpoint_is_not_offered_resume(tmp_path, capsys):
    """The issue's case: a finished --checkpoint-every 0 run, trained into again. The line's fix works: --overwrite
    trains, and keeps the user's own file."""
    out = tmp_path / "run"
    assert main([*RUN, "--checkpoint-every", "0", "--out", str(out)]) == 0
    assert not (out / CHECKPOINT_DIR).exists()
    capsys.readouterr()
    assert main([*RUN, "--out", str(out)]) == USER_ERROR
    line = _one_error_line(capsys)
    assert "--resume" not in line and "--overwrite" in line and str(out) in line, line
    (out / "notes.txt").write_text("mine\n")
    assert main([*RUN, "--checkpoint-every", "0", "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine\n"


# --- resuming a log -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"foo,bar\n1,2\n", b"step,loss\n0,1.0\n\xff\xfe\n"], ids=["no-step", "not-utf8"])
def test_resuming_over_a_log_this_run_did_not_write_refuses_and_keeps_it(tmp_path, content):
    """A log.csv whose rows a rewrite would drop (another header) or cannot read (not UTF-8): one line naming it and
    the fix; the file and its folder as they were."""
    path = tmp_path / "log.csv"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path} .*not the log this run wrote.*move it aside"):
        CsvLog(path, ("step", "loss"), keep_before=5)
    assert path.read_bytes() == content and [p.name for p in tmp_path.iterdir()] == ["log.csv"]


def test_resuming_keeps_the_rows_before_the_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "log.csv"
    path.write_text("step,loss,old_column\n0,1.0,x\n1,0.5,y\n2,0.4,z\n")  # a column this version no longer writes
    with CsvLog(path, ("step", "loss"), keep_before=2) as log:
        log.write({"step": 2, "loss": 0.3})
    assert path.read_text() == "step,loss\n0,1.0\n1,0.5\n2,0.3\n"

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "replace", refuse)  # an immutable log.csv (chattr +i): the rename fails
    with pytest.raises(PermissionError):
        CsvLog(path, ("step", "loss"), keep_before=2)
    assert [p.name for p in tmp_path.iterdir()] == ["log.csv"]


# --- permissions ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep_before", [None, 1], ids=["new log", "log rewritten on resume"])
def test_a_csv_log_gets_the_umask_mode(tmp_path, umask, keep_before):
    path = tmp_path / "log.csv"
    path.write_text("step,loss\n0,1.0\n1,0.5\n")
    with CsvLog(path, ("step", "loss"), keep_before=keep_before) as log:
        log.write({"step": 1, "loss": 0.25})
    assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE


def test_everything_a_run_writes_gets_the_umask_mode(tmp_path, umask, capsys):
    """log.csv and val.csv (rewritten through mkstemp), ckpt/ (written through mkdtemp) and its tensors (safetensors
    writes 0600) get what run.json gets: the umask's mode for a new file or folder. After a resume too."""
    out = tmp_path / "run"
    assert main([*RUN, "--checkpoint-every", "2", "--out", str(out)]) == 0, capsys.readouterr().err
    modes = _modes(out)
    assert {"log.csv", "val.csv", "run.json", "ckpt/tensors.safetensors", "ckpt/manifest.json"} <= modes.keys()
    wrong = {p: oct(m) for p, m in modes.items() if m != (FOLDER_MODE if (out / p).is_dir() else FILE_MODE)}
    assert not wrong, wrong
    assert main(["train", "--steps", "4", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    assert checkpoint_extra(out / CHECKPOINT_DIR)["step"] == 4  # the checkpoint was replaced
    wrong = {p: oct(m) for p, m in _modes(out).items() if m != (FOLDER_MODE if (out / p).is_dir() else FILE_MODE)}
    assert not wrong, wrong
