"""Hugging Face `tokenizers` for minifloat's data: load a tokenizer.json, train a byte-level BPE offline, encode text.

A tokenizer is identified by the SHA-256 of its tokenizer.json, which the data manifest records: a run resumed with
another tokenizer is refused. Encoding adds no special tokens; between two files the tokenizer's end-of-text id
(the first of END_OF_TEXT it knows) marks the boundary.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import pathlib
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# end-of-text tokens by family: GPT-2 and tiktoken-style, Llama 3, SentencePiece (Llama 2, T5), others
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
BPE_SPECIAL = "<|endoftext|>"  # the one special token of the BPE `train_bpe` makes (id 0)
TOKENIZER_FIX = "pass a tokenizer.json saved by Hugging Face tokenizers (Tokenizer.save) or by minifloat tokenize"
ENCODE_BATCH = 64  # texts per encode_batch call at most (the Rust side encodes them in parallel)
# characters per encode_batch call at most (a longer text is cut into pieces: text_pieces): tokenizers holds about
# 100-250 bytes per token while it encodes (each Encoding's tokens, offsets and masks; per-byte alignments), so 1 Mi
# characters peak at a few hundred MB (measured with tokenizers 0.23), whatever the corpus
ENCODE_CHARS = 1 << 20
CUT_CONTEXT = 1024  # characters on each side of a cut in a long text that the cut's check encodes (text_pieces)
CUT_TRIES = 32  # candidate cuts of each kind (line break, space) checked per piece at most


@dataclasses.dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer and what identifies it."""

    tokenizer: Tokenizer
    path: pathlib.Path
    sha256: str
    data: bytes = dataclasses.field(repr=False)  # the file as read: what a run's checkpoints keep a copy of
    origin: pathlib.Path | None = None  # the file the user named, where `path` is a copy of it (error messages)

    @functools.cached_property
    def vocab_size(self) -> int:
        """The model's vocabulary: the largest id + 1 (a vocabulary with gaps in its ids has fewer tokens than that,
        which get_vocab_size() counts; an embedding of that many rows had no row for the largest ids)."""
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        return max(self.tokenizer.get_vocab_size(), max(ids, default=-1) + 1)

    @property
    def eot_id(self) -> int | None:
        """The end-of-text id put between files, or None when the tokenizer has none."""
        return next((i for i in map(self.tokenizer.token_to_id, END_OF_TEXT) if i is not None), None)

    def describe(self) -> dict:
        """For a manifest or meta.json: {"file", "sha256", "vocab_size"}."""
        return {"file": self.path.name, "sha256": self.sha256, "vocab_size": self.vocab_size}


def load_tokenizer(path: str | pathlib.Path, *, fix: str | None = None) -> LoadedTokenizer:
    """Read a tokenizer.json.

    Args:
        path: the file.
        fix: what the error line tells the user to do (default: pass a good one with --tokenizer); a reader of a
            file the user did not name (a minifloat tokenize folder's) says how to mend that file.
    Raises:
        ValueError naming the file and the fix: missing, unreadable, or not a tokenizers file.
    """
    path = pathlib.Path(path).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"tokenizer {str(path)!r} {what}; {fix or f'{TOKENIZER_FIX} with --tokenizer'}")
    try:
        raw = path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as err:
        raise ValueError(f"tokenizer {str(path)!r} cannot be read ({err.strerror}); {fix or TOKENIZER_FIX}") from None
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON (and UTF-8 errors)
        reason = " ".join(str(err).split())[:120]
        raise ValueError(f"tokenizer {str(path)!r} is not a Hugging Face tokenizers file ({reason}); "
                         f"{fix or TOKENIZER_FIX}") from None
    return LoadedTokenizer(tokenizer, path, hashlib.sha256(raw).hexdigest(), raw)


def train_bpe(texts: Iterable[str | Iterable[str]], *, vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte has a token, so any text encodes) trained on `texts`, offline.

    The result depends on the texts and vocab_size alone: the trainer counts pairs in parallel but merges by count,
    ties broken by the pair, so the same input gives the same tokenizer.json (tested).

    Args:
        texts: the training texts, each a str or an iterable of its parts (minifloat tokenize passes the train
            split's files, in path order); an iterator is read as tokenizers' train_from_iterator asks for them, so
            they need not be in memory together.
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
    pre_tokenizer = tokenizer.pre_tokenizer

    def words(parts: list[str]) -> list[list[str]]:
        return [[word for word, _ in pre_tokenizer.pre_tokenize_str(part)] for part in parts]
    # a long text in pieces cut where its pre-tokens (the words the trainer counts) stay the same: the same
    # tokenizer as from the texts whole, in memory bounded by a piece (tokenizers holds a whole input's words)
    pieces = (piece for text in texts for piece in _pieces(text, ENCODE_CHARS, words))
    tokenizer.train_from_iterator((part for piece in pieces for part in _long_runs_cut(piece)), trainer)
    return tokenizer


# The trainer's time grows with the square of a word's length (a run of 300,000 "x" alone took 86 s, 3 MB hours):
# a run of this many characters without whitespace, which may be one pre-token, is cut into runs of this length
# before training (each becomes its own word). Text has no such words; the cut changes only what it learns of them.
LONG_RUN_CHARS = 1000
_LONG_RUN = re.compile(r"\S{%d,}" % (LONG_RUN_CHARS + 1))


def _long_runs_cut(text: str) -> Iterator[str]:
    """`text` as the trainer sees it: whole, or (where it holds a run longer than LONG_RUN_CHARS without whitespace)
    in parts, the run cut every LONG_RUN_CHARS characters."""
    start = 0
    for run in _LONG_RUN.finditer(text):
        if run.start() > start:
            yield text[start:run.start()]
        yield from (text[i:min(i + LONG_RUN_CHARS, run.end())] for i in range(run.start(), run.end(), LONG_RUN_CHARS))
        start = run.end()
    if start < len(text) or not text:
        yield text[start:]


def encode_batches(tokenizer: LoadedTokenizer, texts: Iterable[str | Iterable[str]], *,
                   batch_chars: int = ENCODE_CHARS) -> Iterator[torch.Tensor]:
    """The texts' ids with the end-of-text id after each text (when the tokenizer has one), a batch at a time: at
    most ENCODE_BATCH pieces of text and `batch_chars` characters (a piece longer than that alone). A text longer
    than `batch_chars` is encoded in pieces of at most that many characters, cut only where cutting leaves its ids
    unchanged (`text_pieces`). A text's ids depend neither on its batch nor on its pieces, so the batches
    concatenated are the ids of the texts encoded whole, one by one; only one batch is held, however long a text or
    the corpus.

    Args:
        tokenizer: from load_tokenizer.
        texts: in order, each a str or an iterable of its parts (TextFiles.texts); an iterator is read as the
            batches are asked for.
        batch_chars: characters per batch at most, >= 1.
    Returns:
        an iterator of (n,) int64 ids (uint32-safe, for shards of any vocabulary), one per batch.
    """
    if not isinstance(batch_chars, int) or batch_chars < 1:
        raise ValueError(f"batch_chars must be an int >= 1, got {batch_chars!r}")
    batch, ends, chars = [], [], 0
    for text in texts:
        pieces = text_pieces(tokenizer, text, batch_chars)
        piece = next(pieces)
        for following in itertools.chain(pieces, [None]):
            if batch and (len(batch) == ENCODE_BATCH or chars + len(piece) > batch_chars):
                yield _encode(tokenizer, batch, ends)
                batch, ends, chars = [], [], 0
            batch.append(piece)
            ends.append(following is None)  # the end-of-text id follows a text's last piece only
            chars += len(piece)
            piece = following
    if batch:
        yield _encode(tokenizer, batch, ends)


def text_pieces(tokenizer: LoadedTokenizer, text: str | Iterable[str], piece_chars: int) -> Iterator[str]:
    """`text` (a str, or its parts in order: minifloat.training.textfiles reads a file a part at a time) cut into
    pieces of at most `piece_chars` characters whose ids, concatenated, are the ids of `text`.

    A tokenizer looks across a cut (a pre-tokenizer joins a run of letters, digits or white space, or punctuation
    with the line breaks after it; a special token spans several characters; some tokenizers mark the start of each
    input), so a cut is taken only where it is shown harmless: encoding the CUT_CONTEXT characters on each side
    separately gives the ids of encoding them together. Candidates are the starts of runs of white space (a line
    break, or a space, after a character that is not white space) in the last half of each piece, nearest its end
    first, at most CUT_TRIES of each kind, the kind that last passed first. Where none passes (a tokenizer that
    marks the start of every input, or one without a pre-tokenizer; a piece without a break), the rest of the text is
    one piece: correct, only longer. This assumes a tokenizer whose view across a cut reaches less than CUT_CONTEXT
    characters, as every regex pre-tokenizer's does at a break.
    """
    def ids(parts: list[str]) -> list[list[int]]:
        return [e.ids for e in encode_fast(tokenizer, parts)]
    return _pieces(text, piece_chars, ids)


def _pieces(text: str | Iterable[str], piece_chars: int, split: Callable[[list[str]], list[list]]) -> Iterator[str]:
    """`text` (a str, or its parts in order) in pieces of at most `piece_chars` characters, cut where `split` (texts
    -> each one's tokens or pre-tokens) finds the window around the cut split the same apart as together (see
    `text_pieces`). Parts are read as needed: the buffer holds a piece, the CUT_CONTEXT characters on either side
    and one part, and every check sees the window it would see in the whole text."""
    parts = iter([text] if isinstance(text, str) else text)
    buf, start, marks, more = "", 0, ["\n", " "], True  # start: where the next piece begins in buf
    while True:
        while more and len(buf) - start <= piece_chars + CUT_CONTEXT:  # a piece and its last cut's right context
            part = next(parts, None)
            more = part is not None
            buf += part or ""
        if len(buf) - start <= piece_chars:
            yield buf[start:]
            return
        cut = None
        for mark in marks:
            cut = _harmless_cut(buf, start + max(1, piece_chars // 2), start + piece_chars, mark, split)
            if cut is not None:
                marks.sort(key=lambda m: m != mark)  # the kind of break that worked is tried first next time
                break
        if cut is None:  # no harmless cut: the rest of the text is one piece
            yield buf[start:] + "".join(parts)
            return
        yield buf[start:cut]
        keep = max(0, cut - CUT_CONTEXT)  # the next cut's left context stays in the buffer
        buf, start = buf[keep:], cut - keep


def _harmless_cut(text: str, lo: int, hi: int, mark: str, split: Callable[[list[str]], list[list]]) -> int | None:
    """A position in [lo, hi] where a run of white space starts with `mark` and cutting `text` leaves what `split`
    makes of the CUT_CONTEXT characters around it unchanged (at most CUT_TRIES tried, from hi down), or None."""
    at, tries = hi + 1, 0
    while tries < CUT_TRIES:
        at = text.rfind(mark, lo, at)
        if at < lo:
            return None
        if text[at - 1].isspace():  # only at the start of a run of white space: a run is one pre-token
            continue
        tries += 1
        left, right = text[max(0, at - CUT_CONTEXT):at], text[at:at + CUT_CONTEXT]
        whole, apart_left, apart_right = split([left + right, left, right])
        if whole == apart_left + apart_right:
            return at
    return None


def encode_fast(tokenizer: LoadedTokenizer, texts: list[str]) -> list:
    """tokenizers' encode_batch_fast, its bare Exception (a model that cannot encode some text: a WordLevel or
    WordPiece vocabulary without an unknown token) as a ValueError naming the tokenizer and the fix."""
    try:
        return tokenizer.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception
        reason = " ".join(str(err).split())[:120]
        raise ValueError(f"tokenizer {str(tokenizer.origin or tokenizer.path)!r} cannot encode this text ({reason}); "
                         f"pass a tokenizer that encodes any text (a byte-level BPE, or one with an unknown token)"
                         ) from None


def _encode(tokenizer: LoadedTokenizer, texts: list[str], ends: list[bool]) -> torch.Tensor:
    eot, parts = tokenizer.eot_id, []
    # encode_batch_fast: the same ids without the offsets (measured: about 40% less memory, half the time)
    for encoding, end in zip(encode_fast(tokenizer, texts), ends):
        parts.append(torch.tensor(encoding.ids, dtype=torch.int64))
        if eot is not None and end:
            parts.append(torch.tensor([eot], dtype=torch.int64))
    return torch.cat(parts)
