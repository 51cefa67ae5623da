"""What every `minifloat` command shares: the console it prints on and its one-line errors."""

from __future__ import annotations

import argparse
import pathlib

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

# soft_wrap: a line of text is printed as one line (a terminal folds it on screen); a log or pipe, where rich
# would otherwise assume 80 columns and break it, keeps it whole and greppable. Tables: print_table.
console = Console(soft_wrap=True)
ERR = Console(stderr=True)
TABLE_WIDTH_LIMIT = 1000  # columns a table printed into a log may take (its widest row, up to this)


def print_table(table: Table) -> None:
    """Print a rich table whole. Where the output is not a terminal (a log, a pipe) rich assumes 80 columns and would
    cut cells to "…", so the console gets the table's own width while it prints. On a terminal narrower than the
    table, a cell of a column that may wrap folds onto more lines rather than losing characters."""
    for column in table.columns:
        if not column.no_wrap:
            column.overflow = "fold"
    saved = console.width
    if not console.is_terminal:
        options = console.options.update_width(TABLE_WIDTH_LIMIT)
        console.width = max(saved, Measurement.get(console, options, table).maximum)
    try:
        console.print(table)
    finally:
        console.width = saved


class CliError(Exception):
    """A user error: main() prints its message as one line (the traceback only with --debug) and exits with
    `status` (2 for a bad option or input, as argparse does)."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def path_arg(value: str) -> str:
    """argparse `type=` of a path option: an empty one (`--out ""`, which would write into the current folder) is
    refused in one line, as `train` refuses it."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file or folder")
    return value


def json_output(args) -> pathlib.Path | None:
    """The file `--json` writes (`output_file`), or None without --json; --overwrite without --json (it replaces
    only that file) is an invalid option, not silently nothing."""
    if args.overwrite and args.json is None:
        raise CliError("invalid option: --overwrite replaces the file --json writes; add --json PATH, or leave "
                       "--overwrite out")
    return output_file("--json", args.json, overwrite=args.overwrite) if args.json is not None else None


def output_file(flag: str, value: str, *, overwrite: bool = False) -> pathlib.Path:
    """The file an option (`flag` `value`) writes, checked before the command's work: a CliError of one line
    (status 2) when the path is a folder, its folder does not exist or is not a folder, or the file exists and
    `overwrite` (the command's --overwrite) is not given: a run's log or checkpoint is never replaced by a report.
    Nothing is created."""
    if not value.strip():
        raise CliError(f"{flag} is an empty path; give the path of a file to write")
    path = pathlib.Path(value)
    if path.is_dir():
        raise CliError(f"{flag} {value} is a folder; give the path of a file to write")
    if path.exists() and not overwrite:
        raise CliError(f"{flag} {value} exists; choose another path, or pass --overwrite to replace it")
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        raise CliError(f"{flag} {value}: {folder} is a file, not a folder; choose another path")
    if not folder.is_dir():
        raise CliError(f"{flag} {value}: the folder {folder} does not exist; create it first, or choose another path")
    return path


def error(message: str) -> None:
    """Print `message` as the command's one error line (on stderr, as argparse does)."""
    ERR.print(f"[red]minifloat: error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
