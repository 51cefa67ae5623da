"""minifloat.training.tokens, shards and batches' TokenStream: every token-data kind loads with the right ids and splits,
shards are memory-mapped (not read whole), batches stay a pure function of (seed, k) and never cross a shard, a
resumed run on shards is bitwise equal to an uninterrupted one, the manifest notices changed data, and every kind of
bad input is one ValueError line naming the file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import struct

import pytest
import torch

from minifloat.cli import main
from minifloat.training.batches import BatchLoader, TokenStream, val_batches
from minifloat.training import tokens as tokens_module
from minifloat.training.data import ByteCorpus, DataConfig, load_corpus, require_windows
from minifloat.training.loop import TrainConfig, train
from minifloat.training.shards import LLMC_HEADER_BYTES, LLMC_MAGIC, MEGATRON_MAGIC, META_FILE
from minifloat.training.tokenizer import encode_batches, load_tokenizer, train_bpe

SEED = 0
USER_ERROR = 2  # main()'s exit status for a bad input
RSS_SLACK = 64 << 20  # bytes: a mapped 1 GiB shard may add page tables and a few touched pages to RSS, not the file


def ids(n: int, high: int, seed: int = SEED) -> torch.Tensor:
    """(n,) int64 ids in [0, high), the top one included so the inferred vocabulary is exactly `high`."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(0, high, (n,), generator=g)
    out[n // 2] = high - 1
    return out


def raw(values: torch.Tensor, dtype: str = "uint16") -> bytes:
    """Little-endian unsigned ids as bytes."""
    return struct.pack(f"<{values.numel()}{'H' if dtype == 'uint16' else 'I'}", *values.tolist())


def llmc(values: torch.Tensor, *, version: int = 1, count: int | None = None) -> bytes:
    header = [LLMC_MAGIC, version, values.numel() if count is None else count] + [0] * 253
    return struct.pack("<256i", *header) + raw(values, "uint16" if version == 1 else "uint32")


def megatron_idx(code: int) -> bytes:
    return MEGATRON_MAGIC + struct.pack("<QB", 1, code) + bytes(16)


def write_meta(folder: pathlib.Path, shards: list[tuple[str, str, int]], *, vocab_size: int,
               dtype: str = "uint16") -> None:
    meta = {"format": "minifloat.tokens", "version": 1, "dtype": dtype, "vocab_size": vocab_size, "tokenizer": None,
            "shards": [{"file": f, "split": s, "tokens": n} for f, s, n in shards]}
    (folder / META_FILE).write_text(json.dumps(meta))


def text_folder(root: pathlib.Path, n_files: int = 8) -> pathlib.Path:
    """Deterministic English-ish text files, a few KB each."""
    words = ("the model trains on tokens while scales follow amax history and loss falls slowly in low precision "
             "éàü ✓ numbers 448 57344").split()
    root.mkdir()
    for i in range(n_files):
        body = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(600))
        (root / f"doc{i:02d}.txt").write_text(f"# file {i}\n{body}\n", encoding="utf-8")
    return root


@pytest.fixture
def tokenizer_file(tmp_path) -> pathlib.Path:
    text = text_folder(tmp_path / "bpe_text")
    path = tmp_path / "tokenizer.json"
    train_bpe([p.read_text(encoding="utf-8") for p in sorted(text.iterdir())], vocab_size=320).save(str(path))
    return path


def stream_ids(stream) -> torch.Tensor:
    """All ids of a split, unsigned, as int64."""
    if isinstance(stream, TokenStream):
        return torch.cat([p.long() & stream.mask if stream.mask else p.long() for p in stream.pieces])
    return stream.long()


# ---- every kind loads ---------------------------------------------------------------------------------------------

def _single_uint16(tmp):
    v = ids(2000, 60_000)  # ids above 32767: stored as negative int16, read back unsigned
    (tmp / "data.bin").write_bytes(raw(v))
    return tmp / "data.bin", v[:1900], v[1900:], 60_000


def _nanogpt(tmp):
    t, v = ids(3000, 50_257), ids(400, 50_257, seed=1)
    (tmp / "train.bin").write_bytes(raw(t))
    (tmp / "val.bin").write_bytes(raw(v))
    return tmp, t, v, 50_257


def _llmc_uint16(tmp):
    t, v = ids(3000, 50_257), ids(400, 50_000, seed=1)
    (tmp / "fineweb_train_000001.bin").write_bytes(llmc(t))
    (tmp / "fineweb_val_000000.bin").write_bytes(llmc(v))
    return tmp, t, v, 50_257


def _llmc_uint32(tmp):
    t, v = ids(3000, 128_256), ids(400, 100_000, seed=1)
    (tmp / "edu_fineweb_train_000001.bin").write_bytes(llmc(t, version=2))
    (tmp / "edu_fineweb_val_000000.bin").write_bytes(llmc(v, version=2))
    return tmp, t, v, 128_256


def _megatron(code: int, dtype: str, high: int):
    def make(tmp):
        v = ids(2000, high)
        (tmp / "corpus_text_document.bin").write_bytes(raw(v, dtype))
        (tmp / "corpus_text_document.idx").write_bytes(megatron_idx(code))
        return tmp, v[:1900], v[1900:], high
    return make


def _meta_uint32(tmp):
    t, v = ids(3000, 70_000), ids(500, 70_000, seed=1)
    (tmp / "train_000000.bin").write_bytes(raw(t, "uint32"))
    (tmp / "val_000000.bin").write_bytes(raw(v, "uint32"))
    write_meta(tmp, [("train_000000.bin", "train", 3000), ("val_000000.bin", "val", 500)], vocab_size=70_000,
               dtype="uint32")
    return tmp, t, v, 70_000


def _shard_folder(prefix: str):
    """Several shards, none named val: split by file with split_files' hash rule. "train_": named by split (train_03
    lands in validation); "shard_": named by neither split nor layout, so a folder of .bin files alone is token data
    (it was read as a text folder, and refused as holding no text)."""
    def make(tmp):
        parts = [ids(600, 1000, seed=i) for i in range(5)]
        names = [f"{prefix}{i:02d}.bin" for i in range(5)]
        for name, p in zip(names, parts):
            (tmp / name).write_bytes(raw(p))
        from minifloat.training.data import split_files
        splits = split_files(names, 0.05)
        train_ids = torch.cat([p for n, p in zip(names, parts) if splits[n].value == "train"])
        val_ids = torch.cat([p for n, p in zip(names, parts) if splits[n].value == "val"])
        return tmp, train_ids, val_ids, 1000
    return make


# (name, make(tmp) -> (--data, train ids, val ids, vocabulary))
KINDS = [
    ("raw uint16 file, last 5% validation", _single_uint16),
    ("nanoGPT train.bin and val.bin", _nanogpt),
    ("llm.c shards (uint16)", _llmc_uint16),
    ("llm.c shards version 2 (uint32)", _llmc_uint32),
    ("Megatron uint16 (.idx code 8)", _megatron(8, "uint16", 50_000)),
    ("Megatron int32 (.idx code 4)", _megatron(4, "uint32", 100_000)),
    ("minifloat meta.json, uint32", _meta_uint32),
    ("folder of shards split by file", _shard_folder("train_")),
    ("folder of unnamed shards", _shard_folder("shard_")),
]


@pytest.mark.parametrize("name, make", KINDS, ids=[k[0] for k in KINDS])
def test_each_kind_loads_its_ids_and_splits(tmp_path, name, make):
    data, train_ids, val_ids, vocab = make(tmp_path)
    corpus = load_corpus(str(data))
    assert corpus.vocab_size == vocab
    assert torch.equal(stream_ids(corpus.train), train_ids) and torch.equal(stream_ids(corpus.val), val_ids)
    assert corpus.manifest.to_dict()["vocab_size"] == vocab
    x, y = BatchLoader(corpus.train, batch_size=4, seq_len=16, seed=SEED).batch(0)
    assert x.dtype == torch.int64 and x.shape == (4, 16) and int(x.max()) < vocab and int(x.min()) >= 0
    require_windows(corpus, seq_len=16)


def test_text_with_tokenizer(tmp_path, tokenizer_file):
    text = text_folder(tmp_path / "text")
    bytes_corpus = load_corpus(str(text), max_bytes=None)
    corpus = load_corpus(str(text), max_bytes=None, tokenizer=str(tokenizer_file))
    assert corpus.vocab_size == 320 == corpus.manifest.to_dict()["vocab_size"]
    assert [f.path for f in corpus.manifest.files] == [f.path for f in bytes_corpus.manifest.files]  # same files
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_file))
    eot = tok.token_to_id("<|endoftext|>")
    val_files = [f.path for f in corpus.manifest.files if f.split.value == "val"]
    expected = [t for p in val_files for t in tok.encode((text / p).read_text(encoding="utf-8")).ids + [eot]]
    assert corpus.val.tolist() == expected  # each file encoded alone, end-of-text after each
    assert len(corpus.train) < bytes_corpus.train.numel()  # BPE merges: fewer tokens than bytes


def test_text_with_tokenizer_is_encoded_in_batches_into_a_mapped_file(tmp_path, tokenizer_file, monkeypatch):
    """Training through a tokenizer holds neither the text (ByteCorpus is never called) nor the ids (spilled a batch
    at a time to a temporary file that the stream maps), and gets the ids, batches and manifest digest of the whole
    corpus encoded in memory, as before it streamed."""
    text = text_folder(tmp_path / "text")
    whole, tok = ByteCorpus.load(DataConfig(path=str(text), max_bytes=20_001)), load_tokenizer(tokenizer_file)
    expected = {}
    for split in ("train", "val"):  # the in-memory reference: each file's text cut from its split's bytes
        data, ids, at = whole.tokens(split).numpy().tobytes(), [], 0
        for entry in (f for f in whole.manifest.files if f.split.value == split):
            ids += [*tok.tokenizer.encode(data[at:at + entry.nbytes].decode("utf-8", errors="ignore")).ids, tok.eot_id]
            at += entry.nbytes
        expected[split] = torch.tensor(ids, dtype=torch.int32)
    batches = []

    def one_file_a_batch(loaded, texts):
        for ids in encode_batches(loaded, texts, batch_chars=1):
            batches.append(ids.numel())
            yield ids

    def whole_corpus(*args, **kwargs):
        raise AssertionError("the text was read into memory whole")

    monkeypatch.setattr(tokens_module, "encode_batches", one_file_a_batch)
    monkeypatch.setattr(ByteCorpus, "load", whole_corpus)
    corpus = load_corpus(str(text), max_bytes=20_001, tokenizer=str(tokenizer_file))
    assert len(batches) >= len(whole.manifest.files) > 2 and max(batches) < corpus.train.numel()  # files or pieces
    assert corpus.train.dtype == corpus.val.dtype == torch.int32
    assert torch.equal(corpus.train, expected["train"]) and torch.equal(corpus.val, expected["val"])
    assert corpus.manifest.digest == hashlib.sha256(f"{whole.manifest.digest}\n{tok.sha256}\n{tok.eot_id}".encode()
                                                    ).hexdigest()  # the digest before streaming: old runs resume
    a = BatchLoader(corpus.train, batch_size=4, seq_len=32, seed=SEED)
    b = BatchLoader(expected["train"], batch_size=4, seq_len=32, seed=SEED)
    assert all(torch.equal(a.batch(k)[0], b.batch(k)[0]) for k in (0, 3, 77))
    maps = pathlib.Path("/proc/self/maps")
    if maps.is_file():  # Linux: the ids are a mapping of the removed temporary file, not the heap
        assert "minifloat-ids-" in maps.read_text()


def test_vocabulary_comes_from_tokenizer_when_shards_name_none(tmp_path, tokenizer_file):
    (tmp_path / "train.bin").write_bytes(raw(ids(500, 300)))
    (tmp_path / "val.bin").write_bytes(raw(ids(100, 300, seed=1)))
    assert load_corpus(str(tmp_path)).vocab_size == 300  # the largest id + 1
    assert load_corpus(str(tmp_path), tokenizer=str(tokenizer_file)).vocab_size == 320


def test_a_folder_of_other_bin_files_is_still_text(tmp_path):
    """Only split words, llm.c's magic, a Megatron .idx or minifloat's meta.json make a folder token data: weights.bin
    and another program's meta.json do not."""
    text = text_folder(tmp_path / "text", 3)
    (text / "weights.bin").write_bytes(bytes(range(256)))
    (text / META_FILE).write_text('{"title": "my notes"}')
    corpus = load_corpus(str(text))
    assert corpus.vocab_size == 256 and META_FILE in [f.path for f in corpus.manifest.files]


# ---- memory mapping -----------------------------------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set size from /proc")
def test_a_1gib_shard_is_mapped_not_read(tmp_path):
    n = (1 << 29) + 1  # 1 GiB + 2 bytes of uint16: over FULL_HASH_LIMIT, so the manifest hashes samples
    with open(tmp_path / "train_000000.bin", "wb") as f:
        f.truncate(2 * n)  # sparse: no disk space, and the OS would read 1 GiB of zeros if we read it
    if os.stat(tmp_path / "train_000000.bin").st_blocks * 512 > 1 << 20:
        pytest.skip("the file system does not keep sparse files")
    (tmp_path / "val_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp_path, [("train_000000.bin", "train", n), ("val_000000.bin", "val", 100)], vocab_size=50)
    before = _rss()
    corpus = load_corpus(str(tmp_path))
    loader = BatchLoader(corpus.train, batch_size=8, seq_len=64, seed=SEED)
    x, _ = loader.batch(0)
    assert _rss() - before < RSS_SLACK, "the shard was read into memory"
    assert len(corpus.train) == n and int(x.max()) == 0
    entry = next(f for f in corpus.manifest.to_dict()["files"] if f["path"] == "train_000000.bin")
    assert entry["sha256"].startswith("sampled:") and "sampled" in corpus.manifest.to_dict()["hash_rule"]


# ---- batches ------------------------------------------------------------------------------------------------------

@pytest.fixture
def constant_shards() -> TokenStream:
    """Shard i holds only the id i (lengths chosen so some shards hold few windows, one none)."""
    lengths = [40, 17, 300, 10, 65]
    return TokenStream([torch.full((n,), i, dtype=torch.int16) for i, n in enumerate(lengths)],
                       names=[f"s{i}.bin" for i in range(len(lengths))], unsigned=True, vocab_size=5)


def test_windows_never_cross_a_shard(constant_shards):
    loader = BatchLoader(constant_shards, batch_size=64, seq_len=16, seed=SEED)
    seen = set()
    for k in range(20):
        x, y = loader.batch(k)
        window = torch.cat([x, y[:, -1:]], 1)
        assert bool((window == window[:, :1]).all())  # one shard per row
        seen |= set(x[:, 0].tolist())
    assert seen == {0, 1, 2, 4}  # shard 3 (10 tokens) holds no window of 17


def _shards_data(tmp: pathlib.Path, _tokenizer: pathlib.Path) -> dict:
    """llm.c shards of a 512-id vocabulary (the tiny model's head stays small), training data in two shards."""
    (tmp / "data").mkdir()
    for name, seed, n in (("d_train_000001.bin", 1, 3000), ("d_train_000002.bin", 2, 2000), ("d_val_000000.bin", 3, 600)):
        (tmp / "data" / name).write_bytes(llmc(ids(n, 512, seed=seed)))
    return {"data": str(tmp / "data")}


def _text_data(tmp: pathlib.Path, tokenizer: pathlib.Path) -> dict:
    return {"data": str(text_folder(tmp / "text")), "tokenizer": str(tokenizer)}


# (name, make(tmp, tokenizer.json) -> TrainConfig's data settings): the two new kinds; bytes are tests/test_train.py's
RUN_DATA = [("llm.c shards", _shards_data), ("text and tokenizer", _text_data)]


@pytest.mark.parametrize("name, make", RUN_DATA, ids=[d[0] for d in RUN_DATA])
def test_batch_k_is_a_pure_function_of_seed_and_k(tmp_path, tokenizer_file, name, make):
    settings = make(tmp_path, tokenizer_file)
    a = BatchLoader(load_corpus(**settings).train, batch_size=4, seq_len=32, seed=7)
    b = BatchLoader(load_corpus(**settings).train, batch_size=4, seq_len=32, seed=7)
    assert all(torch.equal(a.batch(k)[0], b.batch(k)[0]) for k in (0, 1, 5, 1000))
    drawn = [next(a) for _ in range(3)]
    b.load_state_dict(a.state_dict())
    assert torch.equal(next(a)[0], next(b)[0]) and not torch.equal(drawn[0][0], drawn[1][0])


def test_val_batches_stay_inside_shards(constant_shards):
    rows = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in val_batches(constant_shards, batch_size=8,
                                                                              seq_len=16)])
    assert rows.shape[0] == sum((n - 1) // 16 for n in constant_shards.lengths)
    assert bool((rows == rows[:, :1]).all())


def test_one_shard_of_a_tokenize_folder_reads_its_meta_json(tmp_path):
    """--data naming one .bin of a folder with meta.json: the id type (uint32 here, which the bytes alone do not
    tell), the vocabulary and the tokenizer come from meta.json; the shard's tokens are split as a lone shard's."""
    folder, train_ids, _, vocab = _meta_uint32(tmp_path)
    corpus = load_corpus(str(folder / "train_000000.bin"))
    assert corpus.vocab_size == vocab and corpus.manifest.source["dtype"] == "uint32"
    assert torch.equal(torch.cat([stream_ids(corpus.train), stream_ids(corpus.val)]), train_ids.long())
    (folder / "other.bin").write_bytes(raw(ids(300, 1000), "uint16"))  # not listed in meta.json: any lone shard
    assert load_corpus(str(folder / "other.bin")).manifest.source["dtype"] == "uint16"


def test_short_split_is_refused_naming_the_data(tmp_path):
    (tmp_path / "train.bin").write_bytes(raw(ids(500, 100)))
    (tmp_path / "val.bin").write_bytes(raw(ids(20, 100)))
    corpus = load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match=r"validation split of --data .* no token shard longer than one sequence of "
                                         r"33 tokens.*holds 20"):
        require_windows(corpus, seq_len=32)


# ---- a run on shards ----------------------------------------------------------------------------------------------

SMALL = dict(model="tiny", batch_size=4, seq_len=32, warmup=2, eval_every=3, eval_batches=2, checkpoint_every=0)


@pytest.mark.parametrize("name, make", RUN_DATA, ids=[d[0] for d in RUN_DATA])
def test_resume_is_bitwise(tmp_path, tokenizer_file, name, make):
    data = make(tmp_path, tokenizer_file)
    n = 3
    whole = train(TrainConfig(**SMALL, **data, steps=2 * n, out=str(tmp_path / "a")), progress=False)
    # the first half follows the 2n-step schedule (lr_decay_steps), as a run cut short would
    half = TrainConfig(**{**SMALL, "checkpoint_every": n}, **data, steps=n, lr_decay_steps=2 * n,
                       out=str(tmp_path / "b"))
    first = train(half, progress=False)
    second = train(dataclasses.replace(half, steps=2 * n, lr_decay_steps=None, resume=True), progress=False)
    assert second.first_step == n
    assert first.losses + second.losses == whole.losses  # float equality, step by step
    assert second.val_losses[-1] == whole.val_losses[-1]


def test_resume_refuses_a_changed_shard(tmp_path):
    (tmp_path / "data").mkdir()
    data, train_ids, *_ = _nanogpt(tmp_path / "data")
    config = TrainConfig(**{**SMALL, "checkpoint_every": 1}, steps=1, data=str(data), out=str(tmp_path / "run"))
    train(config, progress=False)
    changed = train_ids.clone()
    changed[7] = (changed[7] + 1) % 50_000
    (data / "train.bin").write_bytes(raw(changed))
    with pytest.raises(ValueError, match="corpus differs .*changed: train.bin"):
        train(dataclasses.replace(config, steps=2, resume=True), progress=False)


def test_resume_checks_the_tokenizer_by_content_not_by_path(tmp_path, tokenizer_file):
    """A run trained with --tokenizer resumes with the same tokenizer.json at another path (a copy, another spelling
    of the path, another working folder); a tokenizer whose content differs is refused, naming --tokenizer."""
    text = text_folder(tmp_path / "text")
    config = TrainConfig(**{**SMALL, "checkpoint_every": 1}, steps=1, data=str(text), tokenizer=str(tokenizer_file),
                         out=str(tmp_path / "run"))
    train(config, progress=False)
    copy = tmp_path / "elsewhere" / "tok.json"
    copy.parent.mkdir()
    copy.write_bytes(tokenizer_file.read_bytes())
    resumed = train(dataclasses.replace(config, steps=2, resume=True, tokenizer=str(copy)), progress=False)
    assert resumed.first_step == 1
    other = tmp_path / "other.json"
    train_bpe([(text / "doc00.txt").read_text(encoding="utf-8")], vocab_size=300).save(str(other))
    with pytest.raises(ValueError, match="tokenizer changed.*--tokenizer"):
        train(dataclasses.replace(config, steps=3, resume=True, tokenizer=str(other)), progress=False)


def test_a_resume_from_another_working_folder_takes_the_checkpoints_tokenizer(tmp_path, tokenizer_file, monkeypatch,
                                                                              capsys):
    # the run's --tokenizer, relative to the folder it started in, was looked up from the new one and not found
    # ("tokenizer 'tok.json' does not exist"), though the checkpoint keeps a copy
    (tmp_path / "start").mkdir()
    text = text_folder(tmp_path / "start" / "text")
    (tmp_path / "start" / "tok.json").write_bytes(tokenizer_file.read_bytes())
    flags = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--warmup", "1", "--eval-batches", "1",
             "--checkpoint-every", "1"]
    monkeypatch.chdir(tmp_path / "start")
    assert main(["train", *flags, "--steps", "1", "--data", "text", "--tokenizer", "tok.json", "--out", "run"]) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["train", "--out", "../start/run", "--resume", "--steps", "2", "--data", str(text)]) == 0, \
        capsys.readouterr().err
    assert len((tmp_path / "start" / "run" / "log.csv").read_text().splitlines()) == 3


# ---- the manifest -------------------------------------------------------------------------------------------------

def test_manifest_notices_a_changed_shard(tmp_path):
    data, train_ids, *_ = _nanogpt(tmp_path)
    saved = load_corpus(str(data)).manifest.to_dict()
    assert load_corpus(str(data)).manifest.changes(saved) == []
    train_ids[0] = (train_ids[0] + 1) % 50_000  # same size, one id different
    (data / "train.bin").write_bytes(raw(train_ids))
    assert load_corpus(str(data)).manifest.changes(saved) == ["changed: train.bin"]


def test_manifest_notices_a_changed_tokenizer(tmp_path, tokenizer_file):
    text = text_folder(tmp_path / "text")
    saved = load_corpus(str(text), tokenizer=str(tokenizer_file)).manifest.to_dict()
    other = tmp_path / "other.json"
    train_bpe([(text / "doc00.txt").read_text(encoding="utf-8")], vocab_size=300).save(str(other))
    changes = load_corpus(str(text), tokenizer=str(other)).manifest.changes(saved)
    assert "tokenizer changed" in changes and "vocab_size changed" in changes
    # the same for shards read with a --tokenizer
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train.bin").write_bytes(raw(ids(500, 290)))
    (tmp_path / "shards" / "val.bin").write_bytes(raw(ids(100, 290)))
    saved = load_corpus(str(tmp_path / "shards"), tokenizer=str(tokenizer_file)).manifest.to_dict()
    assert "tokenizer changed" in load_corpus(str(tmp_path / "shards"), tokenizer=str(other)).manifest.changes(saved)


# ---- bad input ----------------------------------------------------------------------------------------------------

def _odd_size(tmp):
    (tmp / "train.bin").write_bytes(raw(ids(100, 50)) + b"\x01")
    return tmp, "train.bin", "not a whole number of uint16 ids"


def _llmc_count(tmp):
    (tmp / "data_train_000.bin").write_bytes(llmc(ids(100, 50), count=120))
    return tmp, "data_train_000.bin", "llm.c header says 120 tokens"


def _llmc_short(tmp):
    (tmp / "data_train_000.bin").write_bytes(struct.pack("<3i", LLMC_MAGIC, 1, 5))
    return tmp, "data_train_000.bin", f"shorter than its {LLMC_HEADER_BYTES}-byte header"


def _empty_shard(tmp):
    (tmp / "train.bin").write_bytes(raw(ids(100, 50)))
    (tmp / "val.bin").write_bytes(b"")
    return tmp, "val.bin", "is empty"


def _id_outside_meta_vocab(tmp):
    (tmp / "train_000000.bin").write_bytes(raw(ids(100, 60)))
    (tmp / "val_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp, [("train_000000.bin", "train", 100), ("val_000000.bin", "val", 100)], vocab_size=50)
    return tmp, "train_000000.bin", "holds the id 59, outside the vocabulary of 50 ids"


def _meta_garbled(tmp):
    (tmp / "train_000000.bin").write_bytes(raw(ids(100, 50)))
    (tmp / META_FILE).write_text('{"format": "minifloat.tokens", ')
    return tmp, META_FILE, "is not valid JSON"


def _meta_missing_shard(tmp):
    (tmp / "train_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp, [("train_000000.bin", "train", 100), ("val_000000.bin", "val", 100)], vocab_size=50)
    return tmp, "val_000000.bin", "which is missing"


def _meta_count(tmp):
    (tmp / "train_000000.bin").write_bytes(raw(ids(100, 50)))
    (tmp / "val_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp, [("train_000000.bin", "train", 90), ("val_000000.bin", "val", 100)], vocab_size=50)
    return tmp, "train_000000.bin", "meta.json says 90 uint16 ids"


def _meta_vocabulary_past_the_dtype(tmp):
    # 10^12 ids of uint16 reached the user as torch's allocator error (a 256 TB embedding)
    (tmp / "train_000000.bin").write_bytes(raw(ids(100, 50)))
    (tmp / "val_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp, [("train_000000.bin", "train", 100), ("val_000000.bin", "val", 100)], vocab_size=10**12)
    return tmp, META_FILE, "is corrupt: .*an int vocab_size it holds"


def _meta_vocabulary_a_bool(tmp):
    (tmp / "train_000000.bin").write_bytes(raw(ids(100, 50)))
    (tmp / "val_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp, [("train_000000.bin", "train", 100), ("val_000000.bin", "val", 100)], vocab_size=True)
    return tmp, META_FILE, "is corrupt: .*an int vocab_size"


def _megatron_bad_idx(tmp):
    (tmp / "c_text_document.bin").write_bytes(raw(ids(100, 50)))
    (tmp / "c_text_document.idx").write_bytes(b"not an index at all")
    return tmp, "c_text_document.idx", "is not a Megatron index"


def _only_val(tmp):
    (tmp / "val.bin").write_bytes(raw(ids(100, 50)))
    (tmp / "validation_2.bin").write_bytes(raw(ids(100, 50)))
    return tmp, str(tmp), "leave the training split empty"


# (name, make(tmp) -> (--data, the file the message names, words it holds))
CORRUPT = [
    ("size not a multiple of the id size", _odd_size),
    ("llm.c header count disagrees with the size", _llmc_count),
    ("llm.c file shorter than its header", _llmc_short),
    ("empty shard", _empty_shard),
    ("id outside meta.json's vocabulary", _id_outside_meta_vocab),
    ("meta.json not JSON", _meta_garbled),
    ("meta.json lists a missing shard", _meta_missing_shard),
    ("meta.json token count disagrees with the size", _meta_count),
    ("meta.json vocabulary past its dtype", _meta_vocabulary_past_the_dtype),
    ("meta.json vocabulary a bool", _meta_vocabulary_a_bool),
    ("Megatron .idx without its magic", _megatron_bad_idx),
    ("every shard named val", _only_val),
]


@pytest.mark.parametrize("name, make", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_corrupt_shards_are_one_line_naming_the_file(tmp_path, capsys, name, make):
    data, named, words = make(tmp_path)
    with pytest.raises(ValueError, match=words) as info:
        load_corpus(str(data))
    assert named in str(info.value) and "\n" not in str(info.value)
    status = main(["train", "--model", "tiny", "--steps", "1", "--data", str(data), "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.splitlines()
    assert status == USER_ERROR and len(lines) == 1 and named in lines[0] and "Traceback" not in lines[0], lines


def test_an_id_outside_the_vocabulary_past_the_sample_is_named_when_drawn(tmp_path):
    values = ids(300_000, 50)
    values[100_000] = 60  # between the sampled chunks: found when a batch reads it
    (tmp_path / "train_000000.bin").write_bytes(raw(values))
    (tmp_path / "val_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp_path, [("train_000000.bin", "train", 300_000), ("val_000000.bin", "val", 100)], vocab_size=50)
    corpus = load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match=r"token shard train_000000.bin holds the id 60 at token 100000, outside the "
                                         r"vocabulary of 50 ids"):
        list(val_batches(corpus.train, batch_size=64, seq_len=100))


@pytest.mark.parametrize("name, content, words", [
    ("missing", None, "does not exist"),
    ("not JSON", b"{ this is not json", "is not a Hugging Face tokenizers file"),
    ("JSON but not a tokenizer", b'{"hello": 1}', "is not a Hugging Face tokenizers file"),
    ("not UTF-8", b"\xff\xfe\x00", "is not a Hugging Face tokenizers file"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_tokenizer_is_one_line(tmp_path, capsys, name, content, words):
    text = text_folder(tmp_path / "text", 3)
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=words) as info:
        load_corpus(str(text), max_bytes=None, tokenizer=str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    status = main(["train", "--model", "tiny", "--steps", "1", "--data", str(text), "--tokenizer", str(path),
                   "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.splitlines()
    assert status == USER_ERROR and len(lines) == 1 and str(path) in lines[0], lines


def test_tokenizer_disagreeing_with_the_shards_vocabulary_is_one_line(tmp_path, tokenizer_file):
    (tmp_path / "train_000000.bin").write_bytes(raw(ids(100, 50)))
    (tmp_path / "val_000000.bin").write_bytes(raw(ids(100, 50)))
    write_meta(tmp_path, [("train_000000.bin", "train", 100), ("val_000000.bin", "val", 100)], vocab_size=50)
    with pytest.raises(ValueError, match=r"has a vocabulary of 320 ids, but the token shards .* one of 50"):
        load_corpus(str(tmp_path), tokenizer=str(tokenizer_file))


def test_ids_past_a_tokenizers_vocabulary_are_refused(tmp_path, tokenizer_file):
    (tmp_path / "train.bin").write_bytes(raw(ids(500, 1000)))
    (tmp_path / "val.bin").write_bytes(raw(ids(100, 300)))
    with pytest.raises(ValueError, match=r"train.bin holds the id 999, outside the vocabulary of 320 ids "
                                         r"\(--tokenizer"):
        load_corpus(str(tmp_path), tokenizer=str(tokenizer_file))


# ---- the tokenizer a minifloat tokenize folder names --------------------------------------------------------------

@pytest.fixture
def tokenized(tmp_path) -> pathlib.Path:
    """A `minifloat tokenize` folder: shards, meta.json and the tokenizer.json it names."""
    from minifloat.training.tokenize import tokenize_folder

    tokenize_folder(str(text_folder(tmp_path / "text")), str(tmp_path / "tok"), vocab_size=300)
    return tmp_path / "tok"


def _tokenizer_gone(tok):
    (tok / "tokenizer.json").unlink()
    return "tokenizer.json", "which is missing"


def _tokenizer_garbled(tok):
    (tok / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    return "tokenizer.json", "is not a Hugging Face tokenizers file"


def _tokenizer_of_another_vocabulary(tok):
    train_bpe(["some other text, to make another tokenizer"], vocab_size=280).save(str(tok / "tokenizer.json"))
    return "tokenizer.json", r"is not the one meta.json records .*the shards' 300"


def _tokenizer_of_the_same_vocabulary(tok):
    """Another tokenizer of the same size: only meta.json's SHA-256 tells it apart."""
    data = json.loads((tok / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300 - 2:]  # swap the ids of the last two merges' tokens
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tok / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return "tokenizer.json", r"is not the one meta.json records \(sha256"


def test_a_given_tokenizer_of_the_same_size_but_other_tokens_is_refused(tokenized, tmp_path):
    # only the vocabulary's size was compared with --tokenizer: another 300-id tokenizer trained silently, and the
    # run's checkpoint kept it, so generate and export decoded the ids as other text
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((tokenized / "tokenizer.json").read_bytes())
    _tokenizer_of_the_same_vocabulary(other)
    with pytest.raises(ValueError, match=r"--tokenizer .* is not the tokenizer the token shards .* were made with "
                                         r"\(sha256 .*meta.json says"):
        load_corpus(str(tokenized), tokenizer=str(other / "tokenizer.json"))
    assert load_corpus(str(tokenized), tokenizer=str(tokenized / "tokenizer.json")).vocab_size == 300


def _tokenizer_entry_a_path(tok):
    meta = json.loads((tok / META_FILE).read_text())
    meta["tokenizer"]["file"] = "../elsewhere/tokenizer.json"
    (tok / META_FILE).write_text(json.dumps(meta))
    return META_FILE, r"is corrupt: .*a tokenizer \{file: NAME, sha256: HEX\} or null"


# (name, damage(tokenize folder) -> (the file the message names, words it holds))
TOKENIZER_DAMAGE = [
    ("tokenizer.json missing", _tokenizer_gone),
    ("tokenizer.json not JSON", _tokenizer_garbled),
    ("another tokenizer, another vocabulary", _tokenizer_of_another_vocabulary),
    ("another tokenizer, the same vocabulary", _tokenizer_of_the_same_vocabulary),
    ("meta.json's tokenizer entry a path", _tokenizer_entry_a_path),
]


@pytest.mark.parametrize("name, damage", TOKENIZER_DAMAGE, ids=[c[0] for c in TOKENIZER_DAMAGE])
def test_a_tokenize_folder_needs_the_tokenizer_its_meta_json_records(tokenized, tmp_path, capsys, name, damage):
    """Training on the folder without its tokenizer would leave the run's checkpoints without the copy `generate`
    and `export` read: one line naming the file and the fix, for the folder and for one of its shards."""
    named, words = damage(tokenized)
    for data in (tokenized, tokenized / "train_000000.bin"):
        with pytest.raises(ValueError, match=words) as info:
            load_corpus(str(data))
        message = str(info.value)
        assert named in message and "\n" not in message
        assert "minifloat tokenize" in message, message
    out = tmp_path / "run"
    status = main(["train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--data", str(tokenized),
                   "--out", str(out)])
    lines = capsys.readouterr().err.splitlines()
    assert status == USER_ERROR and len(lines) == 1 and named in lines[0] and "Traceback" not in lines[0], lines
    assert "minifloat tokenize" in lines[0] and not lines[0].endswith("…"), lines  # the fix is on the printed line
    assert not out.exists()


def test_the_fixes_a_missing_tokenizer_names_work(tokenized, tmp_path):
    """Either fix the line offers works: the tokenizer passed as --tokenizer (then kept, the folder's not read), or
    put back; the run's checkpoints then keep that tokenizer. Shards made without a tokenizer still need none."""
    original = (tokenized / "tokenizer.json").read_bytes()
    given = tmp_path / "given.json"
    given.write_bytes(original)
    (tokenized / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="pass it as --tokenizer"):
        load_corpus(str(tokenized))
    assert load_corpus(str(tokenized), tokenizer=str(given)).tokenizer_json == original
    (tokenized / "tokenizer.json").write_bytes(original)
    assert load_corpus(str(tokenized)).tokenizer_json == original
    meta = json.loads((tokenized / META_FILE).read_text())
    meta["tokenizer"] = None  # as a hand-written meta.json of shards made without one
    (tokenized / META_FILE).write_text(json.dumps(meta))
    assert load_corpus(str(tokenized)).tokenizer_json is None


@pytest.mark.parametrize("n", [5000, 900], ids=["5000-ids", "900-ids"])  # 900 ids (3.6 KB) passed as uint16
@pytest.mark.parametrize("high", [300, 128_256], ids=["small-vocab", "llama3-vocab"])
def test_bare_uint32_ids_are_refused_not_read_as_uint16(tmp_path, high, n):
    """A bare train.bin is nanoGPT's uint16. Written as uint32 (a vocabulary above 65,536 needs it), it was read as
    uint16 without a word: every second id a 0 or 1, the vocabulary 65,536, training on garbage."""
    (tmp_path / "train.bin").write_bytes(raw(ids(n, high), "uint32"))
    (tmp_path / "val.bin").write_bytes(raw(ids(3000, high, seed=1), "uint32"))
    with pytest.raises(ValueError, match=r"train.bin looks like uint32 ids .* meta.json with dtype uint32"):
        load_corpus(str(tmp_path))
    if high < 1 << 16:  # the same ids as uint16, as the fix says: they load
        (tmp_path / "train.bin").write_bytes(raw(ids(n, high)))
        (tmp_path / "val.bin").write_bytes(raw(ids(3000, high, seed=1)))
        assert load_corpus(str(tmp_path)).vocab_size == high



def test_a_vocabulary_with_gaps_in_its_ids_sizes_the_model_by_its_largest_id(tmp_path):
    # get_vocab_size() counts 5 tokens of ids up to 500: the model had 5 embedding rows and the first batch holding
    # "return" failed inside torch ("IndexError: index out of range in self")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "def": 1, "import": 2, "self": 3, "return": 500},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "gap.json"))
    assert load_tokenizer(tmp_path / "gap.json").vocab_size == 501
    data = tmp_path / "text"
    data.mkdir()
    for name in ("a.py", "b.py"):
        (data / name).write_text("def f(self):\n    import os\n    return self\n" * 400)
    corpus = load_corpus(str(data), tokenizer=str(tmp_path / "gap.json"))
    assert corpus.vocab_size == 501
    train(TrainConfig(model="tiny", data=str(data), tokenizer=str(tmp_path / "gap.json"), steps=1, batch_size=4,
                      seq_len=32, eval_batches=1, out=str(tmp_path / "run")), progress=False)


def test_bpe_training_cuts_runs_without_whitespace_into_words_of_bounded_length():
    # the trainer's time grows with the square of a word's length: one file of 3,000,000 "x" kept minifloat
    # tokenize busy for hours. Runs past LONG_RUN_CHARS are cut into words of that length, nothing else changes
    from minifloat.training import tokenizer as module

    n = module.LONG_RUN_CHARS
    text = "def f():\n    return 1\n" + "x" * (2 * n + n // 2) + " tail"
    parts = list(module._long_runs_cut(text))
    assert "".join(parts) == text and [len(p) for p in parts[1:4]] == [n, n, n // 2]
    assert list(module._long_runs_cut("short text")) == ["short text"]
    whole = train_bpe(["x" * (5 * n) + " y"], vocab_size=300).to_str()
    assert whole == train_bpe(["x" * n] * 5 + [" y"], vocab_size=300).to_str()  # five words of n characters
