"""Tests for minifloat.numerics.rounding: stochastic rounding through cast(..., rounding="stochastic")."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import minifloat as mf
from minifloat.numerics import compiling
from minifloat.numerics.compiling import maybe_compile
from minifloat.numerics.quantize import cast
from minifloat.numerics import rounding as R
from minifloat.numerics.rounding import UNIFORM_BITS, counter_seed, counter_uniform, round_stochastic

SR_FORMATS = [mf.BF16, mf.E4M3, mf.E5M2, mf.E2M1]
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX v1.0 §5.3.3
Z_SIGMAS = 5.0  # a mean error beyond 5 standard errors has probability < 6e-7 under an unbiased rounding
DRAWS = 4000


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)


def grid(fmt) -> torch.Tensor:
    """Every finite value of `fmt`, sorted, from ml_dtypes / the OCP table (independent of minifloat's maths)."""
    if fmt is mf.E2M1:
        half = torch.tensor(E2M1_VALUES)
        return torch.cat([-half.flip(0), half[1:]])
    np_dtype = {"bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt.name]
    bits = np.arange(2 ** fmt.bits, dtype=np.uint16 if fmt.bits == 16 else np.uint8)
    values = torch.from_numpy(bits.view(np_dtype).astype(np.float32))
    return torch.unique(values[torch.isfinite(values)])  # sorted; -0 and +0 merge


def neighbours(values: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid values just below-or-at and at-or-above each y."""
    hi_idx = torch.searchsorted(values, y).clamp(max=len(values) - 1)
    lo_idx = torch.searchsorted(values, y, right=True).sub(1).clamp(min=0)
    return values[lo_idx], values[hi_idx]


def samples(fmt, n: int, generator) -> torch.Tensor:
    """Values spread over fmt's whole range (log-uniform magnitudes, both signs, subnormals included)."""
    lo, hi = np.log2(fmt.min_subnormal), np.log2(fmt.max)
    mag = torch.exp2(lo + (hi - lo) * torch.rand(n, generator=generator))
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
    return (sign * mag).clamp(-fmt.max, fmt.max)


@pytest.mark.parametrize("fmt", SR_FORMATS, ids=lambda f: f.name)
def test_grid_values_stay_exact(fmt, generator):
    values = grid(fmt)
    values = torch.cat([values, torch.tensor([-0.0])])
    for _ in range(20):
        out = cast(values, fmt, rounding="stochastic", generator=generator)
        assert torch.equal(out, values)
        assert torch.equal(torch.signbit(out), torch.signbit(values))  # -0 stays -0


@pytest.mark.parametrize("fmt", SR_FORMATS, ids=lambda f: f.name)
def test_result_is_one_of_the_two_neighbours(fmt, generator):
    y = samples(fmt, 20000, generator)
    lo, hi = neighbours(grid(fmt), y)
    out = cast(y, fmt, rounding="stochastic", generator=generator)
    assert bool(((out == lo) | (out == hi)).all())
    both = (out == lo).any() and (out == hi).any()
    assert both, "stochastic rounding never used one of the two neighbours"


@pytest.mark.parametrize("fmt", SR_FORMATS, ids=lambda f: f.name)
def test_mean_error_vanishes(fmt, generator):
    """z-test per value: |mean(SR(y)) - y| <= Z_SIGMAS standard errors, with the Bernoulli standard error
    (hi - lo)·sqrt(p(1-p)/N), p = (y - lo)/(hi - lo). Round to nearest fails it (shown on the same values)."""
    y = samples(fmt, 64, generator)
    lo, hi = neighbours(grid(fmt), y)
    draws = cast(y.expand(DRAWS, -1).contiguous(), fmt, rounding="stochastic", generator=generator).double()
    p = ((y - lo) / (hi - lo)).double().nan_to_num(0.0)  # exact values: hi == lo
    stderr = (hi - lo).double() * torch.sqrt(p * (1 - p) / DRAWS)
    error = (draws.mean(0) - y.double()).abs()
    assert bool((error <= Z_SIGMAS * stderr + 1e-300).all())
    nearest_error = (cast(y, fmt).double() - y.double()).abs()
    assert bool((nearest_error > Z_SIGMAS * stderr).any()), "round to nearest should be visibly biased here"


def test_bf16_matches_the_integer_construction(generator):
    """bf16 SR = add floor(u·2^16) to the float32 bits and truncate the low 16 bits (then read by ml_dtypes)."""
    y = samples(mf.BF16, 50000, generator)
    u = torch.rand(y.shape, generator=torch.Generator().manual_seed(7))
    bits = y.numpy().view(np.uint32).astype(np.uint64)
    rounded = ((bits + np.floor(u.numpy().astype(np.float64) * 2**16).astype(np.uint64)) & 0xFFFF0000).astype(np.uint32)
    expected = (rounded >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(round_stochastic(y, mf.BF16, u).numpy(), expected)
    # cast draws u from the generator it is given, as torch.rand(shape, generator=...) does
    drawn = cast(y, mf.BF16, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    assert torch.equal(drawn, round_stochastic(y, mf.BF16, u))


def frexp_round_stochastic(y: torch.Tensor, fmt, u: torch.Tensor) -> torch.Tensor:
    """The module docstring's formula with e from torch.frexp and ulp from exp2: the reference for the bit-field
    form round_stochastic computes."""
    a = y.abs()
    _, exponent = torch.frexp(a)
    ulp = torch.exp2(((exponent - 1).clamp(min=fmt.emin) - fmt.mbits).float())
    units = a / ulp
    lo = torch.floor(units)
    return torch.copysign((lo + (u >= 1.0 - (units - lo)).float()) * ulp, y)


@pytest.mark.parametrize("fmt", [mf.E2M1, mf.E4M3, mf.E5M2, mf.BF16, mf.FP16], ids=lambda f: f.name)
def test_bit_field_exponent_is_the_frexp_formula(fmt, monkeypatch, generator):
    # magnitudes from float32 subnormals to the format's top, signed zeros and NaN
    y = torch.cat([torch.randn(1 << 14, generator=generator) * 10.0**p for p in range(-40, 39, 3)]
                  + [torch.tensor([0.0, -0.0, float("nan"), 2**-149, -(2**-140), 2**-126, 2**-127])])
    y = y.clamp(-fmt.max, fmt.max)
    u = torch.rand(y.shape, generator=generator)
    want = frexp_round_stochastic(y, fmt, u).view(torch.int32)
    assert torch.equal(round_stochastic(y, fmt, u).view(torch.int32), want)  # bitwise, NaN and -0 included
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
    compiled = maybe_compile(lambda a, b: round_stochastic(a, fmt, b))(y, u)
    assert torch.equal(compiled.view(torch.int32), want)


def test_reproducible_with_a_seed():
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    a = cast(y, mf.E4M3, rounding="stochastic", generator=torch.Generator().manual_seed(3))
    b = cast(y, mf.E4M3, rounding="stochastic", generator=torch.Generator().manual_seed(3))
    c = cast(y, mf.E4M3, rounding="stochastic", generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("name, x, expected", [
    ("inf saturates", float("inf"), 448.0),
    ("-inf saturates", float("-inf"), -448.0),
    ("beyond max saturates", 1000.0, 448.0),
    ("just below max stays on the grid", 447.0, None),  # 416 or 448
])
def test_saturation_like_cast(name, x, expected, generator):
    out = cast(torch.full((100,), x), mf.E4M3, rounding="stochastic", generator=generator)
    if expected is None:
        assert set(out.tolist()) <= {416.0, 448.0}
    else:
        assert bool((out == expected).all())


def test_nan_stays_nan_and_dtype_is_kept(generator):
    x = torch.tensor([float("nan"), 1.3], dtype=torch.bfloat16)
    out = cast(x, mf.E4M3, rounding="stochastic", generator=generator)
    assert out.dtype == torch.bfloat16 and torch.isnan(out[0]) and out[1].item() in (1.25, 1.375)


@pytest.mark.parametrize("name, call, match", [
    ("unknown rounding", lambda: cast(torch.ones(2), mf.E4M3, rounding="up"), "rounding"),
    ("scale format", lambda: cast(torch.ones(2), mf.E8M0, rounding="stochastic"), "e8m0"),
])
def test_invalid_options_raise(name, call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------------- counter draws

COUNTER_DRAWS = 1 << 20
CHI2_BINS = 64
# chi-square with 63 degrees of freedom: P(X > 130) ≈ 2e-6 (mean 63, sd 11.2)
CHI2_MAX = 130.0


def counter(seed: int, n: int = COUNTER_DRAWS) -> torch.Tensor:
    return counter_uniform(torch.tensor(seed, dtype=torch.int64), (n,)).double()


def test_counter_uniform_is_on_the_2_24_grid_in_unit_interval_and_reproducible():
    u = counter_uniform(torch.tensor(12345), (3, 7, 11))
    assert u.shape == (3, 7, 11) and u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    k = u.double() * 2**UNIFORM_BITS
    assert torch.equal(k, k.round())  # round_stochastic's exactness argument needs u = k / 2^24
    assert torch.equal(u, counter_uniform(torch.tensor(12345), (3, 7, 11)))  # a pure function of seed and index


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 3, 2**62 - 1])
def test_counter_uniform_is_uniform(seed):
    u = counter(seed)
    # mean of U(0,1) draws: sd 1/sqrt(12 n)
    z = (u.mean().item() - 0.5) / math.sqrt(1 / (12 * COUNTER_DRAWS))
    assert abs(z) < Z_SIGMAS, z
    counts = torch.bincount((u * CHI2_BINS).long(), minlength=CHI2_BINS).double()
    expected = COUNTER_DRAWS / CHI2_BINS
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_MAX, chi2


@pytest.mark.parametrize("name, a, b", [
    ("neighbours", lambda: counter(7)[:-1], lambda: counter(7)[1:]),  # lag-1 within a stream
    ("seeds differing in the low word", lambda: counter(7), lambda: counter(8)),
    ("seeds differing in the high word", lambda: counter(7), lambda: counter(7 + 2**32)),
])
def test_counter_uniform_draws_are_uncorrelated(name, a, b):
    x, y = a(), b()
    r = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
    # the sample correlation of independent draws is about N(0, 1/n)
    assert abs(r) * math.sqrt(x.numel()) < Z_SIGMAS, (name, r)


def python_counter_uniform(seed: int, index: int) -> float:
    """counter_uniform's documented formula in Python integers: the independent reference for its tensor forms."""
    def hash32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x735A2D97) & 0xFFFFFFFF
        return x ^ (x >> 15)
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return (hash32(hash32(index ^ lo) ^ hi) >> (32 - UNIFORM_BITS)) / 2**UNIFORM_BITS


# seeds whose halves cross 2^31 (negative as int32) and the extremes
SEEDS_32BIT_EDGES = [0, 2**31 - 1, 2**31, 2**32 - 1, 2**31 + 2**63 - 2**32, 2**62 - 1, 0x123456789ABCDEF]


@pytest.mark.parametrize("seed", SEEDS_32BIT_EDGES)
def test_counter_uniform_int32_form_is_the_int64_form_and_the_formula(seed):
    s = torch.tensor(seed, dtype=torch.int64)
    fast, wide = counter_uniform(s, (4099,)), counter_uniform(s, (4099,), wide=True)
    assert torch.equal(fast, wide)  # exactness is the point: the int32 lanes wrap to the same bits
    for i in (0, 1, 2**12, 4098):
        assert fast[i].item() == python_counter_uniform(seed, i)


def test_counter_uniform_int32_form_compiled_is_the_int64_form(monkeypatch):
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)  # compile, whatever the size
    seed, zeros = torch.tensor(2**62 - 3, dtype=torch.int64), torch.zeros(64, 1024)
    fast = maybe_compile(lambda s, z: z + counter_uniform(s, z.shape))(seed, zeros)
    wide = maybe_compile(lambda s, z: z + counter_uniform(s, z.shape, wide=True))(seed, zeros)
    assert torch.equal(fast, wide)
    assert torch.equal(fast, counter_uniform(seed, zeros.shape, wide=True))


def test_cast_takes_given_draws():
    y = torch.full((1000,), 2.5)  # halfway between the E2M1 values 2 and 3
    u = torch.linspace(0, 1 - 2**-24, 1000)
    out = cast(y, mf.E2M1, rounding="stochastic", uniform=u)
    assert torch.equal(out, round_stochastic(y, mf.E2M1, u))
    assert torch.equal(out, torch.where(u >= 0.5, 3.0, 2.0))


def test_counter_seeds_depend_on_seed_and_index_only():
    def seed_of(seed, index):
        return int(counter_seed(torch.tensor(seed, dtype=torch.int64), torch.tensor(index, dtype=torch.int64)))

    assert seed_of(3, 5) == seed_of(3, 5)  # no hidden state: (seed, index) is the whole state
    pairs = [(3, 0), (3, 1), (4, 0), (3 + 2**32, 0), (0, 0), (2**62 - 1, 2**32 - 1)]
    seeds = [seed_of(*p) for p in pairs]
    assert len(set(seeds)) == len(pairs) and all(0 <= s < 2**62 for s in seeds)
    # the draws of consecutive stream positions are uncorrelated
    x, y = (counter_uniform(counter_seed(torch.tensor(9), torch.tensor(i)), (COUNTER_DRAWS,)).double() for i in (0, 1))
    r = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
    assert abs(r) * math.sqrt(COUNTER_DRAWS) < Z_SIGMAS, r


# ---------------------------------------------------------------------------------------------------- div_rn


def _division_cases() -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (numerator, denominator) pairs: random magnitudes over the whole exponent range, and the edges —
    quotients that overflow, land on float32's largest value or in its subnormals, zeros, infinities and NaN."""
    gen = torch.Generator().manual_seed(11)
    n = 200_000
    mant = lambda: 1 + torch.rand(n, generator=gen, dtype=torch.float64)  # noqa: E731
    expo = lambda: torch.randint(-140, 128, (n,), generator=gen).double()  # noqa: E731
    num = (mant() * torch.exp2(expo())).float() * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    den = (mant() * torch.exp2(expo())).float()
    edges = torch.tensor([
        (448.0, 3.0), (1.0, 3.0), (2688.0, 7.0e-3), (1.0, 1e-38), (1.0, 2.0**-149), (3.4e38, 0.5), (3.4e38, 1.0),
        (2.0**-126, 3.0), (2.0**-140, 7.0), (1.0, 0.0), (-1.0, 0.0), (0.0, 5.0), (-0.0, 5.0), (1.0, math.inf),
        (math.inf, 2.0), (math.nan, 1.0), (1.0, math.nan), (0.0, 0.0), (57344.0, 1.7e-5), (6.0, 6.0)])
    return torch.cat([num, edges[:, 0]]), torch.cat([den, edges[:, 1]])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN in the same places, every other element the same float32 bits (signed zeros included)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def test_division_through_float64_is_the_float32_division():
    """The route compiled graphs take on a GPU: the float64 quotient of two float32 values rounded to float32 is their
    IEEE float32 quotient, bit for bit (double rounding is innocuous for division), eager and compiled; reciprocals
    too."""
    num, den = _division_cases()
    want = num / den  # IEEE float32 division (the CPU's)
    via64 = R._div_via_float64(num, den)
    assert _same_bits(via64, want)
    compiled = torch.compile(R._div_via_float64, dynamic=True)
    assert _same_bits(compiled(num, den), want)
    assert _same_bits(R._div_via_float64(1.0, den), den.reciprocal())
    assert _same_bits(R._div_via_float64(num, 6.0), num / torch.full_like(num, 6.0))


def test_div_rn_is_the_tensor_division_and_never_a_product_by_a_reciprocal():
    """div_rn with a float on either side divides tensor by tensor: `x / 6.0` on a GPU, and `448.0 / x` everywhere,
    are products by a reciprocal (two roundings), which differ from the quotient somewhere in these cases."""
    num, den = _division_cases()
    finite = torch.isfinite(num) & torch.isfinite(den) & (den != 0)
    num, den = num[finite], den[finite]
    assert _same_bits(R.div_rn(448.0, den), torch.full_like(den, 448.0) / den)
    assert _same_bits(R.div_rn(num, 6.0), num / torch.full_like(num, 6.0))
    assert _same_bits(R.reciprocal_rn(den), den.reciprocal())
    two_roundings = den.reciprocal() * 448.0
    assert not torch.equal(two_roundings, R.div_rn(448.0, den))  # the difference div_rn exists for is real here


def test_compiled_graphs_on_triton_devices_take_the_float64_route(monkeypatch):
    """Inside a compiled graph on a device inductor writes Triton for, div_rn and reciprocal_rn divide in float64 (the
    CPU stands in for one here): the compiled results are still float32 IEEE's, bit for bit, and so are the scales
    quantize computes from them."""
    num, den = _division_cases()
    calls = []
    real = R._div_via_float64
    monkeypatch.setattr(R, "_TRITON_DEVICES", ("cpu",))
    monkeypatch.setattr(R, "_div_via_float64", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda n, d: (R.div_rn(n, d), R.reciprocal_rn(d), R.div_rn(448.0, d)))
        got = compiled(num, den)
    finally:
        torch._dynamo.reset()
    assert calls, "the float64 route was not taken"
    for g, want in zip(got, (num / den, den.reciprocal(), torch.full_like(den, 448.0) / den)):
        assert _same_bits(g, want)
    assert R.div_rn(num, den) is not None and len(calls) == 3  # eager: the float32 division, not the route
