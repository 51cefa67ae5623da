"""Tests for minifloat.training.data: the split by file, skipping and errors, the manifest, and batch order.

The loader's contract is that batch k is a pure function of (seed, k): fresh loaders, resumed loaders and skip(n) must
produce tensors equal (torch.equal, not allclose) to an uninterrupted run. Folders are built in tmp_path; the one
standard-library test caps max_bytes so it reads a handful of files.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from minifloat.training.data import (
    BatchLoader,
    ByteCorpus,
    DataConfig,
    Split,
    split_files,
    val_batches,
)
from minifloat.training.textfiles import TextFiles

SEED = 0
B, T = 4, 8
N_FILES = 40
VAL_FRACTION = 0.25  # large, so a 40-file folder has several validation files (expected 10)
STDLIB_MAX_BYTES = 20_000
# A stream whose bytes are their own positions: a window starting at s is s, s+1, …, so shifts are exact to check.
RAMP = torch.arange(200, dtype=torch.uint8)


def _write_folder(root: pathlib.Path, n: int = N_FILES) -> pathlib.Path:
    root.mkdir(exist_ok=True)
    for i in range(n):
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:03d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog\n" * (i + 1))
    return root


def _load(root: pathlib.Path, **kw) -> ByteCorpus:
    return ByteCorpus.load(DataConfig(path=root, val_fraction=kw.pop("val_fraction", VAL_FRACTION), **kw))


def _splits(corpus: ByteCorpus) -> dict[str, Split]:
    return {f.path: f.split for f in corpus.manifest.files}


def _draw(loader: BatchLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def _assert_same_batches(a, b):
    assert len(a) == len(b)
    for k, ((xa, ya), (xb, yb)) in enumerate(zip(a, b)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb), f"batch {k} differs"


# ---- split ---------------------------------------------------------------------------------------------------------


def test_split_is_deterministic_and_disjoint_by_file(tmp_path):
    root = _write_folder(tmp_path / "corpus")
    first, second = _load(root), _load(root)
    assert first.manifest == second.manifest
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    splits = _splits(first)
    assert len(splits) == len(first.manifest.files) == N_FILES  # each file appears once: the splits are disjoint
    train = {p for p, s in splits.items() if s == Split.TRAIN}
    val = {p for p, s in splits.items() if s == Split.VAL}
    assert train and val and not train & val
    assert first.train.numel() == sum(f.nbytes for f in first.manifest.files if f.split == Split.TRAIN)
    assert first.val.numel() == sum(f.nbytes for f in first.manifest.files if f.split == Split.VAL)
    assert first.tokens("train") is first.train and first.tokens(Split.VAL) is first.val


def test_split_is_stable_when_a_file_is_added(tmp_path):
    root = _write_folder(tmp_path / "corpus")
    before = _splits(_load(root))
    (root / "d1" / "new.txt").write_text("a file that was not there before\n")
    after = _splits(_load(root))
    assert after.keys() == before.keys() | {"d1/new.txt"}
    assert {p: after[p] for p in before} == before


@pytest.mark.parametrize("name, n_paths, val_fraction", [
    ("tiny fraction, two files", 2, 1e-9),
    ("huge fraction, two files", 2, 1 - 1e-9),
    ("tiny fraction, many files", 50, 1e-9),
    ("huge fraction, many files", 50, 1 - 1e-9),
])
def test_split_never_leaves_a_side_empty(name, n_paths, val_fraction):
    splits = split_files([f"f{i}.txt" for i in range(n_paths)], val_fraction)
    assert set(splits.values()) == {Split.TRAIN, Split.VAL}, name


def test_split_fraction_is_roughly_honoured():
    paths = [f"pkg/module_{i}.py" for i in range(2000)]
    n_val = sum(s == Split.VAL for s in split_files(paths, 0.05).values())
    assert 60 <= n_val <= 140  # Binomial(2000, 0.05): mean 100, sd 9.7; the bounds are > 4 sd out


# ---- sources, skipping, errors -------------------------------------------------------------------------------------


def test_stdlib_default_respects_max_bytes():
    corpus = ByteCorpus.load(DataConfig(max_bytes=STDLIB_MAX_BYTES))
    assert corpus.train.numel() + corpus.val.numel() == STDLIB_MAX_BYTES
    assert corpus.val.numel() == 1_000  # ceil(20_000 · 0.05)
    assert corpus.train.dtype == corpus.val.dtype == torch.uint8


def test_stdlib_default_excludes_tests_and_installed_packages():
    corpus = ByteCorpus.load()  # the whole standard library: about 12 MB, well under a second
    assert corpus.train.numel() > 0 and corpus.val.numel() > 0
    for f in corpus.manifest.files:
        parts = f.path.split("/")
        assert f.path.endswith(".py"), f.path
        assert not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(parts), f.path


@pytest.mark.parametrize("max_bytes", [2, 100, 1_000, 5_000])
def test_max_bytes_respected(tmp_path, max_bytes):
    corpus = _load(_write_folder(tmp_path / "corpus"), max_bytes=max_bytes)
    assert corpus.train.numel() + corpus.val.numel() == max_bytes  # the folder holds more than 5_000 bytes
    assert corpus.val.numel() >= 1 and corpus.train.numel() >= 1
    assert sum(f.nbytes for f in corpus.manifest.files) == max_bytes


def test_binary_and_unreadable_files_are_skipped_and_counted(tmp_path, caplog):
    root = tmp_path / "mixed"
    root.mkdir()
    (root / "a.txt").write_text("plain text, the only readable file on this side\n" * 10)
    (root / "b.txt").write_text("another plain text file\n" * 10)
    (root / "nul.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (root / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (root / "dangling.txt").symlink_to(root / "nowhere.txt")  # listed by the walk, fails to open (also as root)
    os.mkfifo(root / "pipe.txt")  # opening it waited for a writer: the load hung
    with caplog.at_level("WARNING", logger="minifloat"):
        corpus = ByteCorpus.load(DataConfig(path=root, val_fraction=0.5))
    reasons = dict(corpus.manifest.skipped)
    assert sorted(reasons) == ["dangling.txt", "latin1.txt", "nul.txt", "pipe.txt"]
    assert reasons["nul.txt"].startswith("binary") and reasons["latin1.txt"].startswith("binary")
    assert reasons["dangling.txt"].startswith("unreadable") and reasons["pipe.txt"].startswith("not a regular file")
    assert sorted(f.path for f in corpus.manifest.files) == ["a.txt", "b.txt"]
    assert "skipped 4 binary, non-UTF-8 or unreadable file(s)" in caplog.text
    assert len(caplog.records) == 1  # one warning for all of them


def test_text_files_are_split_alone_when_a_split_draws_only_binary_files(tmp_path, caplog):
    root = tmp_path / "mostly-binary"
    root.mkdir()
    for i in range(5):  # with 7 paths and val_fraction 0.05, validation gets the lowest-scored path: a binary one
        (root / f"bin{i}.txt").write_bytes(bytes(range(256)))
    (root / "t1.txt").write_text("the first text file\n")
    (root / "t2.txt").write_text("the second text file\n")
    with caplog.at_level("WARNING", logger="minifloat"):
        corpus = ByteCorpus.load(DataConfig(path=root))
    assert sorted(f.split for f in corpus.manifest.files) == [Split.TRAIN, Split.VAL]
    assert sorted(f.path for f in corpus.manifest.files) == ["t1.txt", "t2.txt"]
    assert len(corpus.manifest.skipped) == 5 and "skipped 5 binary" in caplog.text


def test_max_bytes_leaves_train_a_byte(tmp_path):
    corpus = _load(_write_folder(tmp_path / "corpus", n=4), max_bytes=2, val_fraction=0.9)
    assert (corpus.train.numel(), corpus.val.numel()) == (1, 1)


def test_patterns_select_files(tmp_path):
    root = _write_folder(tmp_path / "corpus", n=6)
    (root / "notes.md").write_text("# notes\n")
    (root / "d0" / "more.md").write_text("# more\n")
    corpus = ByteCorpus.load(DataConfig(path=root, patterns=("*.md",), val_fraction=0.5))
    assert sorted(f.path for f in corpus.manifest.files) == ["d0/more.md", "notes.md"]


def _missing(tmp_path):
    return tmp_path / "does-not-exist"


def _empty(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _only_binary(tmp_path):
    (tmp_path / "bin").mkdir()
    for name in ("x.txt", "y.txt"):
        (tmp_path / "bin" / name).write_bytes(bytes(range(256)))
    return tmp_path / "bin"


def _one_file(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "only.txt").write_text("just one file\n")
    return tmp_path / "one"


def _no_match(tmp_path):
    (tmp_path / "other").mkdir()
    for name in ("weights.bin", "image.png"):
        (tmp_path / "other" / name).write_bytes(bytes(range(256)))
    return tmp_path / "other"


def _a_file(tmp_path):
    (tmp_path / "file.txt").write_text("a file, not a folder\n")
    return tmp_path / "file.txt"


# (name, folder, error, words the message must hold besides the path and the fix)
BAD_PATH_CASES = [
    ("missing path", _missing, FileNotFoundError, "does not exist"),
    ("empty folder", _empty, FileNotFoundError, "holds no files"),
    ("no file matches", _no_match, FileNotFoundError, r"none of the 2 file\(s\).*matches the patterns \['\*\.txt'"),
    ("a file, not a folder", _a_file, NotADirectoryError, "is a file, not a folder"),
    ("one file: no split by file", _one_file, ValueError,
     r"need at least 2 non-empty text files.*found only 'only\.txt'"),
    ("every file binary", _only_binary, ValueError, r"found none and skipped 2 binary, non-UTF-8 or unreadable"),
]


@pytest.mark.parametrize("name, make, error, words", BAD_PATH_CASES, ids=[c[0] for c in BAD_PATH_CASES])
def test_bad_paths_raise_naming_the_path_and_the_fix(tmp_path, caplog, name, make, error, words):
    path = make(tmp_path)
    with pytest.raises(error, match=words) as info:
        ByteCorpus.load(DataConfig(path=path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert message.endswith("point --data (DataConfig.path) at a folder of UTF-8 text files, or at token shards "
                            "(a .bin file or a folder of them, as minifloat tokenize writes)")
    assert not caplog.records  # the error alone: no warning about skipped files before it


@pytest.mark.parametrize("name, make, error, words", BAD_PATH_CASES, ids=[c[0] for c in BAD_PATH_CASES])
def test_a_reader_of_text_alone_ends_the_errors_with_its_own_fix(tmp_path, name, make, error, words):
    """minifloat tokenize reads text only: its data errors must not offer token shards (training's DATA_FIX)."""
    path = make(tmp_path)
    with pytest.raises(error, match=words) as info:
        TextFiles.scan(DataConfig(path=path), fix="point --data at a folder of text")
    assert str(info.value).endswith("; point --data at a folder of text") and "shards" not in str(info.value)


@pytest.mark.parametrize("name, kwargs", [
    ("val_fraction 0", {"val_fraction": 0}),
    ("val_fraction 1", {"val_fraction": 1.0}),
    ("val_fraction negative", {"val_fraction": -0.1}),
    ("max_bytes 1", {"max_bytes": 1}),
    ("max_bytes float", {"max_bytes": 1e6}),
    ("patterns a list", {"patterns": ["*.txt"]}),
    ("patterns empty", {"patterns": ()}),
])
def test_config_rejects_invalid_values(name, kwargs):
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=field):
        DataConfig(**kwargs)


# ---- manifest ------------------------------------------------------------------------------------------------------


def test_digest_changes_when_a_file_changes(tmp_path):
    root = _write_folder(tmp_path / "corpus")
    before = _load(root).manifest
    (root / "d0" / "f000.txt").write_text("edited\n")
    after = _load(root).manifest
    assert after.digest != before.digest
    assert after.changes(before.to_dict()) == ["changed: d0/f000.txt"]
    assert _load(root).manifest.changes(after.to_dict()) == []


def test_digest_does_not_depend_on_the_root(tmp_path):
    a, b = _write_folder(tmp_path / "a"), _write_folder(tmp_path / "b")
    assert _load(a).manifest.digest == _load(b).manifest.digest


# ---- batches -------------------------------------------------------------------------------------------------------


@pytest.fixture
def tokens(tmp_path) -> torch.Tensor:
    return _load(_write_folder(tmp_path / "corpus")).train


def test_batch_k_is_identical_across_fresh_loaders(tokens):
    a = BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED)
    b = BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED)
    _assert_same_batches(_draw(a, 10), [b.batch(k) for k in range(10)])
    other = BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED + 1)
    assert not torch.equal(other.batch(0)[0], b.batch(0)[0])


def test_resume_from_state_dict_reproduces_the_rest(tokens):
    uninterrupted = _draw(BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED), 12)
    first = BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED)
    _draw(first, 5)
    state = first.state_dict()
    assert state == {"position": 5, "seed": SEED} and all(type(v) is int for v in state.values())
    resumed = BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED + 99)  # the saved seed wins
    resumed.load_state_dict(state)
    _assert_same_batches(_draw(resumed, 7), uninterrupted[5:])


def test_skip_equals_drawing(tokens):
    drawn = BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED)
    _draw(drawn, 6)
    skipped = BatchLoader(tokens, batch_size=B, seq_len=T, seed=SEED)
    skipped.skip(6)
    assert skipped.state_dict() == drawn.state_dict()
    _assert_same_batches(_draw(skipped, 3), _draw(drawn, 3))


def test_batches_are_shifted_windows_with_shapes_and_dtypes():
    loader = BatchLoader(RAMP, batch_size=B, seq_len=T, seed=SEED)
    for x, y in _draw(loader, 20):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # on RAMP, "y is x shifted by one" is y = x + 1
        assert torch.equal(x - x[:, :1], torch.arange(T).expand(B, T))  # contiguous windows
        assert int(y.max()) <= RAMP.numel() - 1  # windows stay inside the stream


# Window starts of batch 0, seed 0, on RAMP (B=4, T=8: 192 starts), computed independently of the loader as
# [int.from_bytes(d[i:i + 8], "little") % 192 for i in (0, 8, 16, 24)], d = shake_256(b"minifloat.data/0/0").digest(32).
GOLDEN_STARTS = [106, 144, 134, 117]


def test_golden_batch():
    # Pins the hash-based sampler: checkpoints resume to the same batches on any torch or Python version.
    x, _ = BatchLoader(RAMP, batch_size=B, seq_len=T, seed=SEED).batch(0)
    assert x[:, 0].tolist() == GOLDEN_STARTS


@pytest.mark.parametrize("name, state", [
    ("missing seed", {"position": 3}),
    ("extra key", {"position": 3, "seed": 0, "epoch": 1}),
    ("negative position", {"position": -1, "seed": 0}),
    ("float position", {"position": 3.0, "seed": 0}),
])
def test_load_state_dict_rejects_bad_state(name, state):
    with pytest.raises(ValueError):
        BatchLoader(RAMP, batch_size=B, seq_len=T).load_state_dict(state)


def test_loader_rejects_a_stream_too_short():
    with pytest.raises(ValueError, match="seq_len"):
        BatchLoader(RAMP[:T], batch_size=B, seq_len=T)


def test_val_batches_cover_the_stream_once_and_are_fixed():
    batches = list(val_batches(RAMP, batch_size=B, seq_len=T))
    n_windows = (RAMP.numel() - 1) // T  # 24
    assert [x.shape[0] for x, _ in batches] == [B] * (n_windows // B)
    targets = torch.cat([y.flatten() for _, y in batches])
    assert torch.equal(targets, torch.arange(1, n_windows * T + 1))  # every target once, in order
    _assert_same_batches(batches, list(val_batches(RAMP, batch_size=B, seq_len=T)))
    assert len(list(val_batches(RAMP, batch_size=B, seq_len=T, max_batches=2))) == 2


def test_val_batches_last_batch_may_be_short():
    batches = list(val_batches(RAMP[:T * 5 + 1], batch_size=B, seq_len=T))
    assert [x.shape for x, _ in batches] == [(B, T), (1, T)]
