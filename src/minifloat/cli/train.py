"""`minifloat train`."""

from __future__ import annotations

import argparse
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


# TrainConfig fields set by flags of the same name (--batch-size -> batch_size); None = not given
FLAG_FIELDS = ("model", "preset", "steps", "batch_size", "seq_len", "grad_accum", "lr", "warmup", "lr_decay_steps",
               "seed", "data", "max_bytes", "out", "eval_every", "eval_batches", "checkpoint_every", "resume",
               "overwrite", "device", "fp8_format", "fp8_amax_history_len", "fp8_margin", "shadow_every",
               "shadow_threshold", "rollback_after", "snapshot_every", "embedding_grad_alpha", "compile", "nproc",
               "parallel", "tp_size", "optimizer_state", "master", "bf16_tail", "nvfp4_weight_2d", "nvfp4_rht",
               "nvfp4_stochastic_rounding", "keep_blocks")
# boolean fields whose flags take on|off (an ablation must be able to say off)
ON_OFF_FIELDS = ("nvfp4_weight_2d", "nvfp4_rht", "nvfp4_stochastic_rounding")
# fields a resumed run takes from its checkpoint when their flag is not given (the rest start from the defaults)
NOT_INHERITED = ("out", "resume", "overwrite", "device", "compile", "lr_decay_steps")


def train_config(args: argparse.Namespace):
    """The TrainConfig the flags ask for. With --resume, flags not given take the checkpoint's values, so
    `minifloat train --out DIR --resume --steps 800` continues the run as it was set up."""
    from minifloat.training.loop import CHECKPOINT_DIR, TrainConfig
    from minifloat.training.parallel import launched_by_torchrun
    from minifloat.training.sharded import read_extra

    fields = {name: getattr(args, name) for name in FLAG_FIELDS if getattr(args, name) is not None}
    for name in ON_OFF_FIELDS:  # checked here: argparse's own choices error is a usage block, not one line
        if name in fields:
            if fields[name] not in ("on", "off"):
                raise common.CliError(f"invalid option: --{name.replace('_', '-')} must be on or off, "
                                      f"got {fields[name]!r}")
            fields[name] = fields[name] == "on"
    if launched_by_torchrun() and "nproc" not in fields:  # `torchrun --nproc-per-node N -m minifloat.train`
        fields["nproc"] = int(os.environ["WORLD_SIZE"])
    if args.nan_steps is not None:
        fields["nan_steps"] = _steps(args.nan_steps)
    if args.lr is not None:  # --lr alone moves the floor with it (min_lr = lr / 10, nanoGPT's rule of thumb)
        fields["min_lr"] = args.lr / 10
    if args.resume:
        ckpt = pathlib.Path(fields.get("out", TrainConfig.out)) / CHECKPOINT_DIR
        if ckpt.is_dir():  # else train() says there is no checkpoint
            saved = read_extra(ckpt).get("config") or {}
            inherited = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                         if k in TrainConfig.__dataclass_fields__ and k not in NOT_INHERITED}
            if args.nproc is not None and args.parallel is None:  # new ranks: the layout is chosen anew, below
                inherited.pop("parallel", None)
            fields = {**inherited, **fields}
    if fields.get("nproc", 1) > 1 and fields.get("parallel") is None:
        fields["parallel"] = "ddp"
    if fields.get("nproc", 1) == 1 and not launched_by_torchrun():
        fields.pop("parallel", None)  # one process: no layout to choose
    return TrainConfig(**fields)


def launch_argv(args: argparse.Namespace, config) -> list[str]:
    """The train flags that give each launched rank `config`: the flags given, with --nproc and --parallel."""
    argv = [flag for flag, on in (("--verbose", args.verbose), ("--debug", args.debug)) if on]
    for name in (*FLAG_FIELDS, "nan_steps"):
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if name in ("nproc", "parallel") or value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv + ["--nproc", str(config.nproc), "--parallel", config.parallel]


def run_rank(config):
    """This process's rank of a multi-process run (started by torchrun): rank 0 logs as one process would, the
    others log errors only. A rank started by `minifloat train --nproc` hands its error to the launcher."""
    from minifloat.cli import USER_ERRORS, one_line
    from minifloat.training.loop import train

    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("minifloat").setLevel(logging.ERROR)
    try:
        return train(config)
    except USER_ERRORS as err:
        if report_rank_error(one_line(err), 2):
            raise SystemExit(2) from None
        raise
    except Exception as err:
        if report_rank_error(f"{type(err).__name__}: {one_line(err)}", 1):
            raise SystemExit(1) from None
        raise


def cmd_train(args: argparse.Namespace) -> int:
    """Train the reference Llama on the byte corpus (the Python standard library's sources, or --data) under a
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

    config = train_config(args)
    if config.parallel is not None and not launched_by_torchrun():
        status, message = launch(launch_argv(args, config), nproc=config.nproc)
        if message is not None:
            raise common.CliError(message, status=status)
        return 0
    result = run_rank(config) if config.parallel is not None else train(config)
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
    t.add_row("tokens/s", f"{result.tokens_per_s:,.0f}" + (f" (first {result.warmup_steps} steps left out)"
                                                            if result.warmup_steps else ""))
    t.add_row("MFU (vs dense BF16 peak)", f"{result.mfu:.1%}" if result.mfu is not None else "- (no GPU peak known)")
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


def add_parser(sub) -> None:
    from minifloat.safety.shadow import ShadowConfig
    from minifloat.training.loop import TrainConfig  # defaults shown in --help come from the config itself
    from minifloat.training.optimizer import MASTER_HELP

    defaults = TrainConfig()
    tr = sub.add_parser("train", help="train the reference Llama on the byte corpus under a precision preset",
                        description=cmd_train.__doc__)
    tr.add_argument("--model", default=None, help=f"model size: tiny, small, 10m, 100m (default {defaults.model})")
    tr.add_argument("--preset", default=None,
                    help=f"precision preset: fp32, bf16, fp16, fp8-delayed, fp8-current, fp8-block, mxfp8, nvfp4, "
                         f"mxfp4 (default {defaults.preset})")
    tr.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {defaults.steps})")
    tr.add_argument("--batch-size", type=int, default=None, help=f"sequences per batch (default {defaults.batch_size})")
    tr.add_argument("--seq-len", type=int, default=None, help=f"bytes per sequence (default {defaults.seq_len})")
    tr.add_argument("--lr", type=float, default=None,
                    help=f"peak learning rate; the cosine floor is lr/10 (default {defaults.lr})")
    tr.add_argument("--warmup", type=int, default=None,
                    help=f"steps of linear learning-rate warm-up (default {defaults.warmup})")
    tr.add_argument("--seed", type=int, default=None,
                    help=f"seed for weights and batch order (default {defaults.seed})")
    tr.add_argument("--data", default=None, help="folder of text files (default: the Python standard library)")
    tr.add_argument("--max-bytes", type=int, default=None,
                    help=f"cap on the corpus bytes, train + val (default {defaults.max_bytes})")
    tr.add_argument("--out", default=None, help=f"output folder (default {defaults.out})")
    tr.add_argument("--eval-every", type=int, default=None,
                    help=f"steps between validation passes (default {defaults.eval_every})")
    tr.add_argument("--eval-batches", type=int, default=None,
                    help=f"validation batches per pass (default {defaults.eval_batches})")
    tr.add_argument("--checkpoint-every", type=int, default=None,
                    help=f"steps between checkpoints into OUT/ckpt, 0 for none (default {defaults.checkpoint_every})")
    tr.add_argument("--resume", action="store_true", default=None,
                    help="continue the run in OUT from OUT/ckpt; flags not given keep the checkpoint's values, and "
                         "--steps must go beyond its step")
    tr.add_argument("--overwrite", action="store_true", default=None,
                    help="replace the run in OUT (only the files a run writes there are removed)")
    tr.add_argument("--device", default=None,
                    help=f"auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N "
                         f"(default {defaults.device})")
    tr.add_argument("--grad-accum", type=int, default=None, metavar="K",
                    help=f"micro-batches of --batch-size per optimizer step; FP8 scales advance once per step "
                         f"(default {defaults.grad_accum})")
    tr.add_argument("--lr-decay-steps", type=int, default=None, metavar="N",
                    help="step at which the cosine decay reaches its floor (default: --steps; on --resume the "
                         "checkpoint's, and a new value re-plans the rest of the decay from the current lr)")
    tr.add_argument("--fp8-format", default=None, choices=["hybrid", "e4m3"],
                    help="FP8 formats of the delayed recipe: hybrid (E4M3 forward, E5M2 gradients) or e4m3 "
                         "(needs a preset with delayed scaling, fp8-delayed)")
    tr.add_argument("--fp8-amax-history-len", type=int, default=None, metavar="N",
                    help="steps of amax history of the delayed recipe (needs fp8-delayed)")
    tr.add_argument("--fp8-margin", type=int, default=None, metavar="N",
                    help="scale = fp8_max / amax / 2^N: N bits of headroom (needs fp8-delayed)")
    tr.add_argument("--shadow-every", type=int, default=None, metavar="N",
                    help=f"every N steps, run the batch in FP8 and in BF16 and compare the losses; "
                         f"{ShadowConfig().patience} unhealthy checks in a row move the run to BF16, "
                         f"{ShadowConfig().recover_after} healthy ones back to FP8; 0 for off (needs an FP8 preset; "
                         f"default {defaults.shadow_every})")
    tr.add_argument("--shadow-threshold", type=float, default=None, metavar="X",
                    help=f"largest healthy relative loss difference |fp8 - bf16| / bf16 of a shadow check "
                         f"(default {defaults.shadow_threshold})")
    tr.add_argument("--rollback-after", type=int, default=None, metavar="N",
                    help=f"after N skipped steps in a row, restore the last snapshot and continue past the bad "
                         f"batches; 0 for off (default {defaults.rollback_after})")
    tr.add_argument("--snapshot-every", type=int, default=None, metavar="N",
                    help=f"steps between the in-memory rollback snapshots (default {defaults.snapshot_every})")
    tr.add_argument("--embedding-grad-alpha", type=float, default=None, metavar="A",
                    help=f"multiply the gradient into the token embedding's output by A in (0, 1] (GLM-130B: 0.1); "
                         f"1 for off (default {defaults.embedding_grad_alpha})")
    tr.add_argument("--compile", action="store_true", default=None,
                    help="run the training steps under torch.compile (the first steps compile; results as eager)")
    tr.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="train on N processes of this machine (torchrun; gloo on CPU, NCCL on GPU), each on "
                         "--grad-accum micro-batches of every step; logs, progress and checkpoints come from rank 0 "
                         f"(default {defaults.nproc})")
    tr.add_argument("--parallel", default=None, choices=["ddp", "fsdp", "fsdp+tp"],
                    help="how the ranks hold the model: ddp (replicated, DistributedDataParallel), fsdp (sharded, "
                         "FSDP2, FP8 weights gathered in FP8) or fsdp+tp (tensor/sequence parallel in groups of "
                         "--tp-size ranks, FSDP2 across them); default ddp when --nproc is above 1")
    tr.add_argument("--optimizer-state", default=None, metavar="M,V",
                    help=f"formats of AdamW's two moments, stored per block of 128: fp32, bf16, e4m3, e5m2, int8, "
                         f"int8-dynamic or int4 each (e.g. e4m3,bf16: 3 B/param instead of 8; norms, embeddings and "
                         f"small tensors keep fp32; default {defaults.optimizer_state})")
    tr.add_argument("--master", default=None, metavar="MODE",
                    help="how the weights outside the fp32 norms, embeddings and head keep small updates: "
                         + "; ".join(f"{mode}: {text}" for mode, text in MASTER_HELP.items())
                         + f". The bf16 modes halve the gradients too (bf16), keep the AdamW moments as "
                           f"--optimizer-state says, need a bf16-computing preset and --nproc 1 "
                           f"(default {defaults.master})")
    tr.add_argument("--bf16-tail", type=float, default=None, metavar="F",
                    help=f"run the FP8/FP4 layers in BF16 for the last fraction F of --steps (NVIDIA's late switch "
                         f"for NVFP4; needs an fp8 or fp4 preset; default {defaults.bf16_tail})")
    for field, text in (("nvfp4_weight_2d", "16×16 weight tiles, so that dgrad's Wᵀ holds the forward's numbers"),
                        ("nvfp4_rht", "the random Hadamard transform of the wgrad operands"),
                        ("nvfp4_stochastic_rounding", "stochastic rounding of the gradients")):
        tr.add_argument("--" + field.replace("_", "-"), default=None, metavar="on|off",
                        help=f"{text}: on (the nvfp4 preset's default) or off, for ablations (needs --preset nvfp4)")
    tr.add_argument("--keep-blocks", default=None, metavar="FIRST,LAST",
                    help="keep the linear layers of the first FIRST and last LAST transformer blocks in BF16 under "
                         "an fp8 or fp4 preset; each a count or a fraction of the blocks below 1, rounded up "
                         "(0,0.15 keeps the last 15%%) (default: the preset's; nvfp4 and mxfp4 keep the last "
                         "block: 0,1)")
    tr.add_argument("--tp-size", type=int, default=None, metavar="T",
                    help=f"ranks per tensor-parallel group with --parallel fsdp+tp; must divide --nproc and "
                         f"--seq-len (default {defaults.tp_size})")
    tr.add_argument("--nan-steps", default=None, metavar="S,S",
                    help="fault injection: comma list of steps whose loss is made NaN, to try the guards (the "
                         "batch numbers, once a rollback skipped batches; default none)")
    tr.set_defaults(func=cmd_train)
