"""A native GEMM rule minifloat has not yet run on a GPU of its generation is checked on each device before use.

`NATIVE_RULES` (minifloat.fp8.native) marks such rules `verified=False`: MXFP8 and NVFP4 on Blackwell, whose
kernels, scale dtypes, element packing and swizzled scale layout were written from cuBLASLt's and torch's
documentation, not yet seen on the hardware.
Before a device takes one, `passes` multiplies a test product with it natively and compares it with the exact
emulation. The product is built so that a misread scale layout shows: rows beyond the first tile of 128, K blocks
whose scales differ by up to 2^10, and shapes padded in both scale dimensions. If torch refuses the product or the
results differ by more than the native kernels' own rounding (`TOLERANCE`), the rule is off on that device: its
products run emulated, exactly, and one warning says why.

`passes` is evaluated once per (rule, device) and, inside a compiled region, as a constant (no guard: a graph
traced before the check is not recompiled by it).
"""

from __future__ import annotations

import logging

import torch

from minifloat.numerics.formats import E4M3
from minifloat.numerics.fp4 import quantize_nvfp4
from minifloat.numerics.granularity import Granularity
from minifloat.numerics.quantize import quantize

log = logging.getLogger("minifloat")

# |native - emulated| / max|emulated| a correct kernel stays within: two bfloat16 roundings (the native kernel rounds
# its fp32 accumulator once, the emulation may round it and then scale) and the accumulation order. A misplaced
# scale gives errors of order 1 (the test product's scales differ by factors up to 2^10).
TOLERANCE = 2.0**-6
# (M, K, N) of the test product: M and N pad to 256 rows of scales (K: 16 scales per row, the common case)
SHAPE = (200, 512, 144)
OUT_DTYPES = (torch.bfloat16, torch.float32)  # what an FP8 layer asks of the native GEMM (fp32: a bias added after)

_RESULTS: dict[tuple[str, int], bool] = {}


@torch._dynamo.assume_constant_result
def passes(pair: str, device_index: int) -> bool:
    """Whether the native rule for `pair` ("mx × mx", "nvfp4 × nvfp4") gives the emulation's results on
    cuda:`device_index`."""
    key = (pair, device_index)
    if key not in _RESULTS:
        _RESULTS[key] = False  # while it runs (its own products never ask: they call the kernel directly)
        problem = check(pair, torch.device("cuda", device_index))
        _RESULTS[key] = problem is None
        if problem is not None:
            log.warning("minifloat: the native %s GEMM on cuda:%d is off (%s); those products run emulated, exactly",
                        pair, device_index, problem)
    return _RESULTS[key]


def probe_operands(pair: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The check's (M, K) and (N, K) high-precision operands: deterministic, with scales that vary along K and
    across rows, so that each scale's place in the layout matters."""
    m, k, n = SHAPE
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen) * torch.logspace(-4, 4, k // 32, base=2.0).repeat_interleave(32)
    a = a * torch.logspace(-3, 3, m, base=2.0)[:, None]
    b = torch.randn(n, k, generator=gen) * torch.logspace(3, -3, k // 32, base=2.0).repeat_interleave(32)
    b = b * torch.logspace(2, -2, n, base=2.0)[:, None]
    return a.to(device), b.to(device)


def check(pair: str, device: torch.device) -> str | None:
    """None when the native GEMM of `pair` matches the emulation on `device`, else what went wrong (one line)."""
    from minifloat.fp8.fourbit.gemm import native_product  # (these import minifloat.fp8.native, which imports
    from minifloat.fp8.gemm import scaled_mm  # this module)
    from minifloat.fp8.native import NVFP4_PAIR, native_mm

    a, b = probe_operands(pair, device)
    if pair == NVFP4_PAIR:
        qa, qb = (quantize_nvfp4(t, operand_dtype=None, keep_data=True) for t in (a, b))

        def native(out_dtype):
            return native_product(qa, qb, out_dtype)

        def emulated(out_dtype):
            return scaled_mm(qa.gemm_operand(), qb.gemm_operand(), out_dtype=out_dtype, backend="emulated")
    else:
        granularities = [Granularity.parse(g) for g in pair.split(" × ")]
        qa, qb = (quantize(t, E4M3, granularity=g, operand_dtype=None, keep_data=True)
                  for t, g in zip((a, b), granularities))

        def native(out_dtype):
            return native_mm(qa, qb, out_dtype)

        def emulated(out_dtype):
            return scaled_mm(qa, qb, out_dtype=out_dtype, backend="emulated")
    for out_dtype in OUT_DTYPES:
        try:
            got = native(out_dtype).float()
        except (RuntimeError, ValueError, TypeError) as exc:
            return f"torch._scaled_mm raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        want = emulated(out_dtype).float()
        err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
        if not err <= TOLERANCE:  # NaN fails too
            return (f"{str(out_dtype).replace('torch.', '')} output {err:.3g} from the emulation, relative to its "
                    f"largest value (allowed {TOLERANCE:.3g})")
    return None
