"""Rounding rules onto a format's grid: round-to-nearest-even (`round_to_grid`) and stochastic rounding.

Rounding is exact by construction, on every device and under every compiler setting: each value is scaled by a
power of two read from its own float32 exponent field (integer arithmetic on the bit pattern), rounded to an integer
with torch.round (round-half-to-even) and scaled back:
    ulp = 2^(max(e, emin) - m)     e = floor(log2 |y|) from y's exponent bits, m the format's mantissa bits
    round_to_grid(y) = round(y / ulp) · ulp
The integer route scales by 1/ulp, built from the exponent as ulp is, rather than dividing: inductor's Triton code
divides float32 values approximately (div.full.f32), even by a power of two. Divisions that must round (scales:
fmt.max / amax, their reciprocals) go through `div_rn`, correctly rounded on every device and compiler.
Every product and quotient here is exact (a power-of-two scaling that neither overflows nor underflows), so a compiler
that contracts a multiply and an add into an FMA (inductor's Triton code on a GPU, or the C++ backend with
TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast) cannot change a bit: an FMA of exact operations rounds
the same exact value once. The Veltkamp split this replaces (c = y·(2^(23-m)+1); c - (c - y)) relies on each product
being rounded on its own, and an FMA silently turned it into the identity (issue 20, tests/test_fma_contraction.py).

Two exact ways to find 2^e, one rule (`grid_spacing`): on a GPU (and every device but the CPU) the exponent field is
read with integer arithmetic on the bit pattern. On a CPU (eager or compiled) 2^e comes from float arithmetic alone,
because inductor's C++ code runs every bit cast (and isnan) as a scalar loop between vector registers, which made the
cast of an (M, K) tensor about 4× slower than its arithmetic. Every product in it is by a power of two (exact, so an
FMA cannot change it):
    s = a · 2^23;  r = (s + a) - s      a rounded to one significant bit: 2^e or 2^(e+1)
    2^e = r / 2 where r > a, else r
(s is a multiple of 2^e, its spacing, so s + a rounds a/2^e ∈ [1, 2) to 1 or 2 units of 2^e; where the sum reaches the
next binade, it lies below 2^(e+24) + 2^e and rounds to 2^(e+24), r = 2^e again). Both ways give the same bits for
every |y| <= fmt.max, ±inf and NaN (tests/test_rounding_routes.py sweeps float32 and bfloat16 values); only a compiler
allowed to re-associate additions (TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG=1 in the environment) could fold
(s + a) - s to a, so that setting sends the CPU back to the bit pattern.

Stochastic rounding (SR) sends y, lying between the neighbouring grid values lo < y < hi, to hi with probability
(y - lo) / (hi - lo) and to lo otherwise, so E[SR(y)] = y: rounding errors average out instead of piling up. An
update far below half an ulp, which round-to-nearest drops every time, moves the weight by one ulp with the right
probability (Gupta et al., "Deep Learning with Limited Numerical Precision", arXiv 1502.02551; Zamirai et al.,
"Revisiting BFloat16 Training", arXiv 2010.06192).

The rule takes its randomness as an argument — a uniform u in [0, 1) per element — so that it is a pure function:
    ulp = 2^(max(e, emin) - mbits) with e = floor(log2 |y|)   (the spacing of the binade holding |y|)
    lo  = floor(|y| / ulp) · ulp,   f = |y| / ulp - floor(|y| / ulp)  in [0, 1)
    SR(y) = sign(y) · (lo + ulp · [u >= 1 - f])                 P(up) = P(u >= 1 - f) = f
Every step is exact in float32 (|y| / ulp is a power-of-two scaling and has at most mbits + 1 integer bits), and
e is read from float32's exponent field, which is exact where log2 is not. With u = k / 2^24 (torch.rand's float32
grid) P(up) is exactly f whenever f is a multiple of 2^-24. That holds for every float32 y in the format's normal
range and in its subnormal range down to 2^(emin - mbits - 1), for every format of at most 23 mantissa bits; below
that (|y| far under the format's smallest subnormal) f has more fractional bits than 1 - f keeps in float32, and
P(up) is f rounded to a multiple of 2^-24: a bias of at most 2^-25 of an ulp (E2M1: 3·2^-27 goes up with
probability 1 where f = 0.75·2^-24).
Comparing u with 1 - f (not f) makes bfloat16 SR bitwise the classic integer form: add floor(u·2^16) to the float32
bit pattern and truncate the low 16 bits (checked in tests/test_rounding.py).

`minifloat.numerics.quantize.cast(x, fmt, rounding="stochastic")` is the entry point: it saturates, draws u and calls
`round_stochastic`.
"""

from __future__ import annotations

import math

import torch

from minifloat.numerics import compiling
from minifloat.numerics.formats import FP32, NumberFormat, Special

ROUNDINGS = ("nearest", "stochastic")


def exact_pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for integer k in [-149, 128]: the product of two normal powers of two built from their bit
    patterns, exact (subnormal results included) on every device, where exp2 may be approximate or flush subnormals."""
    k = k.to(torch.int32)
    half = k >> 1
    return ((half + 127) << 23).view(torch.float32) * ((k - half + 127) << 23).view(torch.float32)


def div_rn(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """num / den as float32, correctly rounded on every device and under every compiler, elementwise (float32 tensors,
    or one of them a float that float32 holds exactly). For scales and per-block quantities, not whole tensors.

    A float32 tensor-by-tensor division is IEEE in eager mode on every device and in inductor's C++ code, and that is
    what runs there; a float operand is made a tensor first, because eager torch divides by a float as a product by
    its reciprocal on a GPU and computes `float / tensor` as a reciprocal times the float (two roundings). Inductor's
    Triton code (a compiled graph on a CUDA or XPU device) lowers a float32 `/` to the approximate div.full.f32 (up to
    2 ulp) unless `eager_numerics.division_rounding` is on, but a float64 one to div.rn.f64; there the quotient is
    taken in float64 and rounded to float32, which is the correctly rounded float32 quotient of two float32 values:
    double rounding is innocuous for division when 53 >= 2·24 + 2 (Figueroa, "When is double rounding innocuous?",
    SIGNUM Newsletter 30(3), 1995).
    """
    like = den if isinstance(den, torch.Tensor) else num
    if torch.compiler.is_compiling() and like.device.type in _TRITON_DEVICES:
        return _div_via_float64(num, den)
    num = num if isinstance(num, torch.Tensor) else torch.full_like(den, num)
    return num / (den if isinstance(den, torch.Tensor) else torch.full_like(num, den))


# devices whose compiled graphs inductor writes in Triton (float32 `/` approximate, float64 `/` IEEE); others (MPS has
# no float64) keep the float32 division
_TRITON_DEVICES = ("cuda", "xpu")


def _div_via_float64(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    like = (den if isinstance(den, torch.Tensor) else num).double()
    num64 = num.double() if isinstance(num, torch.Tensor) else torch.full_like(like, num)
    den64 = den.double() if isinstance(den, torch.Tensor) else torch.full_like(like, den)
    return (num64 / den64).float()


def reciprocal_rn(x: torch.Tensor) -> torch.Tensor:
    """1 / x as float32, correctly rounded on every device and compiler (`div_rn`): eager's `x.reciprocal()`."""
    if torch.compiler.is_compiling() and x.device.type in _TRITON_DEVICES:
        return _div_via_float64(1.0, x)
    return x.reciprocal()


_FLOAT_ROUTE_MAX = 2.0**104  # a · 2^23 stays finite: the float route's domain ends here


def float_binade_power(a: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 a) for float32 a in (0, 2^104] (float32 subnormals included; NaN stays NaN), in float arithmetic
    whose every product is by a power of two (see the module docstring)."""
    big = a * 2.0**23
    r = (big + a) - big  # a rounded to one significant bit
    return torch.where(r > a, r * 0.5, r)


def _float_route(y: torch.Tensor, fmt: NumberFormat) -> bool:
    """Whether `grid_spacing` takes the float route for `y`: on a CPU (see the module docstring)."""
    if y.device.type != "cpu" or fmt.max >= _FLOAT_ROUTE_MAX:
        return False
    return not UNSAFE_MATH


# inductor's C++ code may re-associate additions under unsafe math (minifloat.numerics.compiling reads the flag)
UNSAFE_MATH = compiling.CPU_UNSAFE_MATH


def grid_spacing(a: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """2^(max(floor(log2 a), fmt.emin) - fmt.mbits) for float32 a >= 0: the spacing of `fmt`'s grid around a (zero
    and float32 subnormals get the subnormal spacing). ±inf gives a finite spacing (a rounding then keeps inf); NaN
    gives NaN on the float route and a finite spacing on the integer one (a rounding keeps NaN either way)."""
    return _spacing(a, fmt)[0]


def _spacing(a: torch.Tensor, fmt: NumberFormat) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """(grid_spacing(a), powers of two whose product is its reciprocal, or None). The integer route builds the
    reciprocal from the exponent too, so a rounding scales by it with products: a float32 division in inductor's
    Triton code is the approximate div.full.f32, which need not be exact even by a power of two. It is one factor
    where float32 holds it, two for wide formats (bfloat16's subnormal spacing 2^-133 has no float32 reciprocal).
    The float route (CPU only, where a division is IEEE) gives None: the caller divides."""
    if _float_route(a, fmt):
        return float_binade_power(a.clamp(2.0**fmt.emin, _FLOAT_ROUTE_MAX)) * 2.0**-fmt.mbits, None
    # floor(log2 a) from the exponent field; a zero or float32-subnormal a reads -127, below every format's emin
    exponent = (((a.view(torch.int32) >> 23) & 0xFF) - 127).clamp(min=fmt.emin)
    ulp = exact_pow2(exponent - fmt.mbits)
    k = fmt.mbits - exponent  # in [mbits - 128, mbits - emin]
    if fmt.mbits - fmt.emin <= 127:
        return ulp, (exact_pow2(k),)
    half = k >> 1  # each factor within float32's normal range; y · 2^half · 2^(k - half) never leaves it either
    return ulp, (exact_pow2(half), exact_pow2(k - half))


def _in_units(y: torch.Tensor, ulp: torch.Tensor, inverse: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """y / ulp for a power-of-two ulp: exact either way (power-of-two scalings; the result has at most mbits + 1
    integer bits, and a product's partial result lies between y and it)."""
    if inverse is None:
        return y / ulp
    for factor in inverse:
        y = y * factor
    return y


def converts_exactly(y: torch.Tensor, fmt: NumberFormat) -> bool:
    """Whether `round_saturated` rounds `y` onto `fmt` with torch's own float8 conversion: E4M3 on a CPU. That
    conversion is round-to-nearest-even with subnormals, and inductor's C++ code vectorizes it, where the float
    route's arithmetic costs ~20 vector operations per element (a compiled E4M3 cast 1.06-1.13× faster on a 2-core
    Xeon; benchmarks/cast_routes.py). Its E5M2 conversion runs element by element there, so E5M2 keeps the arithmetic.
    The same bits as round_to_grid, with FMA contraction on or off and for AVX-512, AVX2 and scalar code
    (tests/test_rounding_routes.py, tests/test_fma_contraction.py)."""
    return y.device.type == "cpu" and fmt.torch_dtype == torch.float8_e4m3fn and not UNSAFE_MATH


def round_saturated(y: torch.Tensor, fmt: NumberFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """round_to_grid for float32 `y` already saturated to ±fmt.max (or NaN), with the stored form where the rounding
    made it: (float32 grid values, fmt's float8 tensor or None). NaN stays NaN (its payload unspecified); a stored
    NaN is the positive one, whatever y's sign (r != r rather than isnan, which inductor's C++ code runs element by
    element)."""
    if converts_exactly(y, fmt):
        stored = torch.where(y != y, float("nan"), y).to(fmt.torch_dtype)
        return stored.float(), stored
    return round_to_grid(y, fmt), None


def round_to_grid(y: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """Round float32 `y` to the nearest value of `fmt` (ties to even). No saturation: callers clamp first.

    Args:
        y: float32 tensor with |y| <= fmt.max (larger values are rounded but not saturated).
        fmt: the target format.
    Returns:
        float32 tensor of values representable in `fmt` (NaN stays NaN).
    """
    if fmt.mbits >= 23:
        return y
    if fmt.torch_dtype in (torch.bfloat16, torch.float16):
        return y.to(fmt.torch_dtype).float()  # torch's conversion is RNE with subnormals
    if fmt.special == Special.SCALE:
        return _round_pow2(y, fmt)
    ulp, inverse = _spacing(y.abs(), fmt)
    # y / ulp has at most m + 1 integer bits: exact; torch.round is round-half-to-even; · ulp is exact again (a
    # carry into the next binade gives 2^(e+1), also exact). Signs, ±0, inf and NaN pass through unchanged.
    return torch.round(_in_units(y, ulp, inverse)) * ulp


def _round_pow2(y: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    # E8M0 holds 2^e, e in [emin, emax]. Nearest power of two in value: y = m·2^k with m in [0.5, 1) (frexp, exact)
    # rounds up to 2^k when 2m >= 1.5 (the midpoint of [2^(k-1), 2^k]; ties go up). Zero, negatives and NaN have no
    # encoding: NaN. No log2/exp2: a GPU's approximate log2 misplaces values just below a power of two.
    m, k = torch.frexp(y)
    e = (k - 1 + (m >= 0.75).to(k.dtype)).clamp(fmt.emin, fmt.emax)
    e = torch.where(torch.isinf(y), fmt.emax, e)  # frexp(inf) is (inf, 0): +inf saturates to the largest power
    return torch.where(y > 0, exact_pow2(e), torch.full_like(y, float("nan")))


def round_stochastic(y: torch.Tensor, fmt: NumberFormat, u: torch.Tensor) -> torch.Tensor:
    """Round float32 `y` to one of its two neighbours on `fmt`'s grid, up (in magnitude) with probability equal to
    its distance to the lower neighbour over their spacing. No saturation: callers clamp first.

    Args:
        y: float32 tensor with |y| <= fmt.max.
        fmt: the target format (not a scale format such as E8M0).
        u: float32 tensor of y's shape, uniform in [0, 1): the randomness (torch.rand).
    Returns:
        float32 tensor of values of `fmt`; grid values of `fmt` (zeros included, signs kept) come back unchanged and
        NaN stays NaN.
    """
    if fmt.special == Special.SCALE:
        raise ValueError(f"stochastic rounding onto the scale format {fmt.name} is not supported")
    if fmt.mbits >= 23:
        return y
    a = y.abs()
    # floor(log2 a), exactly and with no frexp/exp2 (which compiled kernels run element by element)
    ulp, inverse = _spacing(a, fmt)
    units = _in_units(a, ulp, inverse)
    lo = torch.floor(units)
    up = (u >= 1.0 - (units - lo)).float()
    return torch.copysign((lo + up) * ulp, y)


# ---------------------------------------------------------------------------------------------------- counter draws

# A 32-bit integer hash from Chris Wellons' "hash prospector" (low-bias search, 2018): xorshift-multiply twice. It
# runs on int32 lanes, where a product wraps modulo 2^32 (two's complement, as the vector units and the test check) and
# right shifts are made logical by a mask: twice the lanes of int64 and a native 32-bit multiply, about half the time
# of the int64 form (which masks each product to 32 bits). Both forms give the same bits (tests/test_rounding.py).
_HASH_SHIFTS = (16, 15, 15)
_HASH_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
_MASK32 = 0xFFFFFFFF
UNIFORM_BITS = 24  # u = k / 2^24: the grid round_stochastic's exactness argument assumes (module docstring)
_INT32_INDICES = 2**31  # above this many elements the indices need int64 (they wrap at 2^32 in both forms)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of 32-bit values held in int32 (whose >> is arithmetic) or int64."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """The hash of 32-bit values, elementwise: int32 (wrapping) or int64 holding [0, 2^32), answered in x's dtype."""
    a, b, c = _HASH_SHIFTS
    wide = x.dtype == torch.int64
    for shift, multiplier in ((a, _HASH_MULTIPLIERS[0]), (b, _HASH_MULTIPLIERS[1])):
        x = (x ^ _shift_right(x, shift)) * multiplier
        if wide:
            x = x & _MASK32
    return x ^ _shift_right(x, c)


def _mix(index: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """hash(hash(index ^ lo) ^ hi): a counter `index` under a seed's 32-bit halves, in index's dtype."""
    return _hash32(_hash32(index ^ lo) ^ hi)


def counter_uniform(seed: torch.Tensor, shape: torch.Size | tuple[int, ...], *, wide: bool = False) -> torch.Tensor:
    """Uniform draws u = k / 2^24 in [0, 1), float32 of `shape`, as a pure function of a 0-d int64 `seed` and each
    element's flat index: u_i = hash(hash(i ^ seed_lo) ^ seed_hi) >> 8 (seed_lo, seed_hi its 32-bit halves).

    For stochastic rounding inside a compiled kernel, where torch.rand's generator cannot go: the draws fuse into the
    rounding's single pass instead of costing a pass of mt19937 (on CPU the slowest part of an SR cast). Indices wrap
    at 2^32 elements. The hash is not a cryptographic one; what SR needs of it, uniform and independent draws, is
    tested statistically (tests/test_rounding.py). `wide` computes in int64 (the reference form; the same bits).
    """
    n = math.prod(shape)
    index_dtype = torch.int64 if wide or n > _INT32_INDICES else torch.int32
    return counter_uniform_at(seed, torch.arange(n, dtype=index_dtype, device=seed.device)).reshape(shape)


def counter_seed(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A 62-bit seed (0-d int64 tensor) for draw `index` of the stream `seed` (0-d int64 tensors, index < 2^32):
    the hash of both, computed on the tensors' device with no host read, so that a compiled graph can derive each
    stochastic-rounding cast's seed from a layer's buffers. Distinct (seed, index) pairs give unrelated seeds for
    counter_uniform; int64 arithmetic on 32-bit halves never overflows."""
    seed, index = seed.to(torch.int64), index.to(torch.int64) & _MASK32
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    out_lo = _mix(index, lo, hi)
    out_hi = _hash32(out_lo ^ _hash32(hi ^ _SEED_SALT) ^ lo)
    return ((out_hi >> 2) << 32) | out_lo  # below 2^62


_SEED_SALT = 0x5BD1E995  # keeps out_hi from being a function of out_lo alone when both halves of the seed are 0


def counter_uniform_at(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """counter_uniform's draws at the given flat indices (int32, or int64 taken modulo 2^32), of index's shape: the
    draws a tensor would get at those positions, for a kernel that walks a tensor in another layout."""
    seed = seed.to(torch.int64)
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    if index.dtype == torch.int64:
        index = index & _MASK32
    else:  # the halves' bits as int32 (values from 2^31 become negative: the same 32 bits)
        lo, hi = (torch.where(v >= 2**31, v - 2**32, v).to(torch.int32) for v in (lo, hi))
    return _shift_right(_mix(index, lo, hi), 32 - UNIFORM_BITS).to(torch.float32) * 2.0**-UNIFORM_BITS


def float32_round_to_odd(x: torch.Tensor) -> torch.Tensor:
    """float64 `x` as float32, rounded to odd: truncated toward zero, with the last mantissa bit set where that
    dropped anything. A second rounding onto a format of at most 21 mantissa bits is then exactly the rounding of x
    itself (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
    odd", 2008), where rounding x to float32 to nearest first could round twice (1.0625 + 1e-12 to E4M3: 1.0, not
    1.125). Values beyond float32's range become ±float32 max (finite, so they saturate; ±inf and NaN stay)."""
    t = x.float()
    bits = t.view(torch.int32)
    away = t.double().abs() > x.abs()  # rounded away from zero (or overflowed to inf): one ulp back toward zero
    bits = torch.where(away & torch.isfinite(x), bits - 1, bits)
    inexact = bits.view(torch.float32).double() != x
    return torch.where(inexact & torch.isfinite(x), bits | 1, bits).view(torch.float32)


def float32_for(x: torch.Tensor, fmt: NumberFormat) -> torch.Tensor:
    """x as the float32 the rounding reads: float64 rounded to odd (exact for every format narrower than FP32)."""
    if x.dtype != torch.float64:
        return x.float()
    return x.float() if fmt.mbits > FP32.mbits - 2 else float32_round_to_odd(x)
