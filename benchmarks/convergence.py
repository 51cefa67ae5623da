"""FP8 vs BF16 convergence of the reference Llama on the Python standard library, over one or more seeds.

For each seed this runs `minifloat.training.compare.compare` (every preset trains the same model, on the same
data, from the same initial weights) into OUT/seed<N>/ (summary.json, loss_curves.png, numerics_heatmap.png),
then prints and writes a table of the final validation loss's relative difference to BF16 per preset: per seed, the mean over seeds,
and whether the mean meets a 1% band and DeepSeek-V3's 0.25% (arXiv:2412.19437 §3.3), with tokens/s per preset
(FP8 here is emulated on the CPU, so tokens/s measures the emulation, not FP8 hardware).

Usage:
    python benchmarks/convergence.py                                       # 10.7M-parameter model; about 2 hours
    python benchmarks/convergence.py --model tiny --steps 50 --seeds 0     # smoke run, a minute
    python benchmarks/convergence.py --json docs/bench_convergence_10m.json --markdown out.md
    python benchmarks/convergence.py --throughput-steps 30                 # tokens/s per preset, a few minutes

This is a measurement: nothing here is asserted. The same-machine baseline is the BF16 run of each seed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import platform
import shlex
import statistics
import sys
import time

import torch

from minifloat.training.compare import BASELINE, DEEPSEEK_V3_PCT, DEFAULT_PRESETS, RANGE_BAND_PCT, compare
from minifloat.training.loop import TrainConfig, train
from minifloat.training.rundir import RunExistsError

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

WARMUP_STEPS = 5  # the first steps compile the quantization kernels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="10m", help="model size: tiny, small, 10m, 100m (default 10m)")
    p.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma list of presets (bf16 is the baseline)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per run (default 600)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per batch (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (default 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate; the cosine floor is lr/10 (1e-3)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up steps (default 50)")
    p.add_argument("--seeds", default="0", help="comma list of seeds (default 0)")
    p.add_argument("--eval-batches", type=int, default=32, help="validation batches at the end (default 32)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus bytes, train + val (default 4e6)")
    p.add_argument("--out", default="runs/convergence", help="output folder (default runs/convergence)")
    p.add_argument("--reuse", action="store_true",
                   help="take each preset's run that already finished in OUT/seed<N>/<preset> with the same config "
                        "instead of training it again (compare(reuse=True)): resume an interrupted benchmark, or "
                        "gather presets trained in separate processes")
    p.add_argument("--throughput-steps", type=int, default=0, metavar="N",
                   help="instead of the convergence runs: train each preset N steps (seed 0), one after another, and "
                        "report the median tokens/s of the steps after the first 5 (compilation), as a ratio to BF16")
    p.add_argument("--compile", action="store_true",
                   help="with --throughput-steps: also run every preset under torch.compile (TrainConfig.compile), "
                        "rows '<preset> compiled', with ratios to BF16 eager and to BF16 compiled")
    p.add_argument("--json", default="", help="write the results as JSON to this path")
    p.add_argument("--markdown", default="", help="write the table as Markdown to this path")
    machine.add_overwrite(p)
    args = p.parse_args(argv)
    machine.keep_existing(p, args, "json", "markdown")
    if args.throughput_steps:  # its runs go to OUT/throughput/<preset>; compare() checks the seed folders itself
        names = [f"{q.strip()}{suffix}" for suffix in (("", "-compiled") if args.compile else ("",))
                 for q in ([BASELINE] + args.presets.split(",")) if q.strip()]
        machine.keep_runs(p, args, [pathlib.Path(args.out) / "throughput" / n for n in names])
    return args


def table(presets: list[str], seeds: list[int], summaries: dict[int, dict]) -> tuple[list[str], dict]:
    """Markdown rows and the aggregated numbers (relative differences in %)."""
    agg = {}
    head = ["preset"] + [f"seed {s} val loss" for s in seeds] + [f"seed {s} vs bf16" for s in seeds]
    head += ["mean vs bf16", f"≤ {RANGE_BAND_PCT:g}%", f"≤ {DEEPSEEK_V3_PCT}%", "tokens/s", "skipped", "fallbacks"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for p in presets:
        ms = [summaries[s]["presets"][p] for s in seeds]
        rel = [100 * m["rel_diff_vs_bf16"] for m in ms]
        mean = statistics.fmean(rel)
        tps = statistics.fmean(m["tokens_per_s"] for m in ms)
        skipped = sum(m["skipped_steps"] for m in ms)
        fallbacks = sum(m["fallbacks"] for m in ms)
        agg[p] = {"val_loss": [m["final_val_loss"] for m in ms], "rel_diff_pct": rel, "mean_rel_diff_pct": mean,
                  "tokens_per_s": tps, "skipped_steps": skipped, "fallbacks": fallbacks}
        base = p == BASELINE
        cells = [p] + [f"{m['final_val_loss']:.4f}" for m in ms] + [("—" if base else f"{r:+.2f}%") for r in rel]
        cells += ["—" if base else f"{mean:+.2f}%",
                  "—" if base else ("yes" if abs(mean) <= RANGE_BAND_PCT else "no"),
                  "—" if base else ("yes" if abs(mean) <= DEEPSEEK_V3_PCT else "no"),
                  f"{tps:,.0f}", str(skipped), str(fallbacks)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows, agg


def throughput(presets: list[str], base: TrainConfig, steps: int, out: pathlib.Path,
               compiled: bool = False) -> tuple[list[str], dict]:
    """Median per-step tokens/s of each preset over `steps` steps after WARMUP_STEPS, as Markdown rows and numbers;
    with `compiled`, each preset also under torch.compile."""
    agg = {}
    for compile_ in (False, True) if compiled else (False,):
        for p in presets:
            name = f"{p} compiled" if compile_ else p
            config = dataclasses.replace(base, preset=p, steps=steps, eval_every=steps, eval_batches=1,
                                         out=str(out / "throughput" / name.replace(" ", "-")), checkpoint_every=0,
                                         compile=compile_)
            train(config, progress=False)
            with open(pathlib.Path(config.out) / "log.csv", newline="") as f:
                rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f)][WARMUP_STEPS:]
            agg[name] = {"tokens_per_s": statistics.median(rates)}
    rows = ["| preset | tokens/s | × bf16 | × bf16 compiled |", "|---|---:|---:|---:|"]
    for name, m in agg.items():
        m["vs_bf16"] = m["tokens_per_s"] / agg[BASELINE]["tokens_per_s"]
        same = agg.get(f"{BASELINE} compiled") if name.endswith(" compiled") else None
        m["vs_bf16_compiled"] = m["tokens_per_s"] / same["tokens_per_s"] if same else None
        rows.append(f"| {name} | {m['tokens_per_s']:,.0f} | {m['vs_bf16']:.2f} | "
                    f"{'-' if same is None else format(m['vs_bf16_compiled'], '.2f')} |")
    return rows, agg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if BASELINE not in presets:
        presets.insert(0, BASELINE)
    seeds = [int(s) for s in args.seeds.split(",")]
    base = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                       lr=args.lr, min_lr=args.lr / 10, warmup=args.warmup, eval_every=args.steps,
                       eval_batches=args.eval_batches, max_bytes=args.max_bytes, checkpoint_every=0,
                       overwrite=args.overwrite)
    out = pathlib.Path(args.out)
    summaries, started = {}, time.perf_counter()
    if args.throughput_steps:
        rows, agg = throughput(presets, base, args.throughput_steps, out, compiled=args.compile)
        seeds = [base.seed]
    else:
        for seed in seeds:
            try:
                summaries[seed] = compare(presets, base=dataclasses.replace(base, seed=seed),
                                          out=out / f"seed{seed}", reuse=args.reuse)
            except RunExistsError as e:  # raised before that seed trains anything: earlier runs stay as they were
                print(f"convergence.py: error: {e}", file=sys.stderr)
                return 2
        rows, agg = table(presets, seeds, summaries)
    text = "\n".join(rows)
    print(text)
    meta = {"command": "python benchmarks/convergence.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "config": {k: v for k, v in base.flat().items() if k not in ("preset", "out", "seed")},
            "seeds": seeds, "machine": {"processor": platform.processor() or platform.machine(),
                                        "threads": torch.get_num_threads(), "torch": torch.__version__,
                                        "python": platform.python_version()},
            "wall_s": time.perf_counter() - started, "presets": agg}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(meta, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
