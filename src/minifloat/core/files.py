"""Writing files that must survive a crash: JSON flushed to disk, optionally replaced atomically.

Checkpoint manifests, the sharded checkpoint's state, the exported model's configs and a run's run.json all write
JSON through `write_json`, so each is complete on disk before the folder or file that holds it is moved into place.

A temporary file or folder that becomes one of the user's (tempfile.mkstemp's 0600, mkdtemp's 0700, the 0600 file
safetensors writes) gets the permissions the user's umask gives any new one (`apply_umask`), as an `open` would.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def umask() -> int:
    """The process's umask: read from /proc on Linux, else set and put back at once (os.umask only swaps it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give `path` the permissions the umask gives a new file (0o666 & ~umask) or folder (0o777 & ~umask)."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask())


def fsync_path(path: Path) -> None:
    """Flush a file, or on POSIX a directory entry list, to disk."""
    if path.is_dir() and os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, atomic: bool = False) -> None:
    """`obj` as JSON (no NaN or infinity: they are not JSON) in `path`, flushed to disk, ending with a newline.

    atomic=True writes a temporary file beside `path` and renames it over `path`, so a reader (or a crash) sees
    the old file or the new one, never a part of it.
    """
    path = Path(path)
    target = path.with_name(f".{path.name}.tmp") if atomic else path
    with open(target, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        target.replace(path)


def is_within(path: str | os.PathLike, folder: str | os.PathLike | None) -> bool:
    """Whether `path` (which need not exist) is `folder` or lies inside it, links resolved; False when `folder` is
    None or not a folder. For outputs that must stay out of an input folder a command reads whole."""
    if folder is None or not Path(folder).expanduser().is_dir():
        return False
    folder = Path(folder).expanduser().resolve()
    return Path(path).expanduser().resolve().is_relative_to(folder)


def temp_prefix(path: Path) -> str:
    """The prefix of a temporary sibling that becomes `path` once complete: `.NAME.tmp-PID-`, so that a later call
    can tell one a killed process left (`remove_abandoned`)."""
    return f".{path.name}.tmp-{os.getpid()}-"


def remove_abandoned(path: Path) -> None:
    """Remove the temporary folders beside `path` that a killed process left (SIGKILL, or a signal inside a library
    that ignores it): `.NAME.tmp-PID` or `.NAME.tmp-PID-*` whose process no longer runs on this machine."""
    if not path.parent.is_dir():
        return
    head = f".{path.name}.tmp-"
    for tmp in path.parent.glob(f"{head}*"):
        pid = tmp.name[len(head):].split("-")[0]
        if not (pid.isdigit() and tmp.is_dir()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # gone: its folder was never moved into place
            shutil.rmtree(tmp, ignore_errors=True)
        except (PermissionError, OverflowError, OSError):
            pass  # another user's process, or not a process id: leave it
