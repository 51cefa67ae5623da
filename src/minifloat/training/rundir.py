"""A run's folder: what a run writes there, the rule that no run is replaced by accident, logs that survive a kill,
and a clean stop on SIGTERM / SIGINT.

    prepare_run_dir(out, resume=False, overwrite=False)   # refuses a folder holding a run
    with CsvLog(out / "log.csv", FIELDS, keep_before=None) as log: log.write(row)   # flushed every row
    with GracefulStop() as stop: ... if stop.signal: save and return

A run writes only RUN_ITEMS in its folder, so `overwrite` removes exactly those and leaves every other file alone.
"""

from __future__ import annotations

import csv
import errno
import logging
import os
import pathlib
import shutil
import signal
import tempfile
import threading

from minifloat.core.files import apply_umask

log = logging.getLogger("minifloat")
CHECKPOINT_DIR = "ckpt"
TENSORBOARD_DIR = "tensorboard"
RUN_FILE = "run.json"
# in each checkpoint of a run on token ids: a copy of the tokenizer.json they were made with (minifloat generate and
# export read it, so the run needs neither the path it was given nor the folder it was started from)
CHECKPOINT_TOKENIZER = "tokenizer.json"
# everything a run writes into its folder
RUN_ITEMS = ("log.csv", "val.csv", CHECKPOINT_DIR, TENSORBOARD_DIR, RUN_FILE)


class RunExistsError(FileExistsError):
    """The output folder already holds a run and neither resume nor overwrite was asked for."""


def run_items(out: pathlib.Path) -> list[str]:
    """The RUN_ITEMS present in `out`."""
    return [name for name in RUN_ITEMS if (out / name).exists()]


def prepare_run_dir(out: pathlib.Path, *, resume: bool, overwrite: bool) -> None:
    """Make `out` ready for a run.

    A folder holding a run (any of RUN_ITEMS) is refused unless `resume` (the run continues: nothing is removed
    here) or `overwrite` (the RUN_ITEMS are removed; other files stay). A new or unrelated folder is used as is. The
    refusal offers --resume only when the run has a checkpoint (`resume` needs one), else --overwrite.

    Raises:
        RunExistsError: `out` holds a run and neither flag is set.
        NotADirectoryError: `out` is a file.
        FileNotFoundError: `resume` but `out` holds no checkpoint.
    """
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder; choose a folder for the run")
    found = run_items(out) if out.is_dir() else []
    if resume:
        if not (out / CHECKPOINT_DIR).is_dir():
            if found:  # a run that saved no checkpoint (checkpoint_every 0, or stopped before its first)
                raise FileNotFoundError(f"--resume: {out} holds a run ({', '.join(found)}) but no checkpoint to "
                                        f"continue from; start it again with --overwrite, or choose another --out")
            raise FileNotFoundError(f"--resume: there is no checkpoint at {out / CHECKPOINT_DIR}; start the run "
                                    f"without --resume, or point --out at the run to continue")
        return
    if found and not overwrite:
        if (out / CHECKPOINT_DIR).is_dir():  # what --resume continues from
            raise RunExistsError(f"--out {out} already holds a run ({', '.join(found)}); pass --resume to continue "
                                 f"it, --overwrite to replace it, or choose another --out")
        raise RunExistsError(f"--out {out} already holds a run ({', '.join(found)}) without a checkpoint to continue "
                             f"from; pass --overwrite to replace it (your own files in the folder stay), or choose "
                             f"another --out")
    for name in found:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)


class CsvLog:
    """A CSV log flushed after every row, so a killed run leaves every row it wrote.

    Args:
        path: the file.
        fields: its columns.
        keep_before: None writes a new file; on resume, the rows of the existing file whose "step" is below this
            are kept (rows a stopped run wrote after its last checkpoint are dropped: the resumed run writes them
            again). The kept rows are written to a temporary file that replaces `path` in one rename, so a kill
            during the rewrite loses nothing.
    """

    def __init__(self, path: pathlib.Path, fields: tuple[str, ...], *, keep_before: int | None = None):
        kept = self._kept(path, keep_before) if keep_before is not None and path.is_file() else []
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            apply_umask(tmp)  # mkstemp's 0600 would become the log's: it gets what the umask gives a new file
            with os.fdopen(fd, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(kept)
            os.replace(tmp, path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)  # `path` as it was, and no temporary file left beside it
            raise
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=fields)

    @staticmethod
    def _kept(path: pathlib.Path, keep_before: int) -> list[dict]:
        """The rows of the existing log to keep; ValueError (nothing changed) for a file that is not such a log,
        whose rows a rewrite would lose."""
        fix = (f"move it aside (the resumed run then writes a new {path.name}) or put the run's own back, and "
               f"resume again")
        try:
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                if "step" not in (reader.fieldnames or ()):
                    raise ValueError(f"{path} has no step column (its header: {','.join(reader.fieldnames or [])[:80]}"
                                     f"), so it is not the log this run wrote, and resuming would drop its rows; {fix}")
                return [row for row in reader if (row.get("step") or "").isdigit() and int(row["step"]) < keep_before]
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text, so not the log this run wrote; {fix}") from None

    def write(self, row: dict) -> None:
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CsvLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GracefulStop:
    """While active, SIGTERM and SIGINT do not kill the process: they set `signal` (its name, e.g. "SIGTERM"), and
    the loop stops at the end of the current step, writes a checkpoint and returns. A second signal acts as it
    would without this (SIGINT raises KeyboardInterrupt, SIGTERM terminates), so a stuck run can still be stopped.
    Installed only in the main thread (Python delivers signals there); elsewhere it does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name
        for sig, handler in self._previous.items():  # the next signal acts as usual
            signal.signal(sig, handler)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def tensorboard_writer(out: pathlib.Path):
    """A SummaryWriter on out/tensorboard, or None when tensorboard is not installed (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("minifloat: tensorboard is not installed; logging to log.csv only")
        return None
    return SummaryWriter(str(out / TENSORBOARD_DIR))


def _disk_full(err: BaseException) -> bool:
    """Whether `err` says the file system is full (or over quota): OSError's errno, or the text of a library that
    wraps it (safetensors' "No space left on device (os error 28)")."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(err) or "Disk quota exceeded" in str(err)


def save_failed(done: int, cause: str, save_err: BaseException, out: pathlib.Path) -> str:
    """The one line of a run that failed at step `done` (`cause`) and whose checkpoint then failed too: what is left
    to resume from, and the fix (free space when the disk is full)."""
    ckpt = out / CHECKPOINT_DIR
    kept = (f"the last checkpoint written, {ckpt}, is kept: continue from it with --resume" if ckpt.is_dir()
            and any(ckpt.iterdir()) else "no checkpoint was written, so the run starts again (--overwrite)")
    reason = f"{type(save_err).__name__}: {' '.join(str(save_err).split())[:200]}"
    if _disk_full(save_err):
        return (f"training stopped at step {done}: the file system holding --out {out} is full ({reason}); free space "
                f"there (or move the run elsewhere); {kept}")
    return (f"training failed at step {done} ({cause}), and its checkpoint could not be written ({reason}); fix "
            f"the cause (permissions of --out {out}?); {kept}")
