"""`minifloat <command>`: the command-line interface over the library's dataclasses."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import pathlib
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.table import Table

console = Console()

AUDIT_BYTES = 100_000  # corpus bytes the audited batch is drawn from
AUDIT_SEQ_LEN = 64  # bytes per sequence of the audited Llama batch (TrainConfig's default seq_len)


def cmd_formats(args: argparse.Namespace) -> int:
    """Print the number-format table (every limit derived from the bit layout)."""
    from minifloat.numerics.formats import FORMATS

    rows = [f.describe() for f in FORMATS.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    t = Table(title="minifloat number formats")
    for col in ("name", "bits", "E", "M", "bias", "max", "min normal", "min subnormal", "inf", "NaN", "torch dtype"):
        t.add_column(col, justify="right" if col not in ("name", "torch dtype") else "left")
    for r in rows:
        t.add_row(r["name"], str(r["bits"]), str(r["exponent_bits"]), str(r["mantissa_bits"]), str(r["bias"]),
                  f"{r['max']:.6g}", f"{r['min_normal']:.6g}", f"{r['min_subnormal']:.6g}",
                  "yes" if r["has_inf"] else "no", "yes" if r["has_nan"] else "no", r["torch_dtype"] or "-")
    console.print(t)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train one small byte-level MLP LM under fp32, bf16 and every FP8 recipe; print a comparison table."""
    from rich.progress import Progress

    from minifloat.training.demo import VARIANTS, run_demo

    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        console.print(f"[red]unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
        return 2
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("training", total=args.steps * len(variants))
        results, curves = run_demo(steps=args.steps, batch=args.batch, seed=args.seed, variants=variants,
                                   progress=lambda: bar.advance(task))
    t = Table(title=f"byte-level MLP on Python stdlib sources, {args.steps} steps, batch {args.batch}, "
                    f"seed {args.seed}")
    t.add_column("variant", no_wrap=True)
    for col in ("final loss", "vs bf16", "ms/step", "min SQNR dB", "max saturated"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r.variant, f"{r.final_loss:.4f}", f"{r.rel_diff_vs_bf16:+.2%}", f"{r.ms_per_step:.1f}",
                  "-" if r.min_sqnr_db != r.min_sqnr_db else f"{r.min_sqnr_db:.1f}",
                  "-" if r.max_saturated != r.max_saturated else f"{r.max_saturated:.2%}")
    console.print(t)
    console.print("final loss = mean of the last 20 steps' training loss; SQNR and saturation over every FP8 cast "
                  "of the last step (see minifloat.fp8.telemetry).")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "demo.json").write_text(json.dumps({"results": [r.__dict__ for r in results], "curves": curves},
                                                  indent=1))
        console.print(f"wrote {out / 'demo.json'}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Run one forward+backward of a model under a precision policy, recording the dtype every op ran in; flag
    violations of the policy (softmax or a norm below fp32, an FP8 embedding or head, a low-precision all-reduce).
    Exits with status 1 when there are violations (or, with --preflight, pre-flight issues)."""
    import torch

    from minifloat.safety.audit import audit
    from minifloat.safety.preflight import preflight
    from minifloat.training.demo import ByteMLP, stdlib_bytes
    from minifloat.amp.policy import PRESETS, PrecisionPolicy

    if args.preset not in PRESETS:
        console.print(f"[red]unknown preset {args.preset!r}; choose from {sorted(PRESETS)}")
        return 2
    policy = PrecisionPolicy.preset(args.preset)
    torch.manual_seed(args.seed)
    if args.model == "byte-mlp":
        model = policy.apply(ByteMLP())
        data = stdlib_bytes(AUDIT_BYTES)
        g = torch.Generator().manual_seed(args.seed)
        start = torch.randint(0, data.numel() - model.context - 1, (args.batch,), generator=g)
        window = data[start[:, None] + torch.arange(model.context + 1)]
        inputs, targets = window[:, :-1], window[:, -1]

        def loss_fn(logits, _inputs):
            return torch.nn.functional.cross_entropy(logits.float(), targets)
    else:  # the reference Llama: model(x, y) -> (logits, loss)
        from minifloat.training.data import BatchLoader, ByteCorpus, DataConfig
        from minifloat.training.model import Llama, LlamaConfig

        config = LlamaConfig.preset(args.model)
        model = policy.apply(Llama(config))
        corpus = ByteCorpus.load(DataConfig(max_bytes=AUDIT_BYTES))
        seq_len = min(AUDIT_SEQ_LEN, config.max_seq_len)
        inputs = next(BatchLoader(corpus.train, batch_size=args.batch, seq_len=seq_len, seed=args.seed))  # (x, y)

        def loss_fn(output, _batch):
            return output[1]  # the model's fp32 cross-entropy

    with policy.autocast("cpu"):
        report = audit(model, inputs, loss_fn=loss_fn)
    console.print(policy.describe(model))
    console.print(report.table(full=args.full))
    for v in report.violations:
        console.print(f"[red]violation[/red] {v.rule}: {v.module} ({v.phase}) {v.op} in {v.precision} — {v.detail}")
    console.print("audit passed: no policy violations" if report.ok else
                  f"[red]audit failed: {len(report.violations)} violation(s)")
    status = 0 if report.ok else 1
    if args.preflight:
        pre = preflight(model, inputs)
        console.print(pre.table())
        status = status or (0 if pre.fp16_safe else 1)
    if args.json:
        pathlib.Path(args.json).write_text(report.to_json())
        console.print(f"wrote {args.json}")
    return status


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
        console.print(f"[red]invalid option: {err}")
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
    console.print(t)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Train the reference Llama once per precision preset (same seed, data, model and steps; each into OUT/<preset>)
    and compare them against BF16 (added when not listed). Writes OUT/summary.json, OUT/loss_curves.png (training
    loss and its % difference to BF16, with the ±1% band and DeepSeek-V3's 0.25%) and OUT/numerics_heatmap.png
    (per-layer SQNR of every FP8 cast after training). With --shadow-every the FP8 presets run the shadow check
    and the table counts their fallbacks to BF16. The defaults take about three minutes on 2 CPU cores.
    Exits with status 2 on an invalid option."""
    import dataclasses

    from minifloat.training.compare import DEFAULT_CONFIG, compare
    from minifloat.amp.policy import PRESETS

    fields = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "seed": args.seed, "data": args.data, "max_bytes": args.max_bytes, "shadow_every": args.shadow_every,
              "shadow_threshold": args.shadow_threshold}
    if args.shadow_every:
        fields["preset"] = "fp8-delayed"  # base's preset is replaced per run; an FP8 one may carry shadow_every
    try:
        base = dataclasses.replace(DEFAULT_CONFIG, **{k: v for k, v in fields.items() if v is not None})
        presets = [p.strip() for p in args.presets.split(",") if p.strip()]
        summary = compare(presets, base=base, out=args.out)
    except ValueError as err:
        console.print(f"[red]invalid option: {err}")
        return 2
    t = Table(title=f"{base.model} · {base.steps} steps · batch {base.batch_size} × {base.seq_len} · "
                    f"seed {base.seed}")
    t.add_column("preset", no_wrap=True)
    for col in ("final train loss", "final val loss", "vs bf16", "tokens/s", "skipped", "fallbacks"):
        t.add_column(col, justify="right")
    for name, m in summary["presets"].items():
        t.add_row(name, f"{m['final_train_loss']:.4f}", f"{m['final_val_loss']:.4f}",
                  f"{m['rel_diff_vs_bf16']:+.2%}", f"{m['tokens_per_s']:,.0f}", str(m["skipped_steps"]),
                  str(m["fallbacks"]) if base.shadow_every and PRESETS[name].recipe is not None else "-")
    console.print(t)
    console.print("vs bf16 = relative difference of the final validation loss; fallbacks = FP8 -> BF16 switches of "
                  "the shadow check (--shadow-every; - where it is off).")
    for path in summary["files"].values():
        console.print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minifloat",
        description="Low-precision (FP8 / BF16 / FP16) training for PyTorch that runs anywhere and explains its "
                    "numerics.")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's warnings and info messages")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    f = sub.add_parser("formats", help="print the number-format table", description=cmd_formats.__doc__)
    f.add_argument("--json", action="store_true", help="print JSON instead of a table")
    f.set_defaults(func=cmd_formats)

    d = sub.add_parser("demo", help="FP8 vs BF16 vs FP32 on a small byte-level MLP (minutes on 2 CPU cores)",
                       description=cmd_demo.__doc__)
    d.add_argument("--steps", type=int, default=300, help="training steps per variant (default 300)")
    d.add_argument("--batch", type=int, default=256, help="sequences per batch (default 256)")
    d.add_argument("--seed", type=int, default=0, help="seed for weights and batch order (default 0)")
    d.add_argument("--variants", default="", help="comma list of variants (default: all)")
    d.add_argument("--out", default="", help="folder to write demo.json with results and loss curves")
    d.set_defaults(func=cmd_demo)

    a = sub.add_parser("audit", help="record the dtype every op of a model runs in and flag policy violations",
                       description=cmd_audit.__doc__)
    from minifloat.training.model import SIZES

    a.add_argument("--model", default="byte-mlp", choices=["byte-mlp", *SIZES],
                   help=f"model to audit: byte-mlp (the demo's model) or a reference Llama size ({', '.join(SIZES)}) "
                        f"on a batch of {AUDIT_SEQ_LEN}-byte sequences (default byte-mlp)")
    a.add_argument("--preset", default="fp8-delayed",
                   help="precision policy preset: fp32, bf16, fp16, fp8-delayed (default), fp8-current, fp8-block, "
                        "mxfp8")
    a.add_argument("--batch", type=int, default=32, help="sequences in the audited batch (default 32)")
    a.add_argument("--seed", type=int, default=0, help="seed for weights and batch (default 0)")
    a.add_argument("--preflight", action="store_true",
                   help="also check FP16 overflow/underflow of weights and activations, and native BF16 support")
    a.add_argument("--full", action="store_true", help="list every recorded op, not only the summary rows")
    a.add_argument("--json", default="", help="write every recorded op and violation as JSON to this path")
    a.set_defaults(func=cmd_audit)

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

    from minifloat.training.compare import DEFAULT_CONFIG, DEFAULT_PRESETS

    c = sub.add_parser("compare", help="train under several presets and compare loss curves and numerics with BF16",
                       description=cmd_compare.__doc__)
    c.add_argument("--presets", default=",".join(DEFAULT_PRESETS),
                   help=f"comma list of precision presets; bf16 is added as the baseline when missing "
                        f"(default {','.join(DEFAULT_PRESETS)})")
    c.add_argument("--model", default=None, help=f"model size: tiny, small, 10m, 100m (default {DEFAULT_CONFIG.model})")
    c.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per preset (default {DEFAULT_CONFIG.steps})")
    c.add_argument("--batch-size", type=int, default=None,
                   help=f"sequences per batch (default {DEFAULT_CONFIG.batch_size})")
    c.add_argument("--seq-len", type=int, default=None, help=f"bytes per sequence (default {DEFAULT_CONFIG.seq_len})")
    c.add_argument("--seed", type=int, default=None,
                   help=f"seed for weights and batch order, shared by every preset (default {DEFAULT_CONFIG.seed})")
    c.add_argument("--data", default=None, help="folder of text files (default: the Python standard library)")
    c.add_argument("--max-bytes", type=int, default=None,
                   help=f"cap on the corpus bytes, train + val (default {DEFAULT_CONFIG.max_bytes})")
    c.add_argument("--shadow-every", type=int, default=None, metavar="N",
                   help="run the FP8-vs-BF16 shadow check every N steps in the FP8 presets and count their fallbacks "
                        f"to BF16; 0 for off (default {DEFAULT_CONFIG.shadow_every})")
    c.add_argument("--shadow-threshold", type=float, default=None, metavar="X",
                   help=f"largest healthy relative loss difference of a shadow check "
                        f"(default {DEFAULT_CONFIG.shadow_threshold})")
    c.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    c.set_defaults(func=cmd_compare)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with library_logging(args.verbose):
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
