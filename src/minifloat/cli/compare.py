"""`minifloat compare`."""

from __future__ import annotations

import argparse
import math

from rich.table import Table

from minifloat.cli import common

# headers in two lines where one would widen the table past 80 columns (table_note spells them out)
COLUMNS = ("preset", "train\nloss", "val\nloss", "Δ vs\nbf16", "skipped\nsteps", "fallbacks")
SPEED_COLUMNS = ("preset", "tok/s", "speed-up\nvs bf16", "MFU", "peak\nmemory")
def settings() -> tuple[str, ...]:
    """The TrainConfig settings compare takes as flags (the same flags as `minifloat train`'s): those its reproducing
    command line restates (minifloat.training.compare.COMMAND_SETTINGS), and --device; --presets, --out and
    --overwrite are its own."""
    from minifloat.training.compare import COMMAND_SETTINGS

    return (*COMMAND_SETTINGS, "device")


def base_config(args: argparse.Namespace):
    """The run every preset shares: the device's defaults (minifloat.training.compare.default_config) with the
    flags given on top; without --seq-len, the default is cut to the model's context."""
    import dataclasses

    from minifloat.cli.train import given_settings
    from minifloat.training.compare import default_config
    from minifloat.training.model import SIZES

    base = default_config(args.device or "auto")
    fields = given_settings(args, settings())
    if args.overwrite:
        fields["overwrite"] = True
    if args.shadow_every or fields.get("fp8_layers", "all") != "all":
        fields["preset"] = "fp8-delayed"  # base's preset is replaced per run; an FP8 one may carry these
    if "seq_len" not in fields and fields.get("model") in SIZES:
        fields["seq_len"] = min(base.seq_len, SIZES[fields["model"]].max_seq_len)
    if "lr" in fields and "min_lr" not in fields:
        fields["min_lr"] = fields["lr"] / 10  # as `minifloat train`: the cosine floor follows a given lr
    return dataclasses.replace(base, **fields)


def cmd_compare(args: argparse.Namespace) -> int:
    """Train the reference Llama once per precision preset (same seed, data, model and steps; each into OUT/<preset>)
    and compare them against BF16 (added when not listed). Prints two tables: the losses (final training and
    validation loss, the difference to BF16, skipped steps, shadow fallbacks) and the speed (tokens/s, speed-up over
    BF16, MFU against the GPU's dense BF16 peak, peak GPU memory). Writes OUT/summary.json, OUT/loss_curves.png (the
    training loss; each preset's per-step difference to BF16 over the last quarter; its smoothed difference over the
    run against the band of step-to-step noise and DeepSeek-V3's 0.25%) and OUT/numerics_heatmap.png (per-layer SQNR
    of every FP8 cast after training). On a CPU the defaults train the tiny model in about three minutes on 2
    cores; on a CUDA GPU they are the seed's experiment at GPU scale: the 1b model, 300 steps of 8 × 2048 tokens.
    With --shadow-every the FP8 presets run the shadow check and the table counts their fallbacks to BF16; tok/s
    leaves out each run's warm-up steps (compilation). An OUT holding an earlier comparison is refused unless
    --overwrite, or --reuse: a preset whose run finished there with the same settings is read back instead of
    trained again, and one a signal stopped resumes from its checkpoint (after an interrupted compare, or to add
    presets one command at a time). SIGTERM / Ctrl-C stop the preset training after its current step, with a
    checkpoint, and the comparison with it (exit status 128 + the signal's number). Exits with status 2 on an
    invalid option."""
    import signal

    from minifloat.training.compare import ComparisonStopped, compare

    # a bad option, data folder or existing comparison is one error line from main(), before anything trains
    base = base_config(args)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    try:
        summary = compare(presets, base=base, out=args.out, reuse=args.reuse)
    except ComparisonStopped as stop:
        common.console.print(str(stop), highlight=False)
        return 128 + getattr(signal, stop.result.stopped_by).value
    common.print_table(summary_table(summary))
    common.print_table(speed_table(summary))
    for line in table_note(summary):
        common.console.print(line, highlight=False)
    for path in summary["files"].values():
        common.console.print(f"wrote {path}")
    if stale := earlier_runs(args.out, summary["presets"]):
        common.console.print(f"{args.out} also holds runs of presets not in this comparison, left as they were: "
                             f"{', '.join(stale)}", highlight=False)
    return 0


def earlier_runs(out: str, presets) -> list[str]:
    """The preset folders in `out` that hold a run (an earlier comparison's, e.g. before --overwrite with fewer
    presets) but are not among `presets`."""
    import pathlib

    from minifloat.amp.policy import PRESETS
    from minifloat.training.rundir import run_items

    return [p for p in PRESETS if p not in presets and run_items(pathlib.Path(out) / p)]


def summary_table(summary: dict) -> Table:
    """The losses of a compare summary (as `compare` returns it), one row per preset. Its headers take two lines
    (spelled out by table_note) and no cell wraps, so that a row is one line and the table fits 80 columns
    (tests/test_cli_output.py)."""
    from minifloat.amp.policy import PRESETS

    config = summary["config"]
    t = Table(title=f"{config['model']} · {config['steps']} steps · batch {config['batch_size']} × "
                    f"{config['seq_len']} · seed {config['seed']}")
    for header in COLUMNS:
        t.add_column(header, justify="left" if header == "preset" else "right", no_wrap=True)
    for name, m in summary["presets"].items():
        shadowed = config["shadow_every"] and PRESETS[name].recipe is not None
        t.add_row(name, f"{m['final_train_loss']:.4f}", f"{m['final_val_loss']:.4f}",
                  f"{m['rel_diff_vs_bf16']:+.2%}", str(m["skipped_steps"]),
                  str(m["fallbacks"]) if shadowed else "-")
    return t


def speed_table(summary: dict) -> Table:
    """The speed of each preset: tokens/s, speed-up over BF16, MFU and peak memory ("-" where a CPU has none)."""
    t = Table(title=f"speed on {summary.get('device', 'this device')}")
    for header in SPEED_COLUMNS:
        t.add_column(header, justify="left" if header == "preset" else "right", no_wrap=True)
    for name, m in summary["presets"].items():
        mfu, memory = m.get("mfu"), m.get("peak_memory_gib")
        t.add_row(name, f"{m['tokens_per_s']:,.0f}", f"{m.get('speedup_vs_bf16', math.nan):.2f}×",
                  "-" if mfu is None else f"{mfu:.1%}", "-" if memory is None else f"{memory:.1f} GiB")
    return t


def table_note(summary: dict) -> list[str]:
    """The lines under the tables, each within 80 columns: what the headers mean, and how many warm-up steps
    tok/s leaves out."""
    excluded = sorted({m["warmup_steps_excluded"] for m in summary["presets"].values()})
    if excluded == [0]:
        speed = "tok/s: training tokens per second, over every step."
    else:
        n = str(excluded[0]) if len(excluded) == 1 else f"{excluded[0]}-{excluded[-1]}"
        first = "step" if n == "1" else f"{n} steps"
        speed = f"tok/s: training tokens per second after the first {first} (warm-up)."
    lines = ["train / val loss: the final training / validation loss.",
             "Δ vs bf16: the val loss relative to bf16's.",
             "skipped steps: steps the guard skipped.",
             "fallbacks: FP8 -> BF16 switches of the shadow check (- where it is off).",
             speed,
             "MFU: model FLOPs / s over the GPU's dense BF16 peak (FP8 presets too).",
             "peak memory: the most GPU memory held in tensors during the run."]
    layers = summary["config"].get("fp8_layers", "all")
    if layers != "all":  # the presets' rows hide how much of each ran in low precision
        counts = ", ".join(f"{name} {m['low_precision_layers']}" for name, m in summary["presets"].items()
                           if name != "bf16" and "low_precision_layers" in m)
        lines.append(f"--fp8-layers {layers}: low-precision linears per preset: {counts}.")
    return lines


# settings whose `minifloat train` help speaks of what compare does not do (resume a run, shapes on meta)
HELPS = {"steps": "optimizer steps each preset trains",
         "tokenizer": "tokenizer.json of Hugging Face tokenizers that turns the --data text into tokens; the model's "
                      "vocabulary is the tokenizer's (default: bytes, 256 ids; token shards name their own)",
         "device": "auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N"}
HELP = "train under several presets and compare loss curves, speed and numerics with BF16"  # in `minifloat --help`


def add_parser(sub) -> None:
    from minifloat.cli.train import add_settings
    from minifloat.training.compare import DEFAULT_CONFIG, DEFAULT_PRESETS, GPU_SETTINGS

    c = sub.add_parser("compare", help=HELP, description=cmd_compare.__doc__)
    c.add_argument("--presets", default=",".join(DEFAULT_PRESETS),
                   help=f"comma list of precision presets; bf16 is added as the baseline when missing "
                        f"(default {','.join(DEFAULT_PRESETS)})")
    c.add_argument("--out", default="runs/compare", type=common.path_arg, help="output folder (default runs/compare)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace an earlier comparison in OUT (only the files the comparison and its runs wrote)")
    c.add_argument("--reuse", action="store_true",
                   help="read back each preset whose run finished in OUT with the same settings instead of training "
                        "it again, and resume those a signal stopped; the others train (the tables and plots are "
                        "written anew). Settings of how a call runs (--device, --compile, ...) may differ")
    on_gpu = {name: f"; on CUDA {'none' if value is None else value}" for name, value in GPU_SETTINGS.items()}
    add_settings(c, settings(), defaults=DEFAULT_CONFIG, extra_help=on_gpu, helps=HELPS)
    c.set_defaults(func=cmd_compare)
