"""minifloat.cli.launch: which rank's failure `minifloat train --nproc N` reports, and when a stop is no error.

Every rank of a run meets the same bad input; the first to exit makes the agent SIGTERM the others. The launcher used
to prefer any rank killed by a signal, SIGTERM included, over the errors the ranks wrote: "rank 1 of 2: killed by
SIGTERM" (exit 143) in place of the one-line error (exit 2), seemingly at random. And a clean stop on Ctrl-C or
SIGTERM (a checkpoint, then 130 / 143) was printed as an error.
"""

from __future__ import annotations

import dataclasses
import signal

import pytest

from minifloat.cli.launch import STATUS_SEP, _root_cause


@dataclasses.dataclass
class Failure:
    """What torch's ChildFailedError holds per rank: the exit code (negative: killed by that signal) and pid."""
    exitcode: int
    pid: int = 1234

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


def written(tmp_path, rank: int, status: int, message: str) -> None:
    (tmp_path / f"rank{rank}.txt").write_text(f"{status}{STATUS_SEP}{message}", encoding="utf-8")


# (name, exit codes by rank, errors written {rank: (status, message)}, expected (rank, message or None, status))
CASES = [
    ("an error and a rank the agent stopped", {0: 2, 1: -signal.SIGTERM}, {0: (2, "data path 'x' does not exist")},
     (0, "data path 'x' does not exist", 2)),
    ("the agent stopped the rank that wrote", {0: -signal.SIGTERM, 1: 2}, {1: (2, "n_head (4) must be ...")},
     (1, "n_head (4) must be ...", 2)),
    ("a rank killed outright", {0: -signal.SIGTERM, 1: -signal.SIGKILL}, {0: (1, "a collective failed")},
     (1, "killed by SIGKILL (pid 1234)", 137)),
    ("Ctrl-C: both ranks stopped cleanly", {0: 130, 1: 130}, {}, (0, None, 130)),
    ("one rank stopped, the agent stopped the other", {0: -signal.SIGTERM, 1: 143}, {}, (1, None, 143)),
    ("a crash without a written error", {0: 1, 1: -signal.SIGTERM}, {}, (0, "exited with status 1", 1)),
]


@pytest.mark.parametrize("name, exits, errors, expected", CASES, ids=[c[0] for c in CASES])
def test_the_root_cause_is_the_error_a_rank_wrote(tmp_path, name, exits, errors, expected):
    for rank, (status, message) in errors.items():
        written(tmp_path, rank, status, message)
    assert _root_cause({rank: Failure(code) for rank, code in exits.items()}, tmp_path) == expected


def test_ctrl_c_to_the_launcher_is_the_ranks_clean_stop(monkeypatch):
    """Ctrl-C reaches the launcher and its ranks (one process group): the ranks stop after a checkpoint and rank 0
    says so; the agent raised its SignalException, which ended as "SignalException: ... got signal: 2" and exit 1."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from minifloat.cli import launch as launch_module

    def interrupted(config, entrypoint):
        def run(*args):
            raise SignalException(f"Process 1 got signal: {signal.SIGINT}", sigval=signal.SIGINT)
        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", interrupted)
    assert launch_module.launch(["--out", "x"], nproc=2) == (128 + signal.SIGINT, None)
