"""Optional torch.compile for minifloat's elementwise kernels, with an eager fallback.

Quantization is memory-bound: eager PyTorch spends one pass over the data per op (scale, clamp, round, convert),
a compiled kernel spends one pass in all. Compilation needs a C++ compiler on CPU and Triton on GPU; where either is
missing or compiling fails, the same Python function runs eagerly (same results, slower) and a warning says so once.
Under a torch dispatch mode (FlopCounterMode, a profiler's or debugger's mode), which dynamo cannot trace, a call runs
eagerly without giving up compiling for later calls. Set MINIFLOAT_COMPILE=0 to force eager execution.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Callable, Iterator, TypeVar

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from minifloat.core.switch import ThreadSwitch

log = logging.getLogger("minifloat")
F = TypeVar("F", bound=Callable)
# one kernel is traced once per (dtype, format, output set, scale shape) combination; allow enough of them
_RECOMPILE_LIMIT = 64
# Below this many elements in its largest tensor argument a kernel runs eagerly: a compiled call costs ~0.5 ms of
# guards and dispatch on a CPU, more than the eager ops on a small tensor (per-token activations while generating,
# small layers). The results are the same bits either way (tests/test_quantize.py, tests/test_fp4_numerics.py).
EAGER_BELOW = 1 << 15


_EAGER = ThreadSwitch()  # on inside eager_kernels(), for the calling thread only

# Whether inductor's C++ code rounds every float operation on its own, as eager code does: it is compiled with
# -ffp-contract=off (no multiply and add fused into an FMA) and without unsafe math (no re-association) unless these
# are set. Read from the environment, as inductor reads them (a compiled trace cannot read inductor's config object).
CPU_UNSAFE_MATH = os.environ.get("TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG", "0") == "1"
CPU_KERNELS_ROUND_EACH_OP = (
    os.environ.get("TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG", "off") == "off" and not CPU_UNSAFE_MATH)


@functools.cache
def _env_allows_compile() -> bool:
    return os.environ.get("MINIFLOAT_COMPILE", "1").lower() not in ("0", "false", "no", "off")


def compile_enabled() -> bool:
    return _env_allows_compile() and not _EAGER


@contextlib.contextmanager
def eager_kernels() -> Iterator[None]:
    """Run minifloat's kernels eagerly inside the block (this thread only): in unit tests that should not pay
    compile time. (Under a torch dispatch mode, which dynamo cannot trace, they run eagerly on their own.) Results are
    the same either way."""
    with _EAGER.on():
        yield


def maybe_compile(fn: F) -> F:
    """Wrap `fn` so that it runs compiled (dynamic shapes) when possible and eagerly otherwise."""
    compiled = None
    broken = False
    # enough recompiles for every (dtype, format, output set, scale shape), scoped to this kernel's calls; made once,
    # on the first compiled call (building the patch per call cost as much as a small kernel; building it at import
    # loaded torch's compiler with `import minifloat`)
    limit = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled, broken, limit
        if torch.compiler.is_compiling() or broken or not compile_enabled() or _largest(args) < EAGER_BELOW:
            return fn(*args, **kwargs)  # inside a compiled graph: inlined
        if is_in_torch_dispatch_mode():  # a caller's FlopCounterMode, profiler or audit: dynamo cannot trace under
            return fn(*args, **kwargs)  # it; this call runs eagerly, later ones compile as before
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            limit = torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT)
        try:
            with torch.no_grad(), limit:
                return compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to the identical eager function
            broken = True
            log.warning("minifloat: compiling %s failed (%s: %s); running it eagerly from now on",
                        fn.__name__, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return fn(*args, **kwargs)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _largest(args: tuple) -> int:
    """The element count of the largest tensor among `args`."""
    return max((a.numel() for a in args if isinstance(a, torch.Tensor)), default=0)


@torch.library.custom_op("minifloat::transposed_copy", mutates_args=(), schema="(Tensor x) -> Tensor")
def transposed_copy(x: torch.Tensor) -> torch.Tensor:
    """xᵀ of a 2-D tensor as a contiguous copy, made by an op compiled graphs do not fuse through.

    For re-quantizing a tensor along its other axis inside a compiled graph: inductor (torch 2.13) fuses a row-wise
    block reduction and a down-the-columns one over the same tensor into one kernel it then fails to lower.
    """
    return x.t().contiguous()


@transposed_copy.register_fake
def _transposed_copy_shape(x):
    return x.new_empty((x.shape[1], x.shape[0]))


def graph_operand(t: torch.Tensor) -> torch.Tensor:
    """A 2-D GEMM operand as a compiled graph hands it to minifloat's GEMM ops: as it is in eager mode, and when it or
    its transpose is contiguous (the layout eager mode passes, which the GEMM's bits depend on), else a contiguous
    copy. An MX operand cut from its padded blocks, saved for backward as such a strided view, had its stride fixed
    at the batch size it was traced at by torch 2.13's dynamic-shape backward (inductor's assert_size_stride failed
    at a third batch size)."""
    if not torch.compiler.is_compiling() or t.is_contiguous() or t.t().is_contiguous():
        return t
    return t.contiguous()
