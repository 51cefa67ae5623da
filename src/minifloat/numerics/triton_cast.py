"""One-pass FP8 casts on a GPU: scale, round, store row-major and/or transposed, take the amax: one Triton kernel.

An FP8 linear layer needs each 2-D tensor in two layouts: x (M, K) row-major for one GEMM and xᵀ (K, M) row-major for
another (torch._scaled_mm takes its first operand row-major and its second column-major). Cast and transpose as
separate steps read the high-precision tensor once and the FP8 one again (`.contiguous()`: a third of the GPU time of
an FP8 layer's step before this kernel); here one program loads a (BLOCK_M, BLOCK_K) tile once and writes both.

    y    = clamp(x · qscale, ±fmt.max)          qscale: one per tensor, per row or per column (its strides say which)
    data = round_to_grid(y)                      written as (M, K) and/or (K, M), either or both
    amax = max |x|                               optional; per tensor, NaN propagates

The rounding is `minifloat.numerics.rounding.round_to_grid`, in the kernel's own arithmetic: ulp = 2^(max(e, emin) -
mbits) from y's exponent bits, |y|·2^-k rounded to an integer by adding and subtracting 1.5·2^23 (round-half-to-even
in float32's default rounding mode, exact for |v| < 2^22), the sign put back bit for bit. Every step is exact, so the
result is the CPU emulation's, bit for bit, with or without FMA contraction. Only exactly representable values reach
the FP8 conversion, so no conversion rounds (Triton's interpreter rounds inexact values wrongly near powers of two).

The amax is the maximum of |x|'s float32 bit patterns as int32 (for non-negative floats integer order is value order,
and every NaN pattern lies above +inf), taken per tile and merged with an integer atomic max: NaN propagates, as
torch's amax does.

The multipliers come in computed (delayed scaling: from the stored scale) or are computed in the kernel from the
amaxes by `scale_from_amax`'s rule, bit for bit (current scaling: `tensor_amax` takes the amax in one pass first;
per-row amaxes come from one compiled reduction). A per-tensor cast given a ScalingState's slot (`record`) also
records its amax there in the same launch: each program merges its tile's amax into a scratch word and takes a ticket,
and the program that finishes last folds the total into the history (or counts it as non-finite) and zeroes the
scratch (`_record_fn`). `fold_amax` records any other cast's amaxes (rows, tiles) in one launch.
Per FP8 layer and training step (fwd+bwd) the launches fell from 129 to 16 (delayed), 160 to 17 (current) and 263
to 29 (row scaling): benchmarks/launches.py counts them on any machine (docs/benchmarks.md has the history).

`quantize` calls `fused_cast` for 2-D tensors cast per tensor (or per row with given scales; per row and per column
from their amaxes, minifloat.numerics.triton_rows' two passes) to FP8 data without a bfloat16 operand, on CUDA when
Triton imports (the native GEMM path) and `self_check` found the kernels give the torch path's bits on that device
(else one warning, and the torch path). How a launch is tiled: minifloat.numerics.triton_tiles. Under
torch.compile they do not run: the graph's own ops are left to inductor, which fuses them itself. The kernels are
built on first use, so TRITON_INTERPRET=1 set before then runs them on CPU tensors (tests/test_triton_cast.py).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch

from minifloat.numerics import triton_tiles
from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.formats import NumberFormat

_MAGIC = 12582912.0  # 1.5 · 2^23: v + MAGIC - MAGIC rounds |v| < 2^22 to an integer, ties to even
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
log = logging.getLogger("minifloat")


@functools.cache
def _triton():
    """The triton module, or None where it does not import."""
    try:
        import triton  # noqa: F401 - optional: shipped with CUDA builds of torch
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Triton kernels
        return None
    return triton


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(x: torch.Tensor) -> bool:
    """Whether `fused_cast` can run on `x` here: a CUDA tensor with Triton, or any tensor in the interpreter; on a
    GPU only once `self_check` passed there. Tensors of 2^31 elements or more, or whose elements lie 2^31 or more
    apart, take the torch path: the kernels address inputs and outputs with int32 offsets (a view of few elements
    with far-apart rows, such as a column slice of a large fused tensor, read outside the tensor)."""
    if torch.compiler.is_compiling() or _CHECKING or (not x.is_cuda and not interpreted()):
        return False
    if max(span(x), x.numel()) >= MAX_ELEMENTS:
        return False
    if _triton() is None:
        return False
    return self_check(x.device) if x.is_cuda else True


MAX_ELEMENTS = 2**31  # int32 element offsets in every kernel


def span(x: torch.Tensor) -> int:
    """1 + the largest element offset of `x` from its first element, in elements (its numel when contiguous)."""
    if x.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride()))
_CHECKING: list = []  # non-empty while self_check runs: quantize then takes the torch path, the reference
_CHECKED: dict[str, bool] = {}  # per device: did the kernels give the torch path's bits?


def self_check(device: torch.device) -> bool:
    """Run the kernels once on `device` against the torch path (ties, subnormals, saturating and non-finite values;
    both formats; scales given and from amaxes; rows, columns, 1×128 tiles both ways and from FP8, 128×128 blocks;
    a recorded amax). If any fails to compile (a Triton without an op used), raises, or differs by a bit, they are
    not used on that device and one warning says why: the torch path gives the same results, more slowly."""
    key = str(device)
    if key not in _CHECKED:
        problem = None
        _CHECKED[key] = True  # the check's own casts take the kernels
        try:
            from minifloat.numerics import triton_selfcheck  # (it imports this module)

            for name, cast in triton_selfcheck.checks(device):
                _CHECKING.append(1)
                try:
                    with eager_kernels():  # the torch path's eager kernels: its bits, without compiling each
                        expected = cast()
                finally:
                    _CHECKING.pop()
                if not triton_selfcheck.same(expected, cast()):
                    problem = f"{name} differs from the torch path's"
                    break
            if problem is None and not triton_selfcheck.folds_as_torch_does(device):
                problem = "recording an amax differs from the torch path's"
        except Exception as err:  # noqa: BLE001 - any failure: the torch path instead
            problem = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        _CHECKED[key] = problem is None
        if problem is not None:
            log.warning("minifloat: the one-pass Triton casts are off on %s (%s); casts run as compiled torch ops",
                        key, problem)
    return _CHECKED[key]


def takes(x: torch.Tensor, storage: torch.dtype | None, operand_dtype: torch.dtype | None, unblocked: bool) -> bool:
    """Whether `quantize` casts `x` here: FP8 data (`storage`) of a 2-D tensor scaled per tensor, row or column
    (`unblocked`), no bfloat16 operand, where `available`."""
    return (x.dim() == 2 and x.numel() > 0 and operand_dtype is None and storage in _FP8 and unblocked
            and available(x))


tl = None  # triton.language, bound by _kernel() where the kernels are built
_larger = _scale = _code = _record = None  # _larger_fn, _scale_fn, _code_fn and _record_fn once compiled by triton.jit


@functools.cache
def _kernel():
    """The Triton kernel, built on first use, so TRITON_INTERPRET is read then, not at import. Its helpers are module
    globals (the kernel's source resolves names there; the interpreter runs tl's own library functions such as tl.max
    only when TRITON_INTERPRET was set before triton's import, hence the combine function of our own)."""
    global tl, _larger, _scale, _code, _record
    triton = _triton()
    tl = triton.language
    # the interpreter reduces with numpy where the combine function is tl's own maximum, and calls any other one
    # element by element (most of the suite's time in the Triton tests); every reduction here takes amax bit patterns
    # or values without NaN, where numpy's nanmax is the maximum. For a GPU the kernels keep _larger_fn, the same
    # tl.maximum as tl's own combine
    _larger = getattr(tl.standard, "_elementwise_max", None) if interpreted() else None
    _larger = _larger or triton.jit(_larger_fn)
    _scale = triton.jit(_scale_fn)
    _code = triton.jit(_code_fn)
    _record = triton.jit(_record_fn)
    return triton.jit(_cast_kernel_fn)


def _larger_fn(a, b):
    return tl.maximum(a, b)


def _scale_fn(a, FMT_MAX: tl.constexpr, MARGIN: tl.constexpr, POW2: tl.constexpr):
    """`quantize.scale_from_amax` (fallback 1) in the kernel's arithmetic, bit for bit: torch computes fmt.max / amax
    as fmt.max · (1 / amax) (Tensor.__rtruediv__ is reciprocal, then multiply), so this does too, with an IEEE
    reciprocal; the power of two below s comes from its exponent bits (a subnormal s scaled up by 2^64 first)."""
    s = tl.div_rn(FMT_MAX * tl.div_rn(1.0 + 0.0 * a, a), 2.0 ** MARGIN + 0.0 * a)
    s = tl.where(s != s, s, tl.minimum(s, 3.4028234663852886e38))
    if POW2:
        normal = s >= 1.1754943508222875e-38
        up = tl.where(normal, s, s * 18446744073709551616.0)
        p = (up.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        p = tl.where(normal, p, p * 5.421010862427522e-20)
        s = tl.where((s == s) & (s <= 3.4028234663852886e38) & (s > 0), p, s)
    good = (s == s) & (s <= 3.4028234663852886e38) & (a > 0) & (s > 0)
    return tl.where(good, s, 1.0)


def _code_fn(y, FMT_MAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """The FP8 code (an int32 in 0..255) of y saturated to ±FMT_MAX and rounded to the grid (ties to even), by
    exact arithmetic on y's bits (see the module docstring)."""
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX))  # saturate; NaN stays NaN
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    # |y| · 2^(mbits - e), an exact power-of-two scaling, rounded to an integer (ties to even), scaled back
    inv_ulp = ((MBITS - exponent + 127) << 23).to(tl.float32, bitcast=True)
    ulp = ((exponent - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    units = tl.abs(y) * inv_ulp
    rounded = ((units + 12582912.0) - 12582912.0) * ulp
    # the FP8 code, built from the exact value's bits (no conversion instruction rounds anything)
    rb = rounded.to(tl.int32, bitcast=True)
    e = ((rb >> 23) & 0xFF) - 127
    normal = ((e + 1 - EMIN) << MBITS) | ((rb & 0x7FFFFF) >> (23 - MBITS))
    small = tl.where((e < EMIN) & (y == y), rounded, 0.0)  # a subnormal's code is the exact integer |y| / 2^(emin-m)
    subnormal = (small * (1 << (MBITS - EMIN))).to(tl.int32)
    code = tl.where(e >= EMIN, normal, subnormal)
    code = tl.where(y != y, 0x7F, code | ((bits >> 24) & 0x80))  # the sign bit for bit; NaN as quantize writes it
    return code


def _cast_kernel_fn(x_ptr, q_ptr, out_ptr, out_t_ptr, amax_ptr, dscale_ptr, slot_ptr, counter_ptr, scratch_ptr, M, K,
                    stride_xm, stride_xk,
                    ALONG: tl.constexpr, FMT_MAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                    WRITE: tl.constexpr, WRITE_T: tl.constexpr, AMAX: tl.constexpr, FROM_AMAX: tl.constexpr,
                    MARGIN: tl.constexpr, POW2: tl.constexpr, RECORD: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    # the multipliers, one vector along the tile's rows (one per tensor, ALONG 0, or per row, 1) or its columns (2):
    # scales computed on BLOCK elements, not BLOCK_M·BLOCK_K
    if ALONG == 2:
        q_offsets = cols
        q_mask = cols < K
    else:
        q_offsets = rows * (ALONG == 1)
        q_mask = rows < M
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=1.0)
    if FROM_AMAX:  # q_ptr holds amaxes: the multipliers are computed here; the tiles of the first row or column of
        q = _scale(q, FMT_MAX, MARGIN, POW2)  # the grid store 1 / multiplier (repeated stores of equal values)
        zero = q_offsets * 0  # (tensors, not scalars: the interpreter masks with tensors)
        first = ((zero + pid_k) == 0) if ALONG == 1 else (((zero + pid_m) == 0) if ALONG == 2
                                                          else (zero + pid_m + pid_k) == 0)
        tl.store(dscale_ptr + q_offsets, tl.div_rn(1.0 + 0.0 * q, q), mask=q_mask & first)
    q = q[None, :] if ALONG == 2 else q[:, None]
    r8 = _code(x * q, FMT_MAX, EMIN, MBITS).to(tl.uint8)
    if WRITE:
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], r8, mask=mask)
    if WRITE_T:
        tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(r8), mask=tl.trans(mask))
    if AMAX:
        a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tile = tl.reduce(tl.reduce(a, 1, _larger), 0, _larger)
        if RECORD:
            _record(tile, amax_ptr, slot_ptr, counter_ptr, scratch_ptr)
        else:
            tl.atomic_max(amax_ptr, tile)


def _record_fn(tile, amax_ptr, slot_ptr, counter_ptr, scratch_ptr):
    """Merge this program's tile amax (|x|'s float32 bits as int32) into the tensor's, and in the program that
    finishes last write the tensor's amax to amax_ptr and fold it into a ScalingState as `ScalingState.record` does:
    the history slot keeps max(slot, amax) when the amax is finite, else the non-finite counter goes up by one.

    scratch_ptr holds two int32, zero between launches: the running amax and a count of programs done. Each program
    merges its amax, then takes a ticket (atomics with acquire-release order, so the program holding the last ticket
    sees every other program's amax); the last one folds and puts both back to zero for the next launch."""
    tl.atomic_max(scratch_ptr, tile)
    ticket = tl.atomic_add(scratch_ptr + 1, 1)
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        total = tl.atomic_xchg(scratch_ptr, 0)
        tl.atomic_xchg(scratch_ptr + 1, 0)
        tl.store(amax_ptr, total)
        finite = total < 0x7F800000  # +inf's bits; every NaN's are above them
        slot = tl.load(slot_ptr)
        tl.store(slot_ptr, tl.where(finite, tl.maximum(slot, total.to(tl.float32, bitcast=True)), slot))
        tl.store(counter_ptr, tl.load(counter_ptr) + tl.where(finite, 0, 1).to(tl.int64))


def fused_cast(x: torch.Tensor, fmt: NumberFormat, qscale: torch.Tensor | None, *, along: str = "tensor",
               write: bool = True, write_t: bool = False, want_amax: bool = False, amax: torch.Tensor | None = None,
               margin: int = 0, power_of_two: bool = False, record: AmaxSlot | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """cast(x · qscale) onto `fmt` for a 2-D `x`, in one pass over x.

    Args:
        x: (M, K) floating tensor (any strides, at least one element).
        fmt: E4M3 or E5M2.
        qscale: float32 quantization multipliers: () for along="tensor", M of them for "row", K for "column"; None
            to compute them in the kernel from `amax` (same shapes) by `scale_from_amax`'s rule with `margin` and
            `power_of_two`.
        along: which axis the multipliers follow: "tensor", "row" or "column".
        write: return the (M, K) row-major FP8 data.
        write_t: return the (K, M) row-major FP8 data of xᵀ (the same values).
        want_amax: return max |x| (float32, 0-dim; NaN if x holds one).
        record: with want_amax, also fold that amax into a ScalingState's slot (`ScalingState.amax_slot`), as
            `ScalingState.record` does, in the same launch (no zero-filled amax buffer, no second kernel).
    Returns:
        (data or None, data of xᵀ or None, amax or None, dequantization scales or None (the 1 / multiplier computed
        from `amax`, shaped like it)); bitwise what `quantize` computes from the same scales or amaxes.
    """
    if x.dim() != 2 or fmt.torch_dtype not in _FP8 or not x.numel():
        raise ValueError(f"fused_cast takes a non-empty 2-D tensor and an FP8 format, got shape {tuple(x.shape)} and "
                         f"{fmt.name}")
    if (qscale is None) == (amax is None):
        raise ValueError("fused_cast takes either qscale or amax")
    if record is not None and not (want_amax and along == "tensor"):
        raise ValueError("fused_cast records the amax it takes: pass want_amax=True, along='tensor'")
    m, k = x.shape
    q = (qscale if qscale is not None else amax).to(x.device, torch.float32).contiguous()  # a CPU 0-d scale too
    along_code = {"tensor": 0, "row": 1, "column": 2}[along]
    dtype = fmt.torch_dtype
    out = torch.empty((m, k), dtype=dtype, device=x.device) if write else None
    out_t = torch.empty((k, m), dtype=dtype, device=x.device) if write_t else None
    # recording, the last program writes the amax (no fill); else every program merges into a zero
    amax_bits = (torch.empty if record is not None else torch.zeros)((), dtype=torch.int32, device=x.device) \
        if want_amax else None
    dscale = torch.empty_like(q) if qscale is None else None
    placeholder = (out if out is not None else out_t).view(torch.uint8)
    slot, counter, scratch = record if record is not None else (q, q, q)
    args = (x, q, out.view(torch.uint8) if write else placeholder, out_t.view(torch.uint8) if write_t else placeholder,
            amax_bits if want_amax else q, dscale if dscale is not None else q, slot, counter, scratch, m, k,
            x.stride(0), x.stride(1))
    triton_tiles.launch(_kernel(), triton_tiles.CAST_TILES, x, args,
                        dict(ALONG=along_code, FMT_MAX=float(fmt.max), EMIN=fmt.emin, MBITS=fmt.mbits, WRITE=write,
                             WRITE_T=write_t, AMAX=want_amax, FROM_AMAX=qscale is None, MARGIN=margin,
                             POW2=power_of_two, RECORD=record is not None),
                        restore=_RESTORE, key=("ALONG", "WRITE", "WRITE_T", "AMAX", "FROM_AMAX", "RECORD"))
    return out, out_t, amax_bits.view(torch.float32) if want_amax else None, dscale


# what a launch updates in place, restored after each of the autotuner's trials (the amax merges by max: idempotent)
_RESTORE = ("amax_ptr", "slot_ptr", "counter_ptr")


def _amax_fn(x_ptr, amax_ptr, slot_ptr, counter_ptr, scratch_ptr, M, K, stride_xm, stride_xk, RECORD: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    a = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tile = tl.reduce(tl.reduce(a, 1, _larger), 0, _larger)
    if RECORD:
        _record(tile, amax_ptr, slot_ptr, counter_ptr, scratch_ptr)
    else:
        tl.atomic_max(amax_ptr, tile)


@functools.cache
def _amax_kernel():
    _kernel()  # binds tl and the helpers
    return _triton().jit(_amax_fn)


def tensor_amax(x: torch.Tensor, record: AmaxSlot | None = None) -> torch.Tensor:
    """max |x| of a non-empty 2-D tensor as a 0-dim float32 (NaN if x holds one), in one pass: the amax current
    scaling needs before its cast. `record`: also fold it into a ScalingState's slot in the same launch (see
    `fused_cast`)."""
    m, k = x.shape
    bits = (torch.empty if record is not None else torch.zeros)((), dtype=torch.int32, device=x.device)
    slot, counter, scratch = record if record is not None else (bits, bits, bits)
    triton_tiles.launch(_amax_kernel(), triton_tiles.AMAX_TILES, x,
                        (x, bits, slot, counter, scratch, m, k, x.stride(0), x.stride(1)),
                        dict(RECORD=record is not None), restore=_RESTORE, key=("RECORD",))
    return bits.view(torch.float32)


def _fold_amax_fn(slot_ptr, counter_ptr, amax_ptr, N, BLOCK: tl.constexpr):
    # one program walks the amaxes (one, or a row's or a tile's each) in blocks: their largest finite value and
    # whether any is not finite
    offsets = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    bad = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, N, BLOCK):
        a = tl.load(amax_ptr + start + offsets, mask=start + offsets < N, other=0.0).to(tl.float32)
        finite = tl.abs(a) <= 3.4028234663852886e38  # False for inf and NaN
        best = tl.maximum(best, tl.where(finite, a, float("-inf")))
        bad = tl.maximum(bad, tl.where(finite, 0, 1))
    top = tl.reduce(best, 0, _larger)
    any_bad = tl.reduce(bad, 0, _larger)
    slot = tl.load(slot_ptr)
    tl.store(slot_ptr, tl.where(any_bad == 0, tl.maximum(slot, top), slot))
    tl.store(counter_ptr, tl.load(counter_ptr) + any_bad.to(tl.int64))


@functools.cache
def _fold_kernel():
    _kernel()  # binds tl
    return _triton().jit(_fold_amax_fn)


FOLD_BLOCK = 1024


class AmaxSlot(NamedTuple):
    """Where a cast records its amax: one role's entry of a ScalingState (`ScalingState.amax_slot`)."""

    amax: torch.Tensor  # float32, 0-dim: the role's entry in row 0 of the amax history
    nonfinite: torch.Tensor  # int64, 0-dim: the role's count of casts that met a NaN/inf amax
    scratch: torch.Tensor  # int32, (2,), zero between launches: where the one-pass kernels merge their tiles' amaxes


def record_amax(slot: AmaxSlot, amax: torch.Tensor) -> None:
    """slot.amax = max(slot.amax, max(amax)) where every amax is finite, else slot.nonfinite += 1 (the torch ops of
    `ScalingState.record`, sync-free; one `fold_amax` launch where the kernels run). No amaxes (an empty tensor's
    cast per row or block): nothing to record."""
    amax = amax.detach()
    if not amax.numel():
        return
    if available(amax):
        fold_amax(slot.amax, slot.nonfinite, amax)
        return
    top = amax.float().amax()
    finite = torch.isfinite(top)
    slot.amax.copy_(torch.where(finite, torch.maximum(slot.amax, top), slot.amax))
    slot.nonfinite.add_((~finite).long())


def fold_amax(slot: torch.Tensor, counter: torch.Tensor, amax: torch.Tensor) -> None:
    """slot = max(slot, max(amax)) where every amax is finite, else counter += 1: one kernel launch for what takes
    eight to twelve torch ops (`ScalingState.record` on a GPU). `slot` (float32) and `counter` (int64) are 0-dim views
    into the state's buffers, `amax` a non-empty float tensor (a cast's amax: one, or one per row or block); all on
    the device `available` accepts."""
    flat = amax.reshape(-1)
    if not flat.numel():
        raise ValueError("fold_amax needs at least one amax")
    _fold_kernel()[(1,)](slot, counter, flat, flat.numel(), BLOCK=FOLD_BLOCK)
