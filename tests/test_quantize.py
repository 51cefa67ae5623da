"""Tests for minifloat.numerics.quantize: `cast` bit for bit against ml_dtypes, and `quantize` at every granularity.

ml_dtypes is an independent implementation of the OCP formats (round-to-nearest-even, subnormals kept) that does not
saturate, so the reference for the saturating `cast` is  clip(x, -max, max) -> ml_dtypes -> float32.
"""

from __future__ import annotations

import importlib
import logging
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifloat.numerics.compiling import EAGER_BELOW, compile_enabled
from minifloat.numerics.formats import BF16, E2M1, E4M3, E5M2, E8M0, FP16, NumberFormat
from minifloat.numerics.granularity import GRANULARITIES, MX_BLOCK, TILE
from minifloat.numerics.quantize import Quantized, cast, quantize, scale_from_amax, sqnr_db

# `minifloat.numerics.quantize` is also the name of the function the package exports, so fetch the module itself
Q = importlib.import_module("minifloat.numerics.quantize")
EAGER_KERNEL = Q._cast_kernel_compiled.eager  # the plain Python function behind the compiled kernel

# (name, format, ml_dtypes type) for the element formats ml_dtypes implements
ML_FORMATS = [
    ("e4m3", E4M3, ml_dtypes.float8_e4m3fn),
    ("e5m2", E5M2, ml_dtypes.float8_e5m2),
    ("e2m1", E2M1, ml_dtypes.float4_e2m1fn),
]
ML_IDS = [c[0] for c in ML_FORMATS]
ML_PARAMS = [c[1:] for c in ML_FORMATS]

# SQNR floors for N(0, 1) data. Rounding to m mantissa bits leaves a relative error uniform within half an ulp
# (2^-(m+1)), so SQNR ≈ 6.02·m + 13.5 dB: measured 31.5 dB for E4M3 and 25.5 dB for E5M2 at every granularity.
# The floors sit 3.5 dB (about half a mantissa bit) below that.
SQNR_MARGIN_DB = 3.5


def sqnr_floor_db(fmt: NumberFormat) -> float:
    return 6.02 * fmt.mbits + 13.5 - SQNR_MARGIN_DB  # E4M3: 28.1 dB, E5M2: 22.0 dB


# quantize returns scale = 1 / (max / amax): two float32 roundings away from amax / max, at most 2 ulps = 2^-22
SCALE_RTOL = 2.0**-22

RAGGED_SHAPES = [(300, 260), (1, 5), (129, 33)]
RAGGED_IDS = ["300x260", "1x5", "129x33"]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20240611)


@pytest.fixture
def compiled_route():
    """Requested by the tests that exercise the compiled kernel; every other test runs its eager twin."""


@pytest.fixture(autouse=True)
def _eager_kernel_unless_compiled_route(request, monkeypatch):
    # Compiling each kernel variant costs seconds; test_quantize_compiled_and_eager_agree proves the compiled and
    # eager kernels give the same bits, so the remaining tests run the eager one.
    if "compiled_route" not in request.fixturenames:
        monkeypatch.setattr(Q, "_cast_kernel_compiled", EAGER_KERNEL)


# ---------------------------------------------------------------------------------------------------- helpers


def ml_reference(x: np.ndarray, fmt: NumberFormat, mltype) -> np.ndarray:
    """clip to ±max, round with ml_dtypes, back to float32; NaN stays NaN (E2M1 has no NaN code to keep it in)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = np.clip(x, -fmt.max, fmt.max).astype(mltype).astype(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), ref)


def mf_cast(x: np.ndarray, fmt: NumberFormat) -> np.ndarray:
    return cast(torch.from_numpy(np.asarray(x, dtype=np.float32)), fmt).numpy()


def assert_same_values(got: np.ndarray, ref: np.ndarray, x: np.ndarray) -> None:
    """NaN-aware equality (-0.0 == 0.0 here: the sign of zero is assert_same_signs' job, so that a failure says
    which of the two went wrong)."""
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    if not same.all():
        bad = np.flatnonzero(~same)[:8]
        raise AssertionError(f"{(~same).sum()} mismatches, e.g. x={x.ravel()[bad].tolist()} "
                             f"got={got.ravel()[bad].tolist()} expected={ref.ravel()[bad].tolist()}")


def assert_same_signs(got: np.ndarray, ref: np.ndarray, x: np.ndarray) -> None:
    ok = (np.signbit(got) == np.signbit(ref)) | np.isnan(ref)
    if not ok.all():
        bad = np.flatnonzero(~ok)[:8]
        raise AssertionError(f"{(~ok).sum()} sign mismatches, e.g. x={x.ravel()[bad].tolist()} "
                             f"got={got.ravel()[bad].tolist()} expected={ref.ravel()[bad].tolist()}")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of t, so that equality also covers NaN and the sign of zero."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def float32_sweep(step: int = 251) -> np.ndarray:
    """Every `step`-th float32 bit pattern (zeros, subnormals, normals, inf, NaN), both signs."""
    pos = np.arange(0, 2**31, step, dtype=np.uint32)
    pos = np.concatenate([pos, np.array([0x7F800000, 0x7FC00000, 0x00000001, 0x007FFFFF], dtype=np.uint32)])
    return np.concatenate([pos, pos | np.uint32(0x80000000)]).view(np.float32)


def grid(mltype) -> np.ndarray:
    """All finite non-negative values of an ml_dtypes format, ascending, in float64."""
    if mltype == ml_dtypes.float4_e2m1fn:
        codes = np.arange(16, dtype=np.uint8).astype(ml_dtypes.uint4)
    else:
        codes = np.arange(256, dtype=np.uint8)
    values = codes.view(mltype).astype(np.float64)
    return np.unique(values[np.isfinite(values) & (values >= 0)])


def midpoints(mltype) -> np.ndarray:
    """Exact midpoints between consecutive grid values (ties), as float32 (exact: the grids have <= 4 bits)."""
    g = grid(mltype)
    mids = (g[:-1] + g[1:]) / 2
    assert np.all(mids.astype(np.float32) == mids)
    return mids.astype(np.float32)


def reference_block_amax(t: torch.Tensor, granularity: str) -> torch.Tensor:
    """max |t| per scaling block of a 2-D tensor, by explicit slicing, shaped like Quantized.scale."""
    a = t.float().abs()
    m, k = a.shape
    if granularity == "tensor":
        return a.amax() if a.numel() else torch.zeros(())
    if granularity == "row":
        return a.amax(dim=-1, keepdim=True) if k else torch.zeros(m, 1)
    if granularity in ("tile", "mx"):
        b = TILE if granularity == "tile" else MX_BLOCK
        return torch.stack([a[:, j:j + b].amax(dim=-1) for j in range(0, k, b)], dim=-1)
    return torch.stack([torch.stack([a[i:i + TILE, j:j + TILE].amax() for j in range(0, k, TILE)])
                        for i in range(0, m, TILE)])


def expanded(scale: torch.Tensor, granularity: str, shape) -> torch.Tensor:
    """A scale broadcast to a 2-D data shape, by explicit slicing."""
    m, k = shape
    if granularity in ("tensor", "row"):
        return scale.expand(m, k).clone()
    out = torch.empty(m, k)
    if granularity in ("tile", "mx"):
        b = TILE if granularity == "tile" else MX_BLOCK
        for j in range(scale.shape[-1]):
            out[:, j * b:(j + 1) * b] = scale[:, j:j + 1]
        return out
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * TILE:(i + 1) * TILE, j * TILE:(j + 1) * TILE] = scale[i, j]
    return out


def is_power_of_two(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t.float())
    return bool(torch.all(mantissa == 0.5))


# ---------------------------------------------------------------------------------------------------- cast vs ml_dtypes

float32s = st.floats(width=32, allow_nan=True, allow_infinity=True)


@pytest.mark.parametrize("fmt, mltype", ML_PARAMS, ids=ML_IDS)
@settings(max_examples=300, deadline=None)
@given(values=st.lists(float32s, min_size=1, max_size=64))
def test_cast_matches_ml_dtypes_on_arbitrary_floats(fmt, mltype, values):
    x = np.array(values, dtype=np.float32)
    got, ref = mf_cast(x, fmt), ml_reference(x, fmt, mltype)
    assert_same_values(got, ref, x)
    assert_same_signs(got, ref, x)


@pytest.mark.parametrize("fmt, mltype", ML_PARAMS, ids=ML_IDS)
@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.floats(min_value=-2.0**-5, max_value=2.0**-5, width=32), min_size=1, max_size=64))
def test_cast_matches_ml_dtypes_near_the_subnormal_range(fmt, mltype, values):
    """Arbitrary floats pile up at the extremes; this draws from around the formats' subnormals."""
    x = np.array(values, dtype=np.float32) * np.float32(fmt.min_normal * 2**5)
    got, ref = mf_cast(x, fmt), ml_reference(x, fmt, mltype)
    assert_same_values(got, ref, x)
    assert_same_signs(got, ref, x)


@pytest.mark.parametrize("fmt, mltype", ML_PARAMS, ids=ML_IDS)
def test_cast_matches_ml_dtypes_on_float32_sweep(fmt, mltype):
    """Every 251st float32 bit pattern, both signs: values first, then the sign (negative values that round to zero
    give -0.0, as in ml_dtypes and IEEE 754)."""
    x = float32_sweep()
    got, ref = mf_cast(x, fmt), ml_reference(x, fmt, mltype)
    assert_same_values(got, ref, x)
    assert_same_signs(got, ref, x)


@pytest.mark.parametrize("fmt, mltype", ML_PARAMS, ids=ML_IDS)
@pytest.mark.parametrize("offset", ["tie", "above", "below"])
def test_cast_matches_ml_dtypes_at_midpoints(fmt, mltype, offset):
    """Ties round to even; one float32 ulp either side of a tie rounds to the nearer neighbour."""
    mids = midpoints(mltype)
    if offset == "above":
        mids = np.nextafter(mids, np.float32(np.inf))
    elif offset == "below":
        mids = np.nextafter(mids, np.float32(0))
    x = np.concatenate([mids, -mids])
    got, ref = mf_cast(x, fmt), ml_reference(x, fmt, mltype)
    assert_same_values(got, ref, x)
    assert_same_signs(got, ref, x)


@pytest.mark.parametrize("fmt, mltype", ML_PARAMS, ids=ML_IDS)
def test_cast_is_identity_on_the_grid(fmt, mltype):
    g = grid(mltype).astype(np.float32)
    x = np.concatenate([g, -g])
    got = mf_cast(x, fmt)
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(x))


# ---------------------------------------------------------------------------------------------------- cast golden table

NAN = float("nan")
INF = float("inf")

# (name, format, input, expected)
CAST_CASES = [
    ("e4m3-max-stays", E4M3, 448.0, 448.0),
    ("e4m3-449-saturates", E4M3, 449.0, 448.0),
    ("e4m3-464-saturates", E4M3, 464.0, 448.0),  # the tie between 448 and the NaN code
    ("e4m3-1e9-saturates", E4M3, 1e9, 448.0),
    ("e4m3-inf-saturates", E4M3, INF, 448.0),
    ("e4m3-neg-inf-saturates", E4M3, -INF, -448.0),
    ("e4m3-nan", E4M3, NAN, NAN),
    ("e4m3-min-subnormal-stays", E4M3, 2.0**-9, 2.0**-9),
    ("e4m3-half-min-subnormal-ties-to-zero", E4M3, 2.0**-10, 0.0),
    ("e4m3-1.5-min-subnormal-ties-to-even", E4M3, 1.5 * 2.0**-9, 2.0**-8),
    ("e4m3-min-normal-stays", E4M3, 2.0**-6, 2.0**-6),
    ("e4m3-tie-down-to-even", E4M3, 1.0 + 1 / 16, 1.0),
    ("e4m3-tie-up-to-even", E4M3, 1.0 + 3 / 16, 1.25),
    ("e4m3-negative", E4M3, -3.3, -3.25),
    ("e4m3-neg-zero", E4M3, -0.0, -0.0),
    ("e4m3-neg-tiny-to-neg-zero", E4M3, -(2.0**-11), -0.0),
    ("e5m2-max-stays", E5M2, 57344.0, 57344.0),
    ("e5m2-61440-saturates", E5M2, 61440.0, 57344.0),  # the tie between max and inf
    ("e5m2-1e9-saturates", E5M2, 1e9, 57344.0),
    ("e5m2-inf-saturates", E5M2, INF, 57344.0),
    ("e5m2-neg-inf-saturates", E5M2, -INF, -57344.0),
    ("e5m2-nan", E5M2, NAN, NAN),
    ("e5m2-min-subnormal-stays", E5M2, 2.0**-16, 2.0**-16),
    ("e5m2-half-min-subnormal-ties-to-zero", E5M2, 2.0**-17, 0.0),
    ("e5m2-1.5-min-subnormal-ties-to-even", E5M2, 1.5 * 2.0**-16, 2.0**-15),
    ("e5m2-tie-down-to-even", E5M2, 1.125, 1.0),
    ("e5m2-tie-up-to-even", E5M2, 1.375, 1.5),
    ("e5m2-neg-zero", E5M2, -0.0, -0.0),
    ("e2m1-max-stays", E2M1, 6.0, 6.0),
    ("e2m1-7-saturates", E2M1, 7.0, 6.0),
    ("e2m1-inf-saturates", E2M1, INF, 6.0),
    ("e2m1-neg-inf-saturates", E2M1, -INF, -6.0),
    ("e2m1-nan", E2M1, NAN, NAN),
    ("e2m1-quarter-ties-to-zero", E2M1, 0.25, 0.0),
    ("e2m1-0.75-ties-to-even", E2M1, 0.75, 1.0),
    ("e2m1-1.25-ties-to-even", E2M1, 1.25, 1.0),
    ("e2m1-2.5-ties-to-even", E2M1, 2.5, 2.0),
    ("e2m1-3.5-ties-to-even", E2M1, 3.5, 4.0),
    ("e2m1-5-ties-to-even", E2M1, 5.0, 4.0),
    ("e2m1-neg-zero", E2M1, -0.0, -0.0),
    ("bf16-rne", BF16, 1.0 + 2.0**-8, 1.0),
    ("fp16-saturates", FP16, 1e6, 65504.0),
    ("fp16-subnormal-stays", FP16, 2.0**-24, 2.0**-24),
]


@pytest.mark.parametrize("fmt, x, expected", [c[1:] for c in CAST_CASES], ids=[c[0] for c in CAST_CASES])
def test_cast_golden(fmt, x, expected):
    got = cast(torch.tensor([x], dtype=torch.float32), fmt)
    expected_t = torch.tensor([expected], dtype=torch.float32)
    torch.testing.assert_close(got, expected_t, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(expected_t)) or math.isnan(expected)


def test_cast_accepts_format_names():
    x = torch.tensor([449.0, 1.0 + 1 / 16])
    assert torch.equal(cast(x, "e4m3"), cast(x, E4M3))
    assert torch.equal(cast(x, "E4M3"), cast(x, E4M3))


def test_cast_unknown_format_name_raises():
    with pytest.raises(ValueError, match="e9m9"):
        cast(torch.ones(2), "e9m9")


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"])
def test_cast_returns_the_input_dtype_with_the_same_values(fmt, dtype, gen):
    """Every 8- and 4-bit grid value is exact in bf16, fp16 and fp64, so the dtype changes nothing but storage."""
    x = (torch.randn(4096, generator=gen) * 100).to(dtype)
    x[:4] = torch.tensor([INF, -INF, NAN, 1e-3])
    got = cast(x, fmt)
    assert got.dtype == dtype
    assert got.shape == x.shape
    expected = cast(x.float(), fmt)
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool],
                         ids=["int32", "int64", "uint8", "bool"])
def test_cast_rejects_non_floating_input(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        cast(torch.zeros(3, dtype=dtype), E4M3)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cast_passes_gradients_straight_through_and_stops_them_where_it_saturates(fmt, rounding, dtype):
    """With autograd on, cast gives the same bits as without, and its gradient is 1 inside [-max, max] and 0 where
    the value saturated or is NaN: the same rule for every format, rounding and route (before, E4M3 on a CPU passed
    gradients unchanged, the other routes returned whatever autograd made of the rounding's arithmetic)."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(4096, generator=g) * fmt.max / 3).to(dtype)
    x[:4] = torch.tensor([fmt.max, -fmt.max, float("inf"), float("nan")], dtype=dtype)
    x[4:8] = torch.tensor([fmt.max * 1.5, -fmt.max * 4, 0.0, -0.0], dtype=dtype)
    leaf = x.clone().requires_grad_(True)
    y = cast(leaf, fmt, rounding=rounding, generator=torch.Generator().manual_seed(3))
    want = cast(x, fmt, rounding=rounding, generator=torch.Generator().manual_seed(3))
    assert y.dtype == dtype and torch.equal(y.detach().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                            want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    upstream = torch.randn(x.shape, generator=g).to(dtype)
    y.backward(upstream)
    inside = (x.float().abs() <= fmt.max)
    assert leaf.grad.dtype == dtype
    assert torch.equal(leaf.grad, torch.where(inside, upstream, torch.zeros_like(upstream)))
    assert inside[:2].all() and not inside[2:4].any() and not inside[4:6].any()


def test_cast_gradient_works_under_torch_func_transforms():
    """torch.func.grad and vmap go through cast's straight-through rule as they go through plain torch ops."""
    x = torch.tensor([[0.3, -500.0, 2.5], [1e4, -0.01, float("nan")]])
    inside = ((x >= -E4M3.max) & (x <= E4M3.max)).float()
    grads = torch.func.vmap(torch.func.grad(lambda row: cast(row, E4M3).sum()))(x)
    assert torch.equal(grads, inside)
    mapped, want = torch.func.vmap(lambda row: cast(row, E4M3))(x), cast(x, E4M3)
    assert torch.equal(mapped.isnan(), want.isnan()) and torch.equal(mapped.nan_to_num(), want.nan_to_num())



def test_cast_keeps_shape(gen):
    x = torch.randn(3, 4, 5, generator=gen)
    assert cast(x, E4M3).shape == (3, 4, 5)
    assert cast(x.transpose(0, 2), E4M3).shape == (5, 4, 3)


# ---------------------------------------------------------------------------------------------------- cast to E8M0

# (name, input, expected): E8M0 holds 2^e, e in [-127, 127]; nearest power of two, ties (1.5·2^e) go up
E8M0_CASES = [
    ("one-stays", 1.0, 1.0),
    ("quarter-stays", 0.25, 0.25),
    ("pow2-1024-stays", 1024.0, 1024.0),
    ("max-stays", 2.0**127, 2.0**127),
    ("min-stays", 2.0**-127, 2.0**-127),
    ("3-rounds-up", 3.0, 4.0),
    ("1.4-rounds-down", 1.4, 1.0),
    ("1.5-tie-goes-up", 1.5, 2.0),
    ("0.7-rounds-down", 0.7, 0.5),
    ("zero-is-nan", 0.0, NAN),
    ("neg-zero-is-nan", -0.0, NAN),
    ("negative-is-nan", -1.0, NAN),
    ("nan-is-nan", NAN, NAN),
    ("huge-saturates", 3e38, 2.0**127),
    ("inf-saturates", INF, 2.0**127),
    ("tiny-goes-to-min", 1e-45, 2.0**-127),
]


@pytest.mark.parametrize("x, expected", [c[1:] for c in E8M0_CASES], ids=[c[0] for c in E8M0_CASES])
def test_cast_e8m0_golden(x, expected):
    got = cast(torch.tensor([x], dtype=torch.float32), E8M0)
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float32), rtol=0, atol=0, equal_nan=True)


def test_cast_e8m0_matches_ml_dtypes_on_normal_floats():
    """Positive float32 normals up to 2^127, plus the ties 1.5·2^e and their neighbours.

    Below 2^-126 (float32 subnormals) ml_dtypes rounds every value above 2^-127 up to 2^-126, which is not the
    nearest power of two (1.4·2^-127 is nearer 2^-127), so the comparison stops at the float32 normal range.
    """
    x = float32_sweep()
    ties = (1.5 * 2.0 ** np.arange(-126, 127)).astype(np.float32)
    x = np.concatenate([x, ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(np.inf))])
    x = x[np.isfinite(x) & (x >= 2.0**-126) & (x <= 2.0**127)]
    ref = x.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert_same_values(mf_cast(x, E8M0), ref, x)


# ---------------------------------------------------------------------------------------------------- scale_from_amax

# (name, amax, options, expected multiplier) for E4M3 (max 448)
SCALE_CASES = [
    ("unit", 448.0, {}, 1.0),
    ("half-range", 224.0, {}, 2.0),
    ("large-amax", 448.0 * 1024, {}, 1 / 1024),
    ("zero-falls-back", 0.0, {}, 1.0),
    ("inf-falls-back", INF, {}, 1.0),
    ("nan-falls-back", NAN, {}, 1.0),
    ("negative-falls-back", -1.0, {}, 1.0),
    ("custom-fallback", 0.0, {"fallback": 7.0}, 7.0),
    ("custom-fallback-nan", NAN, {"fallback": 0.25}, 0.25),
    ("margin-1", 448.0, {"margin": 1}, 0.5),
    ("margin-3", 224.0, {"margin": 3}, 0.25),
    ("pow2-exact", 448.0, {"power_of_two": True}, 1.0),
    ("pow2-rounds-down", 300.0, {"power_of_two": True}, 1.0),  # 448/300 = 1.49
    ("pow2-rounds-down-large", 100.0, {"power_of_two": True}, 4.0),  # 4.48
    ("pow2-rounds-down-small", 1e-3, {"power_of_two": True}, 2.0**18),  # 448000
    ("pow2-below-one", 1000.0, {"power_of_two": True}, 0.25),  # 0.448
    ("pow2-with-margin", 100.0, {"power_of_two": True, "margin": 1}, 2.0),
    ("pow2-zero-falls-back", 0.0, {"power_of_two": True}, 1.0),
]


@pytest.mark.parametrize("amax, options, expected", [c[1:] for c in SCALE_CASES], ids=[c[0] for c in SCALE_CASES])
def test_scale_from_amax_golden(amax, options, expected):
    s = scale_from_amax(torch.tensor(amax), E4M3, **options)
    assert s.dtype == torch.float32
    assert s.item() == expected


def test_scale_from_amax_margin_halves_the_scale_per_step():
    amax = torch.tensor([0.37, 3.0, 448.0, 1e4])
    base = scale_from_amax(amax, E4M3)
    for margin in range(1, 6):
        assert torch.equal(scale_from_amax(amax, E4M3, margin=margin), base / 2**margin)


def test_scale_from_amax_is_elementwise_and_always_finite():
    amax = torch.tensor([0.0, INF, NAN, -3.0, 448.0, 1.0])
    s = scale_from_amax(amax, E5M2)
    assert torch.isfinite(s).all()
    assert s.tolist()[:4] == [1.0, 1.0, 1.0, 1.0]
    assert s.tolist()[4:] == [57344.0 / 448.0, 57344.0]


def test_scale_from_amax_power_of_two_never_exceeds_the_exact_scale(gen):
    amax = torch.rand(1000, generator=gen) * 1e3 + 1e-3
    exact = scale_from_amax(amax, E4M3)
    p2 = scale_from_amax(amax, E4M3, power_of_two=True)
    assert is_power_of_two(p2)
    assert torch.all(p2 <= exact) and torch.all(p2 > exact / 2)


# ---------------------------------------------------------------------------------------------------- quantize

FP8 = [E4M3, E5M2]
FP8_IDS = ["e4m3", "e5m2"]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FP8, ids=FP8_IDS)
def test_quantize_sqnr_above_floor(fmt, granularity, gen):
    source = torch.randn(300, 260, generator=gen, dtype=torch.float64)  # ragged in both dims
    q = quantize(source.float(), fmt, granularity=granularity)
    assert sqnr_db(source, q.dequantize()) > sqnr_floor_db(fmt)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FP8, ids=FP8_IDS)
def test_quantize_power_of_two_sqnr_above_floor(fmt, granularity, gen):
    source = torch.randn(300, 260, generator=gen, dtype=torch.float64)
    q = quantize(source.float(), fmt, granularity=granularity, power_of_two=True)
    assert sqnr_db(source, q.dequantize()) > sqnr_floor_db(fmt)


# (name, input shape, granularity, expected scale shape), per Quantized's docstring
SCALE_SHAPES = [
    ("tensor", (300, 260), "tensor", ()),
    ("row", (300, 260), "row", (300, 1)),
    ("tile", (300, 260), "tile", (300, 3)),
    ("mx", (300, 260), "mx", (300, 9)),
    ("block", (300, 260), "block", (3, 3)),
    ("tile-1x5", (1, 5), "tile", (1, 1)),
    ("mx-1x5", (1, 5), "mx", (1, 1)),
    ("block-1x5", (1, 5), "block", (1, 1)),
    ("row-129x33", (129, 33), "row", (129, 1)),
    ("mx-129x33", (129, 33), "mx", (129, 2)),
    ("block-129x33", (129, 33), "block", (2, 1)),
    ("tensor-3d", (2, 130, 70), "tensor", ()),
    ("row-3d", (2, 130, 70), "row", (2, 130, 1)),
    ("tile-3d", (2, 130, 300), "tile", (2, 130, 3)),
    ("mx-3d", (2, 130, 70), "mx", (2, 130, 3)),
    ("block-3d", (2, 130, 300), "block", (2, 2, 3)),
    ("tile-1d", (300,), "tile", (3,)),
    ("mx-1d", (64,), "mx", (2,)),
    ("row-1d", (64,), "row", (1,)),
    ("tensor-empty", (0, 64), "tensor", ()),
    ("row-empty", (0, 64), "row", (0, 1)),
    ("tile-empty", (0, 64), "tile", (0, 1)),
    ("mx-empty", (0, 64), "mx", (0, 2)),
    ("block-empty", (0, 64), "block", (0, 1)),
]


@pytest.mark.parametrize("shape, granularity, scale_shape", [c[1:] for c in SCALE_SHAPES],
                         ids=[c[0] for c in SCALE_SHAPES])
@pytest.mark.parametrize("fmt", [E4M3, E2M1], ids=["e4m3", "e2m1"])  # float8 and float32 storage
def test_quantize_shapes_and_dtypes(fmt, shape, granularity, scale_shape, gen):
    x = torch.randn(*shape, generator=gen)
    q = quantize(x, fmt, granularity=granularity)
    assert q.shape == x.shape
    assert q.data.dtype == (fmt.torch_dtype or torch.float32)
    assert q.scale.shape == scale_shape
    assert q.scale.dtype == torch.float32
    assert q.amax is not None and q.amax.shape == scale_shape
    assert q.granularity == granularity and q.fmt is fmt
    assert q.dequantize().shape == x.shape
    assert q.expanded_scale().expand(x.shape).shape == x.shape
    assert torch.isfinite(q.scale).all()


@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_dequantize_is_data_times_scale(granularity, shape, gen):
    x = torch.randn(*shape, generator=gen) * 10
    q = quantize(x, E4M3, granularity=granularity)
    expected = q.data.float() * expanded(q.scale, granularity, shape)
    assert torch.equal(q.dequantize(), expected)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_quantize_scaling_uses_the_full_range(fmt, granularity, shape, gen):
    """scale = amax / max, so each block's largest element lands on ±max (rounding of amax·(max/amax) included)."""
    x = torch.randn(*shape, generator=gen) * 3
    q = quantize(x, fmt, granularity=granularity)
    torch.testing.assert_close(q.amax, reference_block_amax(x, granularity), rtol=0, atol=0)
    data_amax = reference_block_amax(q.data, granularity)
    assert torch.all(data_amax == fmt.max), data_amax
    torch.testing.assert_close(q.scale, q.amax / fmt.max, rtol=SCALE_RTOL, atol=0)


@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
@pytest.mark.parametrize("fmt", FP8, ids=FP8_IDS)
def test_quantize_power_of_two_scales(fmt, granularity, shape, gen):
    """Power-of-two scales are the largest 2^k that keep amax within range: each block's max lands in [max/2, max]."""
    x = torch.randn(*shape, generator=gen) * 3
    q = quantize(x, fmt, granularity=granularity, power_of_two=True)
    assert is_power_of_two(q.scale)
    data_amax = reference_block_amax(q.data, granularity)
    assert torch.all(data_amax <= fmt.max) and torch.all(data_amax >= fmt.max / 2), data_amax
    # nothing saturates: the scaled source never exceeds max (power-of-two scaling is exact)
    assert torch.all(x.abs() / expanded(q.scale, granularity, shape) <= fmt.max)


@pytest.mark.parametrize("scale_exp", [-122, -60, 60, 100], ids=lambda e: f"2^{e}")
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_sqnr_does_not_depend_on_magnitude(granularity, scale_exp, gen):
    """Scaling exists to make the magnitude irrelevant: N(0, 1)·2^k quantizes as well as N(0, 1) for any float32 k.

    At 2^-122 (amax ≈ 1e-36) the ideal multiplier 448 / amax exceeds float32's range; a finite, positive amax must
    still give a usable scale, not the zero/inf/NaN fallback.
    """
    source = torch.randn(300, 260, generator=gen, dtype=torch.float64) * 2.0**scale_exp
    q = quantize(source.float(), E4M3, granularity=granularity)
    assert sqnr_db(source, q.dequantize()) > sqnr_floor_db(E4M3)


@pytest.mark.parametrize("scale_exp", [-30, 0, 40], ids=lambda e: f"2^{e}")
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_never_exceeds_max_at_any_magnitude(granularity, scale_exp, gen):
    x = torch.randn(129, 140, generator=gen) * 2.0**scale_exp
    for fmt in (E4M3, E5M2, E2M1):
        q = quantize(x, fmt, granularity=granularity)
        assert q.data.float().abs().max() <= fmt.max
        assert torch.isfinite(q.scale).all() and torch.all(q.scale > 0)


def test_quantize_e2m1_data_lies_on_the_grid(gen):
    x = torch.randn(64, 96, generator=gen)
    for granularity in GRANULARITIES:
        q = quantize(x, E2M1, granularity=granularity)
        values = set(q.data.abs().unique().tolist())
        assert values <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}, (granularity, values)


# ---------------------------------------------------------------------------------------------------- quantize: mx


@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("rule", ["up", "floor"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_mx_scales_are_powers_of_two(fmt, rule, shape, gen):
    x = torch.randn(*shape, generator=gen) * 5
    q = quantize(x, fmt, granularity="mx", mx_rule=rule)
    assert is_power_of_two(q.scale)
    assert torch.equal(torch.log2(q.scale), torch.log2(q.scale).round())
    assert torch.all(q.scale >= E8M0.min_normal) and torch.all(q.scale <= E8M0.max)


@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_mx_rule_up_never_saturates(fmt, shape, gen):
    """rule "up": 2^e is the smallest power of two with amax/2^e <= max, so no element is clipped."""
    x = torch.randn(*shape, generator=gen) * 5
    q = quantize(x, fmt, granularity="mx", mx_rule="up")
    scaled = x / expanded(q.scale, "mx", shape)  # exact: the scales are powers of two
    assert torch.all(scaled.abs() <= fmt.max)
    assert torch.equal(q.data.float(), cast(scaled, fmt))  # so the clamp inside cast changed nothing
    block_amax = reference_block_amax(x, "mx")
    assert torch.all(block_amax / q.scale > fmt.max / 2)  # ... and it is the smallest such power


@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_mx_rule_floor_follows_ocp(fmt, shape, gen):
    """OCP MX v1.0 §6.3: X = 2^(floor(log2(amax)) - emax_elem); computed here exactly with frexp in float64."""
    x = torch.randn(*shape, generator=gen) * 5
    q = quantize(x, fmt, granularity="mx", mx_rule="floor")
    block_amax = reference_block_amax(x, "mx").double().flatten().tolist()
    expected = [2.0 ** (math.frexp(a)[1] - 1 - fmt.emax) for a in block_amax]
    assert q.scale.double().flatten().tolist() == expected
    assert torch.equal(q.data.float(), cast(x / expanded(q.scale, "mx", shape), fmt))


# (name, format, rule, block amax, expected scale): one 1x32 block with its largest element at amax
MX_CASES = [
    ("e4m3-up-at-max", E4M3, "up", 448.0, 1.0),
    ("e4m3-up-just-above-max", E4M3, "up", 449.0, 2.0),
    ("e4m3-up-2max", E4M3, "up", 896.0, 2.0),
    ("e4m3-up-one", E4M3, "up", 1.0, 2.0**-8),
    ("e4m3-up-zero-block", E4M3, "up", 0.0, 1.0),
    ("e4m3-floor-one", E4M3, "floor", 1.0, 2.0**-8),
    ("e4m3-floor-449", E4M3, "floor", 449.0, 1.0),
    ("e4m3-floor-511", E4M3, "floor", 511.0, 1.0),
    ("e4m3-floor-512", E4M3, "floor", 512.0, 2.0),
    ("e4m3-floor-zero-block", E4M3, "floor", 0.0, 1.0),
    ("e5m2-up-at-max", E5M2, "up", 57344.0, 1.0),
    ("e5m2-floor-one", E5M2, "floor", 1.0, 2.0**-15),
    ("e2m1-up-at-max", E2M1, "up", 6.0, 1.0),
    ("e2m1-up-7", E2M1, "up", 7.0, 2.0),
    ("e2m1-floor-7", E2M1, "floor", 7.0, 1.0),
    # float32's top binade: the "up" rule's 2^120 would let 3.3e38 round to 256 · 2^120 = 2^128 (inf); capped at
    # the floor rule's 2^(127 - emax), the block saturates to 448 · 2^119 instead
    ("e4m3-up-f32-top", E4M3, "up", 3.3e38, 2.0**119),
    ("e4m3-up-f32-max", E4M3, "up", torch.finfo(torch.float32).max, 2.0**119),
    ("e5m2-up-f32-max", E5M2, "up", torch.finfo(torch.float32).max, 2.0**112),
    ("e2m1-up-f32-max", E2M1, "up", torch.finfo(torch.float32).max, 2.0**125),
    ("e4m3-floor-f32-max", E4M3, "floor", torch.finfo(torch.float32).max, 2.0**119),
]


@pytest.mark.parametrize("fmt, rule, amax, expected", [c[1:] for c in MX_CASES], ids=[c[0] for c in MX_CASES])
def test_mx_scale_golden(fmt, rule, amax, expected):
    x = torch.zeros(1, MX_BLOCK)
    x[0, 0] = -amax
    x[0, 1:] = amax / 4
    q = quantize(x, fmt, granularity="mx", mx_rule=rule)
    assert q.scale.item() == expected
    assert q.data.float().abs().max().item() == cast(torch.tensor(amax / expected), fmt).item()  # saturated
    assert torch.isfinite(q.dequantize()).all()  # a finite block dequantizes finite (2^128 was inf)


# ---------------------------------------------------------------------------------------------------- quantize: options


@pytest.mark.parametrize("power_of_two", [False, True], ids=["any-scale", "pow2"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_operand_is_exact_bf16(fmt, granularity, power_of_two, gen):
    shape = (129, 140)
    x = torch.randn(*shape, generator=gen) * 7
    q = quantize(x, fmt, granularity=granularity, power_of_two=power_of_two, operand_dtype=torch.bfloat16)
    assert q.operand is not None and q.operand.dtype == torch.bfloat16 and q.operand.shape == shape
    # power-of-two block scales are folded into the operand; tensor/row scales are applied after the GEMM
    assert q.scale_folded == (granularity == "mx" or (power_of_two and granularity in ("tile", "block")))
    expected = q.data.float() * expanded(q.scale, granularity, shape) if q.scale_folded else q.data.float()
    assert torch.equal(q.operand.float(), expected)
    assert torch.equal(expected.to(torch.bfloat16).float(), expected)  # the values themselves are bf16-exact


def test_operand_is_none_unless_asked(gen):
    assert quantize(torch.randn(4, 8, generator=gen), E4M3).operand is None


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_explicit_scale_is_used_as_given(granularity, gen):
    x = torch.randn(6, 40, generator=gen) * 10
    if granularity == "tensor":
        scale = torch.tensor(0.375)  # deliberately not amax/max, not a power of two
    else:
        scale = torch.linspace(0.01, 2.0, 6).reshape(6, 1)
    q = quantize(x, E4M3, granularity=granularity, scale=scale)
    assert torch.equal(q.scale, scale)
    # per Quantized's docstring: with an explicit scale, amax is still measured for "tensor" (delayed scaling needs
    # this step's amax) and None otherwise
    if granularity == "tensor":
        assert q.amax.item() == x.abs().max().item()
    else:
        assert q.amax is None
    assert torch.equal(q.data.float(), cast(x * (1.0 / scale), E4M3))


def test_explicit_row_scale_accepts_a_flat_vector(gen):
    x = torch.randn(6, 40, generator=gen)
    scale = torch.linspace(0.01, 2.0, 6)
    q = quantize(x, E4M3, granularity="row", scale=scale)
    assert q.scale.shape == (6, 1)
    assert torch.equal(q.scale.flatten(), scale)


def test_explicit_scale_saturates_instead_of_overflowing(gen):
    x = torch.randn(8, 8, generator=gen) * 1e4
    q = quantize(x, E4M3, scale=torch.tensor(1.0))
    assert q.data.float().abs().max() == E4M3.max


@pytest.mark.parametrize("granularity", ["tile", "block", "mx"])
def test_explicit_scale_rejected_for_blocked_granularities(granularity):
    with pytest.raises(ValueError, match=f"scale.*{granularity!r}"):
        quantize(torch.randn(4, 256), E4M3, granularity=granularity, scale=torch.tensor(1.0))


@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_zero_tensor(granularity, shape):
    q = quantize(torch.zeros(*shape), E4M3, granularity=granularity)
    assert torch.isfinite(q.scale).all() and torch.all(q.scale > 0)
    assert torch.all(q.data.float() == 0)
    assert torch.all(q.dequantize() == 0)


# (name, value planted at [1, 3], expected data there)
POISON_CASES = [
    ("nan", NAN, NAN),
    ("inf", INF, E4M3.max),
    ("neg-inf", -INF, -E4M3.max),
]


@pytest.mark.parametrize("value, expected", [c[1:] for c in POISON_CASES], ids=[c[0] for c in POISON_CASES])
def test_non_finite_input_tensor_granularity_falls_back_to_unit_scale(value, expected, gen):
    x = torch.randn(4, 40, generator=gen)
    x[1, 3] = value
    q = quantize(x, E4M3)
    assert q.scale.item() == 1.0  # scale_from_amax's fallback
    got = q.data.float()
    torch.testing.assert_close(got[1, 3], torch.tensor(expected), rtol=0, atol=0, equal_nan=True)
    clean = torch.ones_like(x, dtype=torch.bool)
    clean[1, 3] = False
    assert torch.equal(got[clean], cast(x, E4M3)[clean])  # the rest quantized with scale 1


@pytest.mark.parametrize("value, expected", [c[1:] for c in POISON_CASES], ids=[c[0] for c in POISON_CASES])
@pytest.mark.parametrize("granularity", ["row", "tile", "block", "mx"])
def test_non_finite_input_leaves_other_blocks_alone(granularity, value, expected, gen):
    x = torch.randn(130, 140, generator=gen)
    poisoned = x.clone()
    poisoned[1, 3] = value
    q_clean = quantize(x, E4M3, granularity=granularity)
    q = quantize(poisoned, E4M3, granularity=granularity)
    assert torch.isfinite(q.scale).all()
    # the scaling block holding [1, 3]: row 1, column block 0, row block 0
    hit = torch.zeros_like(q.scale, dtype=torch.bool)
    if granularity == "block":
        hit[0, 0] = True
    else:
        hit[1, 0] = True
    assert torch.all(q.scale[hit] == 1.0)
    assert torch.equal(q.scale[~hit], q_clean.scale[~hit])
    in_block = expanded(hit.float(), granularity, x.shape).bool()
    assert torch.equal(bits(q.data)[~in_block], bits(q_clean.data)[~in_block])
    torch.testing.assert_close(q.data.float()[1, 3], torch.tensor(expected), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_nan_stays_nan_in_e5m2_data(granularity, gen):
    x = torch.randn(130, 140, generator=gen)
    x[5, 7] = NAN
    q = quantize(x, E5M2, granularity=granularity)
    assert torch.isnan(q.data.float()).sum() == 1 and torch.isnan(q.data.float()[5, 7])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_negative_zero_keeps_its_sign(granularity):
    x = torch.tensor([[-0.0, 1.0, -1e-30, 2.0] * 16])
    q = quantize(x, E4M3, granularity=granularity)
    assert torch.equal(torch.signbit(q.data.float()), torch.signbit(x))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_3d_matches_2d(granularity, gen):
    """Leading dims are batch dims: blocks never straddle them."""
    x = torch.randn(3, 130, 200, generator=gen)
    q = quantize(x, E4M3, granularity=granularity)
    if granularity == "tensor":
        ref = quantize(x.reshape(-1, 200), E4M3, granularity=granularity)
        assert torch.equal(q.scale, ref.scale)
        assert torch.equal(bits(q.data), bits(ref.data).reshape(x.shape))
    elif granularity == "block":
        for i in range(3):
            ref = quantize(x[i], E4M3, granularity=granularity)
            assert torch.equal(q.scale[i], ref.scale)
            assert torch.equal(bits(q.data[i]), bits(ref.data))
    else:
        ref = quantize(x.reshape(-1, 200), E4M3, granularity=granularity)
        assert torch.equal(q.scale, ref.scale.reshape(q.scale.shape))
        assert torch.equal(bits(q.data), bits(ref.data).reshape(x.shape))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_non_contiguous_input(granularity, gen):
    x = torch.randn(260, 300, generator=gen).t()  # (300, 260), a transposed view
    assert not x.is_contiguous()
    q = quantize(x, E4M3, granularity=granularity, operand_dtype=torch.bfloat16)
    ref = quantize(x.contiguous(), E4M3, granularity=granularity, operand_dtype=torch.bfloat16)
    assert torch.equal(q.scale, ref.scale)
    assert torch.equal(bits(q.data), bits(ref.data))
    assert torch.equal(bits(q.operand), bits(ref.operand))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_bf16_input_matches_float32(granularity, gen):
    x = torch.randn(130, 200, generator=gen).to(torch.bfloat16)
    q = quantize(x, E4M3, granularity=granularity)
    ref = quantize(x.float(), E4M3, granularity=granularity)
    assert torch.equal(q.scale, ref.scale)
    assert torch.equal(bits(q.data), bits(ref.data))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_zero_element_input(granularity):
    x = torch.empty(0, 64)
    q = quantize(x, E4M3, granularity=granularity, operand_dtype=torch.bfloat16)
    assert q.shape == (0, 64) and q.data.numel() == 0
    assert q.operand.shape == (0, 64)
    assert q.dequantize().shape == (0, 64)
    assert torch.isfinite(q.scale).all()


def test_block_granularity_needs_two_dims():
    with pytest.raises(ValueError, match="block"):
        quantize(torch.randn(300), E4M3, granularity="block")


# (name, call, exception, message pattern)
BAD_ARGUMENTS = [
    ("granularity", lambda: quantize(torch.randn(4, 4), E4M3, granularity="foo"), ValueError, "granularity.*'foo'"),
    ("mx-rule", lambda: quantize(torch.randn(4, 4), E4M3, granularity="mx", mx_rule="x"), ValueError, "mx_rule.*'x'"),
    ("integer-tensor", lambda: quantize(torch.ones(4, 4, dtype=torch.int64), E4M3), TypeError, "int64"),
    ("bool-tensor", lambda: quantize(torch.ones(4, 4, dtype=torch.bool), E4M3), TypeError, "bool"),
    ("e8m0-elements", lambda: quantize(torch.randn(4, 4), E8M0), ValueError, "E8M0"),
    ("e8m0-by-name", lambda: quantize(torch.randn(4, 4), "e8m0"), ValueError, "E8M0"),
    ("unknown-format", lambda: quantize(torch.randn(4, 4), "e9m9"), ValueError, "e9m9"),
    ("scale-for-tile", lambda: quantize(torch.randn(4, 4), E4M3, granularity="tile", scale=torch.tensor(1.0)),
     ValueError, "'tile'"),
    ("mx-scale-rule", lambda: Q.mx_scale(torch.tensor(1.0), E4M3, rule="nearest"), ValueError, "'nearest'"),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in BAD_ARGUMENTS], ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_raise_naming_the_problem(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@settings(max_examples=150, deadline=None)
@given(values=st.lists(float32s, min_size=1, max_size=80), granularity=st.sampled_from(GRANULARITIES),
       fmt=st.sampled_from([E4M3, E5M2, E2M1]))
def test_quantize_any_floats_gives_finite_scales_and_bounded_data(values, granularity, fmt):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    q = quantize(x, fmt, granularity=granularity)
    assert torch.isfinite(q.scale).all() and torch.all(q.scale > 0)
    data = q.data.float()
    assert torch.equal(torch.isnan(data), torch.isnan(x))
    assert torch.all(data[~torch.isnan(data)].abs() <= fmt.max)


# ---------------------------------------------------------------------------------------------------- compiled vs eager


def _strictly_compiled_kernel():
    """A fresh torch.compile of the eager kernel that raises instead of falling back, so the comparison is real.

    The library's own wrapper silently runs eagerly once compiling fails (e.g. after dynamo's recompile limit), so
    comparing against it alone could compare eager with eager.
    """
    def kernel(*args, **kwargs):
        return EAGER_KERNEL(*args, **kwargs)

    return torch.compile(kernel, dynamic=True, fullgraph=True)


def _tricky_input(gen: torch.Generator) -> torch.Tensor:
    """Gaussian data plus NaN, ±inf, ±0, subnormal-range values and exact E4M3 ties."""
    x = torch.randn(130, 300, generator=gen)
    specials = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 2.0**-10, -(2.0**-10), 1.5 * 2.0**-9, 1.0 + 1 / 16, 464.0,
                             1e-30, -1e-30, 3e38])
    x[0, : specials.numel()] = specials
    x[129, -specials.numel():] = specials
    return x


def assert_same_quantized(q: Quantized, ref: Quantized) -> None:
    """Bit-identical scales, amax, data and operand; NaN counts as equal to NaN whatever its sign bit."""
    assert torch.equal(q.scale, ref.scale)
    assert (q.amax is None) == (ref.amax is None)
    if ref.amax is not None:
        torch.testing.assert_close(q.amax, ref.amax, rtol=0, atol=0, equal_nan=True)
    for a, b in ((q.data, ref.data), (q.operand, ref.operand)):
        if b is None:
            assert a is None
            continue
        nan = torch.isnan(b.float())
        assert torch.equal(torch.isnan(a.float()), nan)
        assert torch.equal(bits(a)[~nan], bits(b)[~nan])


# (name, format, input, options). Each distinct combination costs a compilation (seconds), so a few that cover
# every branch of the kernel: 0-d and per-block qscale, with and without an operand, with and without a folded
# scale. "sweep" with a unit scale makes the kernel a plain saturating cast of every 4093rd float32 bit pattern, so
# the rounding arithmetic (Veltkamp split, (y + K) - K) must survive compilation bit for bit.
COMPILE_CASES = [
    ("e4m3-sweep", E4M3, "sweep", {"scale": torch.tensor(1.0), "operand_dtype": torch.bfloat16}),
    ("e5m2-sweep", E5M2, "sweep", {"scale": torch.tensor(1.0), "operand_dtype": torch.bfloat16}),
    ("e2m1-sweep", E2M1, "sweep", {"scale": torch.tensor(1.0), "operand_dtype": torch.bfloat16}),
    ("e4m3-row", E4M3, "tricky", {"granularity": "row"}),
    ("e4m3-mx-folded", E4M3, "tricky", {"granularity": "mx", "operand_dtype": torch.bfloat16}),
    ("e5m2-block-pow2-folded", E5M2, "tricky", {"granularity": "block", "power_of_two": True,
                                                 "operand_dtype": torch.bfloat16}),
]


@pytest.mark.parametrize("fmt, source, options", [c[1:] for c in COMPILE_CASES], ids=[c[0] for c in COMPILE_CASES])
def test_quantize_compiled_and_eager_agree(fmt, source, options, gen, compiled_route, monkeypatch):
    if not compile_enabled():
        pytest.skip("MINIFLOAT_COMPILE disables torch.compile")
    x = torch.from_numpy(float32_sweep(step=4093)) if source == "sweep" else _tricky_input(gen)
    default = quantize(x, fmt, **options)  # the library's route: compiled, unless its wrapper fell back to eager
    with torch._dynamo.config.patch(recompile_limit=64):
        monkeypatch.setattr(Q, "_cast_kernel_compiled", _strictly_compiled_kernel())
        compiled = quantize(x, fmt, **options)
    monkeypatch.setattr(Q, "_cast_kernel_compiled", EAGER_KERNEL)
    eager = quantize(x, fmt, **options)
    assert_same_quantized(compiled, eager)
    assert_same_quantized(default, eager)
    if source == "sweep":
        torch.testing.assert_close(eager.data.float(), cast(x, fmt), rtol=0, atol=0, equal_nan=True)


def test_quantize_is_deterministic(gen):
    x = _tricky_input(gen)
    for granularity in GRANULARITIES:
        a = quantize(x, E4M3, granularity=granularity, operand_dtype=torch.bfloat16)
        b = quantize(x.clone(), E4M3, granularity=granularity, operand_dtype=torch.bfloat16)
        assert torch.equal(bits(a.data), bits(b.data))  # strictly: NaN sign bits too
        assert torch.equal(bits(a.operand), bits(b.operand))
        assert torch.equal(a.scale, b.scale)


def test_given_amax_is_returned_with_an_explicit_tensor_scale():
    x = torch.randn(64, 48)
    scale = torch.tensor(0.01)
    own = Q.quantize(x, E4M3, scale=scale)
    given = Q.quantize(x, E4M3, scale=scale, amax=x.abs().max())
    assert torch.equal(own.data.float(), given.data.float()) and torch.equal(own.amax, given.amax)


@pytest.mark.parametrize("kwargs", [{"granularity": "row", "scale": torch.ones(64, 1)}, {"granularity": "row"},
                                    {"granularity": "tile"}], ids=["row-scale", "row", "tile"])
def test_a_given_amax_is_per_tensor_only(kwargs):
    with pytest.raises(ValueError, match="amax"):
        Q.quantize(torch.randn(64, 256), E4M3, amax=torch.tensor(1.0), **kwargs)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_a_shard_cast_with_the_whole_amax_is_that_part_of_the_whole_cast(power_of_two):
    """Without a scale, a given amax sets the scale: a shard cast with the whole tensor's amax is bitwise the
    matching rows of the whole tensor's cast (what an FP8 all-gather of shards relies on)."""
    x = torch.randn(64, 48) * torch.logspace(-3, 3, 64)[:, None]
    whole = Q.quantize(x, E4M3, power_of_two=power_of_two)
    shard = Q.quantize(x[16:40], E4M3, power_of_two=power_of_two, amax=x.abs().max())
    assert torch.equal(shard.scale, whole.scale)
    assert torch.equal(shard.data.view(torch.uint8), whole.data[16:40].view(torch.uint8))


def test_small_tensors_skip_the_compiled_kernel(gen, monkeypatch):
    """maybe_compile runs a kernel eagerly below EAGER_BELOW elements (its guards cost more than the ops there), and
    the bits are the same either way."""
    from minifloat.numerics import compiling

    calls = []
    kernel = compiling.maybe_compile(lambda x: calls.append(torch.compiler.is_compiling()) or x * 2)
    small = torch.randn(8, 8, generator=gen)
    assert torch.equal(kernel(small), small * 2) and calls == [False]  # eager: called outside any trace
    if compile_enabled():
        monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
        assert torch.equal(kernel(small), small * 2) and calls[-1] is True  # traced by torch.compile


def test_a_dispatch_mode_runs_a_kernel_eagerly_once_and_compiling_goes_on(gen, monkeypatch, caplog):
    """dynamo cannot trace under a torch dispatch mode (a user's FlopCounterMode measuring a step): the kernel runs
    eagerly for that call, with no warning, and the next call outside the mode compiles. Before, the failed compile
    made the kernel eager for the rest of the process."""
    from torch.utils.flop_counter import FlopCounterMode

    from minifloat.numerics import compiling

    if not compile_enabled():
        pytest.skip("MINIFLOAT_COMPILE=0: nothing compiles")
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
    calls = []
    kernel = compiling.maybe_compile(lambda x: calls.append(torch.compiler.is_compiling()) or x * 2)
    x = torch.randn(8, 8, generator=gen)
    with caplog.at_level(logging.WARNING, logger="minifloat"), FlopCounterMode(display=False):
        assert torch.equal(kernel(x), x * 2)
    assert calls == [False] and not caplog.records  # eager, and no "compiling ... failed"
    assert torch.equal(kernel(x), x * 2) and calls[-1] is True  # traced by torch.compile


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256), (1024, 128)], ids=str)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("power_of_two", [False, True])
def test_whole_128x128_blocks_cast_through_a_view_as_through_block_rows(gen, shape, fmt, power_of_two):
    """A contiguous tensor of whole 128×128 blocks is cast through a 4-D view of itself (no copy into block order
    and back); a transposed copy of the same values takes the block-row route. Both give the same bits: data,
    operand, scales and amaxes (NaN, inf and an all-zero block included). (1024, 128) holds 131072 elements,
    above compiling.EAGER_BELOW: the compiled kernels."""
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[-1])
    x[..., :128, :128] = 0.0
    x.view(-1)[7], x.view(-1)[-5], x.view(-1)[300] = float("nan"), float("inf"), -float("inf")
    strided = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, not contiguous
    assert not strided.is_contiguous()
    a, b = (quantize(t, fmt, granularity="block", power_of_two=power_of_two, operand_dtype=torch.bfloat16)
            for t in (x, strided))
    for field in ("data", "operand", "scale", "amax"):
        ta, tb = getattr(a, field), getattr(b, field)
        assert ta.shape == tb.shape and torch.equal(_bits(ta.contiguous()), _bits(tb.contiguous())), field
    assert a.data.is_contiguous() and a.operand.is_contiguous()


@pytest.mark.parametrize("shape, dim", [
    ((512, 96), -2),  # a 2-D tensor's column amaxes (row scaling's cast along the token axis)
    ((4, 128, 96), -2),  # 128×1 tiles down the columns
    ((16, 32, 96), 1),  # MX blocks of 32 down the columns
    ((4, 128, 3, 32), -3),  # the tile view of requantize_t, (MB, 128, KB, n), with narrower blocks
    ((8, 6144), 0),  # too few rows to split: one stage
    ((520, 96), -2),  # a row count the split does not divide: one stage
    ((512, 96), -1),  # along the rows: never split
])
@pytest.mark.parametrize("two_stages", [True, False], ids=["two stages", "one stage"])
def test_block_amax_down_the_columns_is_the_plain_reduction(shape, dim, two_stages, monkeypatch):
    """abs_max along a dim other than the last reduces in two stages on the CPU (chunks of rows first, for memory
    order) from _DOWN_MIN_ELEMENTS on (lowered here, so that these small tensors take that route): the same float32
    maxima as one reduction, compiled (abs_max: tensors this large take the compiled kernel) and eager, with NaN,
    -inf and a huge finite value where they are."""
    if two_stages:
        monkeypatch.setattr(Q, "_DOWN_MIN_ELEMENTS", 0)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    flat = x.view(-1)
    flat[11], flat[-5], flat[flat.numel() // 2] = float("nan"), float("-inf"), -3e38
    assert x.numel() >= EAGER_BELOW
    expected = x.double().abs().amax(dim, keepdim=True).float()  # NaN propagates through amax
    for got in (Q.abs_max(x, dim), Q._block_amax.eager(x, dim)):
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(0), expected.nan_to_num(0))


def _positive_grid(fmt) -> torch.Tensor:
    """Every finite positive value of an 8- or 16-bit format with a torch dtype, as float64, ascending."""
    codes = torch.arange(2 ** fmt.bits, dtype=torch.int32).to(torch.int16 if fmt.bits == 16 else torch.uint8)
    values = codes.view(fmt.torch_dtype).double()
    return values[torch.isfinite(values) & (values > 0) & (values <= fmt.max)].unique()


@pytest.mark.parametrize("fmt", [E4M3, E5M2, BF16, FP16], ids=lambda f: f.name)
def test_float64_inputs_round_once_to_the_nearest_value(fmt):
    # float64 was rounded to float32 first: 1.0625 + 1e-12 (just above the tie 1.0625, nearest E4M3 1.125) became
    # 1.0625 in float32, then the tie went to even, 1.0. Just above and below every midpoint of the grid, and on it.
    grid = _positive_grid(fmt)
    low, high = grid[:-1], grid[1:]
    mid = (low + high) / 2  # exact in float64
    nudge = mid * 2.0**-40
    x = torch.cat([mid + nudge, mid - nudge, mid])
    low_is_odd = torch.arange(len(low)) % 2 == 0  # grid[i] is code i + 1: the codes ascend with the values
    ties = torch.where(low_is_odd, high, low)  # a tie goes to the neighbour with the even code
    expected = torch.cat([high, low, ties])
    got = cast(torch.cat([x, -x]), fmt)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.cat([expected, -expected]))
    q = quantize(x[: len(low)], fmt, scale=torch.tensor(1.0)) if fmt in (E4M3, E5M2) else None
    if q is not None:
        assert torch.equal(q.dequantize().double(), high)


def test_float64_beyond_float32_saturates_as_a_finite_value():
    assert cast(torch.tensor([1e300, -1e300, math.inf], dtype=torch.float64), E4M3).tolist() == [448.0, -448.0, 448.0]


def test_quantize_refuses_a_format_of_its_own_and_cast_takes_it():
    # quantize looked formats up by name: a custom "e4m3" with bias 8 (max 224) got the built-in's limits
    custom = NumberFormat("e4m3", ebits=4, mbits=3, bias=8, special=E4M3.special)
    with pytest.raises(ValueError, match="NumberFormat of its own"):
        quantize(torch.tensor([300.0]), custom, scale=torch.tensor(1.0))
    assert cast(torch.tensor([300.0]), custom).item() == custom.max == 224.0


@pytest.mark.parametrize("dtype, fmt", [(torch.float16, BF16), (torch.bfloat16, FP16), (torch.float16, E8M0),
                                        (torch.float8_e4m3fn, BF16)])
def test_cast_refuses_a_dtype_that_cannot_hold_the_format(dtype, fmt):
    # an fp16 tensor cast onto BF16 came back holding inf (65504 rounds to 65536, beyond fp16)
    with pytest.raises(ValueError, match="cannot hold every"):
        cast(torch.ones(2).to(dtype), fmt)


@pytest.mark.parametrize("dtype, fmt", [(torch.bfloat16, E4M3), (torch.float16, E5M2), (torch.bfloat16, E8M0),
                                        (torch.float16, E2M1), (torch.float64, E8M0)])
def test_cast_keeps_dtypes_that_hold_the_format(dtype, fmt):
    assert cast(torch.tensor([3.0, 1000.0]).to(dtype), fmt).dtype == dtype


@pytest.mark.parametrize("reference, approx, expected", [
    ([70000.0], [math.inf], -math.inf),     # a finite value decoded as inf: all noise
    ([1.0, 2.0], [1.0, 2.0], math.inf),     # no noise
    ([math.nan], [1.0], math.nan),          # no ratio to speak of
    ([math.inf], [math.inf], math.nan),
    ([0.0], [1.0], -math.inf),              # no signal
], ids=["inf-noise", "exact", "nan", "inf-both", "no-signal"])
def test_sqnr_of_non_finite_tensors(reference, approx, expected):
    got = sqnr_db(torch.tensor(reference), torch.tensor(approx))
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_sqnr_refuses_tensors_it_cannot_compare():
    # a complex tensor lost its imaginary part to .double() (a torch warning only); meta tensors hold no numbers
    # (torch's "Tensor.item() cannot be called on meta tensors")
    with pytest.raises(TypeError, match="real tensors that hold numbers, got a torch.complex64 reference"):
        sqnr_db(torch.ones(3, dtype=torch.complex64), torch.ones(3))
    with pytest.raises(TypeError, match="got a torch.float32 approx on meta"):
        sqnr_db(torch.ones(3), torch.ones(3, device="meta"))


@pytest.mark.parametrize("call, match", [
    (lambda: quantize(torch.zeros(5, 0), E4M3, granularity="row"), "scales along the last dim"),
    (lambda: quantize(torch.tensor(1.0), E4M3, granularity="mx"), "scales along the last dim"),
    (lambda: quantize(torch.randn(4, 8), E4M3, granularity="row", scale=torch.ones(3, 1)), "4 element"),
    (lambda: quantize(torch.randn(4, 8), E4M3, scale=torch.tensor([0.01, 0.02])), "1 element"),
    (lambda: quantize(torch.randn(4, 8), E4M3, margin=2.5), "margin"),
    (lambda: quantize(torch.randn(4, 8), E4M3, margin=-3), "margin"),
    (lambda: cast(torch.ones(3), E4M3, rounding="stochastic", uniform=torch.rand(5)), "uniform="),
    (lambda: cast(torch.ones(3), E4M3, uniform=torch.rand(3)), "uniform="),
], ids=["row-empty-last-dim", "mx-0d", "row-scale-shape", "tensor-scale-shape", "margin-float", "margin-negative",
        "uniform-shape", "uniform-with-nearest"])
def test_edge_inputs_get_one_clear_error(call, match):
    # each was a torch-internal error (reshape, IndexError, broadcasting) or silently accepted
    with pytest.raises(ValueError, match=match):
        call()
