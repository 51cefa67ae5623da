"""Token corpora: memory-mapped token shards, or a folder of text encoded by a Hugging Face tokenizer.

Shards (minifloat.training.shards has the layouts) are split by what their names or meta.json say: a file whose name
holds the word val, valid or validation is validation data; a lone shard gives its last `val_fraction` of tokens to
validation; several shards, none named so, are split by file with `split_files`' hash rule. The vocabulary is
meta.json's, else the --tokenizer's, else one pass over the shards finds the largest id (vocabulary = that + 1).

A text folder with a tokenizer is read exactly as the byte corpus reads it (the same files, split and --max-bytes
cap), each file encoded on its own and the files of a split concatenated with the end-of-text id between them. It is
read and encoded a batch of files at a time and its ids are spilled to a temporary file the stream maps, so memory
does not grow with the corpus (`load_text_tokens`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import pathlib
import re
import tempfile
from collections.abc import Iterable

import torch

from minifloat.training.batches import TokenStream
from minifloat.training.data import DataConfig, FileEntry, Manifest, Split, split_files
from minifloat.training.shards import (HASH_RULE, META_FILE, META_FORMAT, SHARD_FIX, Shard, file_sha256, max_id,
                                       read_meta, read_shard)
from minifloat.training.textfiles import TextFiles
from minifloat.training.tokenizer import LoadedTokenizer, encode_batches, load_tokenizer

log = logging.getLogger("minifloat")

VAL_WORDS = {"val", "valid", "validation"}
# words in a bare .bin's name that make its folder token data (besides VAL_WORDS); a folder holding other .bin files
# only (model weights, say) is read as text, so its text files are not mistaken for shards' neighbours
SPLIT_WORDS = {"train", "training", *VAL_WORDS}


@dataclasses.dataclass(frozen=True)
class TokenCorpus:
    """Token streams of each split (TokenStreams of mapped shards, or in-memory int32 ids), the vocabulary, and the
    manifest they were built from."""

    train: torch.Tensor | TokenStream
    val: torch.Tensor | TokenStream
    vocab_size: int
    manifest: Manifest
    config: DataConfig
    # the tokenizer.json the ids were made with, as read when the corpus loaded (None when none is known): the run's
    # checkpoints keep a copy, so the run finds its tokenizer wherever it is read from
    tokenizer_json: bytes | None = dataclasses.field(default=None, repr=False)

    def tokens(self, split: Split | str) -> torch.Tensor | TokenStream:
        """The stream of one split ("train" or "val")."""
        return self.train if Split(split) == Split.TRAIN else self.val


def _words(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", pathlib.PurePath(name).stem.lower()))


def is_token_data(data: str) -> bool:
    """Whether --data names token shards: a `.bin` file; or a folder holding meta.json, or `.bin` files of which one
    is an llm.c or Megatron shard or has a split word (SPLIT_WORDS) in its name, as nanoGPT's train.bin, or whose
    files are `.bin` files only (shard_00.bin, ...)."""
    path = pathlib.Path(data).expanduser()
    if path.is_file():
        return path.suffix == ".bin"
    if not path.is_dir():
        return False
    if _has_meta(path):
        return True
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    bins = [p for p in files if p.suffix == ".bin"]
    if len(bins) >= 2 and len(bins) == len(files):  # shards; one lone unnamed .bin may be anything (weights.bin)
        return True
    return any(p.with_suffix(".idx").is_file() or _words(p.name) & SPLIT_WORDS or _llmc_magic(p) for p in bins)


def _has_meta(folder: pathlib.Path) -> bool:
    """Whether the folder holds minifloat's meta.json: one that says so, or one that is not JSON (read_meta then says
    what is wrong). Another program's meta.json in a folder of text files leaves it text."""
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return (folder / META_FILE).is_file()
    return isinstance(meta, dict) and meta.get("format") == META_FORMAT


def _llmc_magic(path: pathlib.Path) -> bool:
    try:
        return read_shard(path, path.name).layout == "llm.c"
    except (OSError, ValueError):
        return False


def load_token_shards(data: str, *, tokenizer: str | None = None, val_fraction: float | None = None) -> TokenCorpus:
    """The corpus of a `.bin` shard or a folder of them, memory-mapped.

    Args:
        data: a `.bin` file or a folder (see `is_token_data`).
        tokenizer: a tokenizer.json: the vocabulary when the shards name none, else checked against theirs (the
            tokenizer.json a meta.json names is then not read); None: meta.json's, which must be there.
        val_fraction: a lone shard's share of validation tokens (DataConfig's default when None).
    Raises:
        ValueError naming the file and the fix: a corrupt shard or meta.json, a tokenizer.json meta.json names that
        is missing, garbled or not the one it records, a vocabulary that disagrees with the tokenizer's, ids outside
        the vocabulary (checked on a sample of each shard), a split left without shards.
    """
    config = DataConfig(path=data, **({} if val_fraction is None else {"val_fraction": val_fraction}))
    root = pathlib.Path(data).expanduser()
    folder = root if root.is_dir() else root.parent
    meta = read_meta(folder) if _has_meta(folder) else None
    # one shard of a minifloat tokenize folder: its meta.json still gives the id type, vocabulary and tokenizer
    lone = next((e for e in meta["shards"] if e["file"] == root.name), None) if meta and root.is_file() else None
    if root.is_file() and lone is None:
        meta = None  # a lone .bin beside a meta.json that does not list it: read as any lone shard
    if lone is not None:
        shards, splits = [read_shard(root, root.name, dtype=meta["dtype"], tokens=lone["tokens"])], {}
    elif meta is not None:
        for entry in meta["shards"]:
            if not (folder / entry["file"]).is_file():
                raise ValueError(f"{folder / META_FILE} lists the shard {entry['file']}, which is missing from "
                                 f"{folder}; re-create the folder with minifloat tokenize")
        shards = [read_shard(folder / e["file"], e["file"], dtype=meta["dtype"], tokens=e["tokens"])
                  for e in meta["shards"]]
        splits = {e["file"]: Split(e["split"]) for e in meta["shards"]}
    else:
        paths = [root] if root.is_file() else sorted(p for p in root.glob("*.bin") if p.is_file())
        shards = [read_shard(p, p.name) for p in paths]
        splits = _split_by_name([s.rel for s in shards], config.val_fraction)
    loaded = load_tokenizer(tokenizer) if tokenizer is not None else None
    kept = loaded.data if loaded is not None else _meta_tokenizer(folder, meta)  # a missing one fails before mapping
    if len({s.dtype for s in shards}) > 1:
        kinds = ", ".join(f"{s.rel}: {s.dtype}" for s in shards)
        raise ValueError(f"the token shards under {folder} mix id types ({kinds}); {SHARD_FIX}")
    vocab_size = _vocabulary(shards, meta, loaded, folder)
    pieces = _pieces(shards, splits, config.val_fraction)
    for split in Split:
        if not pieces[split]:
            which = "training" if split == Split.TRAIN else "validation"
            raise ValueError(f"the token shards under {folder} leave the {which} split empty; add a shard for it "
                             f"(a .bin whose name has the word val is validation data, any other training data), or "
                             f"re-create the folder with minifloat tokenize")
    streams = {split: TokenStream([t for _, _, t in pieces[split]], names=[n for _, n, _ in pieces[split]],
                                  unsigned=True, vocab_size=vocab_size) for split in Split}
    tokenizer_sha = loaded.sha256 if loaded is not None else ((meta or {}).get("tokenizer") or {}).get("sha256")
    source = {"kind": "shards", "dtype": shards[0].dtype, "tokenizer": tokenizer_sha, "hash_rule": HASH_RULE}
    hashes = {s.rel: file_sha256(s.path) for s in shards}
    files = tuple(FileEntry(name, split, t.numel() * shard.itemsize, hashes[shard.rel])
                  for split in Split for shard, name, t in pieces[split])
    manifest = Manifest(str(folder), files, (), _digest(files, vocab_size, source), vocab_size, source)
    return TokenCorpus(streams[Split.TRAIN], streams[Split.VAL], vocab_size, manifest, config, kept)


def _meta_tokenizer(folder: pathlib.Path, meta: dict | None) -> bytes | None:
    """The bytes of the tokenizer.json meta.json names (None when it names none: shards made without one), checked:
    it is in the folder, it is a tokenizers file, and it is the one meta.json records (its SHA-256). The run's
    checkpoints keep a copy, which `minifloat generate` and `export` need to turn the ids back into text.

    Raises:
        ValueError naming the file and the fix: missing, garbled, or another tokenizer than meta.json records.
    """
    named = (meta or {}).get("tokenizer")
    if named is None:
        return None
    path, meta_path = folder / named["file"], folder / META_FILE
    # the fix stays short: a line is cut at minifloat.cli.MESSAGE_LIMIT characters, and tokenizers' reason comes first
    fix = (f"put back the {named['file']} minifloat tokenize wrote (or pass it as --tokenizer), or re-create the "
           f"folder with minifloat tokenize")
    if not path.exists():
        raise ValueError(f"{meta_path} names the tokenizer {path}, which is missing; {fix}")
    loaded = load_tokenizer(path, fix=fix)
    if loaded.sha256 != named["sha256"]:
        vocab = (f"; {loaded.vocab_size} ids, the shards' {meta['vocab_size']}"
                 if loaded.vocab_size != meta["vocab_size"] else "")
        raise ValueError(f"tokenizer {str(path)!r} is not the one {META_FILE} records (sha256 {loaded.sha256[:12]}…, "
                         f"{META_FILE} says {named['sha256'][:12]}…{vocab}): the ids would decode to other text; "
                         f"{fix}")
    return loaded.data


def _split_by_name(names: list[str], val_fraction: float) -> dict[str, Split]:
    """Shards named val/valid/validation go to validation and the others to training; several shards, none so
    named, are split by `split_files`; a lone one gets {} (`_pieces` splits its tokens)."""
    named = {n: Split.VAL for n in names if _words(n) & VAL_WORDS}
    if named:
        return {n: named.get(n, Split.TRAIN) for n in names}
    if len(names) == 1:
        return {}
    return split_files(names, val_fraction)


def _pieces(shards: list[Shard], splits: dict[str, Split],
            val_fraction: float) -> dict[Split, list[tuple[Shard, str, torch.Tensor]]]:
    """(shard, name, mapped ids) of each split. A lone shard without a split (`splits` empty) gives its last
    ceil(n·val_fraction) tokens to validation and the rest to training."""
    out: dict[Split, list] = {Split.TRAIN: [], Split.VAL: []}
    if not splits:
        shard, ids = shards[0], shards[0].map()
        n_val = math.ceil(ids.numel() * val_fraction)
        if ids.numel() < 2 or n_val >= ids.numel():
            raise ValueError(f"token shard {shard.rel} holds {ids.numel()} tokens, too few to split into training "
                             f"and validation; add tokens or a validation shard (a .bin named val)")
        cut = ids.numel() - n_val
        out[Split.TRAIN].append((shard, f"{shard.rel} (tokens 0-{cut})", ids[:cut]))
        out[Split.VAL].append((shard, f"{shard.rel} (tokens {cut}-{ids.numel()})", ids[cut:]))
        return out
    for shard in shards:
        out[splits[shard.rel]].append((shard, shard.rel, shard.map()))
    return out


def _vocabulary(shards: list[Shard], meta: dict | None, loaded: LoadedTokenizer | None, folder: pathlib.Path) -> int:
    """meta.json's vocabulary (checked against the tokenizer's), else the tokenizer's, else the largest id + 1; a
    stated vocabulary is checked on a sample of each shard."""
    if meta is not None:
        vocab_size = meta["vocab_size"]
        if loaded is not None and loaded.vocab_size != vocab_size:
            raise ValueError(f"--tokenizer {loaded.path} has a vocabulary of {loaded.vocab_size} ids, but the token "
                             f"shards under {folder} were made with one of {vocab_size} (meta.json); pass the "
                             f"tokenizer they were made with, or leave --tokenizer out")
        recorded = (meta.get("tokenizer") or {}).get("sha256")
        if loaded is not None and recorded is not None and loaded.sha256 != recorded:  # same size, other tokens
            raise ValueError(f"--tokenizer {loaded.path} is not the tokenizer the token shards under {folder} were "
                             f"made with (sha256 {loaded.sha256[:12]}…, meta.json says {recorded[:12]}…): the ids "
                             f"would decode to other text; pass the tokenizer they were made with, or leave "
                             f"--tokenizer out")
    elif loaded is not None:
        vocab_size = loaded.vocab_size
    else:
        top = max(max_id(s.map(), sample=False) for s in shards)
        log.info("data: the token shards under %s name no vocabulary; their largest id is %d, so the vocabulary is "
                 "%d ids (pass --tokenizer to set it)", folder, top, top + 1)
        return top + 1
    for shard in shards:
        top = max_id(shard.map(), sample=True)
        if top >= vocab_size:
            raise ValueError(f"token shard {shard.rel} holds the id {top}, outside the vocabulary of {vocab_size} ids "
                             f"({'meta.json' if meta else f'--tokenizer {loaded.path}'}): the shard is corrupt or was "
                             f"made with another tokenizer; {SHARD_FIX}")
    return vocab_size


def _digest(files: tuple[FileEntry, ...], vocab_size: int, source: dict) -> str:
    """SHA-256 over what decides the token streams: each piece (name, split, size, hash), the vocabulary and source."""
    listing = [[f.path, f.split.value, f.nbytes, f.sha256] for f in files]
    return hashlib.sha256(json.dumps([listing, vocab_size, source], sort_keys=True).encode()).hexdigest()


def load_text_tokens(data: str | None, *, max_bytes: int | None, tokenizer: str) -> TokenCorpus:
    """A text folder (the standard library's sources when None) read as ByteCorpus reads it, each file encoded by
    `tokenizer`, the files of a split concatenated with its end-of-text id after each.

    The text is read and encoded a batch of files at a time (minifloat.training.textfiles, tokenizer.encode_batches)
    and each split's ids are spilled to a temporary file that the returned int32 stream maps (`spill_ids`), so neither
    the text nor the ids are held in memory; the ids, the batches drawn from them and the manifest are those of the
    whole corpus encoded in memory (tested).

    Raises:
        ValueError: a missing or unreadable tokenizer.json, a text file changed while it was read; and
            ByteCorpus.load's errors.
    """
    loaded = load_tokenizer(tokenizer)
    files = TextFiles.scan(DataConfig(path=data, max_bytes=max_bytes))
    text_digest = hashlib.sha256()  # ByteCorpus's manifest digest, train then val
    streams = {split: spill_ids(encode_batches(loaded, files.texts(split, hash_into=text_digest.update)))
               for split in Split}
    source = {"kind": "text", "tokenizer": loaded.sha256}
    digest = hashlib.sha256(f"{text_digest.hexdigest()}\n{loaded.sha256}\n{loaded.eot_id}".encode()).hexdigest()
    manifest = dataclasses.replace(files.manifest(digest), vocab_size=loaded.vocab_size, source=source)
    return TokenCorpus(streams[Split.TRAIN], streams[Split.VAL], loaded.vocab_size, manifest, files.config,
                       loaded.data)


def spill_ids(batches: Iterable[torch.Tensor]) -> torch.Tensor:
    """The batches' ids, concatenated, as one (N,) int32 tensor mapped from a temporary file (in TMPDIR, removed
    once mapped: the mapping keeps it until the tensor is freed). The map is private (torch.from_file, shared=False,
    as shards are mapped): pages are read as windows touch them and the kernel may drop them again, so a corpus of
    more ids than memory trains; the disk holds 4 bytes a token meanwhile."""
    with tempfile.NamedTemporaryFile(prefix="minifloat-ids-", suffix=".bin") as f:
        n = 0
        for ids in batches:
            f.write(ids.to(torch.int32).numpy().tobytes())
            n += ids.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.int32)
        f.flush()
        return torch.from_file(f.name, shared=False, size=n, dtype=torch.int32)
