"""Amaxes down the columns on a CPU: one compiled reduction against minifloat's two-stage one, interleaved in one
process.

Row scaling's cast along the token axis needs the amax of every column of an (M, K) tensor, 128×1 tiles that of every
128 rows of a column, MX blocks every 32. Inductor compiles a reduction over a dim that is not the last into a loop
down each strip of columns, one cache line per row; `minifloat.numerics.quantize.abs_max` ("minifloat") reduces
chunks of rows first (read as streams), then the rest, from 2^23 elements (smaller tensors stay in cache, and it runs
the one-stage reduction there: that column then measures its call overhead). Both give the same maxima (checked here,
and in tests/test_quantize.py).

Usage:
    python benchmarks/column_amax.py [--reps 20] [--json out.json]
No numbers here are asserted anywhere: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from minifloat.numerics.quantize import abs_max

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

SHAPES = [(2048, 1024), (2048, 4096), (4096, 1024)]  # (tokens, features): the step-time benchmark's tensors
VIEWS = {"columns": None, "128x1 tiles": 128, "mx 32x1": 32}  # rows per block down the columns (None: all of them)


def one_stage(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(-2, keepdim=True).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    machine.add_overwrite(parser)
    args = parser.parse_args()
    machine.keep_existing(parser, args, "json")
    plain = torch.compile(one_stage, dynamic=True)
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k).to(torch.bfloat16)
        for name, block in VIEWS.items():
            view = x if block is None else x.view(m // block, block, k)
            assert torch.equal(plain(view), abs_max(view, -2))
            times = {"one stage": [], "minifloat": []}
            for _ in range(args.reps):  # interleaved: the machine's drift hits both alike
                for label, fn in (("one stage", lambda: plain(view)), ("minifloat", lambda: abs_max(view, -2))):
                    start = time.perf_counter()
                    fn()
                    times[label].append(time.perf_counter() - start)
            ms = {label: 1e3 * statistics.median(t) for label, t in times.items()}
            rows.append({"shape": [m, k], "blocks": name, **ms, "speedup": ms["one stage"] / ms["minifloat"]})
            print(f"{m}x{k:<5} {name:<12} one stage {ms['one stage']:6.2f} ms   minifloat {ms['minifloat']:6.2f} ms"
                  f"   {rows[-1]['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
