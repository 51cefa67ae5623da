"""Real data, no downloads: a byte-level corpus of text files, split by file, with deterministic, resumable batches.

By default the corpus is the Python standard library's own source files, present on every machine;
`DataConfig(path=…)` points it at any folder of text files instead. Each file goes to train or validation by a hash
of its relative path,
so adding a file never moves another. The tokens are the files' bytes (256 values, no tokenizer), concatenated per
split in path order.

Batches are random windows, and batch k is a pure function of (seed, k): resuming from position k yields the same
batches as a run that never stopped, and `skip(n)` jumps ahead without drawing (BatchLoader and val_batches live in
minifloat.training.batches). The manifest (files, sizes, SHA-256) lets a checkpoint notice that the data under it
changed. `load_corpus` is what runs call: it also reads text through a tokenizer and memory-maps token shards
(minifloat.training.tokens).
"""

from __future__ import annotations

import codecs
import dataclasses
import enum
import fnmatch
import hashlib
import logging
import math
import os
import pathlib
import sysconfig

import torch

from minifloat.core.validate import check_int, check_number
from minifloat.training.batches import BatchLoader, TokenStream, val_batches  # noqa: F401 - re-exported

log = logging.getLogger("minifloat")

DEFAULT_VAL_FRACTION = 0.05
STDLIB_PATTERNS = ("*.py",)
TEXT_PATTERNS = ("*.txt", "*.md", "*.rst", "*.py", "*.c", "*.h", "*.cpp", "*.js", "*.json", "*.toml", "*.yaml", "*.yml",
                 "*.csv", "*.html", "*.tex")
# Names (files or folders, fnmatch patterns) never walked into or read. Hidden entries (.git …) and bytecode caches
# everywhere. In the standard library also: installed packages, which differ per machine; the build-specific
# `_sysconfigdata_*.py` and `config-*/`; and the test suites. Debian/Ubuntu ship those (`test/`, `*/tests`, `*/test`,
# `idlelib/idle_test`) in a separate libpython3.X-testsuite package, so including them would make the default corpus
# depend on what the distribution installed; they also hold deliberately malformed sources and generated data tables.
ALWAYS_EXCLUDED = (".*", "__pycache__")
STDLIB_EXCLUDED = (*ALWAYS_EXCLUDED, "site-packages", "dist-packages", "_sysconfigdata*", "config-*",
                   "test", "tests", "idle_test")
# the fix every "no usable data" error ends with (`--data` is the command line's name for DataConfig.path); a reader
# of text alone (minifloat tokenize) passes its own (`select_files`' fix), which offers no token shards
DATA_FIX = ("point --data (DataConfig.path) at a folder of UTF-8 text files, or at token shards (a .bin file or a "
            "folder of them, as minifloat tokenize writes)")
READ_BYTES = 1 << 24  # a text file is read, checked and hashed 16 MiB at a time


class Split(str, enum.Enum):
    TRAIN = "train"
    VAL = "val"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the corpus comes from and how it is split.

    Args:
        path: a folder of text files; None for the standard library's sources.
        patterns: glob patterns matched against each file's path relative to `path` (right-anchored, so "*.md" matches
            at any depth); None for the default of the source (STDLIB_PATTERNS or TEXT_PATTERNS).
        val_fraction: expected fraction of files in the validation split, in (0, 1).
        max_bytes: cap on train + val bytes (validation gets ceil(max_bytes·val_fraction), train one byte at
            least); None for no cap.
    """

    path: str | os.PathLike | None = None
    patterns: tuple[str, ...] | None = None
    val_fraction: float = DEFAULT_VAL_FRACTION
    max_bytes: int | None = None

    def __post_init__(self):
        if self.patterns is not None and (not isinstance(self.patterns, tuple) or not self.patterns
                                          or not all(isinstance(p, str) and p for p in self.patterns)):
            raise ValueError(f"patterns must be a non-empty tuple of glob strings, got {self.patterns!r}")
        check_number("val_fraction", self.val_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        check_int("max_bytes", self.max_bytes, low=2, allow_none=True)  # one byte per split at least


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file in the corpus: `nbytes` and `sha256` describe the bytes taken (fewer than the file's if capped)."""

    path: str  # relative to the corpus root, '/'-separated
    split: Split
    nbytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a corpus was built from. `digest` hashes the token streams only, so it does not depend on the root."""

    root: str
    files: tuple[FileEntry, ...]
    skipped: tuple[tuple[str, str], ...]  # (relative path, reason)
    digest: str
    vocab_size: int = 256
    # what else decides the tokens, by name (e.g. {"tokenizer": {"sha256": …}, "dtype": "uint16"}); in to_dict()
    source: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain (JSON-able) form, for a checkpoint."""
        return {"root": self.root, "digest": self.digest, "vocab_size": self.vocab_size,
                "skipped": [list(s) for s in self.skipped], **self.source,
                "files": [{"path": f.path, "split": f.split.value, "nbytes": f.nbytes, "sha256": f.sha256}
                          for f in self.files]}

    def changes(self, saved: dict) -> list[str]:
        """Differences from a saved `to_dict()`, one line each; empty when the corpus is the same.

        Args:
            saved: the manifest dict stored in a checkpoint.
        Returns:
            e.g. ["changed: json/decoder.py", "added: new.py"]; just ["digest differs"] if no file explains it.
        """
        if saved["digest"] == self.digest:
            return []
        old = {f["path"]: (f["split"], f["nbytes"], f["sha256"]) for f in saved["files"]}
        new = {f.path: (f.split.value, f.nbytes, f.sha256) for f in self.files}
        lines = [f"removed: {p}" for p in sorted(old.keys() - new.keys())]
        lines += [f"added: {p}" for p in sorted(new.keys() - old.keys())]
        lines += [f"changed: {p}" for p in sorted(old.keys() & new.keys()) if old[p] != new[p]]
        mine = {"vocab_size": self.vocab_size, **self.source}  # the tokenizer, the shards' dtype …
        lines += [f"{key} changed" for key in mine if saved.get(key) != mine[key]]
        return lines or ["digest differs"]


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    """The uint8 token stream of each split, and the manifest it was built from."""

    train: torch.Tensor  # (N_train,) uint8
    val: torch.Tensor  # (N_val,) uint8
    manifest: Manifest
    config: DataConfig

    @classmethod
    def load(cls, config: DataConfig | None = None) -> ByteCorpus:
        """Read, split and concatenate the files `config` describes (the standard library's sources by default).

        Binary, non-UTF-8 and unreadable files are skipped (listed in the manifest, counted in one warning). Should
        one split draw nothing but such files, the readable text files alone are split instead, so any folder with
        two or more non-empty text files loads.

        Raises:
            FileNotFoundError: the path does not exist, or holds no file matching the patterns.
            NotADirectoryError: the path is a file.
            ValueError: fewer than two non-empty text files (a split by file needs two).
        """
        config = config or DataConfig()
        root, streams, files, skipped = select_files(config, keep=True)
        # The digest covers both splits with their lengths, so moving a file between splits changes it too.
        digest = hashlib.sha256()
        for split in Split:
            digest.update(split_header(split, len(streams[split])))  # minifloat.training.textfiles hashes the same
            digest.update(streams[split])
        manifest = Manifest(str(root), tuple(files), tuple(skipped.items()), digest.hexdigest())
        return cls(_tokens(streams[Split.TRAIN]), _tokens(streams[Split.VAL]), manifest, config)

    def tokens(self, split: Split | str) -> torch.Tensor:
        """The (N,) uint8 stream of one split ("train" or "val")."""
        return self.train if Split(split) == Split.TRAIN else self.val

    @property
    def vocab_size(self) -> int:
        """Token ids are bytes: 256."""
        return 256

    @property
    def tokenizer_json(self) -> None:
        """Bytes need no tokenizer (a TokenCorpus carries the tokenizer.json its ids were made with)."""
        return None


def split_header(split: Split, nbytes: int) -> bytes:
    """What the manifest digest hashes before a split's `nbytes` bytes: its name and length."""
    return f"{split.value}:{nbytes}\n".encode()


def load_corpus(data: str | None = None, *, max_bytes: int | None = None, tokenizer: str | None = None):
    """The corpus a run trains on (TrainConfig's data, max_bytes and tokenizer): a folder of text files read as
    bytes (ByteCorpus), or, with a tokenizer.json, encoded by it; or token shards (a `.bin` file, or a folder of them,
    memory-mapped). Every corpus has `train` and `val` (token streams for BatchLoader and val_batches),
    `vocab_size`, `manifest` and `config`; docs/training.md ("Data") has the rules."""
    # imported here: minifloat.training.tokens builds on this module (DataConfig, Manifest, split_files)
    from minifloat.training.tokens import is_token_data, load_text_tokens, load_token_shards

    if data is not None and is_token_data(data):
        return load_token_shards(data, tokenizer=tokenizer)
    if tokenizer is not None:
        return load_text_tokens(data, max_bytes=max_bytes, tokenizer=tokenizer)
    return ByteCorpus.load(DataConfig(path=data, max_bytes=max_bytes))


def require_windows(corpus, *, seq_len: int) -> None:
    """Refuse, before a run starts, a corpus whose train or validation split is too short for one sequence of
    `seq_len` + 1 tokens: training samples such windows from the train split and every evaluation reads the
    validation split, so a short split would otherwise end the run at its first evaluation.

    Raises:
        ValueError naming the split, the data, its size and the fixes.
    """
    where = "the standard library's sources" if corpus.config.path is None else f"--data {corpus.config.path}"
    for split in Split:
        tokens, name = corpus.tokens(split), "validation" if split == Split.VAL else "training"
        if isinstance(tokens, TokenStream):  # shards: a window never crosses from one into the next
            if tokens.n_starts(seq_len) <= 0:
                raise ValueError(
                    f"the {name} split of {where} has no token shard longer than one sequence of {seq_len + 1} tokens "
                    f"(--seq-len {seq_len} + 1): its longest holds {max(tokens.lengths)}; add tokens to the split "
                    f"(files named val/validation are the validation split), or lower --seq-len")
            continue
        n = tokens.numel()
        if n <= seq_len:
            unit = "bytes" if isinstance(corpus, ByteCorpus) else "tokens"
            cap = f"raise --max-bytes (now {corpus.config.max_bytes}), " if corpus.config.max_bytes else ""
            raise ValueError(
                f"the {name} split of {where} holds {n} {unit}, but one "
                f"sequence needs {seq_len + 1} (--seq-len {seq_len} + 1); {cap}add text files (each file goes to "
                f"one split, about {corpus.config.val_fraction:.0%} of them to validation), or lower --seq-len")


def split_files(paths: list[str], val_fraction: float) -> dict[str, Split]:
    """Assign each relative path to a split by its hash; both splits are non-empty when len(paths) >= 2.

    A path's score is the first 8 bytes of SHA-256(path) read as a fraction of 2^64; it goes to validation when the
    score is below `val_fraction`. The score of a path does not depend on the other paths, so adding or removing a file
    moves no other file, except where a split would be empty: then the path with the lowest (highest) score is
    moved into validation (train).

    Args:
        paths: '/'-separated paths relative to the corpus root.
        val_fraction: in (0, 1).
    Returns:
        {path: Split}.
    """
    score = {p: int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "big") / 2**64 for p in paths}
    splits = {p: Split.VAL if score[p] < val_fraction else Split.TRAIN for p in paths}
    by_score = sorted(paths, key=lambda p: (score[p], p))
    if len(paths) >= 2 and Split.VAL not in splits.values():
        splits[by_score[0]] = Split.VAL
    if len(paths) >= 2 and Split.TRAIN not in splits.values():
        splits[by_score[-1]] = Split.TRAIN
    return splits


def select_files(config: DataConfig, *, keep: bool, fix: str = DATA_FIX) -> tuple[pathlib.Path, dict[Split, bytes],
                                                                                 list[FileEntry], dict[str, str]]:
    """The files `config` describes, found, split and checked by ByteCorpus.load's rules (and with its errors).

    Args:
        config: the corpus.
        keep: hold the bytes read; False reads, checks and hashes each file and lets its bytes go
            (minifloat.training.textfiles reads them again, one file at a time).
        fix: what each error ends with: how to point --data at usable data (DATA_FIX: text or token shards).
    Returns:
        (root, each split's bytes joined (b"" unless keep), the files taken, {skipped file: reason}).
    """
    if config.path is None:
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        patterns, excluded = config.patterns or STDLIB_PATTERNS, STDLIB_EXCLUDED
    else:
        root = pathlib.Path(config.path).expanduser()
        patterns, excluded = config.patterns or TEXT_PATTERNS, ALWAYS_EXCLUDED
    if not root.exists():
        raise FileNotFoundError(f"data path {str(root)!r} does not exist; {fix}")
    if not root.is_dir():
        raise NotADirectoryError(f"data path {str(root)!r} is a file, not a folder; {fix}")
    skipped: dict[str, str] = {}  # relative path -> reason
    paths, others = _find_files(root, patterns, excluded, skipped)
    if not paths and not others:
        raise FileNotFoundError(f"data folder {str(root)!r} holds no files; {fix}")
    if not paths:
        bins = sorted(root.glob("*.bin")) if fix == DATA_FIX else []  # a reader that takes token shards too
        # one shard: a folder of shards needs two or more (a train and a validation split)
        hint = (f" (if {bins[0].name} is a token shard, point --data at the file: --data {bins[0]}; a folder of "
                f"shards needs two or more .bin files)" if len(bins) == 1 else "")
        raise FileNotFoundError(f"none of the {others} file(s) under data folder {str(root)!r} matches the "
                                f"patterns {list(patterns)}{hint}; {fix}")
    streams, files = _read_splits(root, paths, config, skipped, keep=keep)
    if not streams:  # a split drew only binary, unreadable or empty files: split the non-empty text files alone
        text = [rel for rel in paths if (got := _read_text(root / rel, rel, skipped, keep=False)) and got[1]]
        if len(text) < 2:
            raise ValueError(_too_few_text_files(root, text, skipped, fix))
        streams, files = _read_splits(root, text, config, skipped, keep=keep)  # both non-empty: see split_files
    if skipped:
        rel, reason = next(iter(skipped.items()))
        log.warning("data: skipped %d binary, non-UTF-8 or unreadable file(s) under %s (e.g. %s: %s)",
                    len(skipped), root, rel, reason)
    return root, streams, files, skipped


def _read_splits(root: pathlib.Path, paths: list[str], config: DataConfig, skipped: dict[str, str], *,
                 keep: bool) -> tuple[dict[Split, bytes], list[FileEntry]]:
    """The bytes of each split (b"" unless `keep`: each file is then read, checked, hashed and let go) and the files
    they came from: `paths` split by `split_files`, each split's files read in path order until its share of
    `config.max_bytes` is taken. Unreadable and binary files go to `skipped`. Returns ({}, []) when a split gets no
    bytes (all its files skipped or empty)."""
    splits = split_files(paths, config.val_fraction)
    budget: dict[Split, int | None] = {Split.TRAIN: None, Split.VAL: None}
    if config.max_bytes is not None:  # validation's ceil share, but one byte left for train (max_bytes >= 2)
        budget[Split.VAL] = min(math.ceil(config.max_bytes * config.val_fraction), config.max_bytes - 1)
        budget[Split.TRAIN] = config.max_bytes - budget[Split.VAL]
    streams, files = {}, []
    for split in Split:
        chunks, total = [], 0
        for rel in (p for p in paths if splits[p] == split):
            if budget[split] is not None and total >= budget[split]:
                break
            limit = None if budget[split] is None else budget[split] - total
            got = _read_text(root / rel, rel, skipped, limit=limit, keep=keep)
            if got is None:
                continue
            data, nbytes, sha256 = got
            chunks.append(data)
            total += nbytes
            files.append(FileEntry(rel, split, nbytes, sha256))
        if total == 0:
            return {}, []
        streams[split] = b"".join(chunks)
    return streams, files


def _too_few_text_files(root: pathlib.Path, text: list[str], skipped: dict[str, str], fix: str) -> str:
    """The message for a folder with fewer than two non-empty text files, naming what was found and skipped."""
    found = f"found only {text[0]!r}" if text else "found none"
    if skipped:
        rel, reason = next(iter(skipped.items()))
        found += f" and skipped {len(skipped)} binary, non-UTF-8 or unreadable file(s), e.g. {rel} ({reason})"
    return (f"need at least 2 non-empty text files under data folder {str(root)!r} for a train/validation split by "
            f"file, {found}; {fix}")


def _excluded(name: str, excluded: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in excluded)


def _find_files(root: pathlib.Path, patterns: tuple[str, ...], excluded: tuple[str, ...],
                skipped: dict[str, str]) -> tuple[list[str], int]:
    """Sorted '/'-separated relative paths of the files under root matching a pattern (symlinked folders not
    followed), and the number of other files (not excluded, matching no pattern); folders that cannot be listed go to
    `skipped`."""
    def unlistable(err: OSError):
        skipped[pathlib.Path(err.filename).relative_to(root).as_posix()] = f"unreadable: {err.strerror}"

    found, others = [], 0
    for dirpath, dirnames, filenames in os.walk(root, onerror=unlistable):
        dirnames[:] = sorted(d for d in dirnames if not _excluded(d, excluded))
        rel_dir = pathlib.PurePosixPath(pathlib.Path(dirpath).relative_to(root).as_posix())
        for name in filenames:
            rel = rel_dir / name
            if _excluded(name, excluded):
                continue
            if any(rel.match(p) for p in patterns):
                if not os.path.isfile(os.path.join(dirpath, name)) and os.path.exists(os.path.join(dirpath, name)):
                    # a named pipe, socket or device: reading it waits for a writer or never ends
                    skipped[rel.as_posix()] = "not a regular file (a pipe, socket or device)"
                    continue
                found.append(rel.as_posix())
            else:
                others += 1
    return sorted(found), others


def _read_text(path: pathlib.Path, rel: str, skipped: dict[str, str], *, limit: int | None = None,
               keep: bool = True) -> tuple[bytes, int, str] | None:
    """(the bytes taken if `keep`, else b"", how many, their SHA-256): the first `limit` bytes (all when None) of a
    file that is text from end to end, read READ_BYTES at a time (a large file is never held whole unless kept); or
    None, and an entry in `skipped`, if it cannot be read or is not UTF-8 text.

    "Text" is git's test (no NUL byte) plus valid UTF-8, so every byte value the model sees comes from real text.
    """
    digest, kept, taken, offset = hashlib.sha256(), [], 0, 0
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            while data := f.read(READ_BYTES):
                if b"\0" in data:
                    skipped[rel] = "binary: contains a NUL byte"
                    return None
                pending = len(decoder.getstate()[0])  # a character's first bytes, held from the last read
                try:
                    decoder.decode(data)
                except UnicodeDecodeError as err:  # its offsets count from the held bytes
                    skipped[rel] = f"binary: not UTF-8 ({err.reason} at byte {offset - pending + err.start})"
                    return None
                offset += len(data)
                take = data if limit is None else data[:max(0, limit - taken)]
                digest.update(take)
                taken += len(take)
                if keep and take:
                    kept.append(take)
        pending = len(decoder.getstate()[0])
        decoder.decode(b"", final=True)
    except OSError as err:
        skipped[rel] = f"unreadable: {err.strerror or type(err).__name__}"
        return None
    except UnicodeDecodeError as err:  # the file ends inside a character
        skipped[rel] = f"binary: not UTF-8 ({err.reason} at byte {offset - pending + err.start})"
        return None
    return b"".join(kept), taken, digest.hexdigest()


def _tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
