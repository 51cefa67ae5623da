"""Low-precision AdamW states on the 10.7M-parameter Llama: final validation loss, optimizer bytes per parameter and
step time of each (m, v) format pair against torch's fp32 AdamW, same seed, data and steps.

    python benchmarks/optimizer_states.py --json docs/bench_optimizer_states_10m.json

The run is docs/benchmarks.md's 10m table (600 steps of 16 × 128 bytes, lr 1e-3 → 1e-4, warm-up 50, 4 MB corpus)
under the bf16 preset: the optimizer state does not depend on the GEMMs' precision. Bytes per parameter are measured
after one real step (minifloat.training.memory: every tensor the optimizer holds, over all parameters, so the
fp32-by-rule tensors — norms, embeddings, small ones — are in the average). tokens/s comes from the training runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from minifloat.training.loop import TrainConfig, train
from minifloat.training.memory import measure

# (m, v) pairs: fp32 baseline; ≤ 2 B/param candidates; ≤ 1 B/param candidates (4-bit v)
PAIRS = ("fp32,fp32", "bf16,bf16", "e4m3,bf16", "e4m3,e5m2", "int8,int8-dynamic", "int8-dynamic,int8-dynamic",
         "int8-dynamic,int4", "int4,int4")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="", help="semicolon list of M,V pairs, e.g. 'fp32,fp32;e4m3,bf16' (default: all)")
    p.add_argument("--model", default="10m")
    p.add_argument("--preset", default="bf16")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/optimizer_states", help="folder of the runs (one sub-folder per pair)")
    p.add_argument("--json", default="", help="write the results to this JSON file")
    args = p.parse_args()
    pairs = [s.strip() for s in args.pairs.split(";") if s.strip()] or list(PAIRS)

    rows = {}
    for pair in pairs:
        config = TrainConfig(model=args.model, preset=args.preset, steps=args.steps, batch_size=16, seq_len=128,
                             lr=1e-3, min_lr=1e-4, warmup=50, eval_every=args.steps, eval_batches=32,
                             max_bytes=4_000_000, checkpoint_every=0, seed=args.seed, optimizer_state=pair,
                             out=f"{args.out}/{pair.replace(',', '_')}-s{args.seed}", overwrite=True, device="cpu")
        footprint = measure(config)
        result = train(config, progress=False)
        rows[pair] = {"val_loss": result.val_losses[-1][1] if result.val_losses else float("nan"),
                      "bytes_per_param": footprint.footprint.optimizer_state / footprint.params,
                      "tokens_per_s": result.tokens_per_s, "skipped": len(result.skipped)}
        print(pair, rows[pair], flush=True)

    base = rows.get("fp32,fp32", {}).get("val_loss")
    print(f"\n{args.model} Llama, {args.steps} steps, preset {args.preset}, seed {args.seed}; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'m,v':<28} {'B/param':>8} {'val loss':>9} {'vs fp32':>8} {'tok/s':>7}")
    for pair, r in rows.items():
        diff = (r["val_loss"] - base) / base if base else float("nan")
        r["rel_diff_vs_fp32"] = diff
        print(f"{pair:<28} {r['bytes_per_param']:>8.3f} {r['val_loss']:>9.4f} {diff:>+8.2%} {r['tokens_per_s']:>7,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
