"""Tests for 4-bit numerics: NVFP4 (minifloat.numerics.fp4), MXFP4 (quantize(..., E2M1, granularity="mx")), the random
Hadamard transform (minifloat.numerics.hadamard) and stochastic rounding onto E2M1.

The references are independent: numpy float32 arithmetic with ml_dtypes' float4_e2m1fn / float8_e4m3fn /
float8_e8m0fnu conversions (not minifloat's rounding), and golden tables written out from the format definitions.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.formats import BF16, E2M1, E4M3
from minifloat.numerics.fp4 import (
    NVFP4_BLOCK,
    decode_e2m1,
    e2m1_values,
    encode_e2m1,
    pack_e2m1,
    quantize_nvfp4,
    quantize_nvfp4_t,
    unpack_e2m1,
)
from minifloat.numerics.granularity import MX_BLOCK, pad_to_multiple
from minifloat.numerics.hadamard import hadamard_matrix, rht, rht_inverse, rht_signs
from minifloat.numerics.quantize import cast, quantize, sqnr_db

NAN = float("nan")
INF = float("inf")
F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)
U32 = 2.0**-24  # float32 unit roundoff

# Stochastic rounding z-test: a mean error beyond Z_SIGMAS standard errors has two-sided probability
# 2·(1 - Φ(5)) ≈ 5.7e-7 per value under an unbiased rounding (normal approximation of a binomial mean of SR_DRAWS
# draws); the tests check 7 + 64 values, so a false alarm on a fresh seed has probability below 5e-5.
Z_SIGMAS = 5.0
SR_DRAWS = 20000
# RHT round trips and norms in float32: each output is a 16-term sum, error <= 16·u·Σ|terms| <= 16·u·‖x_b‖·4/4 per
# pass (Cauchy-Schwarz: Σ|x_i| <= 4‖x_b‖ for 16 terms, times the 1/4 normalisation); two passes and slack: 64·u·‖x_b‖.
RHT_F32_TOL = 64 * U32
RHT_F64_TOL = 64 * 2.0**-53


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20251001)


@pytest.fixture(autouse=True)
def _eager_kernels():
    """quantize()'s compiled cast kernel would cost seconds to compile per variant; tests/test_quantize.py proves
    the compiled and eager kernels give the same bits."""
    with eager_kernels():
        yield


# ---------------------------------------------------------------------------------------------------- references


def ml_e2m1(y: np.ndarray) -> np.ndarray:
    """Saturating RNE onto E2M1 by ml_dtypes; NaN stays NaN (E2M1 has no NaN code to hold it)."""
    y = np.asarray(y, dtype=F32)
    with np.errstate(invalid="ignore"):
        r = np.clip(y, -E2M1.max, E2M1.max).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    return np.where(np.isnan(y), F32(np.nan), r)


def ml_e4m3(y: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.clip(y, -E4M3.max, E4M3.max).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def reference_nvfp4(x: np.ndarray, block_2d: bool = False, global_amax: float | None = None):
    """NVFP4 of a 2-D float32 array, written from arXiv 2509.25149 Appendix B in numpy float32 arithmetic.

    Returns (elements, block scales, global decode scale), elements of x's shape.
    """
    x = np.asarray(x, dtype=F32)
    m, k = x.shape
    with np.errstate(all="ignore"):
        if global_amax is not None:
            a = F32(global_amax)
        else:
            a = F32(np.max(np.abs(x))) if x.size else F32(0)
        s_enc = F32(min(F32(448 * 6) / a, F32_MAX)) if (np.isfinite(a) and a > 0) else F32(1)
        g = F32(1) / s_enc
        rows, cols = (NVFP4_BLOCK if block_2d else 1), NVFP4_BLOCK
        mp, kp = -(-m // rows) * rows, -(-k // cols) * cols
        xp = np.zeros((mp, kp), dtype=F32)
        xp[:m, :k] = x
        tiles = xp.reshape(mp // rows, rows, kp // cols, cols)
        amax_b = np.max(np.abs(tiles), axis=(1, 3))  # (MB, KB); NaN propagates
        s_b = ml_e4m3((amax_b / F32(6)) * s_enc)
        s_b = np.where(np.isfinite(amax_b), s_b, F32(1)).astype(F32)
        d = s_b * g
        r = np.where(d > 0, np.minimum(F32(1) / d, F32_MAX), F32(0)).astype(F32)
        y = tiles * r[:, None, :, None]
        q = ml_e2m1(y).reshape(mp, kp)[:m, :k]
    scale = s_b if block_2d else s_b.reshape(mp, kp // cols)
    return q, scale, g


def reference_mxfp4(x: np.ndarray, rule: str):
    """MXFP4 of a 2-D float32 array per OCP MX v1.0 §6.3: X = 2^(floor(log2 amax) - emax_elem), emax_elem = 2 for
    E2M1 ("floor"), or the smallest power of two with amax / X <= 6 ("up"); exponents by frexp, exact in float64."""
    x = np.asarray(x, dtype=F32)
    m, k = x.shape
    kp = -(-k // MX_BLOCK) * MX_BLOCK
    xp = np.zeros((m, kp), dtype=F32)
    xp[:, :k] = x
    blocks = xp.reshape(m, kp // MX_BLOCK, MX_BLOCK)
    amax = np.max(np.abs(blocks), axis=-1).astype(np.float64)
    scale = np.ones_like(amax)
    for idx, a in np.ndenumerate(amax):
        if not (np.isfinite(a) and a > 0):
            continue
        e = math.frexp(a)[1] - 1 - 2
        if rule == "up" and a / 2.0**e > 6.0:
            e += 1
        scale[idx] = 2.0 ** min(max(e, -127), 127)
    with np.errstate(all="ignore"):
        q = ml_e2m1(blocks * (1.0 / scale).astype(F32)[..., None]).reshape(m, kp)[:, :k]
    return q, scale.astype(F32)


def assert_same(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Equal values, NaN where NaN, and the same sign of zero."""
    got, ref = np.asarray(got, dtype=F32), np.asarray(ref, dtype=F32)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    same = ((got == ref) & (np.signbit(got) == np.signbit(ref))) | (np.isnan(got) & np.isnan(ref))
    if not same.all():
        bad = np.argwhere(~same)[:6]
        raise AssertionError(f"{what}: {(~same).sum()} mismatches at {bad.tolist()}: got "
                             f"{[got[tuple(i)] for i in bad]} expected {[ref[tuple(i)] for i in bad]}")


def assert_matches_reference(x: torch.Tensor, block_2d: bool, **kwargs) -> None:
    q = quantize_nvfp4(x, block_2d=block_2d, **kwargs)
    amax = kwargs.get("global_amax")
    ref_q, ref_s, ref_g = reference_nvfp4(x.numpy(), block_2d, None if amax is None else float(amax))
    assert_same(q.data.numpy(), ref_q, "elements")
    assert_same(q.scale.float().numpy(), ref_s, "block scales")
    assert_same(q.global_scale.numpy(), np.array(ref_g), "global scale")


# ---------------------------------------------------------------------------------------------------- E2M1 codes

# (code, value): OCP MX v1.0 §5.3.3, sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0
E2M1_CODES = [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0), (5, 3.0), (6, 4.0), (7, 6.0),
              (8, -0.0), (9, -0.5), (10, -1.0), (11, -1.5), (12, -2.0), (13, -3.0), (14, -4.0), (15, -6.0)]


@pytest.mark.parametrize("code, value", E2M1_CODES, ids=[f"code{c}" for c, _ in E2M1_CODES])
def test_e2m1_code_table(code, value):
    got = decode_e2m1(torch.tensor([code], dtype=torch.uint8))
    assert got.item() == value and math.copysign(1, got.item()) == math.copysign(1, value)
    assert encode_e2m1(torch.tensor([value])).item() == code


def test_e2m1_codes_match_ml_dtypes():
    ml = np.arange(16, dtype=np.uint8).astype(ml_dtypes.uint4).view(ml_dtypes.float4_e2m1fn).astype(F32)
    assert_same(e2m1_values().numpy(), ml, "E2M1 values in code order")
    values = torch.from_numpy(ml)
    codes = values.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(encode_e2m1(values).numpy(), codes)


# (name, values, packed bytes): element 2i in the low nibble
PACK_CASES = [
    ("pair", [1.0, -6.0], [0xF2]),
    ("two-pairs", [0.0, 0.5, 6.0, -0.0], [0x10, 0x87]),
    ("odd-padded-with-zero", [3.0, 4.0, -1.5], [0x65, 0x0B]),
]


@pytest.mark.parametrize("values, packed", [c[1:] for c in PACK_CASES], ids=[c[0] for c in PACK_CASES])
def test_pack_golden(values, packed):
    v = torch.tensor(values)
    got = pack_e2m1(v)
    assert got.dtype == torch.uint8 and got.tolist() == packed
    back = unpack_e2m1(got, len(values))
    assert torch.equal(back, v) and torch.equal(torch.signbit(back), torch.signbit(v))


def test_pack_round_trips_every_code_pair():
    codes = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8)  # (256, 2)
    values = decode_e2m1(codes)
    packed = pack_e2m1(values)
    assert packed.shape == (256, 1)
    assert sorted(packed.flatten().tolist()) == list(range(256))  # a bijection onto bytes
    assert torch.equal(unpack_e2m1(packed), values)


@pytest.mark.parametrize("value", [NAN, 0.75, 7.0, INF], ids=["nan", "off-grid", "beyond-max", "inf"])
def test_encode_rejects_values_it_cannot_encode(value):
    with pytest.raises(ValueError, match="E2M1"):
        encode_e2m1(torch.tensor([1.0, value]))


# ---------------------------------------------------------------------------------------------------- bf16 exactness


def test_every_e2m1_times_e4m3_product_is_exact_in_bf16():
    """2 significant bits times 4 is at most 6 (bf16 has 8), and |product| lies in [2^-10, 2688]: all exact."""
    e2m1 = e2m1_values().double()
    e4m3 = torch.from_numpy(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    e4m3 = e4m3[torch.isfinite(e4m3)]
    assert e4m3.numel() == 254  # 256 codes less the two NaNs
    products = torch.outer(e2m1, e4m3)  # exact in float64
    assert torch.equal(products.to(torch.bfloat16).double(), products)
    assert torch.equal(products.float().double(), products)


def test_e2m1_times_e8m0_is_exact_in_bf16_unless_it_overflows():
    """The claim "every E2M1 value times an E8M0 scale is exact in bf16" holds except at the top of the range:
    |v|·2^e > bf16 max ((2 - 2^-7)·2^127) overflows for v = 4, 6 at e = 126 and |v| >= 2 at e = 127. At the bottom,
    0.5·2^-127 = 2^-128 is a bf16 subnormal (down to 2^-133) and exact."""
    e2m1 = e2m1_values().double()
    e8m0 = torch.from_numpy(np.arange(255, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64))
    products = torch.outer(e2m1, e8m0)
    exact = products.to(torch.bfloat16).double() == products
    overflow = products.abs() > BF16.max
    assert torch.equal(exact, ~overflow)
    bad = {(abs(v), int(math.log2(s))) for v, s in torch.cartesian_prod(e2m1, e8m0)[overflow.flatten()].tolist()}
    assert bad == {(4.0, 126), (6.0, 126), (2.0, 127), (3.0, 127), (4.0, 127), (6.0, 127)}


# ---------------------------------------------------------------------------------------------------- NVFP4: golden

ANCHOR = 448.0 * 6  # a row holding it makes the global amax 2688: s_enc = 1, g = 1, so s_b = e4m3(a_b / 6)

# (name, one 16-element block, expected elements, expected E4M3 block scale), quantized under g = 1
NVFP4_CASES = [
    ("on-grid-round-trips", [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
     [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], 1.0),
    ("ties-to-even", [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0],
     [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 0], 1.0),
    ("scale-2", [12, 5, 7, 1, 0.5, -12, -3, 0.4] + [0] * 8,
     [6, 2, 4, 0.5, 0, -6, -1.5, 0] + [0] * 8, 2.0),  # 5/2 = 2.5 ties to 2; 7/2 = 3.5 ties to 4; 0.25 ties to 0
    ("scale-ties-down-to-even", [6.375] + [0] * 15, [6] + [0] * 15, 1.0),  # 6.375/6 = 1.0625: 1 or 1.125 -> 1
    ("scale-ties-up-to-even", [7.125] + [0] * 15, [6] + [0] * 15, 1.25),  # 1.1875: 1.125 or 1.25 -> 1.25
    ("scale-subnormal", [0.006, 0.003] + [0] * 14, [3, 1.5] + [0] * 14, 2.0**-9),  # 0.001 -> 2^-9; 0.006·512
    ("scale-underflows-to-zero", [0.005, -0.004] + [0] * 14, [0, -0.0] + [0] * 14, 0.0),  # 0.00083 < 2^-10
    ("all-zero-block", [0] * 16, [0] * 16, 0.0),
    ("amax-block", [ANCHOR, -ANCHOR / 2] + [0] * 14, [6, -3] + [0] * 14, 448.0),
    ("above-anchor-saturates", [3000.0, 1.0] + [0] * 14, [6, 0] + [0] * 14, 448.0),  # amax given as 2688
]


@pytest.mark.parametrize("block, elements, scale", [c[1:] for c in NVFP4_CASES], ids=[c[0] for c in NVFP4_CASES])
def test_nvfp4_golden(block, elements, scale):
    x = torch.tensor([[ANCHOR] + [0.0] * 15, block], dtype=torch.float32)
    q = quantize_nvfp4(x, global_amax=torch.tensor(ANCHOR))
    assert q.global_scale.item() == 1.0
    assert q.scale[1, 0].item() == scale
    expected = torch.tensor(elements, dtype=torch.float32)
    assert torch.equal(q.data[1], expected) and torch.equal(torch.signbit(q.data[1]), torch.signbit(expected))
    assert torch.equal(q.dequantize()[1], expected * scale)


# (name, global amax, expected global decode scale g = 1 / (2688 / amax))
GLOBAL_CASES = [
    ("anchor", ANCHOR, 1.0),
    ("twice-anchor", 2 * ANCHOR, 2.0),
    ("power-of-two", 2688.0 / 1024, 1 / 1024),
    ("zero-falls-back", 0.0, 1.0),
    ("inf-falls-back", INF, 1.0),
    ("nan-falls-back", NAN, 1.0),
    ("tiny-clamps-s_enc", 1e-40, float(F32(1) / F32_MAX)),  # 2688 / 1e-40 overflows float32: s_enc = float32 max
]


@pytest.mark.parametrize("amax, g", [c[1:] for c in GLOBAL_CASES], ids=[c[0] for c in GLOBAL_CASES])
def test_nvfp4_global_scale_golden(amax, g):
    q = quantize_nvfp4(torch.ones(2, 16), global_amax=torch.tensor(amax))
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == ()
    assert q.global_scale.item() == g


@settings(max_examples=60, deadline=None)
@given(amax=st.floats(min_value=2.0**-100, max_value=2.0**100, width=32), k=st.integers(1, 64), seed=st.integers(0, 99))
def test_the_amax_block_gets_scale_448_and_its_amax_becomes_6(amax, k, seed):
    """s_b = e4m3((A/6)·(2688/A)) = 448 whatever A (the few float32 roundings stay far from the E4M3 tie at 464),
    and A·r_b rounds to E2M1's 6."""
    x = torch.rand(3, k, generator=torch.Generator().manual_seed(seed)) * amax
    x[1, k // 2] = -amax
    q = quantize_nvfp4(x)
    assert q.scale[1, (k // 2) // NVFP4_BLOCK].item() == 448.0
    assert q.data[1, k // 2].item() == -6.0
    torch.testing.assert_close(q.global_scale, torch.tensor(amax / 2688.0), rtol=3 * U32, atol=0)


# ------------------------------------------------------------------------------------------------ NVFP4 vs reference


@st.composite
def block_spread_tensors(draw, min_rows=1):
    """(M, K) float32 with per-row magnitudes spread over many binades, zeros, and exact grid-like values."""
    m, k = draw(st.integers(min_rows, 40)), draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((m, k)).astype(F32) * np.exp2(rng.integers(-40, 40, (m, 1))).astype(F32)
    x[rng.random((m, k)) < 0.1] = 0.0
    if draw(st.booleans()):  # values on a coarse grid produce exact ties
        x = np.round(x * 4) / 4
    return torch.from_numpy(x.astype(F32))


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
@settings(max_examples=80, deadline=None)
@given(x=block_spread_tensors())
def test_nvfp4_matches_reference(block_2d, x):
    assert_matches_reference(x, block_2d)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.floats(width=32), min_size=1, max_size=96), k=st.integers(1, 40))
def test_nvfp4_matches_reference_on_arbitrary_floats(block_2d, values, k):
    """Any float32 bit patterns: subnormals, huge values, ±inf and NaN."""
    x = torch.tensor(values + [0.0] * (-len(values) % k), dtype=torch.float32).reshape(-1, k)
    assert_matches_reference(x, block_2d)


@settings(max_examples=40, deadline=None)
@given(x=block_spread_tensors(), scale=st.floats(min_value=2.0**-7, max_value=2.0**7, width=32))
def test_nvfp4_matches_reference_with_a_given_global_amax(x, scale):
    amax = (x.abs().max() * scale).reshape(())
    assert_matches_reference(x, False, global_amax=amax)


@settings(max_examples=60, deadline=None)
@given(x=block_spread_tensors())
def test_dequantize_is_the_exact_product_rounded_once(x):
    """x̂ = (q·s_b)·g: q·s_b is exact in float32 (2 + 4 significant bits), so x̂ is the exact product q·s_b·g
    (at most 30 bits: exact in float64) rounded once to float32."""
    for block_2d in (False, True):
        q = quantize_nvfp4(x, block_2d=block_2d)
        exact = q.data.double() * q.expanded_scale().double() * q.global_scale.double()
        assert torch.equal(q.dequantize(), exact.float())
        assert torch.equal(q.dequantize(torch.bfloat16), exact.float().to(torch.bfloat16))


def test_nvfp4_sqnr_on_gaussian_data(gen):
    """E2M1 with a per-16 E4M3 scale: about 3 bits of precision, ≈ 20 dB on N(0, 1) (measured 20.5 dB)."""
    x = torch.randn(256, 512, generator=gen, dtype=torch.float64)
    assert sqnr_db(x, quantize_nvfp4(x.float()).dequantize()) > 18.0
    assert sqnr_db(x, quantize_nvfp4(x.float(), block_2d=True).dequantize()) > 15.0


# ---------------------------------------------------------------------------------------------------- NVFP4: layout

# (name, shape, block_2d, scale shape)
SHAPES = [
    ("1x16-exact", (32, 64), False, (32, 4)),
    ("1x16-ragged", (5, 33), False, (5, 3)),
    ("1x16-1d", (20,), False, (2,)),
    ("1x16-3d", (2, 3, 40), False, (2, 3, 3)),
    ("16x16-exact", (32, 64), True, (2, 4)),
    ("16x16-ragged", (17, 33), True, (2, 3)),
    ("16x16-3d", (2, 20, 40), True, (2, 2, 3)),
    ("empty", (0, 32), False, (0, 2)),
]


@pytest.mark.parametrize("shape, block_2d, scale_shape", [c[1:] for c in SHAPES], ids=[c[0] for c in SHAPES])
def test_nvfp4_shapes_and_dtypes(shape, block_2d, scale_shape, gen):
    x = torch.randn(*shape, generator=gen)
    q = quantize_nvfp4(x, block_2d=block_2d)
    assert q.data.shape == x.shape and q.data.dtype == torch.float32
    assert q.scale.shape == scale_shape and q.scale.dtype == torch.float8_e4m3fn
    assert q.dequantize().shape == x.shape
    assert q.packed().shape == (*shape[:-1], -(-shape[-1] // 2))
    rows = x.numel() // shape[-1]
    assert q.nbytes() == rows * -(-shape[-1] // 2) + math.prod(scale_shape) + 4


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_ragged_edges_equal_zero_padding(block_2d, gen):
    x = torch.randn(19, 37, generator=gen)
    padded = torch.zeros(32, 48)
    padded[:19, :37] = x
    q, p = quantize_nvfp4(x, block_2d=block_2d), quantize_nvfp4(padded, block_2d=block_2d)
    assert torch.equal(q.data, p.data[:19, :37])
    rows = 2 if block_2d else 19
    assert torch.equal(q.scale.float(), p.scale.float()[:rows])


def test_leading_dims_are_batch_dims(gen):
    x = torch.randn(3, 20, 40, generator=gen)
    q = quantize_nvfp4(x)
    flat = quantize_nvfp4(x.reshape(60, 40))
    assert torch.equal(q.data.reshape(60, 40), flat.data)
    assert torch.equal(q.scale.float().reshape(60, 3), flat.scale.float())
    q2 = quantize_nvfp4(x, block_2d=True, global_amax=x.abs().max())
    for i in range(3):  # 16×16 tiles never straddle the batch dim
        qi = quantize_nvfp4(x[i], block_2d=True, global_amax=x.abs().max())
        assert torch.equal(q2.data[i], qi.data) and torch.equal(q2.scale[i].float(), qi.scale.float())


@settings(max_examples=60, deadline=None)
@given(x=block_spread_tensors())
def test_2d_blocks_transpose_exactly(x):
    """The weight's forward copy and its transposed (dgrad) copy are the same numbers (arXiv 2509.25149 §4.2)."""
    q = quantize_nvfp4(x, block_2d=True)
    qt = quantize_nvfp4(x.t(), block_2d=True)
    flipped = q.t()
    assert torch.equal(flipped.data.view(torch.int32), qt.data.contiguous().view(torch.int32))
    assert torch.equal(flipped.scale.view(torch.uint8), qt.scale.contiguous().view(torch.uint8))
    assert torch.equal(flipped.global_scale, qt.global_scale)
    assert torch.equal(flipped.dequantize(), q.dequantize().t())


def test_1x16_blocks_do_not_transpose(gen):
    """1×16 blocks run along K: xᵀ is quantized from x (high precision), not from the quantized x."""
    x = torch.randn(32, 48, generator=gen)
    with pytest.raises(ValueError, match="block_2d"):
        quantize_nvfp4(x).t()
    assert not torch.equal(quantize_nvfp4(x.t()).dequantize(), quantize_nvfp4(x).dequantize().t())


def test_a_shard_with_the_whole_amax_is_that_part_of_the_whole(gen):
    """A given global amax sets the global scale: a row shard cast with the whole tensor's amax is bitwise the
    matching rows of the whole tensor's cast."""
    x = torch.randn(64, 48, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    whole = quantize_nvfp4(x)
    shard = quantize_nvfp4(x[16:40], global_amax=x.abs().max())
    assert torch.equal(shard.data, whole.data[16:40])
    assert torch.equal(shard.scale.float(), whole.scale.float()[16:40])
    assert torch.equal(shard.global_scale, whole.global_scale)


def test_bf16_input_matches_float32(gen):
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    q, ref = quantize_nvfp4(x), quantize_nvfp4(x.float())
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale.float(), ref.scale.float())


# ---------------------------------------------------------------------------------------------------- NVFP4: non-finite

# (name, value planted at [1, 3], expected element there)
POISON_CASES = [("nan", NAN, NAN), ("inf", INF, 6.0), ("neg-inf", -INF, -6.0)]


@pytest.mark.parametrize("value, element", [c[1:] for c in POISON_CASES], ids=[c[0] for c in POISON_CASES])
def test_non_finite_input_follows_quantize(value, element, gen):
    """As with a per-tensor cast: the (global) scale falls back to 1, the poisoned block's scale to 1; NaN stays NaN
    through dequantize (guards see it), ±inf saturates to ±6; every other element is finite."""
    x = torch.randn(4, 40, generator=gen)
    x[1, 3] = value
    q = quantize_nvfp4(x)
    assert q.global_scale.item() == 1.0
    assert q.scale[1, 0].item() == 1.0
    torch.testing.assert_close(q.data[1, 3], torch.tensor(element), rtol=0, atol=0, equal_nan=True)
    others = torch.ones_like(x, dtype=torch.bool)
    others[1, 3] = False
    assert torch.isfinite(q.dequantize()[others]).all()
    assert torch.isnan(q.dequantize()[1, 3]).item() == math.isnan(value)
    # the other blocks: s_b = e4m3(a_b / 6) under s_enc = 1
    block_amax = torch.tensor([[x[i, j:j + 16].abs().max().item() for j in range(0, 40, 16)] for i in range(4)])
    expected = cast(block_amax / 6, E4M3)
    expected[1, 0] = 1.0
    assert torch.equal(q.scale.float(), expected)


def test_nan_cannot_be_packed(gen):
    x = torch.randn(2, 16, generator=gen)
    x[0, 0] = NAN
    with pytest.raises(ValueError, match="NaN"):
        quantize_nvfp4(x).packed()


# (name, call, exception, message pattern)
BAD_ARGUMENTS = [
    ("rounding", lambda: quantize_nvfp4(torch.ones(2, 16), rounding="up"), ValueError, "rounding.*'up'"),
    ("block_2d-type", lambda: quantize_nvfp4(torch.ones(2, 16), block_2d="yes"), ValueError, "block_2d.*'yes'"),
    ("block_2d-1d", lambda: quantize_nvfp4(torch.ones(16), block_2d=True), ValueError, "2 dims"),
    ("scalar", lambda: quantize_nvfp4(torch.tensor(1.0)), ValueError, "1 dims"),
    ("integer-tensor", lambda: quantize_nvfp4(torch.ones(2, 16, dtype=torch.int32)), TypeError, "int32"),
    ("rht-ragged", lambda: rht(torch.ones(2, 20), rht_signs(0)), ValueError, "multiple of the block 16"),
    ("rht-signs-shape", lambda: rht(torch.ones(2, 16), torch.ones(8)), ValueError, r"signs must have shape \(16,\)"),
    ("hadamard-size", lambda: hadamard_matrix(12), ValueError, "power of two, got 12"),
]


@pytest.mark.parametrize("call, exc, pattern", [c[1:] for c in BAD_ARGUMENTS], ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_raise_naming_the_problem(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ---------------------------------------------------------------------------------------------------- MXFP4


def near_powers_of_two() -> np.ndarray:
    """Block amaxes where float32 log2 rounds across an integer (log2 of 8·(1 - 2^-24) is 3.0 in float32)."""
    p = np.exp2(np.arange(-20, 21, dtype=np.float64)).astype(F32)
    six = (p * F32(6)).astype(F32)
    return np.concatenate([np.nextafter(p, F32(0)), p, np.nextafter(p, F32(np.inf)), six,
                           np.nextafter(six, F32(np.inf))]).astype(F32)


@pytest.mark.parametrize("rule", ["floor", "up"])
def test_mxfp4_matches_ocp_reference_at_binade_edges(rule):
    amaxes = near_powers_of_two()
    x = np.zeros((len(amaxes), MX_BLOCK), dtype=F32)
    x[:, 0] = -amaxes
    x[:, 1] = amaxes * F32(0.3)
    q = quantize(torch.from_numpy(x), E2M1, granularity="mx", mx_rule=rule)
    ref_q, ref_s = reference_mxfp4(x, rule)
    assert_same(q.scale.numpy(), ref_s, "E8M0 scales")
    assert_same(q.data.numpy(), ref_q, "elements")


@pytest.mark.parametrize("rule", ["floor", "up"])
@settings(max_examples=60, deadline=None)
@given(x=block_spread_tensors())
def test_mxfp4_matches_ocp_reference(rule, x):
    q = quantize(x, E2M1, granularity="mx", mx_rule=rule)
    ref_q, ref_s = reference_mxfp4(x.numpy(), rule)
    assert_same(q.scale.numpy(), ref_s, "E8M0 scales")
    assert_same(q.data.numpy(), ref_q, "elements")
    # the scales are E8M0 values (ml_dtypes round-trips them unchanged)
    assert_same(q.scale.numpy().astype(ml_dtypes.float8_e8m0fnu).astype(F32), ref_s, "E8M0 round trip")


# (name, block amax, rule, expected scale): emax(E2M1) = 2, so "floor" gives 2^(floor(log2 amax) - 2)
MXFP4_CASES = [
    ("floor-6", 6.0, "floor", 1.0),
    ("floor-just-below-8", float(np.nextafter(F32(8), F32(0))), "floor", 1.0),  # log2 rounds to 3 in float32
    ("floor-8", 8.0, "floor", 2.0),
    ("floor-7", 7.0, "floor", 1.0),  # 7 then saturates to 6: the OCP rule clips the block's largest elements
    ("up-6", 6.0, "up", 1.0),
    ("up-just-above-6", float(np.nextafter(F32(6), F32(np.inf))), "up", 2.0),
    ("up-just-above-96", float(np.nextafter(F32(96), F32(np.inf))), "up", 32.0),  # float32 log2 rounded to 4
    ("floor-zero-block", 0.0, "floor", 1.0),
]


@pytest.mark.parametrize("amax, rule, scale", [c[1:] for c in MXFP4_CASES], ids=[c[0] for c in MXFP4_CASES])
def test_mxfp4_scale_golden(amax, rule, scale):
    x = torch.zeros(1, MX_BLOCK)
    x[0, 0] = amax
    q = quantize(x, E2M1, granularity="mx", mx_rule=rule)
    assert q.scale.item() == scale
    assert q.data[0, 0].item() == cast(torch.tensor([amax / scale]), E2M1).item()


# ----------------------------------------------------------------------------------------------- stochastic rounding

# values between E2M1 grid points, with their neighbours (lo, hi)
SR_VALUES = [(0.3, 0.0, 0.5), (1.1, 1.0, 1.5), (2.3, 2.0, 3.0), (4.9, 4.0, 6.0), (-2.7, -3.0, -2.0),
             (5.5, 4.0, 6.0), (-0.1, -0.5, 0.0)]


def test_e2m1_stochastic_rounding_is_unbiased_and_nearest_is_not(gen):
    """z-test per value: |mean(SR(y)) - y| <= Z_SIGMAS·σ/√N with σ = (hi - lo)·sqrt(p(1 - p)), p = (y - lo)/(hi - lo)
    the probability of rounding up; false-alarm probability per value ≈ 5.7e-7 (see Z_SIGMAS). Ablation: round to
    nearest on the same values misses by far more than that bound."""
    y = torch.tensor([v for v, _, _ in SR_VALUES])
    lo = torch.tensor([lo for _, lo, _ in SR_VALUES], dtype=torch.float64)
    hi = torch.tensor([hi for _, _, hi in SR_VALUES], dtype=torch.float64)
    draws = cast(y.expand(SR_DRAWS, -1).contiguous(), E2M1, rounding="stochastic", generator=gen).double()
    assert torch.all((draws == lo) | (draws == hi))
    p = (y.double() - lo) / (hi - lo)
    bound = Z_SIGMAS * (hi - lo) * torch.sqrt(p * (1 - p) / SR_DRAWS)
    sr_error = (draws.mean(0) - y.double()).abs()
    assert torch.all(sr_error <= bound), (sr_error, bound)
    nearest_error = (cast(y, E2M1).double() - y.double()).abs()
    assert torch.all(nearest_error > 10 * bound), (nearest_error, bound)


def test_nvfp4_stochastic_rounding_is_unbiased_per_element(gen):
    """Every element of an NVFP4 tensor: the mean of its SR draws is x·r_b within the z-test bound; the block
    scales are rounded to nearest either way. With round to nearest the same elements are biased."""
    x = torch.randn(4, 16, generator=gen) * 3
    draws = 2000
    batch = x.expand(draws, -1, -1).contiguous()
    q = quantize_nvfp4(batch, rounding="stochastic", generator=gen, global_amax=x.abs().max())
    ref = quantize_nvfp4(x)
    assert torch.equal(q.scale[0].float(), ref.scale.float()) and torch.equal(q.global_scale, ref.global_scale)
    r = torch.ones(()) / (ref.scale.float() * ref.global_scale)  # encode multipliers, as quantize_nvfp4's
    y = (x * r).clamp(-E2M1.max, E2M1.max).double()
    grid = e2m1_values().double().unique()
    hi = grid[torch.searchsorted(grid, y).clamp(max=len(grid) - 1)]
    lo = grid[(torch.searchsorted(grid, y, right=True) - 1).clamp(min=0)]
    p = torch.where(hi > lo, (y - lo) / (hi - lo), torch.zeros_like(y))
    bound = Z_SIGMAS * (hi - lo) * torch.sqrt(p * (1 - p) / draws) + 1e-12
    assert torch.all((q.data.double().mean(0) - y).abs() <= bound)
    nearest_bias = (ref.data.double() - y).abs()
    assert (nearest_bias > 3 * bound).float().mean() > 0.5  # most elements: RNE's error is systematic


def test_stochastic_rounding_is_reproducible_with_a_generator():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    a = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


# ---------------------------------------------------------------------------------------------------- RHT


def test_hadamard_matrix_is_sylvester():
    h = hadamard_matrix(16)
    assert torch.equal(h.abs(), torch.ones(16, 16)) and torch.equal(h, h.t())
    assert torch.equal(h @ h, 16 * torch.eye(16))
    h8 = hadamard_matrix(8)
    assert torch.equal(h, torch.cat([torch.cat([h8, h8], 1), torch.cat([h8, -h8], 1)], 0))
    assert torch.equal(h[0], torch.ones(16))


def test_rht_signs_are_seeded_signs():
    s = rht_signs(1234)
    assert s.shape == (16,) and s.dtype == torch.float32 and torch.equal(s.abs(), torch.ones(16))
    assert torch.equal(s, rht_signs(1234))
    assert not torch.equal(s, rht_signs(1235))
    assert rht_signs(0, n=32).shape == (32,)


def test_rht_is_the_matrix_h_diag_signs_over_4():
    """rht of the identity's rows is Tᵀ for T = H·diag(s)/4, and T is exactly orthogonal (entries ±1/4)."""
    s = rht_signs(3)
    t_transposed = rht(torch.eye(16), s)
    t = hadamard_matrix(16) @ torch.diag(s) / 4
    assert torch.equal(t_transposed, t.t())
    assert torch.equal(t @ t.t(), torch.eye(16))
    assert torch.equal(rht_inverse(torch.eye(16), s), t)


def test_rht_round_trips_integers_bitwise(gen):
    """Small integers: every block sum is exact and 1/4 is a power of two, so the round trip is exact."""
    x = torch.randint(-1000, 1000, (8, 64), generator=gen).float()
    s = rht_signs(11)
    y = rht(x, s)
    assert torch.equal(y * 4, torch.round(y * 4))  # quarter-integers
    assert torch.equal(rht_inverse(y, s), x)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, RHT_F32_TOL), (torch.float64, RHT_F64_TOL)],
                         ids=["fp32", "fp64"])
def test_rht_is_orthogonal(dtype, tol, gen):
    x = (torch.randn(32, 128, generator=gen, dtype=torch.float64) * 10).to(dtype)
    s = rht_signs(5)
    y = rht(x, s)
    assert y.dtype == dtype
    block_norms = x.reshape(32, 8, 16).double().norm(dim=-1)
    back_error = (rht_inverse(y, s) - x).reshape(32, 8, 16).double().abs().amax(dim=-1)
    assert torch.all(back_error <= tol * block_norms)
    norm_error = (y.reshape(32, 8, 16).double().norm(dim=-1) - block_norms).abs()
    assert torch.all(norm_error <= tol * block_norms)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, RHT_F32_TOL), (torch.float64, RHT_F64_TOL)],
                         ids=["fp32", "fp64"])
def test_wgrad_product_is_unchanged(dtype, tol, gen):
    """wgrad dW = dYᵀ·X contracts the token dim T. Transforming both operands along it, as quantized (N, T) and
    (K, T) copies: (dYᵀ·Tᵀ)·(Xᵀ·Tᵀ)ᵀ = dYᵀ·X. Error bound: the fp64 product's |dY|ᵀ·|X| times the transforms'
    relative error, plus the GEMM's own (T·u)."""
    tokens, n, k = 96, 24, 40
    dy = torch.randn(tokens, n, generator=gen, dtype=torch.float64).to(dtype)
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64).to(dtype)
    s = rht_signs(9)
    transformed = rht(dy.t().contiguous(), s) @ rht(x.t().contiguous(), s).t()
    exact = dy.double().t() @ x.double()
    magnitude = dy.double().abs().t() @ x.double().abs()
    unit = U32 if dtype == torch.float32 else 2.0**-53
    assert torch.all((transformed.double() - exact).abs() <= (2 * tol + tokens * unit) * 4 * magnitude)


def test_rht_spreads_an_outlier_over_its_block():
    """What the RHT is for: one outlier sets its block's scale; mixed over 16 elements it no longer stands out (the
    crest factor max/rms drops from its ceiling √16 = 4 to about 1), while the block's energy is kept."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(4)) * 0.1
    x[:, 5] = 20.0
    y = rht(x, rht_signs(2))

    def crest(t):
        return (t.abs().amax(-1) / t.pow(2).mean(-1).sqrt()).mean().item()

    assert crest(x) > 3.9 and crest(y) < 1.2
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=RHT_F32_TOL, atol=0)


def test_rht_keeps_dtype_and_leading_dims(gen):
    x = torch.randn(2, 3, 32, generator=gen).to(torch.bfloat16)
    y = rht(x, rht_signs(0))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = rht(x.float().reshape(6, 32), rht_signs(0)).reshape(2, 3, 32).to(torch.bfloat16)
    assert torch.equal(y, ref)



# ---------------------------------------------------------------------------------------------------- compiled kernel


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal, NaN equal to NaN whatever its payload."""
    if a is None or b is None:
        return a is None and b is None
    nan = torch.isnan(b.float())
    return torch.equal(torch.isnan(a.float()), nan) and torch.equal(a[~nan], b[~nan])


# (name, blocking, stochastic, operand dtype): each compiles once (seconds); together they cover every branch of
# the kernel (1×16, 16×16 and column-block amax, both roundings, with and without the operand, bfloat16 input)
NVFP4_COMPILE_CASES = [
    ("1x16-stochastic-operand", "1x16", True, torch.bfloat16),
    ("16x16-nearest", "16x16", False, None),
    ("columns-stochastic-bf16-input", "columns", True, torch.bfloat16),
]


@pytest.mark.parametrize("blocking, stochastic, operand_dtype", [c[1:] for c in NVFP4_COMPILE_CASES],
                         ids=[c[0] for c in NVFP4_COMPILE_CASES])
def test_nvfp4_kernel_compiled_and_eager_agree_bitwise(gen, blocking, stochastic, operand_dtype):
    """quantize_nvfp4 runs its elementwise part as one compiled kernel (numerics.compiling.maybe_compile); a fresh
    strict compile (no eager fallback) gives the eager function's bits, on data with NaN, ±inf, ±0, values in the
    E4M3 block scales' subnormal range and exact E2M1 ties."""
    from minifloat.numerics import fp4

    x = torch.randn(48, 80, generator=gen) * torch.logspace(-12, 3, 80)
    x[0, :8] = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 2.5, -5.0, 1e-30])
    if blocking == "columns":  # quantize_nvfp4_t's layout: 16 rows of a column per block, from bfloat16
        xb, dims = x.to(torch.bfloat16).reshape(3, 16, 80), (-2,)
    else:
        xb, dims = fp4._blocked(x, blocking == "16x16"), ((-3, -1) if blocking == "16x16" else (-1,))
    finite = x[torch.isfinite(x)]
    s_enc = fp4.global_encode_scale(finite.abs().max())
    g = 1.0 / s_enc
    seed = torch.tensor(2**40 + 17) if stochastic else None
    compiled = torch.compile(fp4._nvfp4_cast_kernel, dynamic=True, fullgraph=True)
    with torch.no_grad():
        got = compiled(xb, s_enc, g, seed, dims, operand_dtype)
    expected = fp4._nvfp4_cast_kernel(xb, s_enc, g, seed, dims, operand_dtype)
    for name, a, b in zip(("data", "block scales", "operand"), got, expected):
        assert _same_bits(a, b), name


# ---------------------------------------------------------------------------------- quantize_nvfp4_t (wgrad operands)

# (M, K): whole blocks along M, a ragged M (padded to 48), and both dims ragged
TRANSPOSE_SHAPES = [(64, 40), (40, 48), (33, 17)]


@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rht"])
def test_quantize_nvfp4_t_is_quantize_nvfp4_of_the_transpose(shape, rounding, dtype, rotate, gen):
    """Blocks down x's columns, no transposed copy: bitwise the quantization of xᵀ (rotated: of rht(pad(xᵀ))),
    stochastic rounding's draws included (they are indexed by position in xᵀ)."""
    x = (torch.randn(*shape, generator=gen) * torch.logspace(-3, 2, shape[1])).to(dtype)
    signs = rht_signs(7) if rotate else None
    got = quantize_nvfp4_t(x, rounding=rounding, generator=torch.Generator().manual_seed(3), rht_signs=signs,
                           operand_dtype=torch.bfloat16)
    source = rht(pad_to_multiple(x.t().float(), NVFP4_BLOCK), signs) if rotate else x.t()
    want = quantize_nvfp4(source, rounding=rounding, generator=torch.Generator().manual_seed(3),
                          operand_dtype=torch.bfloat16)
    assert got.shape == want.shape  # rotated: M stays padded, the rotated padding belongs to the product
    assert torch.equal(got.data, want.data)
    assert torch.equal(got.scale.float(), want.scale.float())
    assert torch.equal(got.operand, want.operand)
    assert torch.equal(got.global_scale, want.global_scale) and torch.equal(got.amax, want.amax)


def test_quantize_nvfp4_t_refuses_what_it_cannot_block():
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_nvfp4_t(torch.ones(2, 16, 16))
    with pytest.raises(ValueError, match="rounding"):
        quantize_nvfp4_t(torch.ones(16, 16), rounding="up")


@pytest.mark.parametrize("shape", [(64, 40), (3, 32, 24)], ids=["2d", "3d"])
def test_rht_down_columns_is_the_rht_of_the_transpose(shape, gen):
    x = torch.randn(*shape, generator=gen)
    signs = rht_signs(11)
    down = rht(x, signs, dim=-2)
    along = rht(x.transpose(-1, -2).contiguous(), signs).transpose(-1, -2)
    norm = x.transpose(-1, -2).reshape(-1, 16).norm(dim=-1).max().item()
    assert (down - along).abs().max().item() <= RHT_F32_TOL * norm  # 16-term sums, perhaps in another order
    back = rht_inverse(down, signs, dim=-2)
    assert (back - x).abs().max().item() <= RHT_F32_TOL * norm
    with pytest.raises(ValueError, match="dim must be -1"):
        rht(x, signs, dim=0)
    with pytest.raises(ValueError, match="dim -2 must be a multiple of the block 16"):
        rht(torch.ones(20, 16), signs, dim=-2)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_keep_data_false_keeps_the_operand_and_scales_only(block_2d, gen):
    x = torch.randn(40, 56, generator=gen)
    full = quantize_nvfp4(x, block_2d=block_2d, operand_dtype=torch.bfloat16)
    lean = quantize_nvfp4(x, block_2d=block_2d, operand_dtype=torch.bfloat16, keep_data=False)
    assert lean.data is None and lean.shape == full.shape
    assert torch.equal(lean.operand, full.operand) and torch.equal(lean.scale.float(), full.scale.float())
    assert torch.equal(lean.dequantize(), full.dequantize())  # the operand holds data · scale exactly
    lean_t = quantize_nvfp4_t(x, operand_dtype=torch.bfloat16, keep_data=False)
    assert lean_t.data is None
    assert torch.equal(lean_t.operand, quantize_nvfp4(x.t(), operand_dtype=torch.bfloat16).operand)
    with pytest.raises(ValueError, match="keep_data=True"):
        lean.codes()
    with pytest.raises(ValueError, match="needs operand_dtype"):
        quantize_nvfp4(x, keep_data=False)
