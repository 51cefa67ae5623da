"""A text file is read a part at a time, by the scan that checks and hashes it and by the reading that encodes it.

So one large file (TinyStories' 2 GB train.txt) is never held whole: the scan checks UTF-8 and NUL bytes and hashes
READ_BYTES at a time (minifloat.training.data._read_text), and TextFiles.texts hands each file over as decoded parts
that the encoder and the BPE trainer cut into pieces (minifloat.training.tokenizer.text_pieces). These tests hold
the parts to the whole file: the same skip reasons (byte offsets included), hashes, text, shards and tokenizer, and
the largest Python object well below the file's size.
"""

from __future__ import annotations

import hashlib
import pathlib
import tracemalloc

import pytest

from minifloat.training import data as data_module
from minifloat.training import textfiles as textfiles_module
from minifloat.training import tokenize as tokenize_module
from minifloat.training import tokenizer as tokenizer_module
from minifloat.training.data import ByteCorpus, DataConfig, Split
from minifloat.training.textfiles import TextFiles

# byte strings and what a whole-file check says of them; the multi-byte characters land across every read boundary
# for the read sizes below
CASES = {
    "ascii": b"plain text\n" * 9,
    "multibyte": "é✓ 字 𝄞 — smörgåsbord\n".encode() * 5,
    "bad start byte": "ok é ok".encode() + b"\xff" + b"tail",
    "bad continuation": "ab".encode() + b"\xe2\x9c" + b"x" + b"rest of it",
    "ends inside a character": "text then ✓".encode()[:-1],
    "nul": b"text\x00more",
    "empty": b"",
}
READ_SIZES = (1, 2, 3, 7, 1 << 24)


def _whole_file_verdict(raw: bytes) -> str | None:
    """What the check said when it read the file whole (the reference the streamed check must keep)."""
    if b"\0" in raw:
        return "binary: contains a NUL byte"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"binary: not UTF-8 ({err.reason} at byte {err.start})"
    return None


@pytest.mark.parametrize("read_bytes", READ_SIZES)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("limit", [None, 5])
def test_the_streamed_check_says_what_the_whole_file_check_said(tmp_path, monkeypatch, read_bytes, name, limit):
    monkeypatch.setattr(data_module, "READ_BYTES", read_bytes)
    raw = CASES[name]
    path = tmp_path / "f.txt"
    path.write_bytes(raw)
    skipped = {}
    got = data_module._read_text(path, "f.txt", skipped, limit=limit, keep=True)
    verdict = _whole_file_verdict(raw)
    if verdict is not None:
        assert got is None and skipped == {"f.txt": verdict}
        return
    taken = raw if limit is None else raw[:limit]
    assert skipped == {} and got == (taken, len(taken), hashlib.sha256(taken).hexdigest())
    assert data_module._read_text(path, "f.txt", {}, limit=limit, keep=False) == (b"", len(taken), got[2])


def _folder(root: pathlib.Path) -> pathlib.Path:
    root.mkdir()
    for i in range(6):
        body = " ".join(["déjà vu ✓ 𝄞 tokens", "scales", "amax", "448"][(i + j) % 4] for j in range(300 + 50 * i))
        (root / f"doc{i}.txt").write_text(f"# {i}\n{body}\n", encoding="utf-8")
    return root


@pytest.mark.parametrize("max_bytes", [None, 3001])  # 3001: a cap that cuts files (inside a character, too)
def test_texts_in_parts_are_the_files_read_whole(tmp_path, monkeypatch, max_bytes):
    folder = _folder(tmp_path / "text")
    whole = ByteCorpus.load(DataConfig(path=str(folder), max_bytes=max_bytes))
    monkeypatch.setattr(textfiles_module, "READ_BYTES", 3)
    monkeypatch.setattr(data_module, "READ_BYTES", 3)
    files = TextFiles.scan(DataConfig(path=str(folder), max_bytes=max_bytes))
    digest, sizes = hashlib.sha256(), []
    for split in Split:
        data, at = whole.tokens(split).numpy().tobytes(), 0
        for entry, parts in zip(files.entries(split), files.texts(split, hash_into=digest.update,
                                                                  progress=sizes.append)):
            parts = list(parts)
            assert len(parts) > 1 and "".join(parts) == data[at:at + entry.nbytes].decode("utf-8", errors="ignore")
            at += entry.nbytes
    assert files.manifest(digest.hexdigest()) == whole.manifest and max(sizes) <= 3
    assert sum(sizes) == files.nbytes()


def test_a_file_changed_after_the_scan_is_named(tmp_path):
    folder = _folder(tmp_path / "text")
    files = TextFiles.scan(DataConfig(path=str(folder)))
    first = files.entries(Split.TRAIN)[0]
    path = folder / first.path
    path.write_bytes(path.read_bytes().replace(b"amax", b"AMAX"))
    with pytest.raises(ValueError, match=f"data file {first.path} .* changed while the folder was read"):
        for parts in files.texts(Split.TRAIN):
            next(parts)  # the reading checks the rest itself


def test_tokenize_reads_in_parts_to_the_same_shards(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "text")
    tokenize_module.tokenize_folder(str(folder), str(tmp_path / "whole"), vocab_size=300)
    for module in (data_module, textfiles_module):
        monkeypatch.setattr(module, "READ_BYTES", 7)
    tokenize_module.tokenize_folder(str(folder), str(tmp_path / "parts"), vocab_size=300, batch_chars=500)
    read = {name: {p.name: p.read_bytes() for p in (tmp_path / name).iterdir()} for name in ("whole", "parts")}
    assert read["parts"] == read["whole"]  # shards, tokenizer.json and meta.json


def _tokenize_peak(tmp_path: pathlib.Path, name: str, nbytes: int) -> tuple[int, int]:
    """(tracemalloc's peak while tokenize trains a BPE on and encodes a folder with one file of about `nbytes`,
    that file's size)."""
    folder = tmp_path / name
    folder.mkdir()
    line = "the model trains on tokens while the scales follow the amax history, déjà vu ✓\n"
    (folder / "big.txt").write_text(line * (nbytes // len(line)), encoding="utf-8")
    for i in range(4):
        (folder / f"small{i}.txt").write_text(line * (3 + i), encoding="utf-8")
    tracemalloc.start()
    try:
        meta = tokenize_module.tokenize_folder(str(folder), str(tmp_path / f"{name}-tok"), vocab_size=300,
                                               batch_chars=1 << 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta["source"]["files"] == 5
    return peak, (folder / "big.txt").stat().st_size


def test_a_large_file_is_never_held_whole(tmp_path, monkeypatch):
    """tokenize's memory (BPE training included) does not grow with the largest file: the peak of Python objects
    (tracemalloc follows bytes, str and lists) is the same for a 1 MB and a 4 MB file, and a small part of the
    larger (before the streaming, the scan alone held each file whole)."""
    for module in (data_module, textfiles_module):
        monkeypatch.setattr(module, "READ_BYTES", 1 << 16)
    monkeypatch.setattr(tokenizer_module, "ENCODE_CHARS", 1 << 16)
    small_peak, _ = _tokenize_peak(tmp_path, "small", 1_000_000)
    large_peak, size = _tokenize_peak(tmp_path, "large", 4_000_000)
    assert large_peak < 1.25 * small_peak and large_peak < size / 2, (small_peak, large_peak, size)
