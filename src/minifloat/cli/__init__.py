"""`minifloat <command>`: the command-line interface over the library's dataclasses."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

from minifloat.cli import common, compare, export, generate, memory, tools, train
from minifloat.training.checkpoint import CheckpointError

# errors that describe the user's input (options, files, folders, checkpoints), not a bug in minifloat
USER_ERRORS = (common.CliError, ValueError, OSError, CheckpointError)
MESSAGE_LIMIT = 400  # characters of an error message printed on the one line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minifloat",
        description="Low-precision (FP8 / BF16 / FP16) training for PyTorch that runs anywhere and explains its "
                    "numerics.")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's warnings and info messages")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the full Python traceback instead of the one-line message")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    tools.add_parsers(sub)
    train.add_parser(sub)
    compare.add_parser(sub)
    memory.add_parser(sub)
    generate.add_parser(sub)
    export.add_parser(sub)
    return p


@contextlib.contextmanager
def library_logging(verbose: bool) -> Iterator[None]:
    """The library's log records (the `minifloat` logger) on stderr while a command runs: INFO and up with
    --verbose, else WARNING and up. The logger is left as found, so main() leaves no global logging setting behind
    when another program (or a test) calls it."""
    logger = logging.getLogger("minifloat")
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def one_line(err: BaseException, limit: int = MESSAGE_LIMIT) -> str:
    """The error's message on one line, cut to `limit` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (bad option, input file, data folder or checkpoint) prints one line naming it
    and exits with status 2; any other error prints one line and exits with 1; --debug re-raises both."""
    args = build_parser().parse_args(argv)
    with library_logging(args.verbose):
        try:
            return args.func(args)
        except USER_ERRORS as err:
            if args.debug:
                raise
            status = err.status if isinstance(err, common.CliError) else 2
            common.error(one_line(err))
            return status
        except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops cleanly on its own), or twice
            if args.debug:
                raise
            common.error("interrupted")
            return 130
        except Exception as err:  # a bug, not the user's: one line and the way to the traceback
            if args.debug:
                raise
            common.error(f"{type(err).__name__}: {one_line(err)} (rerun with --debug for the traceback)")
            return 1


if __name__ == "__main__":
    sys.exit(main())
