"""`minifloat train`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import signal

from rich.table import Table

from minifloat.cli import common
from minifloat.cli.launch import launch, report_rank_error


def _steps(text: str) -> tuple[int, ...]:
    """"5,9" -> (5, 9); TrainConfig checks the values."""
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"nan_steps must be a comma list of step numbers, e.g. 5,9, got {text!r}") from None


HELP = "train the reference Llama on the byte corpus under a precision preset"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flagged() -> dict:
    """TrainConfig's settings that have a flag (all but none today), by name."""
    from minifloat.training.config import SETTINGS

    return {name: f for name, f in SETTINGS.items() if f.metadata["flag"]}


def given_settings(args: argparse.Namespace, names) -> dict:
    """The settings among `names` given as flags, as TrainConfig takes them: on|off as bools, --nan-steps as steps;
    a bad on|off is one CliError line (argparse's own choices error is a usage block)."""
    flagged = _flagged()
    fields = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    for name in [n for n in fields if flagged[n].metadata["on_off"]]:
        if fields[name] not in ("on", "off"):
            raise common.CliError(f"invalid option: {_flag(name)} must be on or off, got {fields[name]!r}")
        fields[name] = fields[name] == "on"
    if "nan_steps" in fields:
        fields["nan_steps"] = _steps(fields["nan_steps"])
    return fields


def train_config(args: argparse.Namespace):
    """The TrainConfig the flags ask for (minifloat.training.config.config_from: with --resume, flags not given take
    the checkpoint's values, so `minifloat train --out DIR --resume --steps 800` continues the run as it was set up)."""
    from minifloat.training.config import SETTINGS, config_from
    from minifloat.training.loop import CHECKPOINT_DIR
    from minifloat.training.rundir import CHECKPOINT_TOKENIZER
    from minifloat.training.parallel import launched_by_torchrun
    from minifloat.training.sharded import read_extra

    fields = given_settings(args, _flagged())
    if launched_by_torchrun() and "nproc" not in fields:  # `torchrun --nproc-per-node N -m minifloat.train`
        fields["nproc"] = int(os.environ["WORLD_SIZE"])
    saved = None
    if args.resume:
        ckpt = pathlib.Path(fields.get("out", SETTINGS["out"].default)) / CHECKPOINT_DIR
        if ckpt.is_dir():  # else train() says there is no checkpoint
            saved = read_extra(ckpt).get("config") or {}
            recorded = saved.get("tokenizer")
            # the run's tokenizer named relative to the folder it started in, resumed from another one: the copy its
            # checkpoint keeps (the manifest's SHA-256 still checks it)
            if ("tokenizer" not in fields and isinstance(recorded, str) and not pathlib.Path(recorded).exists()
                    and (ckpt / CHECKPOINT_TOKENIZER).is_file()):
                fields["tokenizer"] = str(ckpt / CHECKPOINT_TOKENIZER)
    config = config_from(fields, saved)
    if given := [_flag(name) for name in ("compile_mode", "compile_scope") if name in fields and not config.compile]:
        raise common.CliError(f"invalid option: {' and '.join(given)} {'choose' if len(given) > 1 else 'chooses'} how "
                              f"--compile compiles; add --compile")
    if "tp_size" in fields and config.parallel != "fsdp+tp":
        raise common.CliError("invalid option: --tp-size sets the tensor-parallel groups of --parallel fsdp+tp; add "
                              "--parallel fsdp+tp, or leave --tp-size out")
    if config.nproc == 1 and config.parallel is not None and not launched_by_torchrun():
        if "parallel" in fields:
            raise common.CliError(f"invalid option: --parallel {config.parallel} lays the model out over several "
                                  f"processes; add --nproc N (N > 1), or launch the ranks with torchrun")
        config = dataclasses.replace(config, parallel=None)  # one process: no layout to choose
    return config


def launch_argv(args: argparse.Namespace, config) -> list[str]:
    """The train flags that give each launched rank `config`: the flags given, with --nproc and --parallel."""
    argv = [flag for flag, on in (("--verbose", args.verbose), ("--debug", args.debug)) if on]
    for name in _flagged():
        value = getattr(args, name)
        flag = _flag(name)
        if name in ("nproc", "parallel") or value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv + ["--nproc", str(config.nproc), "--parallel", config.parallel]


def run_rank(config, args: argparse.Namespace):
    """This process's rank of a multi-process run (started by torchrun): rank 0 logs as one process would, the
    others log errors only. A rank started by `minifloat train --nproc` hands its error to the launcher, worded as
    one process words it (an OS error names the option whose path it is about, options spelt as flags)."""
    from minifloat.cli import USER_ERRORS, flags_of, one_line, os_error_line, with_flags
    from minifloat.training.loop import train

    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("minifloat").setLevel(logging.ERROR)
    try:
        return train(config)
    except USER_ERRORS as err:
        flags = flags_of(args)
        line = os_error_line(err, args, flags) if isinstance(err, OSError) else one_line(err)
        if report_rank_error(with_flags(line, flags), 2):
            raise SystemExit(2) from None
        raise
    except Exception as err:
        if report_rank_error(f"{type(err).__name__}: {one_line(err)}", 1):
            raise SystemExit(1) from None
        raise


def cmd_train(args: argparse.Namespace) -> int:
    """Train the reference Llama on the byte corpus (the Python standard library's sources, or --data: text files,
    encoded by --tokenizer when given, or token shards from minifloat tokenize, nanoGPT, llm.c or Megatron) under a
    precision preset on a CPU or GPU (--device): warm-up + cosine LR, AdamW, gradient accumulation (--grad-accum),
    loss scaling, non-finite and spike guards, evaluation, checkpoints. Optional safety nets: --shadow-every (check
    FP8 against BF16 every N steps and fall back to BF16 while FP8 is off), --rollback-after (after N skipped steps
    in a row, return to the last snapshot and continue past the bad batches), --embedding-grad-alpha (GLM-130B's
    embedding gradient shrink); --nan-steps injects NaN losses to try the guards. Writes OUT/log.csv (one row per
    step; the mode column says fp8 or bf16), OUT/val.csv, OUT/ckpt, OUT/run.json and, if tensorboard is installed,
    OUT/tensorboard. A folder that holds a run is refused unless --resume (continue it: flags not given keep the
    checkpoint's values, the lr schedule continues) or --overwrite (replace it). SIGTERM / Ctrl-C stop after the
    current step with a checkpoint (exit status 128 + the signal's number). Exits with status 2 on an invalid
    option or input."""
    from minifloat.training.loop import train
    from minifloat.training.parallel import launched_by_torchrun
    from minifloat.training.run import low_precision_layers

    config = train_config(args)
    if config.parallel is not None and not launched_by_torchrun():
        status, message = launch(launch_argv(args, config), nproc=config.nproc)
        if message is not None:
            raise common.CliError(message, status=status)
        return status  # 0, or the status of a stop on SIGINT / SIGTERM (rank 0 printed its line)
    result = run_rank(config, args) if config.parallel is not None else train(config)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if result.stopped_by:
        common.console.print(f"stopped by {result.stopped_by} at step {result.last_step}/{config.steps}; checkpoint "
                             f"in {pathlib.Path(config.out) / 'ckpt'}; continue with --resume")
        return 128 + getattr(signal, result.stopped_by).value
    master = f" · master {config.master}" if config.master != "fp32" else ""
    t = Table(title=f"{config.model} · {config.preset}{master} · steps {result.first_step}..{config.steps} · "
                    f"{result.device}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("first loss", f"{result.losses[0]:.4f}" if result.losses else "-")
    t.add_row("final train loss", f"{result.final_loss:.4f}")
    t.add_row("final val loss", f"{result.val_losses[-1][1]:.4f}" if result.val_losses else "-")
    left_out = f"first {result.warmup_steps} step{'s' * (result.warmup_steps > 1)} left out"
    t.add_row("tokens/s", f"{result.tokens_per_s:,.0f}" + (f" ({left_out})" if result.warmup_steps else ""))
    t.add_row("MFU (vs dense BF16 peak)", f"{result.mfu:.1%}" if result.mfu is not None else "- (no GPU peak known)")
    if config.policy().recipe is not None:
        low, linears = low_precision_layers(config)
        t.add_row("low-precision layers", f"{low} of {linears} linears" +
                  (f" (--fp8-layers {config.fp8_layers})" if config.fp8_layers != "all" else ""))
    t.add_row("skipped steps", ", ".join(f"{s} ({r})" for s, r in result.skipped) or "none")
    t.add_row("shadow switches", (", ".join(f"{s} (to {to})" for s, to, _ in result.shadow_events) or "none")
              if config.shadow_every else "off")
    t.add_row("FP8 fallbacks", str(len(result.fallbacks)) if config.shadow_every else "off")
    t.add_row("rollbacks", (", ".join(f"{s} (back to {to}, {n} batches skipped)" for s, to, n in result.rollbacks)
                            or "none") if config.rollback_after else "off")
    t.add_row("spike level shifts", ", ".join(map(str, result.level_shifts)) or "none")
    t.add_row("outputs", str(pathlib.Path(config.out)))
    common.console.print(t)
    return 0


def add_settings(parser, names, *, defaults=None, extra_help: dict | None = None, helps: dict | None = None) -> None:
    """A flag for each TrainConfig setting in `names`, made from the settings' metadata (help, group, metavar,
    choices), in argument groups by the settings' group. Every flag defaults to None (not given). The help
    (`helps[name]` in place of the setting's own, for a command where it says more than applies) shows the
    default of `defaults` (a TrainConfig; the config's own field defaults when None) and `extra_help[name]`."""
    from minifloat.training.config import GROUPS, spelled

    flagged = _flagged()
    groups = {group: parser.add_argument_group(group) for group in GROUPS}
    for name in names:
        f = flagged[name]
        meta, kind = f.metadata, str(f.type)
        default_value = spelled(name, f.default if defaults is None else getattr(defaults, name))
        unset = default_value is None or default_value is False or default_value == ()
        default = "" if unset or "(default" in meta["help"] else f" (default {default_value})"
        text = (helps or {}).get(name, meta["help"]) + default + ((extra_help or {}).get(name) or "")
        options = dict(default=None, help=text.replace("%", "%%"))
        if meta["on_off"]:
            options["metavar"] = "on|off"
        elif kind == "bool":
            options["action"] = "store_true"
        else:
            # a tuple (nan_steps) is parsed in train_config, where a bad value gets one line
            options["type"] = int if kind.startswith("int") else float if kind.startswith("float") else str
            if meta["choices"]:
                options["choices"] = list(meta["choices"])
            elif meta["metavar"]:
                options["metavar"] = meta["metavar"]
        groups[meta["group"]].add_argument(_flag(name), **options)


def add_parser(sub) -> None:
    """`minifloat train`'s flags, one per TrainConfig setting (`add_settings`; the default shown is the config's
    own)."""
    tr = sub.add_parser("train", help=HELP, description=cmd_train.__doc__)
    add_settings(tr, list(_flagged()))
    tr.set_defaults(func=cmd_train)
