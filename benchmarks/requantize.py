"""The backward's re-quantization of a saved FP8 input along the token axis, on the torch path (every CPU).

Per row, 1×128 tile and MX scales do not transpose, so the weight gradient's operand xᵀ is a new cast of the saved FP8
x along its other axis. Two ways, same bits (tests/test_requantize_from_bytes.py), timed interleaved in one process:

    dequantized   q.dequantize() written out (float32, or bfloat16 for folded power-of-two scales), then
                  quantize_t: its column amaxes and its cast each read the written values (the route before)
    from bytes    requantize_t: for float32 scales (rows, tiles without power_of_two) the column amax pass and the
                  cast pass each compute the values from the FP8 bytes; folded scales (pow2 tiles, MX) take the
                  dequantized route there too, so their two columns measure the same work (a check on the noise)

Both make the emulated wgrad's bfloat16 operand (keep_data=False), as Fp8Linear's backward does.

Usage:
    python benchmarks/requantize.py [--reps 20] [--json out.json]
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

from minifloat.numerics.other_axis import quantize_t, requantize_t
from minifloat.numerics.quantize import quantize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

CASES = [("row", False), ("tile", False), ("tile", True), ("mx", True)]  # (granularity, power_of_two)
SHAPES = [(2048, 1024), (2048, 4096)]  # (tokens, features): the step-time benchmark's layer inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    machine.add_overwrite(parser)
    args = parser.parse_args()
    machine.keep_existing(parser, args, "json")
    rows = []
    for shape in SHAPES:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        for granularity, power_of_two in CASES:
            q = quantize(x, "e4m3", granularity=granularity, power_of_two=power_of_two)
            options = dict(power_of_two=power_of_two, operand_dtype=torch.bfloat16, keep_data=False)
            source = torch.bfloat16 if q.scale_folded else torch.float32
            ways = {"dequantized": lambda: quantize_t(q.dequantize(source), q.fmt, granularity=q.granularity,
                                                      **options),
                    "from bytes": lambda: requantize_t(q, **options)}
            times = {name: [] for name in ways}
            for fn in ways.values():  # compile both first
                fn(), fn()
            for _ in range(args.reps):
                for name, fn in ways.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            old, new = (statistics.median(times[name]) * 1e3 for name in ways)
            rows.append(dict(shape=list(shape), granularity=granularity, power_of_two=power_of_two,
                             dequantized_ms=old, from_bytes_ms=new, speedup=old / new))
            print(f"{shape[0]}x{shape[1]:<5d} {granularity:4s} {'pow2' if power_of_two else 'f32 '}  dequantized "
                  f"{old:7.2f} ms  from bytes {new:7.2f} ms  x{old / new:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/requantize.py", "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
