"""Writing files that must survive a crash: JSON flushed to disk, optionally replaced atomically.

Checkpoint manifests, the sharded checkpoint's state, the exported model's configs and a run's run.json all write
JSON through `write_json`, so each is complete on disk before the folder or file that holds it is moved into place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
