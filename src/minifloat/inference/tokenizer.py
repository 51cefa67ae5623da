"""A run's text ↔ token ids: the tokenizer it trained with, or UTF-8 bytes for a run on text without one.

    tok = run_tokenizer("runs/a")                  # found from the run's checkpoint
    ids = tok.encode("def ")                       # list of ints, ids of the run's vocabulary
    tok.decode(ids)                                # text

Where the tokenizer comes from (the checkpoint's config and data manifest, as `minifloat train` wrote them):

    run trained on                        tokenizer
    text, no --tokenizer                  bytes (256 ids, UTF-8; invalid sequences decode to U+FFFD)
    text with --tokenizer FILE            the checkpoint's copy of FILE (CHECKPOINT_TOKENIZER)
    a `minifloat tokenize` folder         the checkpoint's copy of the tokenizer.json its meta.json names
    .bin shards with --tokenizer FILE     the checkpoint's copy of FILE
    .bin shards without meta.json         none: pass one (`tokenizer=FILE`, `minifloat generate --tokenizer FILE`)

A checkpoint written before minifloat kept the copy is read as the run recorded it: FILE at the path the run was
given (a relative path is looked up from the current folder, so from elsewhere it is missing: one line naming
--tokenizer says so), or the tokenize folder's meta.json.

A tokenizer found this way must be the one the run trained with: its vocabulary size is the run's and its SHA-256
the one the run's data manifest recorded, else ValueError (the file was replaced). A tokenizer passed explicitly must
have the run's vocabulary size (ValueError otherwise: ids past the model's vocabulary, or a model whose ids the
tokenizer cannot spell); a SHA-256 other than the recorded one is logged as a warning, not refused, since the same
tokenizer saved again (by transformers' save_pretrained, say) has other bytes and the same ids.

Decoding keeps special tokens (an end-of-text the model generates is shown as the text "<|endoftext|>"): they are
what the model saw between files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Sequence

import torch

from minifloat.inference.runs import run_checkpoint
from minifloat.training.rundir import CHECKPOINT_TOKENIZER
from minifloat.training.sharded import read_extra
from minifloat.training.shards import META_FILE
from minifloat.training.tokenizer import LoadedTokenizer, load_tokenizer

log = logging.getLogger("minifloat")

BYTE_VOCAB = 256  # minifloat.training.data's vocabulary: a token is a byte of UTF-8 text
# the fix every "tokenizer not found" error ends with (minifloat generate and export take --tokenizer)
FIX = "pass the tokenizer.json it trained with: --tokenizer FILE (tokenizer= from Python)"


def _ids(ids: Sequence[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: the vocabulary of a run on text without a tokenizer."""

    vocab_size: int = BYTE_VOCAB
    path: pathlib.Path | None = None  # no file: nothing for an export to copy

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Invalid UTF-8 (a continuation cut short, say) becomes U+FFFD."""
        return bytes(_ids(ids)).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A Hugging Face tokenizer.json, encoding without special tokens as training did
    (minifloat.training.tokenizer.encode_batches)."""

    loaded: LoadedTokenizer

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    @property
    def path(self) -> pathlib.Path:
        return self.loaded.path

    def encode(self, text: str) -> list[int]:
        return self.loaded.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return self.loaded.tokenizer.decode(_ids(ids), skip_special_tokens=False)


RunTokenizer = ByteTokenizer | TextTokenizer


def _recorded(run: pathlib.Path, checkpoint: str) -> tuple[pathlib.Path, dict, dict]:
    """The checkpoint folder, its training config and data manifest ({} for a checkpoint from before the manifest
    was kept)."""
    ckpt = run_checkpoint(run, checkpoint)
    extra = read_extra(ckpt)
    config = extra.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"the checkpoint {ckpt} records no training config; it was not written by minifloat train")
    data = extra.get("data")
    return ckpt, config, data if isinstance(data, dict) else {}


def _recorded_file(ckpt: pathlib.Path, config: dict) -> tuple[pathlib.Path | None, str]:
    """The tokenizer.json the run trained with and where it was found: the checkpoint's copy, else (a checkpoint
    from before minifloat kept one) the file its config names; (None, why not) when it names none."""
    if (ckpt / CHECKPOINT_TOKENIZER).is_file():
        return ckpt / CHECKPOINT_TOKENIZER, "the copy in its checkpoint"
    if config.get("tokenizer"):
        return pathlib.Path(config["tokenizer"]).expanduser(), "its --tokenizer"
    data = config.get("data")
    folder = pathlib.Path(data).expanduser() if data else None
    if folder is not None and not folder.is_absolute() and not folder.exists():
        return None, f"its --data {data} is not found from {os.getcwd()} (a path relative to the folder it trained in)"
    if folder is None or not (folder / META_FILE).is_file():
        where = f"--data {data}" if data else "its data"
        return None, f"{where} has no {META_FILE} naming one (.bin shards without a tokenizer)"
    try:
        named = (json.loads((folder / META_FILE).read_text(encoding="utf-8")).get("tokenizer") or {}).get("file")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        named = None
    if not isinstance(named, str) or not named:
        return None, f"{folder / META_FILE} names no tokenizer"
    return folder / named, f"{folder / META_FILE}"


def run_tokenizer(run_dir: str | os.PathLike, checkpoint: str = "latest", *,
                  tokenizer: str | os.PathLike | None = None) -> RunTokenizer:
    """The run's text ↔ ids (see the module docstring for where it comes from).

    Args:
        run_dir: the run's folder (minifloat train --out).
        checkpoint: "latest" or another checkpoint folder (minifloat.inference.export.run_checkpoint).
        tokenizer: a tokenizer.json to use instead of the one the run records (needed for shards without one).
    Returns:
        A ByteTokenizer or TextTokenizer: encode(text) -> ids, decode(ids) -> text, vocab_size, path.
    Raises:
        FileNotFoundError: no such run folder or checkpoint.
        ValueError, one line naming the run and the fix: the run's tokenizer cannot be found or is not the one it
            trained with; `tokenizer` is unreadable, has another vocabulary size, or is given for a byte run.
    """
    run = pathlib.Path(run_dir)
    ckpt, config, data = _recorded(run, checkpoint)
    vocab_size = data.get("vocab_size", BYTE_VOCAB)
    recorded_sha = data.get("tokenizer") if isinstance(data.get("tokenizer"), str) else None
    if "kind" not in data:  # minifloat.training.data's byte corpus records no source kind (shards, text)
        if tokenizer is not None:
            raise ValueError(f"run {run} trained on text as bytes (a vocabulary of {BYTE_VOCAB}), without a "
                             f"tokenizer; leave --tokenizer out")
        return ByteTokenizer()
    if tokenizer is not None:
        loaded = load_tokenizer(tokenizer)
        _check_vocabulary(run, loaded, vocab_size, "--tokenizer")
        if recorded_sha is not None and loaded.sha256 != recorded_sha:
            log.warning("minifloat: --tokenizer %s is not the file run %s trained with (SHA-256 %s…, recorded "
                        "%s…); its ids are used as they are", loaded.path, run, loaded.sha256[:12], recorded_sha[:12])
        return TextTokenizer(loaded)
    path, source = _recorded_file(ckpt, config)
    if path is None:
        raise ValueError(f"run {run} trained on {vocab_size} token ids, but its tokenizer is not recorded: {source}; "
                         f"{FIX}")
    if not path.is_file():
        relative = "" if path.is_absolute() else (f" from {os.getcwd()} (the run recorded a path relative to the "
                                                  f"folder it trained in, and its checkpoint keeps no copy)")
        raise ValueError(f"run {run} trained with the tokenizer {path} ({source}), which is missing{relative}; {FIX}")
    loaded = load_tokenizer(path)
    _check_vocabulary(run, loaded, vocab_size, source)
    if recorded_sha is not None and loaded.sha256 != recorded_sha:
        raise ValueError(f"the tokenizer {path} ({source}) changed since run {run} trained with it (SHA-256 "
                         f"{loaded.sha256[:12]}…, recorded {recorded_sha[:12]}…); {FIX}")
    return TextTokenizer(loaded)


def _check_vocabulary(run: pathlib.Path, loaded: LoadedTokenizer, vocab_size: int, source: str) -> None:
    if loaded.vocab_size != vocab_size:
        raise ValueError(f"the tokenizer {loaded.path} ({source}) has a vocabulary of {loaded.vocab_size} ids, but "
                         f"run {run} trained on {vocab_size}; {FIX}")
