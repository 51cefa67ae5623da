"""`minifloat train`."""

from __future__ import annotations

import argparse
import pathlib

from rich.table import Table

from minifloat.cli import common


def _steps(text: str) -> tuple[int, ...]:
    """"5,9" -> (5, 9); TrainConfig checks the values."""
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"nan_steps must be a comma list of step numbers, e.g. 5,9, got {text!r}") from None


def cmd_train(args: argparse.Namespace) -> int:
    """Train the reference Llama on the byte corpus (the Python standard library's sources, or --data) under a
    precision preset: warm-up + cosine LR, AdamW, loss scaling, non-finite and spike guards, evaluation, checkpoints.
    Optional safety nets: --shadow-every (check FP8 against BF16 every N steps and fall back to BF16 while FP8 is
    off), --rollback-after (after N skipped steps in a row, return to the last snapshot and continue past the bad
    batches), --embedding-grad-alpha (GLM-130B's embedding gradient shrink); --nan-steps injects NaN losses to try
    the guards. Writes OUT/log.csv (one row per step; the mode column says fp8 or bf16), OUT/val.csv, OUT/ckpt and,
    if tensorboard is installed, TensorBoard logs. Exits with status 2 on an invalid option."""
    from minifloat.training.loop import TrainConfig, train

    fields = {"model": args.model, "preset": args.preset, "steps": args.steps, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup, "seed": args.seed, "data": args.data,
              "max_bytes": args.max_bytes, "out": args.out, "eval_every": args.eval_every,
              "eval_batches": args.eval_batches, "checkpoint_every": args.checkpoint_every, "resume": args.resume,
              "fp8_format": args.fp8_format, "fp8_amax_history_len": args.fp8_amax_history_len,
              "fp8_margin": args.fp8_margin, "shadow_every": args.shadow_every,
              "shadow_threshold": args.shadow_threshold, "rollback_after": args.rollback_after,
              "snapshot_every": args.snapshot_every, "embedding_grad_alpha": args.embedding_grad_alpha,
              "compile": args.compile or None}
    try:
        if args.nan_steps is not None:
            fields["nan_steps"] = _steps(args.nan_steps)
        # --lr alone moves the floor with it (min_lr = lr / 10, nanoGPT's rule of thumb)
        config = TrainConfig(**{k: v for k, v in fields.items() if v is not None},
                             **({"min_lr": args.lr / 10} if args.lr is not None else {}))
    except ValueError as err:
        common.console.print(f"[red]invalid option: {err}")
        return 2
    result = train(config)
    t = Table(title=f"{config.model} · {config.preset} · steps {result.first_step}..{config.steps}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("first loss", f"{result.losses[0]:.4f}" if result.losses else "-")
    t.add_row("final train loss", f"{result.final_loss:.4f}")
    t.add_row("final val loss", f"{result.val_losses[-1][1]:.4f}" if result.val_losses else "-")
    t.add_row("tokens/s", f"{result.tokens_per_s:,.0f}")
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

    defaults = TrainConfig()
    tr = sub.add_parser("train", help="train the reference Llama on the byte corpus under a precision preset",
                        description=cmd_train.__doc__)
    tr.add_argument("--model", default=None, help=f"model size: tiny, small, 10m, 100m (default {defaults.model})")
    tr.add_argument("--preset", default=None,
                    help=f"precision preset: fp32, bf16, fp16, fp8-delayed, fp8-current, fp8-block, mxfp8 "
                         f"(default {defaults.preset})")
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
    tr.add_argument("--resume", action="store_true", default=None, help="continue from OUT/ckpt")
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
    tr.add_argument("--compile", action="store_true",
                    help="run the training steps under torch.compile (the first steps compile; results as eager)")
    tr.add_argument("--nan-steps", default=None, metavar="S,S",
                    help="fault injection: comma list of steps whose loss is made NaN, to try the guards (the "
                         "batch numbers, once a rollback skipped batches; default none)")
    tr.set_defaults(func=cmd_train)
