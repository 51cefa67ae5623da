"""`minifloat <command>`: the command-line interface over the library's dataclasses.

Only the command being run gets its options built: the defaults its help shows come from config dataclasses whose
modules import torch, which `minifloat --help` and a mistyped command need not wait for."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pathlib
import re
import signal
import sys
from collections.abc import Callable, Collection, Iterator
from typing import NoReturn

from minifloat.cli import common, compare, export, generate, memory, tokenize, tools, train

# errors that describe the user's input (options, files, folders, checkpoints; a CheckpointError is a ValueError), not
# a bug in minifloat
USER_ERRORS = (common.CliError, ValueError, OSError)
MESSAGE_LIMIT = 400  # characters of an error message printed on the one line

# command -> (what adds its parser to the subparsers, its line in `minifloat --help`), in the order --help lists them
COMMANDS: dict[str, tuple[Callable, str]] = {
    "formats": (tools.add_formats, tools.FORMATS_HELP),
    "demo": (tools.add_demo, tools.DEMO_HELP),
    "train": (train.add_parser, train.HELP),
    "compare": (compare.add_parser, compare.HELP),
    "audit": (tools.add_audit, tools.AUDIT_HELP),
    "memory": (memory.add_parser, memory.HELP),
    "generate": (generate.add_parser, generate.HELP),
    "export": (export.add_parser, export.HELP),
    "tokenize": (tokenize.add_parser, tokenize.HELP),
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that an error in the command line (a missing or unknown option, a value of the
    wrong type or outside its choices) is one line naming the option, as every other minifloat error, not a usage
    block: main() prints it. Subparsers are of the same class, so theirs are one line too."""

    def error(self, message: str) -> NoReturn:
        raise common.CliError(message)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minifloat")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser(commands: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The `minifloat` parser. Every command is listed, but only those in `commands` get their options (building
    them imports the modules their defaults come from); main() builds the one it runs."""
    p = Parser(
        prog="minifloat",
        description="Low-precision (FP8 / BF16 / FP16) training for PyTorch that runs anywhere and explains its "
                    "numerics.")
    p.add_argument("--version", action="version", version=f"minifloat {_version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's warnings and info messages")
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the full Python traceback instead of the one-line message")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    for name, (add, summary) in COMMANDS.items():
        if name in commands:
            add(sub)
        else:
            sub.add_parser(name, help=summary)  # listed only
    return p


def command_of(argv: list[str]) -> str | None:
    """The command named in `argv`: its first word that is not an option (minifloat's own options take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


class StderrHandler(logging.StreamHandler):
    """A log handler that writes each record to `sys.stderr` as it is at that moment. While a rich progress bar is
    drawn on a terminal, rich replaces sys.stderr by a proxy that prints above the bar, so a warning gets a line of
    its own instead of landing on the bar's line (a handler holding the real stderr writes over the bar). Not
    rich.logging.RichHandler: it writes through one console, stdout's (where the bars are) or stderr's, and either
    puts warnings on stdout or past the bar; and it wraps a long message into lines at 80 columns in a log."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ and setStream assign it; the live stderr wins
        pass


@contextlib.contextmanager
def library_logging(verbose: bool) -> Iterator[None]:
    """The library's log records (the `minifloat` logger) on stderr while a command runs, one line each: INFO and up
    with --verbose, else WARNING and up. The logger is left as found, so main() leaves no global logging setting
    behind when another program (or a test) calls it."""
    logger = logging.getLogger("minifloat")
    handler = StderrHandler()
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


def flags_of(args: argparse.Namespace) -> dict[str, str]:
    """The flag of each of the command's options, by field name: every minifloat flag is its field's name with
    dashes, {"keep_blocks": "--keep-blocks", ...}."""
    return {field: "--" + field.replace("_", "-") for field in vars(args)
            if field not in ("command", "func", "verbose", "debug")}


def with_flags(message: str, flags: dict[str, str]) -> str:
    """`message` with the library's Python spelling of an option put as the command line spells it:
    `activations='dynamic'` -> `--activations dynamic`, `overwrite=True` -> `--overwrite`, and a field a sentence
    begins with, "keep_blocks must be ..." -> "--keep-blocks must be ..." (only before "must": a field's name is also
    a plain word elsewhere, "the model has ..."), and a field with an underscore wherever it stands alone
    ("fp8_margin overrides ..." -> "--fp8-margin overrides ...")."""
    for field, flag in flags.items():
        message = re.sub(rf"(?<![\w./\\-]){re.escape(field)}=(?:'([^']*)'|([\w.,+-]+))",
                         lambda m, flag=flag: flag if m.group(2) == "True" else
                         f"{flag} {m.group(1) if m.group(1) is not None else m.group(2)}", message)
        # a field named with an underscore is no plain word: put as its flag wherever it stands alone
        ahead = r"(?![\w=])" if "_" in field else r"(?= must )"
        message = re.sub(rf"(?<![\w./\\-]){re.escape(field)}{ahead}", flag, message)
    # "--top-k must be an int in [1, 256] or None": a flag left out is the None; it cannot be typed
    return re.sub(r"(--[\w-]+ must be [^;]*?) or None\b", r"\1", message)


def _within(path: str, value: str) -> bool:
    """Whether `path` is the option value `value` itself, inside it, or a temporary sibling of it (".NAME.tmp-...",
    written beside it and renamed into place)."""
    p, v = pathlib.PurePath(path), pathlib.PurePath(value)
    return p == v or v in p.parents or (p.parent == v.parent and v.name in p.name and p.name.startswith("."))


def os_error_line(err: OSError, args: argparse.Namespace, flags: dict[str, str]) -> str:
    """An OSError as one line naming the option whose path it concerns, without Python's "[Errno N]":
    "--out /proc/x: No such file or directory". Its own message when it has no path (a message of minifloat's)."""
    if err.filename is None or err.strerror is None:
        return one_line(err)
    path = str(err.filename) + (f" -> {err.filename2}" if err.filename2 is not None else "")
    for field, flag in flags.items():
        value = getattr(args, field, None)
        if isinstance(value, str) and value and _within(str(err.filename), value):
            return one_line(f"{flag} {value}: {err.strerror}" + ("" if path == value else f" ({path})"))
    return one_line(f"{path}: {err.strerror}")


# what gloo and NCCL raise in a rank whose peer process went away (torchrun's ranks each print their own error)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted")


def peer_failed(err: Exception) -> int | None:
    """This rank's number when `err` is the process group breaking because another rank stopped (a rank that
    reported its own error, a bad option say, and left): else None. Rank 0 always reports its error in full."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 or dist.get_rank() == 0:
        return None
    lost = isinstance(err, getattr(dist, "DistError", ())) or any(text in str(err) for text in _PEER_GONE)
    return dist.get_rank() if lost else None


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (bad option, input file, data folder or checkpoint; argparse's own included)
    prints one line naming it and exits with status 2; any other error prints one line and exits with 1; --debug
    re-raises both. Ctrl-C before a command starts (while torch imports) is one line too, status 130."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if "--debug" in argv:
            raise
        common.error("interrupted")
        return 130


def _main(argv: list[str]) -> int:
    command = command_of(argv)
    try:
        args = build_parser([command]).parse_args(argv)
    except common.CliError as err:  # argparse's: before the command runs, so no --debug and no library logging
        where = f"minifloat {command}" if command in COMMANDS else "minifloat"
        common.error(f"{one_line(err)} (see {where} --help)")
        return err.status
    flags = flags_of(args)
    with library_logging(args.verbose):
        try:
            return args.func(args)
        except BrokenPipeError:  # the reader went away (`minifloat formats --json | head`): nothing left to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet the interpreter's flush at exit
            return 128 + signal.SIGPIPE
        except USER_ERRORS as err:
            if args.debug:
                raise
            status = err.status if isinstance(err, common.CliError) else 2
            line = os_error_line(err, args, flags) if isinstance(err, OSError) else one_line(err)
            common.error(with_flags(line, flags))
            return status
        except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops cleanly on its own), or twice
            if args.debug:
                raise
            common.error("interrupted")
            return 130
        except Exception as err:  # a bug, not the user's: one line and the way to the traceback
            if args.debug:
                raise
            if (rank := peer_failed(err)) is not None:  # a rank whose peer stopped first, and said why
                common.error(f"rank {rank} stopped: another rank of the run stopped first (its error is above); "
                             f"rerun with --debug for this rank's traceback")
                return 1
            common.error(f"{type(err).__name__}: {one_line(err)} (rerun with --debug for the traceback)")
            return 1


if __name__ == "__main__":
    sys.exit(main())
