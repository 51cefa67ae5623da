"""Kernel launches of one FP8 layer's training step on the native path, counted on any machine.

A GPU step pays a launch (and its host work) per op; small models are bound by that, not by FLOPs. This counts, for
one bias-free Fp8Linear (--tokens x --dim, bfloat16 autocast) under each recipe, the ops of one forward+backward and
of the FP8 step's end, as the native (GPU) path issues them:
  * the GEMM backend is made "native" on this machine (the casts keep FP8 data, the GEMM is a stand-in);
  * torch ops are counted by a dispatch mode (views, allocations and aliasing excluded: they launch nothing);
  * minifloat's Triton kernels (minifloat.numerics.triton_cast, triton_blocks, triton_rows) count a launch each; with --triton they run in
    Triton's interpreter (TRITON_INTERPRET=1, on the CPU), without it the torch path runs instead: the counts before
    the one-pass kernels.
minifloat's small kernels run eagerly here (eager_kernels): on a GPU, tensors above EAGER_BELOW elements run a
compiled kernel instead of several eager ops, so the --no-triton counts are an upper bound for large tensors.

With --host-time N the native path's host work is timed as well: N steps per recipe with every Triton launch doing
nothing (the interpreter's run stubbed out after a real warm-up), the median against nn.Linear's step. On a CPU the
torch ops left are tiny CPU kernels, so this is Python, dispatcher and allocation time: a proxy for what a GPU's host
pays per layer, without the launches' own cost.

--siblings N (3 by default) also counts N layers reading one input, as a block's q, k and v do, with their input's
cast shared (minifloat.fp8.shared_input) and not.

Usage:
    python benchmarks/launches.py              # torch path
    TRITON_INTERPRET=1 python benchmarks/launches.py --triton
    TRITON_INTERPRET=1 python benchmarks/launches.py --triton --host-time 300
No numbers here are asserted anywhere: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minifloat as mf
from minifloat.fp8 import caster, gemm
from minifloat.fp8.step import fp8_step
from minifloat.numerics import triton_blocks, triton_cast, triton_rows
from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.granularity import Granularity

RECIPES = {"delayed": mf.DelayedScaling(), "current": mf.CurrentScaling(),
           "row": mf.CurrentScaling(granularity="row"), "block": mf.BlockScaling()}
NO_LAUNCH = {"aten.view.default", "aten.detach.default", "aten.select.int", "aten.t.default", "aten.view.dtype",
             "aten._reshape_alias.default", "aten.expand.default", "aten.alias.default", "aten.as_strided.default",
             "aten.unsqueeze.default", "aten.squeeze.dim", "aten.reshape.default", "aten.transpose.int",
             "aten.slice.Tensor", "aten.empty.memory_format", "aten.new_empty.default", "aten.empty_like.default",
             "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset", "aten.lift_fresh.default",
             "aten._unsafe_view.default"}
# inside minifloat's Triton wrappers only these launch a kernel on a GPU (Triton's interpreter adds copies of its own)
FILLS = {"aten.zeros.default", "aten.zero_.default", "aten.fill_.Scalar", "aten.full.default"}
_inside = [0]
_launches: collections.Counter = collections.Counter()


class CountOps(TorchDispatchMode):
    """Counts the torch ops that launch a kernel, outside minifloat's Triton kernels."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _inside[0] and str(func) not in NO_LAUNCH:
            self.ops[str(func)] += 1
        elif _inside[0] and str(func) in FILLS:  # a zero-filled buffer a Triton kernel accumulates into
            _launches["zero fills"] += 1
        return func(*args, **(kwargs or {}))


def _count_triton(name: str, module=triton_cast, launches: int = 1) -> None:
    real = getattr(module, name)

    def counted(*args, **kwargs):
        _launches[name] += launches
        _inside[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            _inside[0] -= 1

    setattr(module, name, counted)


def native_everywhere(set_attr=setattr, count: bool = True) -> None:
    """The native path's decisions on this machine, with a stand-in for torch._scaled_mm (`set_attr`: a test passes
    pytest's monkeypatch.setattr, which undoes it); with `count`, minifloat's Triton kernels count their launches."""
    native = (Granularity.TENSOR, Granularity.ROW, Granularity.TILE, Granularity.BLOCK)  # Hopper's pairings
    set_attr(caster, "native_granularity", lambda device, g, backend=None: Granularity.parse(g) in native)
    set_attr(gemm, "native_support", lambda a, b, out_dtype=None, **kw: None)
    set_attr(gemm, "native_writes", lambda a, b, out_dtype: True)  # Hopper with CUDA 12.9+: every output dtype
    set_attr(gemm, "native_mm", lambda a, b, out_dtype, bias=None, fast_accum=False: torch.zeros(
        a.shape[0], b.shape[0], dtype=out_dtype, device=a.data.device))
    if not count:
        return
    for name in ("fused_cast", "tensor_amax", "fold_amax"):
        _count_triton(name)
    _count_triton("block_cast", triton_blocks)
    _count_triton("row_col_cast", triton_rows, launches=2)  # an amax pass and a cast pass


def _train_step(layer: torch.nn.Module, tokens: int, dim: int):
    def train_step():
        x = torch.randn(tokens, dim, requires_grad=True)
        with eager_kernels(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        with eager_kernels():
            y.backward(torch.ones_like(y))

    return train_step


def count(recipe, tokens: int, dim: int, layers: int) -> dict:
    layer = mf.Fp8Linear(dim, dim, recipe=recipe, bias=False)
    train_step = _train_step(layer, tokens, dim)
    for _ in range(2):  # seeded delayed scales, cached weight casts: the steady state
        train_step()
        fp8_step(layer)
    _launches.clear()
    with CountOps() as step_ops:
        train_step()
    triton = sum(_launches.values())
    with CountOps() as end_ops:
        fp8_step(layer)
    kernels = dict(_launches)
    model = torch.nn.Sequential(*[mf.Fp8Linear(dim, dim, recipe=recipe, bias=False) for _ in range(layers)])
    for _ in range(2):  # 16 tokens: the step end does not depend on them
        model(torch.randn(16, dim)).sum().backward()
        fp8_step(model)
    with CountOps() as model_end_ops:  # all layers' states advance together
        fp8_step(model)
    return {"torch_ops": sum(step_ops.ops.values()), "triton_launches": triton,
            "total": sum(step_ops.ops.values()) + triton, "step_end_ops": sum(end_ops.ops.values()),
            "model_step_end_ops": sum(model_end_ops.ops.values()),
            "triton_kernels": kernels, "ops": dict(step_ops.ops.most_common())}


class Siblings(torch.nn.Module):
    """n FP8 layers reading one input, summed (q, k and v's pattern: minifloat.fp8.shared_input)."""

    def __init__(self, recipe, dim: int, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(mf.Fp8Linear(dim, dim, recipe=recipe, bias=False) for _ in range(n))

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


CPU_ONLY = "aten._local_scalar_dense.default"  # the CPU's non-finite check reads each recorded amax; a GPU skips it


def count_siblings(recipe, tokens: int, dim: int, n: int) -> dict:
    """Launches of one forward+backward of n sibling layers with their input's cast shared and not, after warm-up,
    without the CPU-only reads (what a GPU launches)."""
    from minifloat.fp8 import shared_input

    model = Siblings(recipe, dim, n)
    train_step = _train_step(model, tokens, dim)
    out = {}
    for setting in ("unshared", "shared"):
        with shared_input.unshared() if setting == "unshared" else contextlib.nullcontext():
            for _ in range(2):
                train_step()
                fp8_step(model)
            _launches.clear()
            with CountOps() as ops:
                train_step()
            out[setting] = sum(ops.ops.values()) - ops.ops[CPU_ONLY] + sum(_launches.values())
            out[f"{setting}_triton"] = dict(_launches)
            fp8_step(model)
    return out


def host_time(layer: torch.nn.Module, tokens: int, dim: int, steps: int) -> float:
    """Median wall time (µs) of one training step of `layer` (forward, backward and, for an FP8 layer, the FP8 step's
    end) with every Triton kernel a launch that does nothing: the host work of the native path. The warm-up runs
    the kernels (in the interpreter), so the scales are seeded from real values."""
    from triton.runtime import interpreter

    train_step = _train_step(layer, tokens, dim)
    fp8 = isinstance(layer, mf.Fp8Linear)
    for _ in range(3):
        train_step()
        if fp8:
            fp8_step(layer)
    real = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            train_step()
            if fp8:
                fp8_step(layer)
            times.append(time.perf_counter() - start)
    finally:
        interpreter.InterpretedFunction.run = real
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--triton", action="store_true", help="run the Triton kernels (needs TRITON_INTERPRET=1 "
                                                              "on a CPU)")
    parser.add_argument("--layers", type=int, default=24, help="layers of the model whose FP8 step end is counted")
    parser.add_argument("--verbose", action="store_true", help="list the ops")
    parser.add_argument("--siblings", type=int, default=3, help="also count N layers reading one input (q, k, v: "
                                                                  "3), their input's cast shared and not; 0: skip")
    parser.add_argument("--host-time", type=int, default=0, metavar="STEPS",
                        help="also time STEPS steps per recipe with the Triton kernels' launches doing nothing (with "
                             "--triton in the interpreter): the host work per layer step, against nn.Linear's")
    args = parser.parse_args()
    if args.triton and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--triton on a CPU needs TRITON_INTERPRET=1 in the environment")
    if args.host_time and (not args.triton or torch.cuda.is_available()):
        parser.error("--host-time needs --triton on a CPU (TRITON_INTERPRET=1): it stubs the interpreter's launches")
    if not args.triton:
        os.environ.pop("TRITON_INTERPRET", None)
    native_everywhere()
    if args.host_time:
        base = host_time(torch.nn.Linear(args.dim, args.dim, bias=False), args.tokens, args.dim, args.host_time)
        print(f"{'nn.Linear':8s} host time per step: {base:7.0f} µs (bfloat16 autocast, for comparison)")
    for name, recipe in RECIPES.items():
        c = count(recipe, args.tokens, args.dim, args.layers)
        print(f"{name:8s} fwd+bwd: {c['total']:4d} launches ({c['torch_ops']} torch ops + {c['triton_launches']} "
              f"Triton {c['triton_kernels']}); FP8 step end: {c['step_end_ops']} ops, of {args.layers} layers "
              f"{c['model_step_end_ops']}")
        if args.verbose:
            print("   ", c["ops"])
        if args.host_time:
            us = host_time(mf.Fp8Linear(args.dim, args.dim, recipe=recipe, bias=False), args.tokens, args.dim,
                           args.host_time)
            print(f"{'':8s} host time per step: {us:7.0f} µs ({us / base:.2f}× nn.Linear)")
        if args.siblings:
            c = count_siblings(recipe, args.tokens, args.dim, args.siblings)
            print(f"{'':8s} {args.siblings} siblings reading one input, fwd+bwd on a GPU (the CPU's reads left out): "
                  f"{c['unshared']} launches unshared {c['unshared_triton']}, {c['shared']} shared "
                  f"{c['shared_triton']}")


if __name__ == "__main__":
    main()
