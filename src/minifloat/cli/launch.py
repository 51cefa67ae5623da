"""`minifloat train --nproc N`: start N ranks through torchrun's launcher on this machine, and report a failed rank's
error as one line.

Each rank runs `python -m minifloat.train <the train flags>` (what `torchrun --nproc-per-node N -m minifloat.train`
runs too) under torch.distributed's elastic agent (`torch.distributed.launcher.api.elastic_launch`, the engine of
torchrun; `--standalone` rendezvous on localhost, no restarts). Rank 0 writes to this terminal (progress, warnings,
the result table); the other ranks' stdout and stderr go to files in a temporary folder. A rank that fails
writes its one-line error into the folder named by $MINIFLOAT_RANK_ERRORS instead of printing it. When any rank
fails, the agent stops the others, and the launcher prints the root cause (`_root_cause`: a rank killed by a
signal no peer sends, else the earliest error written) as `minifloat: error: rank R: <message>`, and exits with that
rank's status. Ranks that stopped on SIGINT / SIGTERM after their checkpoint (Ctrl-C reaches the whole group) are no
error: the launcher exits with the stop's status, and rank 0 has said how to resume.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator

ERRORS_ENV = "MINIFLOAT_RANK_ERRORS"  # folder where a launched rank writes its error line (rank<R>.txt)
STATUS_SEP = "\t"  # rank<R>.txt holds "<exit status>\t<message>"
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


def report_rank_error(message: str, status: int) -> bool:
    """In a rank this launcher started: write the rank's error line for the launcher and return True (the rank then
    exits with `status` without printing it). Elsewhere (one process, or plain torchrun) return False."""
    folder = os.environ.get(ERRORS_ENV)
    if not folder:
        return False
    path = pathlib.Path(folder) / f"rank{os.environ.get('RANK', '0')}.txt"
    path.write_text(f"{status}{STATUS_SEP}{message}", encoding="utf-8")
    return True


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The elastic agent's own INFO / WARNING logging off while it runs: the launcher reports failures itself."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith(AGENT_LOGGERS)]  # with levels
    loggers = [logging.getLogger(name) for name in (*AGENT_LOGGERS, *names)]  # of their own, set at import
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


STOPS = (signal.SIGINT, signal.SIGTERM)  # what a rank stops on cleanly (a checkpoint, 128 + the signal), or is sent


def _root_cause(failures: dict, errors: pathlib.Path) -> tuple[int, str | None, int]:
    """(rank, message, exit status) of the failure that started it, in this order: a rank killed by a signal no
    peer sends (SIGKILL, SIGSEGV: the OOM killer, a crash); else the rank that wrote its error first (the others then
    fail in their collectives, or the agent stops them with SIGTERM); else a rank that stopped on SIGINT / SIGTERM
    after its checkpoint, or was stopped by one: no error (message None), the status of the stop; else the lowest
    rank's exit status."""
    exits = {rank: f.exitcode for rank, f in failures.items() if f.exitcode is not None}
    killed = [rank for rank, code in sorted(exits.items()) if code < 0 and -code not in STOPS]
    if killed:
        f = failures[killed[0]]
        return killed[0], f"killed by {f.signal_name()} (pid {f.pid})", 128 + abs(f.exitcode)
    written = sorted(errors.glob("rank*.txt"), key=lambda p: p.stat().st_mtime_ns)
    if written:
        status, _, message = written[0].read_text(encoding="utf-8").partition(STATUS_SEP)
        return int(written[0].stem.removeprefix("rank")), message, int(status)
    stops = {rank: 128 + abs(code) if code < 0 else code for rank, code in sorted(exits.items())
             if abs(code) in STOPS or code - 128 in STOPS}
    if stops and len(stops) == len(exits):
        rank = min(stops, key=lambda r: (exits[r] < 0, r))  # a rank's own clean stop before one the agent sent
        return rank, None, stops[rank]
    rank = min(failures)
    return rank, f"exited with status {failures[rank].exitcode}", failures[rank].exitcode or 1


def launch(argv: list[str], *, nproc: int) -> tuple[int, str | None]:
    """Run `python -m minifloat.train *argv` on `nproc` ranks of this machine and wait for them.

    Returns:
        (exit status, the root cause's one-line error or None when every rank succeeded).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="minifloat-ranks-") as tmp:
        errors, logs = pathlib.Path(tmp) / "errors", pathlib.Path(tmp) / "logs"
        errors.mkdir()
        redirects = {rank: Std.NONE if rank == 0 else Std.ALL for rank in range(nproc)}  # rank 0 on this terminal
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                              logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=redirects))
        previous = {name: os.environ.get(name) for name in (ERRORS_ENV, "OMP_NUM_THREADS")}
        os.environ[ERRORS_ENV] = str(errors)
        # as torchrun does: ranks sharing the CPU cores do not each start a thread per core
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        try:
            with _quiet_agent():
                elastic_launch(config, sys.executable)("-m", "minifloat.train", *argv)
        except ChildFailedError as err:
            rank, message, status = _root_cause(err.failures, errors)
            return status, None if message is None else f"rank {rank} of {nproc}: {message}"
        except SignalException as err:  # Ctrl-C / SIGTERM to this process: its group's ranks got it too and stopped
            return 128 + int(err.sigval), None  # after their checkpoint; rank 0 said so on this terminal
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return 0, None

