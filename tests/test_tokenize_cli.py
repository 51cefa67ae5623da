"""`minifloat tokenize` (minifloat.cli.tokenize, minifloat.training.tokenize): a round trip from text to shards and
back, the files and meta.json it writes, a deterministic BPE, streaming in bounded memory with the same bytes as
encoding each split whole, its refusal to write over files, its one-line errors, and `minifloat train --data OUT` on
the result."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from minifloat.cli import main
from minifloat.cli import tokenize as cli_tokenize
from minifloat.training import tokenize as lib_tokenize
from minifloat.training.data import ByteCorpus, DataConfig, load_corpus
from minifloat.training.sharded import read_extra
from minifloat.training.tokenizer import load_tokenizer

USER_ERROR = 2
VOCAB = 300


def tokenize(tmp_path: pathlib.Path, capsys, *extra: str, out: str = "tok") -> tuple[int, str, str]:
    status = main(["tokenize", "--data", str(tmp_path / "text"), "--out", str(tmp_path / out), *extra])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def text(tmp_path) -> pathlib.Path:
    """Eight deterministic text files of a few KB, non-ASCII characters included."""
    words = "the model trains on tokens while scales follow amax history éàü ✓ numbers 448 57344".split()
    root = tmp_path / "text"
    root.mkdir()
    for i in range(8):
        body = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(600))
        (root / f"doc{i:02d}.txt").write_text(f"# file {i}\n{body}\n", encoding="utf-8")
    return root


def _shard_ids(folder: pathlib.Path, meta: dict, split: str) -> list[int]:
    out = []
    for shard in meta["shards"]:
        if shard["split"] == split:
            data = (folder / shard["file"]).read_bytes()
            out += torch.frombuffer(bytearray(data), dtype=torch.int16).long().bitwise_and(0xFFFF).tolist()
    return out


def test_round_trip(tmp_path, capsys, text):
    status, stdout, err = tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB), "--shard-tokens", "700")
    assert status == 0 and err == "" and "minifloat train --data" in stdout
    out = tmp_path / "tok"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB and meta["tokenizer"]["trained"]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["meta.json", "tokenizer.json", *(s["file"] for s in meta["shards"])])
    assert all(s["tokens"] <= 700 for s in meta["shards"]) and len(meta["shards"]) > 2  # cut into shards
    tok = load_tokenizer(out / "tokenizer.json")
    assert meta["tokenizer"]["sha256"] == tok.sha256
    bytes_corpus = load_corpus(str(text), max_bytes=None)
    for split in ("train", "val"):
        ids = _shard_ids(out, meta, split)
        assert sum(s["tokens"] for s in meta["shards"] if s["split"] == split) == len(ids)
        files = [f.path for f in bytes_corpus.manifest.files if f.split.value == split]  # training's own split
        pieces, piece = [], []
        for i in ids:  # cut at the end-of-text ids
            if i == tok.eot_id:
                pieces.append(piece)
                piece = []
            else:
                piece.append(i)
        assert [tok.tokenizer.decode(p) for p in pieces] == [(text / f).read_text(encoding="utf-8") for f in files]
    corpus = load_corpus(str(out))
    assert corpus.vocab_size == VOCAB and len(corpus.val) == len(_shard_ids(out, meta, "val"))


def test_trained_bpe_is_deterministic(tmp_path, capsys, text):
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB), out="a")[0] == 0
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB), out="b")[0] == 0
    for name in ("tokenizer.json", "train_000000.bin", "val_000000.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_given_tokenizer_is_used_and_copied(tmp_path, capsys, text):
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB), out="first")[0] == 0
    given = tmp_path / "first" / "tokenizer.json"
    status, _, err = tokenize(tmp_path, capsys, "--tokenizer", str(given), out="second")
    assert status == 0 and err == ""
    meta = json.loads((tmp_path / "second" / "meta.json").read_text())
    assert not meta["tokenizer"]["trained"] and (tmp_path / "second" / "tokenizer.json").read_bytes() == \
        given.read_bytes()
    assert (tmp_path / "second" / "train_000000.bin").read_bytes() == \
        (tmp_path / "first" / "train_000000.bin").read_bytes()


def test_a_tokenizer_that_cannot_encode_the_text_is_one_line(tmp_path, capsys, text):
    """A WordLevel vocabulary without an unknown token loads but fails on the first word it lacks: tokenize and train
    say so in one line naming the file the user gave (not tokenize's temporary copy), exit 2, and leave nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"the": 0}, unk_token=None))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "words.json"
    words.save(str(path))
    status, _, err = tokenize(tmp_path, capsys, "--tokenizer", str(path))
    lines = err.splitlines()
    assert status == 2 and len(lines) == 1, err
    assert f"tokenizer {str(path)!r} cannot encode this text" in lines[0] and "unknown token" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text", "words.json"]  # no shards, no temporary folder
    status = main(["train", "--model", "tiny", "--steps", "1", "--data", str(text), "--tokenizer", str(path),
                   "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and f"tokenizer {str(path)!r} cannot encode this text" in err and "Traceback" not in err


def _reference_shards(text: pathlib.Path, tokenizer: pathlib.Path, *, max_bytes: int | None,
                      shard_tokens: int) -> tuple[dict[str, bytes], str]:
    """The shards as tokenize wrote them before it streamed: the whole corpus in memory (ByteCorpus), each split's
    files encoded by the tokenizer itself with the end-of-text id after each, the split cut every shard_tokens ids;
    and the corpus digest."""
    corpus, tok = ByteCorpus.load(DataConfig(path=str(text), max_bytes=max_bytes)), load_tokenizer(tokenizer)
    shards = {}
    for split in ("train", "val"):
        data, ids, at = corpus.tokens(split).numpy().tobytes(), [], 0
        for entry in (f for f in corpus.manifest.files if f.split.value == split):
            piece = data[at:at + entry.nbytes].decode("utf-8", errors="ignore")
            ids += [*tok.tokenizer.encode(piece, add_special_tokens=False).ids, tok.eot_id]
            at += entry.nbytes
        for index, first in enumerate(range(0, len(ids), shard_tokens)):
            shards[f"{split}_{index:06d}.bin"] = np.array(ids[first:first + shard_tokens], dtype="<u2").tobytes()
    return shards, corpus.manifest.digest


@pytest.mark.parametrize("batch_chars, max_bytes, shard_tokens", [
    (1, None, 700),  # one file a batch, shards cut inside batches and batches across shards
    (10**9, None, 10**6),  # the whole split one batch, one shard a split
    (2000, 20_001, 333),  # a cap that cuts the last file read
])
def test_streamed_shards_are_the_splits_encoded_whole_and_cut(tmp_path, text, batch_chars, max_bytes, shard_tokens):
    lib_tokenize.tokenize_folder(str(text), str(tmp_path / "bpe"), vocab_size=VOCAB)
    tokenizer = tmp_path / "bpe" / "tokenizer.json"
    out = tmp_path / "tok"
    meta = lib_tokenize.tokenize_folder(str(text), str(out), tokenizer=str(tokenizer), max_bytes=max_bytes,
                                        shard_tokens=shard_tokens, batch_chars=batch_chars)
    expected, digest = _reference_shards(text, tokenizer, max_bytes=max_bytes, shard_tokens=shard_tokens)
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == expected
    assert [s["file"] for s in meta["shards"]] == list(expected)  # in order, train first
    assert meta["source"]["digest"] == digest  # the manifest digest of the corpus read whole


def test_the_corpus_is_never_held_whole(tmp_path, text, monkeypatch):
    """With one file a batch, the shard writer gets a chunk of ids per file or piece of a file, each a small part of
    the split; the BPE trainer gets an iterator, not a list of texts; and the whole-corpus reader (ByteCorpus) is
    never called."""
    def whole(*args, **kwargs):
        raise AssertionError("tokenize read the whole corpus into memory")

    chunks, trained_on = [], []
    write, train_bpe = lib_tokenize.ShardWriter.write, lib_tokenize.train_bpe

    def spy_write(self, ids):
        chunks.append((self.split.value, ids.numel()))
        write(self, ids)

    def spy_train(texts, **kwargs):
        trained_on.append(type(texts))
        assert not isinstance(texts, (list, tuple)), "the BPE trainer got every text at once"
        return train_bpe(texts, **kwargs)

    monkeypatch.setattr(ByteCorpus, "load", whole)
    monkeypatch.setattr(lib_tokenize.ShardWriter, "write", spy_write)
    monkeypatch.setattr(lib_tokenize, "train_bpe", spy_train)
    meta = lib_tokenize.tokenize_folder(str(text), str(tmp_path / "tok"), vocab_size=VOCAB, shard_tokens=10**6,
                                        batch_chars=1)
    assert trained_on and len(chunks) >= meta["source"]["files"] == len(list(text.iterdir()))  # or pieces
    for split in ("train", "val"):
        sizes = [n for s, n in chunks if s == split]
        total = sum(s["tokens"] for s in meta["shards"] if s["split"] == split)
        assert sum(sizes) == total and (len(sizes) == 1 or max(sizes) < total)


def test_refuses_a_folder_holding_files_and_overwrite_keeps_the_users(tmp_path, capsys, text):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    status, _, err = tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB))
    lines = err.splitlines()
    assert status == USER_ERROR and len(lines) == 1 and "--overwrite" in lines[0] and str(out) in lines[0]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB), "--overwrite")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB))[0] == USER_ERROR  # now it holds shards
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing changed
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB + 20), "--overwrite")[0] == 0
    assert (out / "notes.txt").read_text() == "mine\n"
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == VOCAB + 20
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tok.tmp")]  # the temporary folder is gone


@pytest.mark.parametrize("files", [{"meta.json": '{"mine": true}', "tokenizer.json": '{"mine": true}'},
                                   {"tokenizer.json": "{}"}, "unlisted"], ids=["not-ours", "no-meta", "unlisted"])
def test_overwrite_replaces_only_what_an_earlier_tokenize_wrote(tmp_path, capsys, text, files):
    """Files under tokenize's names that no earlier tokenize there wrote (its meta.json lists what it wrote) are the
    user's: --overwrite refuses, in one line naming them, and changes nothing."""
    out = tmp_path / "tok"
    if files == "unlisted":  # an earlier tokenize's folder, plus a shard its meta.json does not list
        assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB))[0] == 0
        files = {"train_000099.bin": "mine"}
    out.mkdir(exist_ok=True)
    for name, content in files.items():
        (out / name).write_text(content)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    status, _, err = tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB), "--overwrite")
    lines = err.splitlines()
    assert status == USER_ERROR and len(lines) == 1, err
    assert "which no earlier minifloat tokenize there wrote" in lines[0] and sorted(files)[0] in lines[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_killed_tokenizes_temporary_folder_is_removed_by_the_next(tmp_path, capsys, text):
    # SIGKILL (or SIGTERM inside the BPE trainer) left .tok.tmp-PID beside --out for good
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that no longer runs
    abandoned = tmp_path / f".tok.tmp-{dead.pid}"
    abandoned.mkdir()
    (abandoned / "train_000000.bin").write_bytes(b"\0" * 8)
    running = tmp_path / f".tok.tmp-{os.getppid()}"  # a live process's folder stays
    running.mkdir()
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB))[0] == 0
    assert not abandoned.exists() and running.exists()


@pytest.mark.parametrize("name, extra, words", [
    ("vocabulary too small", ["--vocab-size", "100"], "--vocab-size must be at least 257"),
    ("vocabulary with a tokenizer", ["--vocab-size", "400", "--tokenizer", "t.json"], "leave one of them out"),
    ("shard tokens 0", ["--shard-tokens", "0"], "--shard-tokens must be at least 1"),
    ("missing tokenizer", ["--tokenizer", "/nonexistent/tokenizer.json"], "does not exist"),
    ("missing text folder", ["--data", "/nonexistent/text"], "does not exist"),
    # shards `minifloat train` would refuse at its default --seq-len (64): nothing is written
    ("a cap too small for one sequence", ["--max-bytes", "10"], "raise --max-bytes (now 10)"),
    ("shards too short for one sequence", ["--shard-tokens", "20"], "raise --shard-tokens (now 20) to 65"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_errors_are_one_line(tmp_path, capsys, text, name, extra, words):
    status, stdout, err = tokenize(tmp_path, capsys, *extra)
    lines = err.splitlines()
    assert status == USER_ERROR and len(lines) == 1 and words in lines[0] and "Traceback" not in err, lines
    assert ".bin" not in lines[0], lines  # tokenize reads text: token shards are no fix it can take
    assert not (tmp_path / "tok").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tok.tmp")]


@pytest.mark.parametrize("name, cut", [
    ("no text folder", lambda text: ["--data", str(text / "missing")]),
    ("an empty folder", lambda text: ["--data", str(text / "empty")]),
    ("one text file", lambda text: ["--data", str(text / "one")]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_data_errors_offer_text_only(tmp_path, capsys, text, name, cut):
    (text / "empty").mkdir()
    (text / "one").mkdir()
    (text / "one" / "a.txt").write_text("one file cannot be split by file\n")
    status = main(["tokenize", *cut(text), "--out", str(tmp_path / "tok")])
    lines = capsys.readouterr().err.splitlines()
    assert status == USER_ERROR and len(lines) == 1, lines
    assert lines[0].endswith(lib_tokenize.TEXT_FIX) and "shard" not in lines[0], lines


def _nanogpt_folder(tmp_path, tok):
    (tmp_path / "nano").mkdir()
    for name in ("train.bin", "val.bin"):
        (tmp_path / "nano" / name).write_bytes((tok / "train_000000.bin").read_bytes())
    return tmp_path / "nano"


@pytest.mark.parametrize("name, data", [
    ("a minifloat tokenize folder", lambda tmp_path, tok: tok),
    ("one of its shards", lambda tmp_path, tok: tok / "train_000000.bin"),
    ("nanoGPT's train.bin and val.bin", _nanogpt_folder),
], ids=lambda v: v if isinstance(v, str) else "")
def test_token_shards_as_data_are_refused_naming_train(tmp_path, capsys, text, name, data):
    """Its meta.json and tokenizer.json would be read as text (a useless corpus): one line pointing at train."""
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB))[0] == 0
    shards = data(tmp_path, tmp_path / "tok")
    status = main(["tokenize", "--data", str(shards), "--out", str(tmp_path / "again")])
    lines = capsys.readouterr().err.splitlines()
    assert status == USER_ERROR and len(lines) == 1, lines
    assert "token shard" in lines[0] and f"minifloat train --data {shards}" in lines[0], lines
    assert not (tmp_path / "again").exists()


def test_help_explains_itself(capsys):
    with pytest.raises(SystemExit):
        main(["tokenize", "--help"])
    text = capsys.readouterr().out
    for words in ("byte-level BPE", "--overwrite", "meta.json", "minifloat train --data", "uint16"):
        assert words in " ".join(text.split()), words


def test_cli_defaults_are_the_librarys():
    assert cli_tokenize.DEFAULT_VOCAB_SIZE == lib_tokenize.DEFAULT_VOCAB_SIZE
    assert cli_tokenize.DEFAULT_SHARD_TOKENS == lib_tokenize.DEFAULT_SHARD_TOKENS


def test_train_on_the_shards_uses_their_vocabulary(tmp_path, capsys, text):
    assert tokenize(tmp_path, capsys, "--vocab-size", str(VOCAB))[0] == 0
    run = tmp_path / "run"
    status = main(["train", "--data", str(tmp_path / "tok"), "--model", "tiny", "--steps", "2", "--batch-size", "2",
                   "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every", "2",
                   "--out", str(run), "--device", "cpu"])
    assert status == 0, capsys.readouterr().err
    data = read_extra(run / "ckpt")["data"]
    assert data["vocab_size"] == VOCAB and data["kind"] == "shards" and data["dtype"] == "uint16"


def test_an_out_inside_the_data_or_holding_a_run_is_refused(text, tmp_path, capsys):
    # tokenize wrote its shards into the text folder it read (the next read took tokenizer.json and meta.json as
    # text), and --overwrite mixed shards into a training run's folder
    assert main(["tokenize", "--data", str(text), "--out", str(text / "tok"), "--vocab-size", "300"]) == 2
    assert "lies inside --data" in capsys.readouterr().err and not (text / "tok").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.csv").write_text("step,loss\n")
    assert main(["tokenize", "--data", str(text), "--out", str(run), "--overwrite", "--vocab-size", "300"]) == 2
    assert "holds a training run" in capsys.readouterr().err and sorted(p.name for p in run.iterdir()) == ["log.csv"]
