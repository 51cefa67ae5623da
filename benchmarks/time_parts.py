"""Where a profiled step's time goes, in the parts an FP8 step differs by: FP8 GEMMs, other GEMMs, minifloat's casts,
attention, the optimizer, compiled (inductor) kernels and the rest.

benchmarks/gpu.py --profile adds each run's split to its JSON ("time_by_part_ms", per step), so that a GPU run says at
once how much of a variant's step is GEMMs, casts, attention or the optimizer, and what FP8 saved or added beside
bf16's row. On a GPU every kernel counts its own duration. It is classified by its own name first:
  * minifloat's Triton kernels (numerics.triton_cast, triton_rows, triton_blocks) are casts and amax passes;
  * inductor's Triton kernels are compiled regions, where casts fuse with their neighbours.
Otherwise the CPU ops it was launched under decide, innermost first:
  * `aten::_scaled_mm` gives FP8 GEMMs;
  * mm, addmm and bmm give other GEMMs (bf16, and the fp32 head's TF32);
  * an op whose name says attention (SDPA's flash, memory-efficient and cuDNN kernels);
  * `Optimizer.step`, which also ends the FP8 step (delayed scales, histories).
On a CPU the ops themselves are the work: each op's self CPU time is classified by the same rules. The FP8 casts
there are the torch path, compiled by inductor or run as eager ops.
"""

from __future__ import annotations

from typing import Iterable, Sequence

FP8_GEMM, OTHER_GEMM, CASTS, ATTENTION, OPTIMIZER, COMPILED, OTHER = (
    "FP8 GEMMs", "other GEMMs", "minifloat casts", "attention", "optimizer", "compiled (inductor)", "other")
PARTS = (FP8_GEMM, OTHER_GEMM, CASTS, ATTENTION, OPTIMIZER, COMPILED, OTHER)
# the Python functions behind minifloat's triton.jit kernels: a kernel carries its function's name
MINIFLOAT_KERNELS = frozenset({"_cast_kernel_fn", "_amax_fn", "_fold_amax_fn", "_amax_kernel_fn", "_block_kernel_fn"})
HIGH_PRECISION_GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"})
COMPILED_PREFIXES = ("triton_", "## Call CompiledFxGraph", "cpp_fused")


def part_of(name: str, ops: Sequence[str]) -> str:
    """The part a kernel (or a CPU op's own time) named `name` belongs to, launched under the CPU ops `ops`
    (innermost first)."""
    if name in MINIFLOAT_KERNELS:
        return CASTS
    if name.startswith(COMPILED_PREFIXES):
        return COMPILED
    for op in ops:
        if op == "aten::_scaled_mm":
            return FP8_GEMM
        if op in HIGH_PRECISION_GEMMS:
            return OTHER_GEMM
        if "attention" in op.lower():
            return ATTENTION
        if op.startswith("Optimizer.step"):
            return OPTIMIZER
        if op.startswith(COMPILED_PREFIXES) or op.startswith("Torch-Compiled Region"):
            return COMPILED
    return OTHER


def _ancestry(event) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def time_by_part(events: Iterable, on_device: bool, steps: int) -> dict[str, float]:
    """Milliseconds per step of each part, from a finished torch.profiler run's `events()`: the kernels' durations
    under their CPU ops (`on_device`), else each CPU op's self CPU time. Parts with no time are left out."""
    totals = dict.fromkeys(PARTS, 0.0)
    for event in events:
        if event.device_type.name != "CPU":
            continue
        ancestry = _ancestry(event)
        if on_device:
            for kernel in event.kernels:
                totals[part_of(kernel.name, ancestry)] += kernel.duration
        else:
            totals[part_of(event.name, ancestry)] += event.self_cpu_time_total
    return {part: us / 1e3 / steps for part, us in totals.items() if us > 0}
