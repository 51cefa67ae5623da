"""Hugging Face `tokenizers` for minifloat's data: load a tokenizer.json, train a byte-level BPE offline, encode text.

A tokenizer is identified by the SHA-256 of its tokenizer.json, which the data manifest records: a run resumed with
another tokenizer is refused. Encoding adds no special tokens; between two files the tokenizer's end-of-text id
(the first of END_OF_TEXT it knows) marks the boundary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from collections.abc import Iterable, Iterator

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# end-of-text tokens by family: GPT-2 and tiktoken-style, Llama 3, SentencePiece (Llama 2, T5), others
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BPE_SPECIAL = "<|endoftext|>"  # the one special token of the BPE `train_bpe` makes (id 0)
TOKENIZER_FIX = "pass a tokenizer.json saved by Hugging Face tokenizers (Tokenizer.save) or by minifloat tokenize"
ENCODE_BATCH = 64  # texts per encode_batch call at most (the Rust side encodes them in parallel)
# characters per encode_batch call at most (a longer text is encoded alone): tokenizers holds about 100-250 bytes per
# token while it encodes (each Encoding's tokens, offsets and masks; per-byte alignments), so 1 Mi characters peak at
# a few hundred MB (measured with tokenizers 0.23), whatever the corpus
ENCODE_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer and what identifies it."""

    tokenizer: Tokenizer
    path: pathlib.Path
    sha256: str
    data: bytes = dataclasses.field(repr=False)  # the file as read: what a run's checkpoints keep a copy of

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eot_id(self) -> int | None:
        """The end-of-text id put between files, or None when the tokenizer has none."""
        return next((i for i in map(self.tokenizer.token_to_id, END_OF_TEXT) if i is not None), None)

    def describe(self) -> dict:
        """For a manifest or meta.json: {"file", "sha256", "vocab_size"}."""
        return {"file": self.path.name, "sha256": self.sha256, "vocab_size": self.vocab_size}


def load_tokenizer(path: str | pathlib.Path) -> LoadedTokenizer:
    """Read a tokenizer.json.

    Raises:
        ValueError naming the file and the fix: missing, unreadable, or not a tokenizers file.
    """
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"tokenizer {str(path)!r} {what}; {TOKENIZER_FIX} with --tokenizer")
    try:
        raw = path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as err:
        raise ValueError(f"tokenizer {str(path)!r} cannot be read ({err.strerror}); {TOKENIZER_FIX}") from None
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON (and UTF-8 errors)
        reason = " ".join(str(err).split())[:120]
        raise ValueError(f"tokenizer {str(path)!r} is not a Hugging Face tokenizers file ({reason}); "
                         f"{TOKENIZER_FIX}") from None
    return LoadedTokenizer(tokenizer, path, hashlib.sha256(raw).hexdigest(), raw)


def train_bpe(texts: Iterable[str], *, vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte has a token, so any text encodes) trained on `texts`, offline.

    The result depends on the texts and vocab_size alone: the trainer counts pairs in parallel but merges by count,
    ties broken by the pair, so the same input gives the same tokenizer.json (tested).

    Args:
        texts: the training texts (minifloat tokenize passes the train split's files, in path order); an iterator
            is read as tokenizers' train_from_iterator asks for them, so they need not be in memory together.
        vocab_size: the largest vocabulary to learn, >= 257 (256 bytes and BPE_SPECIAL); a small corpus may stop
            short of it when no pair is left to merge.
    """
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"vocab_size must be an int >= 257 (256 byte tokens and {BPE_SPECIAL}), got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode_batches(tokenizer: LoadedTokenizer, texts: Iterable[str], *,
                   batch_chars: int = ENCODE_CHARS) -> Iterator[torch.Tensor]:
    """The texts' ids with the end-of-text id after each text (when the tokenizer has one), a batch of texts at a
    time: ENCODE_BATCH texts or `batch_chars` characters, whichever comes first (a longer text is a batch alone). A
    text's ids do not depend on its batch, so the batches concatenated are the ids of the texts encoded one by one;
    only one batch is held, however many texts there are.

    Args:
        tokenizer: from load_tokenizer.
        texts: in order (an iterator is read as the batches are asked for).
        batch_chars: characters per batch at most, >= 1.
    Returns:
        an iterator of (n,) int64 ids (uint32-safe, for shards of any vocabulary), one per batch.
    """
    if not isinstance(batch_chars, int) or batch_chars < 1:
        raise ValueError(f"batch_chars must be an int >= 1, got {batch_chars!r}")
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) == ENCODE_BATCH or chars >= batch_chars:
            yield _encode(tokenizer, batch)
            batch, chars = [], 0
    if batch:
        yield _encode(tokenizer, batch)


def _encode(tokenizer: LoadedTokenizer, texts: list[str]) -> torch.Tensor:
    eot, parts = tokenizer.eot_id, []
    # encode_batch_fast: the same ids without the offsets (measured: about 40% less memory, half the time)
    for encoding in tokenizer.tokenizer.encode_batch_fast(texts, add_special_tokens=False):
        parts.append(torch.tensor(encoding.ids, dtype=torch.int64))
        if eot is not None:
            parts.append(torch.tensor([eot], dtype=torch.int64))
    return torch.cat(parts)
