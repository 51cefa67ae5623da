"""What every `minifloat` command shares: the console it prints on and its one-line errors."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

console = Console()
ERR = Console(stderr=True)


def print_table(table, width: int) -> None:
    """Print a rich table whole: where the output is not a terminal (a log, a pipe) rich assumes 80 columns and
    would cut the numbers, so the console gets the `width` the table is made for while it prints."""
    saved = console.width
    if not console.is_terminal:
        console.width = max(saved, width)
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


def error(message: str) -> None:
    """Print `message` as the command's one error line (on stderr, as argparse does)."""
    ERR.print(f"[red]minifloat: error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
