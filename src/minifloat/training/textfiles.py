"""A folder of text read a file at a time: the files minifloat.training.data chooses and splits, without their bytes.

    files = TextFiles.scan(DataConfig(path="text/"))       # each file read once: checked (UTF-8, no NUL), hashed
    digest = hashlib.sha256()
    for split in Split:                                     # TRAIN, then VAL: the order the manifest digest hashes
        for parts in files.texts(split, hash_into=digest.update):   # a file's text, a part at a time
            for text in parts: ...
    files.manifest(digest.hexdigest())                      # == ByteCorpus.load(DataConfig(path="text/")).manifest

Work on a corpus larger than memory (`minifloat tokenize`, training through a tokenizer) holds a part of one file at
a time (READ_BYTES) instead of the whole corpus (ByteCorpus holds every byte). Each file is read twice, by the scan
(minifloat.training.data, which streams it too) and by `texts`; the second reading is checked against the first's
SHA-256, so a file changed in between is named and the work fails, instead of mixing it in.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import pathlib
from collections.abc import Callable, Iterator

from minifloat.training.data import (DATA_FIX, READ_BYTES, DataConfig, FileEntry, Manifest, Split, select_files,
                                     split_header)


@dataclasses.dataclass(frozen=True)
class TextFiles:
    """The files of a text corpus and their splits (ByteCorpus.load's choice), read again on demand."""

    root: pathlib.Path
    files: tuple[FileEntry, ...]  # as ByteCorpus's manifest lists them: nbytes and sha256 of the bytes taken
    skipped: tuple[tuple[str, str], ...]
    config: DataConfig
    fix: str = DATA_FIX  # what a data error ends with: how to point --data at usable data

    @classmethod
    def scan(cls, config: DataConfig | None = None, *, fix: str = DATA_FIX) -> TextFiles:
        """Find, read, check and hash the files `config` describes, keeping none of their bytes.

        Args:
            config: the corpus (the standard library's sources when None).
            fix: what each data error ends with (DATA_FIX: text or token shards; minifloat tokenize reads text only).
        Raises:
            ByteCorpus.load's errors (no such folder, no text files, fewer than two).
        """
        config = config or DataConfig()
        root, _, files, skipped = select_files(config, keep=False, fix=fix)
        return cls(root, tuple(files), tuple(skipped.items()), config, fix)

    def entries(self, split: Split | str) -> list[FileEntry]:
        """The files of one split, in order."""
        return [f for f in self.files if f.split == Split(split)]

    def nbytes(self, split: Split | str | None = None) -> int:
        """The bytes taken from the files of one split (both when None)."""
        return sum(f.nbytes for f in (self.files if split is None else self.entries(split)))

    def texts(self, split: Split | str, *, hash_into: Callable[[bytes], object] | None = None,
              progress: Callable[[int], object] | None = None) -> Iterator[Iterator[str]]:
        """Each file of one split, in order, as its text in parts (READ_BYTES bytes at a time, decoded as they
        come): as many bytes as the scan took (a --max-bytes cap included; a cap inside a UTF-8 character loses that
        character). A file's parts are read as they are asked for, and the next file is not opened before the last
        part of this one is read (the reading ends it if its consumer did not).

        Args:
            split: "train" or "val".
            hash_into: called with what the manifest digest hashes for this split (its header, then each file's
                bytes): pass `digest.update` for TRAIN, then VAL, to rebuild the digest ByteCorpus.load computes.
            progress: called with the bytes of each part as it is read.
        Raises:
            ValueError naming the file: it changed, vanished or became unreadable since the scan (a change is found
            at the end of the file, after its parts were handed out: the caller's work on them must be discarded,
            as `minifloat tokenize` and training's token spill do with everything on any error).
        """
        entries = self.entries(split)
        if hash_into is not None:
            hash_into(split_header(Split(split), sum(f.nbytes for f in entries)))
        for entry in entries:
            parts = self._parts(entry, hash_into, progress)
            yield parts
            for _ in parts:  # whatever the consumer left unread: the hash and the check need every byte
                pass

    def _parts(self, entry: FileEntry, hash_into: Callable[[bytes], object] | None,
               progress: Callable[[int], object] | None) -> Iterator[str]:
        digest, left = hashlib.sha256(), entry.nbytes
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        try:
            with open(self.root / entry.path, "rb") as f:
                while left > 0:
                    data = f.read(min(READ_BYTES, left))
                    if not data:
                        break  # the file shrank: the digest check below names it
                    left -= len(data)
                    digest.update(data)
                    if hash_into is not None:
                        hash_into(data)
                    if progress is not None:
                        progress(len(data))
                    text = decoder.decode(data)
                    if text:
                        yield text
        except OSError as err:
            raise ValueError(f"data file {entry.path} under {self.root} cannot be read any more "
                             f"({err.strerror or type(err).__name__}); leave the folder alone while it is "
                             f"read, or {self.fix}") from None
        if digest.hexdigest() != entry.sha256:
            raise ValueError(f"data file {entry.path} under {self.root} changed while the folder was read; "
                             f"leave the folder alone while it is read, and run again")

    def manifest(self, digest: str) -> Manifest:
        """The manifest ByteCorpus.load would give, with `digest` (see the module docstring)."""
        return Manifest(str(self.root), self.files, self.skipped, digest)
