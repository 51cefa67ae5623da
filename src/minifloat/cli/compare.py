"""`minifloat compare`."""

from __future__ import annotations

import argparse

from rich.table import Table

from minifloat.cli import common

# headers in two lines where one would widen the table past 80 columns (table_note spells them out)
COLUMNS = ("preset", "train\nloss", "val\nloss", "Δ vs\nbf16", "tok/s", "skipped\nsteps", "fallbacks")


def cmd_compare(args: argparse.Namespace) -> int:
    """Train the reference Llama once per precision preset (same seed, data, model and steps; each into OUT/<preset>)
    and compare them against BF16 (added when not listed). Writes OUT/summary.json, OUT/loss_curves.png (the
    training loss; each preset's per-step difference to BF16 over the last quarter; its smoothed difference over the
    run against the band of step-to-step noise and DeepSeek-V3's 0.25%) and OUT/numerics_heatmap.png (per-layer SQNR
    of every FP8 cast after training). With --shadow-every the
    FP8 presets run the shadow check and the table counts their fallbacks to BF16; tok/s leaves out each run's
    warm-up steps (compilation). The defaults take about three minutes on 2 CPU cores.
    An OUT holding an earlier comparison is refused unless --overwrite. Exits with status 2 on an invalid option."""
    import dataclasses

    from minifloat.training.compare import DEFAULT_CONFIG, compare

    fields = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "seed": args.seed, "data": args.data, "max_bytes": args.max_bytes, "shadow_every": args.shadow_every,
              "shadow_threshold": args.shadow_threshold, "device": args.device, "overwrite": args.overwrite or None}
    if args.shadow_every:
        fields["preset"] = "fp8-delayed"  # base's preset is replaced per run; an FP8 one may carry shadow_every
    # a bad option, data folder or existing comparison is one error line from main(), before anything trains
    base = dataclasses.replace(DEFAULT_CONFIG, **{k: v for k, v in fields.items() if v is not None})
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    summary = compare(presets, base=base, out=args.out)
    common.print_table(summary_table(summary))
    for line in table_note(summary):
        common.console.print(line, highlight=False)
    for path in summary["files"].values():
        common.console.print(f"wrote {path}")
    return 0


def summary_table(summary: dict) -> Table:
    """The table of a compare summary (as `compare` returns it), one row per preset. Its headers take two lines
    (spelled out by table_note) and no cell wraps, so that a row is one line and the table fits 80 columns with a
    GPU's tokens/s (tests/test_cli_output.py)."""
    from minifloat.amp.policy import PRESETS

    config = summary["config"]
    t = Table(title=f"{config['model']} · {config['steps']} steps · batch {config['batch_size']} × "
                    f"{config['seq_len']} · seed {config['seed']}")
    for header in COLUMNS:
        t.add_column(header, justify="left" if header == "preset" else "right", no_wrap=True)
    for name, m in summary["presets"].items():
        shadowed = config["shadow_every"] and PRESETS[name].recipe is not None
        t.add_row(name, f"{m['final_train_loss']:.4f}", f"{m['final_val_loss']:.4f}",
                  f"{m['rel_diff_vs_bf16']:+.2%}", f"{m['tokens_per_s']:,.0f}", str(m["skipped_steps"]),
                  str(m["fallbacks"]) if shadowed else "-")
    return t


def table_note(summary: dict) -> list[str]:
    """The lines under summary_table, each within 80 columns: what the headers mean, and how many warm-up steps
    tok/s leaves out."""
    excluded = sorted({m["warmup_steps_excluded"] for m in summary["presets"].values()})
    if excluded == [0]:
        speed = "tok/s: training tokens per second, over every step."
    else:
        n = str(excluded[0]) if len(excluded) == 1 else f"{excluded[0]}-{excluded[-1]}"
        first = "step" if n == "1" else f"{n} steps"
        speed = f"tok/s: training tokens per second after the first {first} (warm-up)."
    return ["train / val loss: the final training / validation loss.",
            "Δ vs bf16: the val loss relative to bf16's.",
            speed,
            "skipped steps: steps the guard skipped.",
            "fallbacks: FP8 -> BF16 switches of the shadow check (- where it is off)."]


HELP = "train under several presets and compare loss curves and numerics with BF16"  # its line in `minifloat --help`


def add_parser(sub) -> None:
    from minifloat.training.compare import DEFAULT_CONFIG, DEFAULT_PRESETS

    c = sub.add_parser("compare", help=HELP, description=cmd_compare.__doc__)
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
    c.add_argument("--device", default=None,
                   help=f"auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N "
                        f"(default {DEFAULT_CONFIG.device})")
    c.add_argument("--overwrite", action="store_true",
                   help="replace an earlier comparison in OUT (only the files the comparison and its runs wrote)")
    c.set_defaults(func=cmd_compare)
