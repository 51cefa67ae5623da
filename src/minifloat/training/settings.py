"""`setting`: a TrainConfig field with everything said of it (flag, help, group, resume rule) in its metadata."""

from __future__ import annotations

import dataclasses

# the groups of settings, in the order `minifloat train --help` lists them
GROUPS = ("model and data", "optimizer and schedule", "precision", "safety nets", "parallelism and device", "run")
RESUMES = ("inherit", "fixed", "fresh")
NOT_RECORDED = object()


def setting(default, help: str, *, group: str, resume: str = "inherit", why: str = "", absent=NOT_RECORDED,
            metavar: str | None = None, choices: tuple | None = None, on_off: bool = False, flag: bool = True):
    """A TrainConfig field and all that is said of it: its flag and help (minifloat.cli.train) and resume rule.

    Args:
        default: the default value.
        help: what the setting does (the flag's help; the default is appended).
        group: one of GROUPS.
        resume: what a resumed run does with it: "inherit" (takes the checkpoint's value unless given), "fixed"
            (must equal the checkpoint's: `why` says what a change would do) or "fresh" (never inherited: where and
            how this call runs).
        absent: for "fixed" settings newer than some checkpoints, the value such a checkpoint ran with.
        metavar, choices: for the flag's help. on_off: a bool whose flag takes on|off (ablations must say off).
        flag: False for settings with no flag.
    """
    if group not in GROUPS or resume not in RESUMES or (resume == "fixed") != bool(why):
        raise ValueError(f"bad setting metadata: group={group!r}, resume={resume!r}, why={why!r}")
    meta = dict(help=help, group=group, resume=resume, why=why, absent=absent, metavar=metavar, choices=choices,
                on_off=on_off, flag=flag)
    return dataclasses.field(default=default, metadata=meta)
