"""Batches of a token stream: random training windows where batch k is a pure function of (seed, k), and fixed
validation windows.

A stream is a 1-D tensor (the byte corpus, or text encoded by a tokenizer) or a `TokenStream`: the memory-mapped
shards of one split, read a window at a time. A window never crosses from one shard into the next: the loader maps a
global window start over the shards' valid starts, so a one-piece stream draws exactly the windows of its tensor.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Iterator, Sequence

import torch

from minifloat.core.validate import check_int, check_seed

# ids stored as int16 / int32 are the bit patterns of uint16 / uint32 ids: torch reads them as signed integers, and
# `int64 & mask` gives back the unsigned value (0xFFFF read as int16 is -1; -1 & 0xFFFF = 65535)
UNSIGNED_MASKS = {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}


class TokenStream:
    """One split's tokens as pieces (1-D tensors, typically memory-mapped shards) that windows never cross.

    Args:
        pieces: 1-D integer tensors, in order.
        names: one name per piece, for error messages (a shard's path).
        unsigned: int16 / int32 pieces hold uint16 / uint32 ids (see UNSIGNED_MASKS).
        vocab_size: when given, every window drawn is checked to hold ids below it (a corrupted shard is named, not
            turned into an index error deep in the embedding).
    """

    def __init__(self, pieces: Sequence[torch.Tensor], *, names: Sequence[str], unsigned: bool = False,
                 vocab_size: int | None = None):
        if len(pieces) != len(names) or not pieces or any(p.dim() != 1 for p in pieces):
            raise ValueError(f"a TokenStream needs one name per 1-D piece, got {len(pieces)} piece(s) and "
                             f"{len(names)} name(s)")
        self.pieces, self.names, self.vocab_size = list(pieces), list(names), vocab_size
        self.mask = UNSIGNED_MASKS.get(pieces[0].dtype) if unsigned else None
        self.lengths = [p.numel() for p in self.pieces]

    def __len__(self) -> int:
        return sum(self.lengths)

    def numel(self) -> int:
        return len(self)

    def n_starts(self, seq_len: int) -> int:
        """Window starts (windows of seq_len + 1 tokens) over all pieces."""
        return sum(max(0, n - seq_len) for n in self.lengths)

    def locate(self, starts: torch.Tensor, seq_len: int) -> tuple[list[int], torch.Tensor]:
        """Global window starts in [0, n_starts) -> (piece of each, offset in it). Pieces too short for one window
        hold no starts, so the searchsorted below steps over them."""
        counts = torch.tensor([max(0, n - seq_len) for n in self.lengths])
        ends = torch.cumsum(counts, 0)  # (P,) one past each piece's last global start
        piece = torch.searchsorted(ends, starts, right=True)
        return piece.tolist(), starts - (ends - counts)[piece]

    def windows(self, pieces: list[int], offsets: torch.Tensor, length: int) -> torch.Tensor:
        """Rows of `length` tokens, row i at `offsets[i]` of piece `pieces[i]`; (B, length) int64."""
        if len(set(pieces)) == 1:
            rows = self.pieces[pieces[0]][offsets[:, None] + torch.arange(length)]
        else:
            rows = torch.stack([self.pieces[p][o:o + length] for p, o in zip(pieces, offsets.tolist())])
        rows = rows.long()
        if self.mask is not None:
            rows &= self.mask
        if self.vocab_size is not None and bool((rows >= self.vocab_size).any()):
            row, col = (rows >= self.vocab_size).nonzero()[0].tolist()
            raise ValueError(
                f"token shard {self.names[pieces[row]]} holds the id {int(rows[row, col])} at token "
                f"{int(offsets[row]) + col}, outside the vocabulary of {self.vocab_size} ids: the shard is corrupt or "
                f"was made with another tokenizer; re-create it (minifloat tokenize) or pass the tokenizer it was "
                f"made with (--tokenizer)")
        return rows


def as_stream(tokens: torch.Tensor | TokenStream) -> TokenStream:
    """A TokenStream as it is; a 1-D tensor as a stream of one piece."""
    if isinstance(tokens, TokenStream):
        return tokens
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
    return TokenStream([tokens], names=["tokens"])


class BatchLoader:
    """Random (B, T) windows of one token stream; batch k is a pure function of (seed, k) and the tokens.

    The window starts of batch k are SHAKE-256("minifloat.data/{seed}/{k}") read as B little-endian uint64s modulo the
    number of starts. A hash rather than torch.Generator: the CPU generator keeps only the low 32 bits of its seed
    (manual_seed(1) and manual_seed(1 + 2**32) draw the same numbers), so seeding one per batch would repeat batches,
    and a hash gives the same batches on every torch version. The modulo bias is below N / 2^64. With several shards
    the starts count over the shards in order (`TokenStream.locate`).
    """

    def __init__(self, tokens: torch.Tensor | TokenStream, *, batch_size: int, seq_len: int, seed: int = 0):
        """Args:
            tokens: (N,) stream, N > seq_len, or a TokenStream with a piece longer than seq_len.
            batch_size: B, windows per batch.
            seq_len: T, tokens per row of x (and of y).
            seed: non-negative int.
        """
        for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("seed", seed, 0)):
            check_int(name, value, low=low)
        if not isinstance(tokens, TokenStream) and (tokens.dim() != 1 or tokens.numel() <= seq_len):
            raise ValueError(f"tokens must be a 1-D stream longer than seq_len={seq_len}, got shape "
                             f"{tuple(tokens.shape)}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.stream = as_stream(tokens)
        if self.stream.n_starts(seq_len) <= 0:
            raise ValueError(f"no piece of the token stream is longer than seq_len={seq_len} (longest: "
                             f"{max(self.stream.lengths)} tokens)")
        self.seed, self.position = seed, 0

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number k (does not move the position). Returns (x, y), both (B, T) int64, y[:, t] = x[:, t + 1]."""
        check_int("k", k, low=0)
        n_starts = self.stream.n_starts(self.seq_len)  # a window is seq_len + 1 tokens
        raw = hashlib.shake_256(f"minifloat.data/{self.seed}/{k}".encode()).digest(8 * self.batch_size)
        starts = torch.tensor([v % n_starts for v in struct.unpack(f"<{self.batch_size}Q", raw)])
        pieces, offsets = self.stream.locate(starts, self.seq_len)
        window = self.stream.windows(pieces, offsets, self.seq_len + 1)  # (B, T + 1)
        return window[:, :-1], window[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        xy = self.batch(self.position)
        self.position += 1
        return xy

    def skip(self, n: int) -> None:
        """Move ahead n batches, as if drawing them (rollback uses it to step over the batches of a bad stretch)."""
        check_int("n", n, low=0)
        self.position += n

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from `state_dict()`; the saved seed replaces this loader's."""
        if set(state) != {"position", "seed"}:
            raise ValueError(f"state must have exactly the keys 'position' and 'seed', got {sorted(state)}")
        check_int("position", state["position"], low=0)
        check_seed("seed", state["seed"])
        self.position, self.seed = state["position"], state["seed"]


def val_batches(tokens: torch.Tensor | TokenStream, *, batch_size: int, seq_len: int,
                max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed batches covering a stream: windows start at 0, T, 2T, … of each piece, so every token after a piece's
    first is a target exactly once (up to a tail shorter than T). The last batch may have fewer than B rows.

    Args:
        tokens: (N,) stream, N > seq_len, or a TokenStream with a piece longer than seq_len.
        batch_size, seq_len: B and T.
        max_batches: stop after this many batches (the first ones, so the subset is fixed too); None for all.
    Returns:
        an iterator of (x, y), each (b, T) int64 with b <= B.
    """
    check_int("batch_size", batch_size, low=1)
    check_int("seq_len", seq_len, low=1)
    if max_batches is not None:
        check_int("max_batches", max_batches, low=1)
    if not isinstance(tokens, TokenStream) and (tokens.dim() != 1 or tokens.numel() <= seq_len):
        raise ValueError(f"tokens must be a 1-D stream longer than seq_len={seq_len}, got shape {tuple(tokens.shape)}")
    stream = as_stream(tokens)
    if stream.n_starts(seq_len) <= 0:
        raise ValueError(f"no piece of the token stream is longer than seq_len={seq_len}")
    # (piece, start) of every window, piece by piece: (n - 1) // T windows in a piece of n tokens
    starts = ((i, w * seq_len) for i, n in enumerate(stream.lengths) for w in range(max(0, (n - 1) // seq_len)))
    for i in itertools.count():
        rows = list(itertools.islice(starts, batch_size))
        if not rows or max_batches is not None and i == max_batches:
            return
        window = stream.windows([p for p, _ in rows], torch.tensor([s for _, s in rows]), seq_len + 1)  # (b, T + 1)
        yield window[:, :-1], window[:, 1:]
