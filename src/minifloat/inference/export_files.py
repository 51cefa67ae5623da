"""The export folder: which files an export writes, where it may write them, and how they reach it whole.

An export is written into a temporary sibling of its folder and moved into place only once complete: one rename
for a new folder, file by file into an existing one (`overwrite`), where only an earlier export's files are
replaced. Its weights are one `model.safetensors`, or shards `model-00001-of-00004.safetensors` ... with the
`model.safetensors.index.json` that maps each tensor to its shard (Hugging Face's layout; minifloat.inference.hf_stream
writes one shard per shard of the folder it reads). An earlier export's weight files that the new one does not
write are removed before the new ones move in: a stale `model.safetensors` beside a new index would be what
transformers loads.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from minifloat.core.files import apply_umask, fsync_path, remove_abandoned, temp_prefix
from minifloat.inference import hf, hf_models
from minifloat.training.checkpoint import MANIFEST_FILE, move_into_place
from minifloat.training.rundir import run_items
from minifloat.training.sharded import is_sharded

INDEX_FILE = "model.safetensors.index.json"  # a sharded export's map of tensor name -> shard file
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# every file an export writes under a fixed name: what --overwrite may replace in an existing folder (nothing else
# there is touched, but an earlier export's weight shards)
EXPORT_FILES = (hf.CONFIG_FILE, hf.GENERATION_FILE, hf.WEIGHTS_FILE, INDEX_FILE, *hf_models.TOKENIZER_FILES)


def shard_name(index: int, count: int) -> str:
    """The file name of shard `index` (from 1) of `count`, as transformers' save_pretrained names them."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def is_weights_file(name: str) -> bool:
    """Whether `name` is one of an export's weight files: model.safetensors, its index, or a shard."""
    return name in (hf.WEIGHTS_FILE, INDEX_FILE) or _SHARD.fullmatch(name) is not None


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an `out` the export must not write into: a file, a training run or checkpoint (never replaced), or a
    non-empty folder without `overwrite`."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose a folder for the export")
    if not out.is_dir() or not any(out.iterdir()):
        return
    run = run_items(out) + ([MANIFEST_FILE] if (out / MANIFEST_FILE).exists() else [])
    if run or is_sharded(out):
        raise FileExistsError(f"{out} holds a training run or checkpoint ({', '.join(run) or 'sharded'}), which an "
                              f"export never replaces; choose another folder for the export")
    if not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose a new path, or pass overwrite=True to replace "
                              f"the export there (other files in it stay)")
    mine = [name for name in EXPORT_FILES if (out / name).exists()]
    if mine and not any((out / name).is_file() for name in (hf.WEIGHTS_FILE, INDEX_FILE)):
        # no earlier export: the files under those names are yours
        raise FileExistsError(f"{out} holds {', '.join(mine)} but no {hf.WEIGHTS_FILE}, so not an earlier export, and "
                              f"overwrite replaces only an export's files; move them, or choose another folder")


def _put_in_place(tmp: Path, out: Path) -> list[str]:
    """Move the complete export in `tmp` to `out`: one rename for a new folder; into an existing one (overwrite), file
    by file (each replaced in one rename), after removing the earlier export's weight files this one does not write.
    Nothing else in `out` is touched: the export files this export does not write (a tokenizer, which a byte or shard
    run has none of) stay, whoever wrote them; returned, to be named."""
    if not out.exists():
        move_into_place(tmp, out)
        return []
    written = {path.name for path in tmp.iterdir()}
    for stale in sorted(p for p in out.iterdir() if is_weights_file(p.name) and p.name not in written):
        stale.unlink()  # first: a folder left without weights by a crash says so; a stale one would load silently
    for name in sorted(written):
        os.replace(tmp / name, out / name)
    tmp.rmdir()
    return [name for name in EXPORT_FILES if name not in written and (out / name).is_file()]


def copy_into(tmp: Path, files: Iterable[str | os.PathLike]) -> None:
    """Copy `files` into the export being written in `tmp` as they are, each named like one of EXPORT_FILES and not
    written already (a Hugging Face model folder's tokenizer files: minifloat.inference.hf_models.tokenizer_files)."""
    for path in map(Path, files):
        if path.name not in EXPORT_FILES or is_weights_file(path.name) or (tmp / path.name).exists():
            raise ValueError(f"copy_files: {path.name} is not a file an export holds, or written already")
        shutil.copyfile(path, tmp / path.name)


def write_export(out: Path, overwrite: bool, fill: Callable[[Path], None]) -> list[str]:
    """Write an export: `fill(tmp)` writes its files into a temporary sibling of `out`, which then replaces `out`
    (see the module docstring); returns the export files `out` keeps from before (see `_put_in_place`). On any
    error or signal the temporary folder is removed and `out` is as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out)  # the temporary folders of exports a kill interrupted
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        fill(tmp)
        for path in (*tmp.iterdir(), tmp):  # mkdtemp's 0700, safetensors' 0600: the umask's modes, as `open` gives
            apply_umask(path)
            fsync_path(path)
        check_out(out, overwrite)  # nothing appeared there meanwhile
        kept = _put_in_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(out.parent)
    return kept
