"""`minifloat tokenize`: a folder of text to token shards that `minifloat train --data OUT` memory-maps.

The text is read as training reads it (minifloat.training.data: the same files, split by file, and --max-bytes cap).
Without a tokenizer, a byte-level BPE is trained offline on the training split's files (validation text stays
unseen). Each split's files are encoded, joined by the end-of-text id, and cut into shards of at most `shard_tokens`
ids (uint16 when the vocabulary fits, else uint32; little-endian, no header):

    OUT/tokenizer.json  OUT/train_000000.bin …  OUT/val_000000.bin …  OUT/meta.json

meta.json (minifloat.training.shards.read_meta) names the dtype, vocabulary, tokenizer (file, SHA-256) and every
shard with its split and token count. Everything is written into a temporary folder beside OUT and moved in when
complete, meta.json last, so an interrupted run leaves no folder that looks finished. A --data that holds token shards
already is refused (its meta.json would be read as text), and so is text whose shards `minifloat train` would refuse
(a split without a shard of one sequence of its default --seq-len): nothing is written then.

The work streams, so memory grows neither with the corpus nor with its largest file: the files are listed, checked
and hashed first, keeping none of their bytes (minifloat.training.textfiles), then read again a part of a file at a
time (minifloat.training.data.READ_BYTES), by the BPE trainer and by the encoder,
which encodes a batch of at most `batch_chars` characters at a time and appends its ids to the open shard
(`ShardWriter`). A file longer than a batch is encoded (and fed to the BPE trainer) in pieces, cut only where the
cut is shown not to change its ids (minifloat.training.tokenizer.text_pieces), so memory is bounded by a batch
(tokenizers holds some 100-250 bytes a token while encoding: tokenizer.ENCODE_CHARS) and a part of a file.
The shards are the same bytes as encoding each split whole and cutting it (tested).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
from collections.abc import Callable

import torch

from minifloat.core.files import fsync_path, is_within, remove_abandoned, write_json
from minifloat.core.validate import check_int
from minifloat.training.data import DEFAULT_VAL_FRACTION, DataConfig, Split
from minifloat.training.rundir import run_items
from minifloat.training.settings import ModelData
from minifloat.training.shards import META_FILE, META_FORMAT, META_VERSION, STORAGE, read_meta
from minifloat.training.textfiles import TextFiles
from minifloat.training.tokenizer import ENCODE_CHARS, encode_batches, load_tokenizer, train_bpe
from minifloat.training.tokens import is_token_data

DEFAULT_VOCAB_SIZE = 8192
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's shard size: 200 MB of uint16
TOKENIZER_FILE = "tokenizer.json"
UINT16_VOCAB = 1 << 16  # ids 0 … 65535 fit a uint16
# each split must hold a shard of one sequence of `minifloat train`'s default --seq-len (+ 1 tokens), what training
# asks of its data before step 1 (minifloat.training.data.require_windows): shards it cannot train on are refused
TRAIN_SEQ_LEN = ModelData().seq_len
# the fix a data error ends with: tokenize reads text, so token shards are no answer (training's DATA_FIX offers them)
TEXT_FIX = "point --data at a folder of UTF-8 text files (minifloat tokenize reads text)"


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
                    batch_chars: int = ENCODE_CHARS, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Write the token shards of a text folder (see the module docstring), in memory bounded by one batch of text.

    Args:
        data: the text folder (None: the Python standard library's sources).
        out: the folder to write; it must be new or empty unless overwrite.
        tokenizer: a tokenizer.json to encode with (copied into `out`); None to train a byte-level BPE.
        vocab_size: the trained BPE's vocabulary (ignored with a tokenizer).
        max_bytes: cap on the text bytes read, train + val (as training's --max-bytes).
        shard_tokens: ids per shard at most.
        overwrite: replace the files a previous `tokenize` wrote in `out` (others are kept).
        batch_chars: characters of text encoded at a time at most (a longer file in pieces:
            minifloat.training.tokenizer.encode_batches).
        progress: called as progress(phase, done, total) while training the BPE and encoding (done, total in bytes
            of text).
    Returns:
        the meta.json written.
    Raises:
        FileExistsError: `out` holds files and overwrite is False.
        ValueError: a bad tokenizer, vocab_size, shard_tokens or batch_chars; `data` holding token shards already;
            ByteCorpus.load's errors for the text (ending with TEXT_FIX); a text file that changed while it was read;
            a split too short for one sequence of TRAIN_SEQ_LEN in one shard (nothing is written then).
    """
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be an int >= 1, got {shard_tokens!r}")
    check_int("batch_chars", batch_chars, low=1)
    if data is not None and is_token_data(str(data)):  # its meta.json and tokenizer.json would be read as text
        held = "is a token shard" if pathlib.Path(data).expanduser().is_file() else "holds token shards"
        raise ValueError(f"--data {data} {held} already, and minifloat tokenize reads text; train on it with: "
                         f"minifloat train --data {data}")
    out_path = pathlib.Path(out).expanduser()
    if is_within(out_path, data):  # read whole: the shards and tokenizer.json would be text of the next tokenize
        raise ValueError(f"--out {out} lies inside --data {data}, which is read whole: choose an --out outside it")
    _check_out(out_path, overwrite)
    loaded = load_tokenizer(tokenizer) if tokenizer is not None else None  # a bad tokenizer fails before the reading
    files = TextFiles.scan(DataConfig(path=data, max_bytes=max_bytes), fix=TEXT_FIX)
    tmp = out_path.parent / f".{out_path.name}.tmp-{os.getpid()}"
    remove_abandoned(out_path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    def reporter(phase: str, total: int) -> Callable[[int], None]:
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(phase, done, total)
        advance(0)
        return advance

    try:
        if loaded is None:  # one pass over the training files, read as the trainer asks for them
            texts = files.texts(Split.TRAIN, progress=reporter("training BPE", files.nbytes(Split.TRAIN)))
            train_bpe(texts, vocab_size=vocab_size).save(str(tmp / TOKENIZER_FILE))
        else:
            shutil.copyfile(loaded.path, tmp / TOKENIZER_FILE)
        copied = load_tokenizer(tmp / TOKENIZER_FILE)
        loaded = copied if loaded is None else dataclasses.replace(copied, origin=loaded.path)
        dtype = "uint16" if loaded.vocab_size <= UINT16_VOCAB else "uint32"
        digest, shards, advance = hashlib.sha256(), [], reporter("encoding", files.nbytes())
        for split in Split:  # train, then val: the order the manifest digest hashes them in
            texts = files.texts(split, hash_into=digest.update, progress=advance)
            with ShardWriter(tmp, split, dtype=dtype, shard_tokens=shard_tokens) as writer:
                for ids in encode_batches(loaded, texts, batch_chars=batch_chars):
                    writer.write(ids)
            shards += writer.shards
        _check_windows(shards, data=data, max_bytes=max_bytes, shard_tokens=shard_tokens)
        meta = {"format": META_FORMAT, "version": META_VERSION, "dtype": dtype, "vocab_size": loaded.vocab_size,
                "eot_id": loaded.eot_id, "tokenizer": {**loaded.describe(), "trained": tokenizer is None},
                "source": {"data": str(files.root), "max_bytes": max_bytes, "digest": digest.hexdigest(),
                           "files": len(files.files)},
                "shards": shards}
        write_json(tmp / META_FILE, meta)
        _move_into(tmp, out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


class ShardWriter:
    """One split's ids written to its shard files as they come: shard i holds ids [i·shard_tokens, (i+1)·shard_tokens)
    of the split's stream, whatever the chunks `write` is given (a shard file is opened at its first id and synced
    to disk when full or closed)."""

    def __init__(self, folder: pathlib.Path, split: Split, *, dtype: str, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[dict] = []  # meta.json's entries of the shards begun
        self._file = None

    def write(self, ids: torch.Tensor) -> None:
        """Append (n,) int64 ids (0 <= id < 2^bits of the dtype) to the split's stream."""
        while ids.numel():
            if self._file is None:
                self.shards.append({"file": shard_name(self.split, len(self.shards)), "split": self.split.value,
                                    "tokens": 0})
                self._file = open(self.folder / self.shards[-1]["file"], "wb")
            take = min(ids.numel(), self.shard_tokens - self.shards[-1]["tokens"])
            self._file.write(_id_bytes(ids[:take], self.dtype))
            self.shards[-1]["tokens"] += take
            ids = ids[take:]
            if self.shards[-1]["tokens"] == self.shard_tokens:
                self._sync()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        """Finish the last shard (`shards` then lists them all, in order)."""
        self._sync()

    def _sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _check_windows(shards: list[dict], *, data: str | None, max_bytes: int | None, shard_tokens: int) -> None:
    """Refuse shards `minifloat train` would refuse at its default --seq-len: each split needs a shard of one
    sequence (TRAIN_SEQ_LEN + 1 tokens), as training's require_windows asks of a run's data before step 1."""
    need, where = TRAIN_SEQ_LEN + 1, "the standard library's sources" if data is None else f"--data {data}"
    for split in Split:
        sizes = [s["tokens"] for s in shards if s["split"] == split.value]
        if max(sizes, default=0) >= need:
            continue
        if sum(sizes) >= need:  # enough tokens, cut too short
            held, fix = f"in shards of {max(sizes)} at most", f"raise --shard-tokens (now {shard_tokens}) to {need}"
        else:
            cap = f"raise --max-bytes (now {max_bytes}), or " if max_bytes is not None else ""
            held, fix = "in all", (f"{cap}add text files (each file goes to one split, about "
                                   f"{DEFAULT_VAL_FRACTION:.0%} of them to validation)")
        name = "validation" if split == Split.VAL else "training"
        raise ValueError(f"the {name} split of {where} encodes to {sum(sizes)} tokens {held}, but minifloat train "
                         f"needs one sequence in a shard ({need} tokens at its default --seq-len {TRAIN_SEQ_LEN}); "
                         f"{fix}")


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; name a new or empty folder for the token shards")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if run_items(out):  # --overwrite replaces a previous tokenize's files, never mixes shards into a training run
        raise FileExistsError(f"--out {out} holds a training run ({', '.join(run_items(out))}); name a new or empty "
                              f"folder for the token shards")
    if held and not overwrite:
        raise FileExistsError(f"--out {out} already holds {len(held)} file(s) (e.g. {held[0]}); name a new or empty "
                              f"folder, or pass --overwrite to replace the files a previous minifloat tokenize wrote")
    ours = [name for name in held if is_output(name)]
    if not ours:
        return
    try:  # --overwrite replaces what an earlier tokenize wrote, as its meta.json lists it, and nothing else
        meta = read_meta(out)
    except (OSError, ValueError):
        meta = None
    listed = set() if meta is None else {META_FILE, *(s["file"] for s in meta["shards"]),
                                         *([meta["tokenizer"]["file"]] if meta["tokenizer"] else [])}
    foreign = [name for name in ours if name not in listed]
    if foreign:
        why = (f"its {META_FILE} does not list them" if meta is not None
               else f"it holds no {META_FILE} of minifloat tokenize")
        raise FileExistsError(f"--out {out} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, "
                              f"which no earlier minifloat tokenize there wrote ({why}), and --overwrite replaces only "
                              f"that one's files; move them, or name another folder")


def _id_bytes(ids: torch.Tensor, dtype: str) -> bytes:
    """ids (int64, 0 <= id < 2^bits) as little-endian unsigned `dtype`, via the same-width signed storage type."""
    bits = STORAGE[dtype].itemsize * 8
    stored = torch.where(ids >= 1 << (bits - 1), ids - (1 << bits), ids).to(STORAGE[dtype])
    return stored.numpy().astype(f"<i{bits // 8}").tobytes()


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
