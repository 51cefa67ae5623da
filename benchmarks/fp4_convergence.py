"""4-bit training on the 10.7M-parameter Llama: NVFP4 with and without each of its fixes, and MXFP4, against BF16.

The setup is docs/benchmarks.md's FP8 table (600 steps of 16 × 128 bytes, lr 1e-3 → 1e-4 with 50 warm-up steps,
4 MB of the standard library, 32 validation batches at the end). Each variant is a TrainConfig: a preset plus the
overrides `minifloat train` exposes (--nvfp4-weight-2d/-rht/-stochastic-rounding on|off, --keep-blocks, --bf16-tail),
so every row can be repeated from the command line.

    python benchmarks/fp4_convergence.py --seeds 0 --variants bf16,nvfp4 --out /tmp/fp4   # train (resumable)
    python benchmarks/fp4_convergence.py --seeds 0,1 --out /tmp/fp4 --report --json docs/bench_fp4_10m.json
    python benchmarks/fp4_convergence.py --throughput-steps 30                             # step time vs FP8

Training runs one variant after another in this process (one torch thread each unless --threads): start several
processes on disjoint --variants to use more cores. A variant whose run folder already holds a finished run with the
same config is not trained again. --report only reads the run folders and prints the table: final validation loss
per seed, its difference to BF16's on the same seed, the mean, and issue 13's bands (1.5% for the full NVFP4 recipe,
0.5% with the late BF16 switch). --throughput-steps measures tokens/s of bf16, fp8-current (the FP8 tensorwise step)
and the 4-bit variants one after another in this process, as ratios. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

from minifloat.training.loop import TrainConfig, train  # noqa: E402

BASELINE = "bf16"
FULL_BAND_PCT = 1.5  # issue 13: the full NVFP4 recipe within 1.5% of BF16's final validation loss
LATE_BAND_PCT = 0.5  # ... and within 0.5% with the late switch to BF16
LATE_FRACTION = 0.2  # NVIDIA switched to BF16 at 8.2T of 10T tokens (arXiv 2509.25149 Appendix D): the last ~18%
WARMUP_STEPS = 5  # the first steps compile the quantization kernels

# name -> (TrainConfig overrides, what it tests)
VARIANTS: dict[str, tuple[dict, str]] = {
    "bf16": (dict(preset="bf16"), "baseline"),
    "nvfp4": (dict(preset="nvfp4"), "full recipe: 16×16 weights, RHT on wgrad, SR on gradients, last block BF16"),
    "nvfp4-late": (dict(preset="nvfp4", bf16_tail=LATE_FRACTION), f"full recipe, last {LATE_FRACTION:.0%} of steps BF16"),
    "nvfp4-no-rht": (dict(preset="nvfp4", nvfp4_rht=False), "without the random Hadamard transform"),
    "nvfp4-no-sr": (dict(preset="nvfp4", nvfp4_stochastic_rounding=False), "gradients rounded to nearest"),
    "nvfp4-1x16": (dict(preset="nvfp4", nvfp4_weight_2d=False), "1×16 weight blocks (W and Wᵀ rounded apart)"),
    "nvfp4-all-blocks": (dict(preset="nvfp4", keep_blocks="0,0"), "no transformer block kept in BF16"),
    "mxfp4": (dict(preset="mxfp4"), "MXFP4: 32-blocks, E8M0 scales, round to nearest, last block BF16"),
}
THROUGHPUT = ("bf16", "fp8-current", "nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "mxfp4")


def config(variant: str, seed: int, out: pathlib.Path, *, steps: int = 600, model: str = "10m",
           overwrite: bool = False) -> TrainConfig:
    overrides = VARIANTS[variant][0] if variant in VARIANTS else dict(preset=variant)
    return TrainConfig(model=model, steps=steps, batch_size=16, seq_len=128, lr=1e-3, min_lr=1e-4, warmup=50,
                       eval_every=steps, eval_batches=32, max_bytes=4_000_000, checkpoint_every=0, seed=seed,
                       out=str(out / f"seed{seed}" / variant), overwrite=overwrite, device="cpu", **overrides)


def finished(cfg: TrainConfig) -> dict | None:
    """The finished run in cfg.out with cfg's settings: {val_loss, tokens_per_s, skipped}; None otherwise."""
    folder = pathlib.Path(cfg.out)
    try:
        saved = json.loads((folder / "run.json").read_text())
        with open(folder / "val.csv", newline="") as f:
            val = [r for r in csv.DictReader(f)]
        with open(folder / "log.csv", newline="") as f:
            log = [r for r in csv.DictReader(f)]
    except (OSError, ValueError):
        return None
    want = {k: v for k, v in json.loads(json.dumps(cfg.flat())).items() if k not in ("overwrite",)}
    got = saved.get("config", {})
    if any(got.get(k) != v for k, v in want.items()) or not val or int(val[-1]["step"]) != cfg.steps:
        return None
    rates = [float(r["tokens_per_s"]) for r in log[WARMUP_STEPS:] if r.get("tokens_per_s")]
    return {"val_loss": float(val[-1]["val_loss"]), "tokens_per_s": statistics.median(rates) if rates else None,
            "skipped": sum(1 for r in log if r.get("skipped") not in ("", "0", None))}


def report(variants: list[str], seeds: list[int], out: pathlib.Path) -> dict:
    rows = {}
    for v in variants:
        rows[v] = {s: finished(config(v, s, out)) for s in seeds}
    base_runs = {s: finished(config(BASELINE, s, out)) for s in seeds}  # the same-seed BF16 run of each seed
    print(f"\n10m Llama, 600 steps; {machine.line()}")
    print(f"{'variant':<18}" + "".join(f"{'seed ' + str(s):>10}{'vs bf16':>9}" for s in seeds) + f"{'mean':>9}")
    for v, by_seed in rows.items():
        line, rel = f"{v:<18}", []
        for s in seeds:
            r, base = by_seed[s], base_runs[s]
            if r is None:
                line += f"{'—':>10}{'':>9}"
                continue
            d = (r["val_loss"] / base["val_loss"] - 1) * 100 if base else float("nan")
            r["vs_bf16_pct"] = d
            rel.append(d)
            line += f"{r['val_loss']:>10.4f}{d:>+8.2f}%"
        mean = statistics.fmean(rel) if rel and v != BASELINE else float("nan")
        print(line + (f"{mean:>+8.2f}%" if rel and v != BASELINE else ""))
        skips = {s: r["skipped"] for s, r in by_seed.items() if r is not None and r["skipped"]}
        if skips:
            print(f"{'':<18}steps skipped by the guard: " + ", ".join(f"seed {s}: {n}" for s, n in skips.items()))
        rows[v] = {"seeds": {str(s): r for s, r in by_seed.items()}, "mean_vs_bf16_pct": mean,
                   "what": VARIANTS[v][1]}
    return rows


def throughput(steps: int, out: pathlib.Path, rounds: int = 1) -> dict:
    """tokens/s of each THROUGHPUT variant over `steps` steps (median after WARMUP_STEPS), one after another; with
    `rounds` > 1 the whole sequence repeats and each variant keeps the median of its rounds (slow drifts of the
    machine then reach every variant alike)."""
    per_round: dict[str, list[float]] = {v: [] for v in THROUGHPUT}
    for _ in range(rounds):
        for v in THROUGHPUT:
            # main checked the folders before the first round; later rounds replace this invocation's own runs
            cfg = dataclasses.replace(config(v, 0, out / "throughput", steps=steps, overwrite=True), eval_every=10**6,
                                      eval_batches=1)
            train(cfg, progress=False)
            with open(pathlib.Path(cfg.out) / "log.csv", newline="") as f:
                rates = [float(r["tokens_per_s"]) for r in csv.DictReader(f)][WARMUP_STEPS:]
            per_round[v].append(statistics.median(rates))
    result = {v: {"tokens_per_s": statistics.median(r), "rounds": r} for v, r in per_round.items()}
    base, fp8 = result["bf16"]["tokens_per_s"], result["fp8-current"]["tokens_per_s"]
    print(f"\n10m Llama, {steps} steps each, {rounds} round(s); {machine.line()}")
    print(f"{'variant':<16}{'tokens/s':>10}{'× bf16':>8}{'step ÷ fp8-current':>20}")
    for v, r in result.items():
        r["vs_bf16"], r["step_vs_fp8_current"] = r["tokens_per_s"] / base, fp8 / r["tokens_per_s"]
        print(f"{v:<16}{r['tokens_per_s']:>10,.0f}{r['vs_bf16']:>8.2f}{r['step_vs_fp8_current']:>20.2f}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--seeds", default="0", help="comma list of seeds (default 0)")
    p.add_argument("--out", default="runs/fp4_convergence", help="folder of the runs (OUT/seed<N>/<variant>)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--report", action="store_true", help="only read the finished runs and print the table")
    p.add_argument("--throughput-steps", type=int, default=0, metavar="N",
                   help="instead: tokens/s of bf16, fp8-current and the 4-bit variants over N steps each")
    p.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="with --throughput-steps: repeat the sequence R times, median per variant (default 1)")
    p.add_argument("--json", default="", help="write the results as JSON to this path")
    machine.add_overwrite(p)
    args = p.parse_args()
    machine.keep_existing(p, args, "json")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = pathlib.Path(args.out)
    torch.set_num_threads(args.threads)
    if args.throughput_steps:
        machine.keep_runs(p, args, [config(v, 0, out / "throughput").out for v in THROUGHPUT])
        result = {"throughput": throughput(args.throughput_steps, out, args.rounds)}
    else:
        if not args.report:  # a run finished with the same settings is kept and read; any other is trained anew
            todo = [cfg for seed in seeds for v in variants
                    if finished(cfg := config(v, seed, out, overwrite=args.overwrite)) is None]
            machine.keep_runs(p, args, [cfg.out for cfg in todo])
            for cfg in todo:
                print(f"training {pathlib.Path(cfg.out).name} seed {cfg.seed} -> {cfg.out}", flush=True)
                train(cfg, progress=False)
        result = {"rows": report(variants, seeds, out)}
    result["machine"] = machine.describe()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
