"""`minifloat tokenize`: a folder of text to token shards that `minifloat train --data OUT` memory-maps.

The text is read as training reads it (minifloat.training.data: the same files, split by file, and --max-bytes cap).
Without a tokenizer, a byte-level BPE is trained offline on the training split's files (validation text stays
unseen). Each split's files are encoded, joined by the end-of-text id, and cut into shards of at most `shard_tokens`
ids (uint16 when the vocabulary fits, else uint32; little-endian, no header):

    OUT/tokenizer.json  OUT/train_000000.bin …  OUT/val_000000.bin …  OUT/meta.json

meta.json (minifloat.training.shards.read_meta) names the dtype, vocabulary, tokenizer (file, SHA-256) and every
shard with its split and token count. Everything is written into a temporary folder beside OUT and moved in when
complete, meta.json last, so an interrupted run leaves no folder that looks finished.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable

import torch

from minifloat.core.files import fsync_path, write_json
from minifloat.training.data import ByteCorpus, DataConfig, Split
from minifloat.training.shards import META_FILE, META_FORMAT, META_VERSION, STORAGE
from minifloat.training.tokenizer import encode_texts, load_tokenizer, train_bpe
from minifloat.training.tokens import split_texts

DEFAULT_VOCAB_SIZE = 8192
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's shard size: 200 MB of uint16
TOKENIZER_FILE = "tokenizer.json"
UINT16_VOCAB = 1 << 16  # ids 0 … 65535 fit a uint16


def shard_name(split: Split, index: int) -> str:
    return f"{split.value}_{index:06d}.bin"


def is_output(name: str) -> bool:
    """Whether a file name is one `tokenize` writes (what --overwrite replaces; a user's other files stay)."""
    stem, dot, ext = name.partition(".")
    split, _, index = stem.partition("_")
    return name in (META_FILE, TOKENIZER_FILE) or (ext == "bin" and dot and split in ("train", "val")
                                                     and len(index) == 6 and index.isdigit())


def tokenize_folder(data: str | None, out: str, *, tokenizer: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    max_bytes: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False,
                    progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Write the token shards of a text folder (see the module docstring).

    Args:
        data: the text folder (None: the Python standard library's sources).
        out: the folder to write; it must be new or empty unless overwrite.
        tokenizer: a tokenizer.json to encode with (copied into `out`); None to train a byte-level BPE.
        vocab_size: the trained BPE's vocabulary (ignored with a tokenizer).
        max_bytes: cap on the text bytes read, train + val (as training's --max-bytes).
        shard_tokens: ids per shard at most.
        overwrite: replace the files a previous `tokenize` wrote in `out` (others are kept).
        progress: called as progress(phase, done, total) while encoding (done, total in characters).
    Returns:
        the meta.json written.
    Raises:
        FileExistsError: `out` holds files and overwrite is False.
        ValueError: a bad tokenizer, vocab_size or shard_tokens; ByteCorpus.load's errors for the text.
    """
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be an int >= 1, got {shard_tokens!r}")
    out_path = pathlib.Path(out).expanduser()
    _check_out(out_path, overwrite)
    loaded = load_tokenizer(tokenizer) if tokenizer is not None else None  # a bad tokenizer fails before the reading
    corpus = ByteCorpus.load(DataConfig(path=data, max_bytes=max_bytes))
    texts = {split: split_texts(corpus, split) for split in Split}
    tmp = out_path.parent / f".{out_path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if loaded is None:
            if progress is not None:
                progress("training BPE", 0, 1)
            train_bpe(texts[Split.TRAIN], vocab_size=vocab_size).save(str(tmp / TOKENIZER_FILE))
        else:
            shutil.copyfile(loaded.path, tmp / TOKENIZER_FILE)
        loaded = load_tokenizer(tmp / TOKENIZER_FILE)
        dtype = "uint16" if loaded.vocab_size <= UINT16_VOCAB else "uint32"
        total, done = sum(len(t) for split in Split for t in texts[split]), 0
        shards = []
        for split in Split:
            def advance(n: int, split=split) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(f"encoding {split.value}", done, total)
            ids = encode_texts(loaded, texts[split], progress=advance)
            for index, first in enumerate(range(0, ids.numel(), shard_tokens)):
                name = shard_name(split, index)
                _write_ids(tmp / name, ids[first:first + shard_tokens], dtype)
                shards.append({"file": name, "split": split.value, "tokens": min(shard_tokens, ids.numel() - first)})
        meta = {"format": META_FORMAT, "version": META_VERSION, "dtype": dtype, "vocab_size": loaded.vocab_size,
                "eot_id": loaded.eot_id, "tokenizer": {**loaded.describe(), "trained": tokenizer is None},
                "source": {"data": str(corpus.manifest.root), "max_bytes": max_bytes, "digest": corpus.manifest.digest,
                           "files": len(corpus.manifest.files)},
                "shards": shards}
        write_json(tmp / META_FILE, meta)
        _move_into(tmp, out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; name a new or empty folder for the token shards")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        raise FileExistsError(f"--out {out} already holds {len(held)} file(s) (e.g. {held[0]}); name a new or empty "
                              f"folder, or pass --overwrite to replace the files a previous minifloat tokenize wrote")


def _write_ids(path: pathlib.Path, ids: torch.Tensor, dtype: str) -> None:
    """ids (int64, 0 <= id < 2^bits) as little-endian unsigned `dtype`, via the same-width signed storage type."""
    bits = STORAGE[dtype].itemsize * 8
    stored = torch.where(ids >= 1 << (bits - 1), ids - (1 << bits), ids).to(STORAGE[dtype])
    with open(path, "wb") as f:
        f.write(stored.numpy().astype(f"<i{bits // 8}").tobytes())
        f.flush()
        os.fsync(f.fileno())


def _move_into(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """The finished files of `tmp` into `out`: a rename of the folder when `out` is new; else, after removing the
    previous outputs, file by file with meta.json last."""
    if not out.exists():
        tmp.rename(out)
        fsync_path(out.parent)
        return
    for old in out.iterdir():
        if old.is_file() and is_output(old.name):
            old.unlink()
    for new in sorted(tmp.iterdir(), key=lambda p: p.name == META_FILE):
        new.replace(out / new.name)
    fsync_path(out)
