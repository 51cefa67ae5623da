"""`minifloat tokenize`: a folder of text to the token shards `minifloat train --data` memory-maps."""

from __future__ import annotations

import argparse

from minifloat.cli import common

DEFAULT_VOCAB_SIZE = 8192  # minifloat.training.tokenize.DEFAULT_VOCAB_SIZE (checked against it in tests)
DEFAULT_SHARD_TOKENS = 100_000_000  # minifloat.training.tokenize.DEFAULT_SHARD_TOKENS (likewise)


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Turn the text files under --data into token shards in --out, for `minifloat train --data OUT`. The files are
    chosen and split into training and validation exactly as `minifloat train --data` chooses and splits them (the
    --max-bytes cap included). Without --tokenizer a byte-level BPE of --vocab-size ids is trained offline on the
    training split's files (the same input gives the same tokenizer) and saved as OUT/tokenizer.json; with
    --tokenizer that tokenizer.json encodes the text and is copied into OUT. Writes OUT/train_000000.bin …,
    OUT/val_000000.bin … (at most --shard-tokens ids each: uint16 when the vocabulary has at most 65,536 ids, else
    uint32, little-endian) and OUT/meta.json (dtype, vocabulary, tokenizer hash, each shard's split and token
    count), written into a temporary folder and moved in when complete. The text is read a file at a time and the
    ids are written to the shards as each batch of files is encoded, so memory does not grow with the corpus (a
    progress bar on a terminal). An --out that holds files is refused unless --overwrite, which replaces only the
    files a previous tokenize wrote. Each split must hold a shard of one sequence of minifloat train's default
    --seq-len, as training asks. Exits with status 2 on a bad option, text folder or tokenizer, on a --data that
    holds token shards already (train on those directly), or on text too short for that sequence."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from minifloat.training.tokenize import tokenize_folder

    if args.tokenizer is not None and args.vocab_size is not None:
        raise common.CliError("invalid option: --vocab-size sets the vocabulary of the BPE that tokenize trains; "
                              "with --tokenizer the vocabulary is the tokenizer's: leave one of them out")
    vocab_size = DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size
    if vocab_size < 257:
        raise common.CliError(f"invalid option: --vocab-size must be at least 257 (256 byte tokens and "
                              f"<|endoftext|>), got {vocab_size}")
    if args.shard_tokens < 1:
        raise common.CliError(f"invalid option: --shard-tokens must be at least 1, got {args.shard_tokens}")
    if args.max_bytes is not None and args.max_bytes < 2:
        raise common.CliError(f"invalid option: --max-bytes must be at least 2, got {args.max_bytes}")
    # on stderr, drawn from the first progress report on (an error before it stays the command's one line), and
    # only on a terminal (a log gets the result line alone)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                   TimeRemainingColumn(), console=common.ERR, transient=True, disable=not common.ERR.is_terminal)
    task = bar.add_task("reading", total=1, start=False)

    def progress(phase: str, done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start()
        bar.update(task, description=phase, completed=done, total=max(total, 1))

    try:
        meta = tokenize_folder(args.data, args.out, tokenizer=args.tokenizer, vocab_size=vocab_size,
                               max_bytes=args.max_bytes, shard_tokens=args.shard_tokens, overwrite=args.overwrite,
                               progress=progress)
    finally:
        bar.stop()
    counts = {split: sum(s["tokens"] for s in meta["shards"] if s["split"] == split) for split in ("train", "val")}
    common.console.print(f"wrote {args.out}: {len(meta['shards'])} shard(s) of {meta['dtype']} ids, "
                         f"{counts['train']:,} training and {counts['val']:,} validation tokens, vocabulary "
                         f"{meta['vocab_size']:,} ({'trained BPE' if meta['tokenizer']['trained'] else 'tokenizer'}"
                         f" {meta['tokenizer']['file']}); train on it with: minifloat train --data {args.out}",
                         highlight=False, soft_wrap=True)
    return 0


HELP = "turn a folder of text into token shards (train a BPE or use a tokenizer.json)"  # its line in --help


def add_parser(sub) -> None:
    t = sub.add_parser("tokenize", help=HELP, description=cmd_tokenize.__doc__)
    t.add_argument("--data", default=None, metavar="DIR",
                   help="folder of UTF-8 text files (default: the Python standard library's sources)")
    t.add_argument("--out", required=True, metavar="DIR", type=common.path_arg, help="folder for the shards (new or empty, or --overwrite)")
    t.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a Hugging Face tokenizer.json to encode with (default: train a byte-level BPE)")
    t.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help=f"vocabulary of the trained BPE, at least 257 (default {DEFAULT_VOCAB_SIZE}; a small text "
                        f"may stop short of it)")
    t.add_argument("--max-bytes", type=int, default=None, metavar="N",
                   help="cap on the text bytes read, train + val, as minifloat train's (default: all)")
    t.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"ids per shard at most (default {DEFAULT_SHARD_TOKENS:,})")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the files a previous minifloat tokenize wrote in --out (others are kept)")
    t.set_defaults(func=cmd_tokenize)
