"""Peak memory of one linear layer's training step on the native (GPU) path, accounted on any machine.

benchmarks/gpu.py's `linear` section measures torch.cuda.max_memory_allocated of one nn.Linear(K, N, bias=False)
forward and backward (fp32 weight and input under bfloat16 autocast). This script replays that step on the CPU with
the native path's decisions (benchmarks/launches.py: the casts keep FP8 data, the GEMM is a stand-in allocating its
output) and minifloat's Triton kernels allocating their outputs without running (their launches stubbed after a
real warm-up in Triton's interpreter), and follows every tensor storage the step creates: a dispatch mode adds each
new output storage, a weak reference drops it when it is freed. The peak of live bytes is what a GPU's allocator
would be asked for at once, less what a kernel allocates inside itself (cuBLAS workspace) and the allocator's
rounding. It scales with the shape, so a small --dim predicts 8192³ (the "at 8192" column multiplies by
(8192/dim)²). Where the peak falls and which tensors are live there is printed per recipe.

Usage:
    TRITON_INTERPRET=1 python benchmarks/peak_memory.py [--dim 256] [--recipes bf16,delayed,current,row]
No numbers here are asserted anywhere except the regression bound of tests/test_bench_peak_memory.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import minifloat as mf
from minifloat.fp8.step import fp8_step
from minifloat.numerics.compiling import eager_kernels

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import launches  # noqa: E402 - benchmarks/launches.py
import machine  # noqa: E402 - benchmarks/machine.py

MIB = 2**20
RECIPES = {"bf16": None, **launches.RECIPES}


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive at each op, from `base` (tensors made before) and every op's outputs; the
    peak and, at the peak, each live storage's bytes and the op (with its index in the step) that made it."""

    def __init__(self, base: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.ops = 0
        self.peak, self.at_peak = 0, []
        for t in base:
            self._add(t, "before the step")

    def _add(self, t: torch.Tensor, made_by: str) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in self.live:
            self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(), made_by)

    def bytes_now(self) -> int:
        self.live = {ptr: v for ptr, v in self.live.items() if not v[0].expired()}
        return sum(v[1] for v in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, f"#{self.ops} {func}")
        self.ops += 1
        now = self.bytes_now()
        if now > self.peak:
            self.peak = now
            self.at_peak = sorted(((v[1], v[2]) for v in self.live.values()), reverse=True)
        return out


def linear_step(recipe, dim: int):
    """gpu.py's linear step at (dim tokens) × dim × dim: (step function, tensors made before the step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim, bias=False))
    if recipe is not None:
        model = mf.convert(model, recipe=recipe, keep_first_last=False)
    x = torch.randn(dim, dim, requires_grad=True)
    grad_y = torch.randn(dim, dim)

    def step():
        with eager_kernels(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        with eager_kernels():
            y.backward(grad_y.to(y.dtype))
        fp8_step(model)
        x.grad = None
        model.zero_grad(set_to_none=True)
        return y.detach()

    return step, [x, grad_y, *model.parameters()]


def peak(recipe, dim: int) -> LiveBytes:
    """The live-bytes account of one steady-state step (after three warm-up steps that run the kernels)."""
    step, base = linear_step(recipe, dim)
    for _ in range(3):
        step()
    from triton.runtime import interpreter

    real = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None  # allocations only
    try:
        with LiveBytes(base) as account:
            step()
    finally:
        interpreter.InterpretedFunction.run = real
    return account


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256, help="tokens = K = N (default 256)")
    parser.add_argument("--recipes", default="bf16,delayed,current,row",
                        help=f"comma list of {', '.join(RECIPES)} (block runs slowly in the interpreter)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    machine.add_overwrite(parser)
    args = parser.parse_args()
    machine.keep_existing(parser, args, "json")
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}")
    if os.environ.get("TRITON_INTERPRET") != "1" or args.dim < 16 or args.dim % 16:
        parser.error("needs TRITON_INTERPRET=1 in the environment (the Triton kernels' allocations) and --dim a "
                     "multiple of 16")
    launches.native_everywhere(count=False)
    print(f"{machine.line()}\none linear, {args.dim} tokens × {args.dim} × {args.dim}, fp32 weight and input, "
          f"bfloat16 autocast, native path (stand-in GEMMs)")
    rows, scale = [], (8192 / args.dim) ** 2
    for name in ["bf16", *[n for n in names if n != "bf16"]]:
        account = peak(RECIPES[name], args.dim)
        rows.append({"recipe": name, "peak_mib": account.peak / MIB, "at_8192_gib": account.peak * scale / 2**30,
                     "live_at_peak": [[b, what] for b, what in account.at_peak]})
        ratio = account.peak / (rows[0]["peak_mib"] * MIB)
        print(f"{name:8s} peak {account.peak / MIB:8.2f} MiB ({ratio:.3f}× bf16; at 8192³ "
              f"{rows[-1]['at_8192_gib']:.2f} GiB)")
        for nbytes, what in account.at_peak:
            if nbytes >= args.dim * args.dim // 2:
                print(f"{'':10s}{nbytes / MIB:7.2f} MiB  {what}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine.describe(),
                                                       "dim": args.dim, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
