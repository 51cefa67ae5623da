"""The CPU's compiled E4M3 cast: torch's float8 conversion as the rounding against the float arithmetic route,
interleaved in one process.

On a CPU an E4M3 cast rounds with torch's own float8 conversion, which inductor's C++ code vectorizes; before, it
rounded with float arithmetic that finds each value's binade (`minifloat.numerics.rounding`, ~20 vector operations
per element). Both give the same bits (checked here on every run, and in tests/test_rounding_routes.py). Each call is
what a training step's cast runs: FP8 bytes, a bfloat16 operand and the tensor's amax in one pass.

Usage:
    python benchmarks/cast_routes.py [--reps 8] [--json out.json [--overwrite]]
No numbers here are asserted anywhere: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import types

import torch

from minifloat.numerics import quantize as kernels
from minifloat.numerics import rounding
from minifloat.numerics.compiling import maybe_compile

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import machine  # noqa: E402 - benchmarks/machine.py

# (rows, cols, dtype): the step-time benchmark's activations and output gradients (bfloat16) and weights (float32)
SHAPES = [(2048, 1024, torch.bfloat16), (2048, 4096, torch.bfloat16), (4096, 1024, torch.float32)]
ROUTES = ("arithmetic", "conversion")
WARM, CALLS = 2, 10  # calls per route and repetition: untimed (the first compiles), then timed together


def arithmetic_kernel():
    """The cast kernel as it was before the conversion route: the same code with the route switched off in its own
    globals, compiled as a function of its own (a code object of its own: dynamo caches the two apart)."""
    scope = dict(vars(kernels))
    scope["round_saturated"] = lambda y, fmt: (rounding.round_to_grid(y, fmt), None)
    code = kernels._cast_kernel.__code__
    return types.FunctionType(code.replace(co_name="_cast_kernel_arithmetic"), scope, "_cast_kernel_arithmetic")


def calls(x: torch.Tensor) -> dict:
    scale = torch.tensor(448.0) / x.abs().amax().float()
    args = (x, scale, "e4m3", torch.float8_e4m3fn, torch.bfloat16, scale.reciprocal(), True)
    arithmetic = maybe_compile(arithmetic_kernel())
    return {"arithmetic": lambda: arithmetic(*args), "conversion": lambda: kernels._cast_kernel_compiled(*args)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--json", help="write the results here (an existing file is kept unless --overwrite)")
    machine.add_overwrite(parser)
    args = parser.parse_args()
    machine.keep_existing(parser, args, "json")
    rows = []
    print(machine.line())
    for m, k, dtype in SHAPES:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(dtype)
        routes = calls(x)
        times = {name: [] for name in ROUTES}
        outputs = {}
        for rep in range(args.reps + 2):  # interleaved: the machine's drift hits both alike; two warm-ups
            for name in ROUTES:
                call = routes[name]
                for _ in range(WARM):  # traced (and compiled, the first time) outside the timing
                    out = call()
                start = time.perf_counter()
                for _ in range(CALLS):
                    call()
                elapsed = (time.perf_counter() - start) / CALLS
                if rep >= 2:
                    times[name].append(elapsed * 1e3)
                outputs[name] = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in out]
        same = all(torch.equal(a, b) for a, b in zip(*outputs.values()))
        assert same, f"the routes differ on {m}×{k} {dtype}"
        medians = {name: statistics.median(v) for name, v in times.items()}
        rows.append({"shape": [m, k], "dtype": str(dtype).removeprefix("torch."), "ms": medians,
                     "speedup": medians["arithmetic"] / medians["conversion"], "same_bits": same})
        print(f"{m}×{k} {rows[-1]['dtype']:>8}: arithmetic {medians['arithmetic']:6.2f} ms, conversion "
              f"{medians['conversion']:6.2f} ms, {rows[-1]['speedup']:.2f}×, same bits")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
