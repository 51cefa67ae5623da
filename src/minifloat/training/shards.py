"""Token shards on disk: the `.bin` layouts minifloat reads, each memory-mapped, never loaded whole.

Layouts, told apart by what is beside or inside the file:
- minifloat's own (`minifloat tokenize`): a folder with `meta.json` naming the dtype, the vocabulary, the tokenizer
  and every shard with its split and token count; the shards are bare ids.
- Megatron-LM: `NAME.bin` with a sibling `NAME.idx`, whose header (magic "MMIDIDX", version, dtype code) gives the
  dtype; the `.bin` is the documents' ids back to back.
- llm.c: a 1024-byte header of 256 int32 (magic 20240520, version 1 for uint16 ids or 2 for uint32, token count),
  then the ids.
- raw (nanoGPT's train.bin / val.bin): bare uint16 ids, no header.

`torch.from_file(shared=False)` maps the file privately (MAP_PRIVATE): pages are read from disk as windows touch
them, and nothing is written back. uint16 / uint32 ids are mapped as int16 / int32 (the unsigned dtypes lack most
torch ops) and read back unsigned by `batches.UNSIGNED_MASKS`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import struct

import torch

from minifloat.training.batches import UNSIGNED_MASKS

META_FILE = "meta.json"
META_FORMAT = "minifloat.tokens"
META_VERSION = 1
LLMC_MAGIC = 20240520  # llm.c's dev/data/data_common.py
LLMC_HEADER_BYTES = 1024  # 256 int32
LLMC_VERSIONS = {1: "uint16", 2: "uint32"}
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"  # megatron/core/datasets/indexed_dataset.py
MEGATRON_DTYPES = {1: "uint8", 4: "uint32", 8: "uint16"}  # its DType codes of the integer id types (int32 ids >= 0)
# id dtype on disk -> the torch dtype it is mapped as (same width)
STORAGE = {"uint8": torch.uint8, "uint16": torch.int16, "uint32": torch.int32}
SHARD_FIX = "re-create the shards (minifloat tokenize) or point --data at intact ones"
# Files up to this size are hashed whole for the manifest; larger ones by their size and SAMPLE_CHUNKS chunks of
# SAMPLE_BYTES spread evenly (a hash prefixed "sampled:"), so a run's start does not read terabytes of shards.
FULL_HASH_LIMIT = 1 << 30
SAMPLE_CHUNKS, SAMPLE_BYTES = 64, 1 << 20
HASH_RULE = (f"sha256 of each file; files over {FULL_HASH_LIMIT} bytes: 'sampled:' sha256 of the size and "
             f"{SAMPLE_CHUNKS} chunks of {SAMPLE_BYTES} bytes spread evenly")


@dataclasses.dataclass(frozen=True)
class Shard:
    """One `.bin` file of token ids: where its ids start and how many there are."""

    path: pathlib.Path
    rel: str  # the name shown in messages and the manifest ('/'-separated, relative to --data's folder)
    layout: str  # "minifloat", "megatron", "llm.c" or "raw"
    dtype: str  # a key of STORAGE
    offset: int  # header bytes before the first id
    tokens: int

    @property
    def itemsize(self) -> int:
        return STORAGE[self.dtype].itemsize

    def map(self) -> torch.Tensor:
        """The ids, (tokens,) int16 / int32 / uint8, memory-mapped (privately: writes would not reach the file)."""
        if self.tokens == 0:
            return torch.empty(0, dtype=STORAGE[self.dtype])
        size = self.path.stat().st_size // self.itemsize
        data = torch.from_file(str(self.path), shared=False, size=size, dtype=STORAGE[self.dtype])
        first = self.offset // self.itemsize
        return data[first:first + self.tokens]


def read_shard(path: pathlib.Path, rel: str, *, dtype: str | None = None, tokens: int | None = None) -> Shard:
    """Recognise a shard's layout from its header or its sibling `.idx`; check its size.

    Args:
        path: the `.bin` file.
        rel: its name in messages.
        dtype, tokens: what meta.json says (minifloat's layout); None to detect.
    Raises:
        ValueError naming the shard and the fix: empty, size not a whole number of ids, a header or meta.json whose
        token count disagrees with the size, an unknown version or dtype code.
    """
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token shard {rel} is empty; {SHARD_FIX}")
    if dtype is not None:  # meta.json's
        shard = Shard(path, rel, "minifloat", dtype, 0, size // STORAGE[dtype].itemsize)
        if tokens is not None and tokens * shard.itemsize != size:
            raise ValueError(f"token shard {rel} holds {size} bytes, but meta.json says {tokens} {dtype} ids "
                             f"({tokens * shard.itemsize} bytes): truncated or changed; {SHARD_FIX}")
    elif path.with_suffix(".idx").is_file():
        shard = Shard(path, rel, "megatron", _megatron_dtype(path.with_suffix(".idx"), rel), 0, 0)
        shard = dataclasses.replace(shard, tokens=size // shard.itemsize)
    elif size >= 4 and struct.unpack("<i", _head(path, 4))[0] == LLMC_MAGIC:
        shard = _llmc(path, rel, size)
    else:  # nanoGPT's: bare uint16
        shard = Shard(path, rel, "raw", "uint16", 0, size // 2)
        _refuse_wider_ids(path, rel, size)
    if (size - shard.offset) % shard.itemsize:
        raise ValueError(f"token shard {rel} holds {size} bytes, not a whole number of {shard.dtype} ids "
                         f"({shard.itemsize} bytes each): truncated or not a token shard; {SHARD_FIX}")
    return shard


# bare ids written as uint32 and read as uint16 show every second 16-bit value as 0 or 1 (an id's high half below
# 131,072, Llama 3's 128k vocabulary included): seen in this many values, at least, it is no run of real uint16 ids
# (real text puts ids 0 and 1 at every second place of 64 in a row with a chance below 10^-100). A shard of fewer
# uint32 ids cannot be told apart (1024 let a 900-id uint32 shard be read as uint16)
WIDE_SIGNATURE = 64


def _refuse_wider_ids(path: pathlib.Path, rel: str, size: int) -> None:
    """ValueError when a bare shard's first ids look like uint32 ids, which the bare layout would read as uint16
    (garbage ids, and a vocabulary of 65,536, without an error)."""
    head = _head(path, min(size, 64 * 1024) // 4 * 4)
    if len(head) < 4 * WIDE_SIGNATURE:
        return
    ids = struct.unpack(f"<{len(head) // 2}H", head)
    high, low = ids[1::2], ids[0::2]
    if max(high) <= 1 and max(low) > 1:
        raise ValueError(f"token shard {rel} looks like uint32 ids (every second 16-bit value is 0 or 1), which a bare "
                         f".bin is not read as (nanoGPT's layout is uint16): write the ids as uint16 when all are "
                         f"below 65,536, or describe the shards in a meta.json with dtype uint32 (docs/training.md, "
                         f"\"Data\")")


def _head(path: pathlib.Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _llmc(path: pathlib.Path, rel: str, size: int) -> Shard:
    """An llm.c shard: header int32s [magic, version, token count, 253 unused]."""
    if size < LLMC_HEADER_BYTES:
        raise ValueError(f"token shard {rel} starts with llm.c's magic {LLMC_MAGIC} but is shorter than its "
                         f"{LLMC_HEADER_BYTES}-byte header; {SHARD_FIX}")
    _, version, count = struct.unpack("<3i", _head(path, 12))
    if version not in LLMC_VERSIONS:
        raise ValueError(f"token shard {rel} is an llm.c shard of version {version}; minifloat reads versions "
                         f"{sorted(LLMC_VERSIONS)} (uint16, uint32 ids); {SHARD_FIX}")
    shard = Shard(path, rel, "llm.c", LLMC_VERSIONS[version], LLMC_HEADER_BYTES, count)
    if count < 0 or LLMC_HEADER_BYTES + count * shard.itemsize != size:
        raise ValueError(f"token shard {rel}: its llm.c header says {count} tokens "
                         f"({LLMC_HEADER_BYTES + count * shard.itemsize} bytes with the header), but the file holds "
                         f"{size} bytes: truncated or corrupt; {SHARD_FIX}")
    return shard


def _megatron_dtype(idx: pathlib.Path, rel: str) -> str:
    """The id dtype in a Megatron `.idx` header: magic (9 bytes), version (uint64), dtype code (uint8)."""
    head = _head(idx, len(MEGATRON_MAGIC) + 9)
    if len(head) < len(MEGATRON_MAGIC) + 9 or not head.startswith(MEGATRON_MAGIC):
        raise ValueError(f"token shard {rel} has a sibling {idx.name} that is not a Megatron index (no "
                         f"{MEGATRON_MAGIC!r} header); {SHARD_FIX}")
    code = head[-1]
    if code not in MEGATRON_DTYPES:
        raise ValueError(f"token shard {rel}: its Megatron index {idx.name} gives dtype code {code}; minifloat reads "
                         f"the integer id codes {sorted(MEGATRON_DTYPES)}; {SHARD_FIX}")
    return MEGATRON_DTYPES[code]


def read_meta(folder: pathlib.Path) -> dict:
    """meta.json of a folder written by `minifloat tokenize`, checked.

    Returns:
        {"dtype", "vocab_size", "tokenizer" ({"file": a name in the folder, "sha256"}, or None: made without one),
        "shards": [{"file", "split", "tokens"}]}.
    Raises:
        ValueError naming the file and what is wrong with it.
    """
    path = folder / META_FILE
    fix = f"re-create {folder} with minifloat tokenize"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("version") != META_VERSION:
        raise ValueError(f"{path} is not a minifloat token-shard description (format {META_FORMAT!r}, version "
                         f"{META_VERSION}); {fix}")
    shards = meta.get("shards")
    vocab = meta.get("vocab_size")
    ok = (meta.get("dtype") in ("uint16", "uint32") and isinstance(vocab, int) and not isinstance(vocab, bool)
          and 1 <= vocab <= (1 << (16 if meta["dtype"] == "uint16" else 32))  # ids the dtype can hold
          and isinstance(shards, list) and shards
          and all(isinstance(s, dict) and _plain_name(s.get("file")) and s["file"].endswith(".bin")
                  and s.get("split") in ("train", "val")
                  and isinstance(s.get("tokens"), int) and s["tokens"] >= 0 for s in shards))
    tokenizer = meta.get("tokenizer")
    if not ok or not (tokenizer is None or isinstance(tokenizer, dict) and isinstance(tokenizer.get("sha256"), str)
                      and _plain_name(tokenizer.get("file"))):
        raise ValueError(f"{path} is corrupt: it needs dtype uint16/uint32, an int vocab_size it holds, a non-empty "
                         f"list of shards, each {{file: NAME.bin, split: train/val, tokens: N}}, and a tokenizer "
                         f"{{file: NAME, sha256: HEX}} or null; {fix}")
    return meta


def _plain_name(name) -> bool:
    """Whether `name` names a file in the folder itself (no path, not . or ..)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def file_sha256(path: pathlib.Path) -> str:
    """The file's SHA-256, read in chunks; for files over FULL_HASH_LIMIT the sampled hash of HASH_RULE."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_LIMIT:
            while chunk := f.read(1 << 23):
                h.update(chunk)
            return h.hexdigest()
        h.update(f"{size}\n".encode())
        for i in range(SAMPLE_CHUNKS):
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLE_CHUNKS - 1))
            h.update(f.read(SAMPLE_BYTES))
    return "sampled:" + h.hexdigest()


def max_id(ids: torch.Tensor, *, sample: bool) -> int:
    """The largest id in a mapped shard (-1 when empty): all of it, a chunk at a time (sample=False), or its first and
    last 64Ki ids and 16 chunks of 4Ki spread between them (sample=True: the cheap check before a run)."""
    n, mask = ids.numel(), UNSIGNED_MASKS.get(ids.dtype)
    if sample:
        edge = 1 << 16
        spans = [(0, edge), (max(0, n - edge), n), *((s, s + (1 << 12)) for s in range(0, n, max(1, n // 16)))]
    else:
        spans = [(s, s + (1 << 22)) for s in range(0, n, 1 << 22)]
    top = -1
    for start, end in spans:
        part = ids[start:end].long()  # a slice past the end stops at it
        if part.numel():
            top = max(top, int((part & mask if mask is not None else part).max()))
    return top
