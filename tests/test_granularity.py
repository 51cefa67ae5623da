"""Tests for minifloat.numerics.granularity: the property table, parsing, the block layout helpers, and that
quantize / quantize_t / Quantized.t follow the table.

The expected properties come from the formats' sources, not from the code under test:
  * DeepSeek-V3 (arXiv 2412.19437 §3.3): 1×128 activation tiles, 128×128 weight blocks;
  * OCP MX v1.0: 32 elements along K share one E8M0 (power-of-two) scale;
  * cuBLASLt / torch._scaled_mm: per-tensor and row-wise scales only;
  * algebra: a scale constant along K factors out of Σ_k a_k·b_k; a scale block transposes with the data iff it is
    the whole tensor or square.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.formats import E4M3, E5M2, E8M0, FP32
from minifloat.numerics.granularity import (
    GRANULARITIES,
    MX_BLOCK,
    TILE,
    Granularity,
    expand_scale,
    from_blocks,
    granularity_info,
    scale_shape,
    to_blocks,
)
from minifloat.numerics.other_axis import quantize_t
from minifloat.numerics.quantize import Quantized, quantize

T, R, TL, B, MX = Granularity.TENSOR, Granularity.ROW, Granularity.TILE, Granularity.BLOCK, Granularity.MX

RAGGED_SHAPES = [(300, 260), (256, 384), (1, 5), (129, 33)]
RAGGED_IDS = ["300x260", "256x384", "1x5", "129x33"]


@pytest.fixture(autouse=True)
def _eager():
    with eager_kernels():  # compiled and eager kernels agree bit for bit (tests/test_quantize.py); skip compile time
        yield


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20261123)


# ---------------------------------------------------------------------------------------------------- the table


def test_block_constants():
    assert TILE == 128  # DeepSeek-V3 §3.3
    assert MX_BLOCK == 32  # OCP MX v1.0


# (name, granularity, property, expected)
PROPERTIES = [
    ("tensor-block", T, "block", None),
    ("row-block", R, "block", None),
    ("tile-block", TL, "block", (1, 128)),
    ("block-block", B, "block", (128, 128)),
    ("mx-block", MX, "block", (1, 32)),
    ("tensor-per-row", T, "per_row", False),
    ("row-per-row", R, "per_row", True),
    ("tensor-per-tensor", T, "per_tensor", True),
    ("row-per-tensor", R, "per_tensor", False),
    ("tile-per-tensor", TL, "per_tensor", False),
    ("tensor-scale-fmt", T, "scale_fmt", FP32),
    ("tile-scale-fmt", TL, "scale_fmt", FP32),
    ("mx-scale-fmt", MX, "scale_fmt", E8M0),
    ("tensor-transposes", T, "transposes_exactly", True),
    ("row-transposes", R, "transposes_exactly", False),
    ("tile-transposes", TL, "transposes_exactly", False),
    ("block-transposes", B, "transposes_exactly", True),
    ("mx-transposes", MX, "transposes_exactly", False),
    ("tensor-factors-out", T, "factors_out", True),
    ("row-factors-out", R, "factors_out", True),
    ("tile-factors-out", TL, "factors_out", False),
    ("block-factors-out", B, "factors_out", False),
    ("mx-factors-out", MX, "factors_out", False),
    ("tensor-always-folds", T, "always_folds", False),
    ("row-always-folds", R, "always_folds", False),
    ("tile-always-folds", TL, "always_folds", False),
    ("block-always-folds", B, "always_folds", False),
    ("mx-always-folds", MX, "always_folds", True),
    ("tensor-folds-p2", T, "folds_when_power_of_two", False),
    ("row-folds-p2", R, "folds_when_power_of_two", False),
    ("tile-folds-p2", TL, "folds_when_power_of_two", True),
    ("block-folds-p2", B, "folds_when_power_of_two", True),
]


@pytest.mark.parametrize("granularity, prop, expected", [c[1:] for c in PROPERTIES], ids=[c[0] for c in PROPERTIES])
def test_table_property(granularity, prop, expected):
    assert getattr(granularity_info(granularity), prop) == expected


# (name, granularity, folds without power_of_two, folds with power_of_two)
FOLDS = [
    ("tensor", T, False, False),  # factored out of the K-sum instead
    ("row", R, False, False),
    ("tile", TL, False, True),
    ("block", B, False, True),
    ("mx", MX, True, True),  # E8M0 scales are powers of two whatever power_of_two says
]


@pytest.mark.parametrize("granularity, plain, power_of_two", [c[1:] for c in FOLDS], ids=[c[0] for c in FOLDS])
def test_folds(granularity, plain, power_of_two):
    info = granularity_info(granularity)
    assert info.folds(False) is plain
    assert info.folds(True) is power_of_two


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_table_rows_are_consistent(granularity):
    info = granularity_info(granularity)
    # a scale factors out of Σ_k iff it is constant along K, i.e. it has no blocks along K
    assert info.factors_out == (info.block is None)
    # the scale layout of xᵀ is x's transposed iff there is one scale, or the blocks are square
    square = info.block is not None and info.block[0] == info.block[1]
    assert info.transposes_exactly == (info.per_tensor or square)
    assert not (info.per_row and info.block is not None)
    # a scale that factors out is applied to the GEMM output; folding it too would apply it twice
    assert not (info.factors_out and info.folds(True))


def test_every_member_has_a_row():
    assert GRANULARITIES == tuple(Granularity)
    assert [granularity_info(g) is not None for g in Granularity] == [True] * len(Granularity)


# ---------------------------------------------------------------------------------------------------- the enum


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_str_enum_stands_for_its_string(granularity):
    s = granularity.value
    assert granularity == s and hash(granularity) == hash(s)
    assert f"{granularity}" == str(granularity) == s
    assert Granularity.parse(s) is granularity and Granularity.parse(granularity) is granularity
    assert granularity_info(s) is granularity_info(granularity)


ALL = ["tensor", "row", "tile", "block", "mx"]

# (name, value, keyword arguments of parse, field the message must name, allowed values it must list)
PARSE_ERRORS = [
    ("unknown", "bogus", {}, "granularity", ALL),
    ("upper-case", "TILE", {}, "granularity", ALL),
    ("int", 128, {}, "granularity", ALL),
    ("none", None, {}, "granularity", ALL),
    ("unhashable", ["tile"], {}, "granularity", ALL),
    ("named-field", "bogus", {"field": "spec.granularity"}, "spec.granularity", ALL),
    ("not-allowed", "tile", {"allowed": (T, R)}, "granularity", ["tensor", "row"]),
    ("not-allowed-member", MX, {"allowed": (T, R)}, "granularity", ["tensor", "row"]),
]


@pytest.mark.parametrize("value, kwargs, field, allowed", [c[1:] for c in PARSE_ERRORS],
                         ids=[c[0] for c in PARSE_ERRORS])
def test_parse_error_names_field_allowed_values_and_value(value, kwargs, field, allowed):
    with pytest.raises(ValueError) as info:
        Granularity.parse(value, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{field} must be one of {allowed}, got "), message
    assert message.endswith(repr(value)), message


@pytest.mark.parametrize("call", [
    lambda: granularity_info("bogus"),
    lambda: quantize(torch.ones(4, 4), E4M3, granularity="bogus"),
    lambda: quantize_t(torch.ones(4, 4), E4M3, granularity="bogus"),
    lambda: Quantized(torch.ones(4, 4), torch.ones(()), E4M3, "bogus"),
], ids=["granularity_info", "quantize", "quantize_t", "Quantized"])
def test_every_entry_point_rejects_unknown_granularities(call):
    with pytest.raises(ValueError, match=re.escape(f"granularity must be one of {ALL}, got 'bogus'")):
        call()


def test_quantized_converts_strings_to_members(gen):
    q = quantize(torch.randn(4, 256, generator=gen), E4M3, granularity="tile")
    assert q.granularity is Granularity.TILE
    assert Quantized(q.data, q.scale, q.fmt, "tile").granularity is Granularity.TILE


# ---------------------------------------------------------------------------------------------------- layout


def reference_expand(scale: torch.Tensor, granularity: Granularity, shape) -> torch.Tensor:
    """A scale broadcast to a 2-D shape by slicing out each block of the table's block shape."""
    m, k = shape
    info = granularity_info(granularity)
    if info.block is None:
        return scale.expand(m, k).clone()
    rows, cols = info.block
    out = torch.empty(m, k)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = scale[i, j]
    return out


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
def test_blocks_round_trip_and_scale_shape(granularity, shape, gen):
    x = torch.randn(*shape, generator=gen)
    xb = to_blocks(x, granularity)
    n_scales = 1
    for n in scale_shape(x.shape, granularity):
        n_scales *= n
    assert xb.shape[0] == n_scales  # one row per scale
    assert torch.equal(from_blocks(xb, x.shape, granularity), x)
    assert quantize(x, E4M3, granularity=granularity).scale.shape == scale_shape(x.shape, granularity)


@pytest.mark.parametrize("granularity", [TL, B, MX])
@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
def test_expand_scale_repeats_each_scale_over_its_block(granularity, shape, gen):
    scale = torch.rand(scale_shape(shape, granularity), generator=gen)
    assert torch.equal(expand_scale(scale, granularity, shape), reference_expand(scale, granularity, shape))


def test_to_blocks_of_a_2d_block_needs_two_dims():
    with pytest.raises(ValueError, match="'block' needs a tensor of at least 2 dims"):
        to_blocks(torch.ones(300), B)


# ---------------------------------------------------------------------------------------------------- quantize


@settings(max_examples=60, deadline=None)
@given(granularity=st.sampled_from(GRANULARITIES), m=st.integers(1, 300), k=st.integers(1, 300),
       power_of_two=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_dequantize_is_data_times_scale_broadcast_per_table(granularity, m, k, power_of_two, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-8, 8, (m, k), generator=gen).float())
    q = quantize(x, E4M3, granularity=granularity, power_of_two=power_of_two)
    assert q.scale.shape == scale_shape(x.shape, granularity)
    expected = q.data.float() * reference_expand(q.scale, granularity, x.shape)
    assert torch.equal(q.dequantize(), expected)
    assert q.scale_folded == granularity_info(granularity).folds(power_of_two)


EXACT = [g for g in GRANULARITIES if granularity_info(g).transposes_exactly]
REQUANTIZED = [g for g in GRANULARITIES if not granularity_info(g).transposes_exactly]


@pytest.mark.parametrize("granularity", EXACT)
@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
def test_exact_transpose_commutes_with_dequantize(granularity, shape, gen):
    x = torch.randn(*shape, generator=gen)
    q = quantize(x, E5M2, granularity=granularity, operand_dtype=torch.bfloat16)
    qt = q.t()
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    assert torch.equal(qt.operand, q.operand.t())
    assert qt.granularity is granularity and qt.scale_folded == q.scale_folded


@pytest.mark.parametrize("granularity", REQUANTIZED)
def test_transpose_refuses_scales_that_do_not_transpose(granularity, gen):
    q = quantize(torch.randn(8, 64, generator=gen), E4M3, granularity=granularity)
    with pytest.raises(ValueError, match=re.escape(f"{[g.value for g in EXACT]}")):
        q.t()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES, ids=RAGGED_IDS)
@pytest.mark.parametrize("power_of_two", [False, True], ids=["plain", "pow2"])
def test_quantize_t_is_quantize_of_the_transpose(granularity, shape, power_of_two, gen):
    # exact transposes reuse x's scales; row, tile and MX re-quantize along x's first dim
    x = torch.randn(*shape, generator=gen) * 7.0
    options = dict(granularity=granularity, power_of_two=power_of_two, operand_dtype=torch.bfloat16)
    got = quantize_t(x, E4M3, **options)
    want = quantize(x.t().contiguous(), E4M3, **options)
    for field in ("data", "scale", "amax", "operand"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape, field
        assert torch.equal(a.float(), b.float()), field
    assert got.scale_folded == want.scale_folded
    assert torch.equal(got.dequantize(), want.dequantize())


@pytest.mark.parametrize("granularity, expected", [(T, 300), (R, 300), (TL, TILE), (B, TILE), (MX, MX_BLOCK)],
                         ids=["tensor", "row", "tile", "block", "mx"])
def test_block_size_is_the_k_extent_of_one_scale(granularity, expected, gen):
    assert quantize(torch.randn(4, 300, generator=gen), E4M3, granularity=granularity).block_size == expected
