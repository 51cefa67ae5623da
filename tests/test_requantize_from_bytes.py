"""A quantized tensor re-quantized along its other axis from its stored bytes, on the torch path (every CPU).

The weight gradient needs the forward's saved FP8 input scaled along the token axis. Where its scales do not
transpose (per row, 1×128 tiles), the emulated backward used to write the dequantized input out in full (float32)
and read it twice more, for the column amaxes and for the cast. `requantize_t` now computes the values from the FP8
bytes inside each of those two passes (`other_axis._decoded_columns`). These tests hold it to what it replaces,
`quantize_t(q.dequantize())`, bit for bit: data, scales, amaxes and the bfloat16 GEMM operand, eagerly (small tensors)
and compiled (large ones), across the delicate values (NaN, ±inf, zeros, ties, subnormals, tiny scales). Folded
power-of-two scales (tiles with power_of_two, MX) keep the old route, checked too. A spy checks which route ran.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.numerics import other_axis
from minifloat.numerics import quantize as kernels
from minifloat.numerics.compiling import EAGER_BELOW
from minifloat.numerics.other_axis import quantize_t, requantize_t
from minifloat.numerics.quantize import quantize

# (granularity, power_of_two): rows and tiles with float32 scales take the from-bytes route; folded power-of-two
# tiles (DeepSeek-V3's BlockScaling default) and MX blocks (always folded) keep the dequantized one
KINDS = [("row", False), ("tile", False), ("tile", True), ("mx", True)]
SHAPES = {"eager": (128, 128), "compiled": (384, 256)}  # the second above EAGER_BELOW: compiled kernels


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def delicate(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over 30 binades, the delicate ones planted: ±0, ±inf (saturating), ties, subnormals, a NaN, an all-zero
    column (its scale falls back) and rows scaled by 2^-128 (tiny scales; below bfloat16's subnormal step, which the
    folded route's bfloat16 source rounds)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-14, 4, cols).roll(seed)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-30, 0.487, 448.0, 449.0, 464.0, 2.0**-9,
                             3 * 2.0**-11, 1.0625, 1.1875, 57344.0, 61440.0, 7.5e4])
    x[0, : len(specials)] = specials
    x[1, :64] = torch.arange(1, 65) / 8.0 + 1.0 / 16  # midpoints between E4M3 neighbours (ties to even)
    x[5, 7] = float("nan")
    x[:, 9] = 0.0
    x[rows // 2:, :] *= 2.0**-128
    return x


@pytest.fixture
def taken(monkeypatch):
    """Whether each requantize_t call went through the from-bytes path."""
    seen = []
    real = other_axis._decoded_columns

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(other_axis, "_decoded_columns", spy)
    return seen


def reference(q, **options):
    """What requantize_t computed before: the dequantized values written out, then quantize_t."""
    source = q.dequantize(torch.bfloat16 if q.scale_folded else torch.float32)
    return quantize_t(source, q.fmt, granularity=q.granularity, **options)


def assert_same(got, ref):
    for name in ("data", "operand", "scale"):
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and a.stride() == b.stride(), name
            assert torch.equal(bits(a), bits(b)), f"{name} differs from quantize_t of the dequantized values"
    nan = torch.isnan(ref.amax)
    assert torch.equal(torch.isnan(got.amax), nan)
    assert torch.equal(bits(got.amax[~nan]), bits(ref.amax[~nan]))
    assert got.scale_folded == ref.scale_folded and got.granularity == ref.granularity and got.fmt == ref.fmt


def _slow_when(*marks_for: tuple) -> list:
    """KINDS × SHAPES, the pairs in `marks_for` in the slow tier: the compiled 1×128 tiles from bytes (~20 s of
    cold compiling on 2 cores; the compiled rows take the same route by default, the eager tiles check its bits)."""
    return [pytest.param(g, p, size, id=f"{g}-{'pow2' if p else 'f32'}-{size}",
                         marks=[pytest.mark.slow] if (g, p, size) in marks_for else [])
            for size in SHAPES for g, p in KINDS]


@pytest.mark.parametrize("granularity, power_of_two, size", _slow_when(("tile", False, "compiled")))
def test_from_bytes_is_quantize_t_of_the_dequantized_values(taken, granularity, power_of_two, size):
    rows, cols = SHAPES[size]
    assert (rows * cols >= EAGER_BELOW) == (size == "compiled")
    x = delicate(rows, cols, seed=3)
    for fmt, margin in ((mf.E4M3, 0), (mf.E5M2, 1)):
        q = quantize(x, fmt, granularity=granularity, power_of_two=power_of_two, margin=margin)
        for options in (dict(operand_dtype=torch.bfloat16, keep_data=False),  # the emulated wgrad's operand
                        dict(operand_dtype=None, keep_data=True), dict(operand_dtype=torch.bfloat16, keep_data=True)):
            options |= dict(margin=margin, power_of_two=power_of_two)
            assert_same(requantize_t(q, **options), reference(q, **options))
    assert taken and all(t == (not power_of_two) for t in taken)


@pytest.mark.parametrize("shape", [(130, 256), (256, 200)], ids=["ragged-rows", "ragged-cols"])
def test_ragged_tiles_take_the_dequantized_route(taken, shape):
    """Tiles that do not cover the tensor exactly are not viewed block by block: the old route, the same bits."""
    q = quantize(delicate(*shape, seed=1), mf.E4M3, granularity="tile")
    options = dict(operand_dtype=torch.bfloat16, keep_data=False)
    assert_same(requantize_t(q, **options), reference(q, **options))
    assert taken == [False]


def test_rows_of_any_count_and_strided_data(taken):
    q = quantize(delicate(130, 96, seed=2), mf.E4M3, granularity="row")
    assert_same(requantize_t(q), reference(q))
    strided = kernels.Quantized(q.data.t().contiguous().t(), q.scale, q.fmt, q.granularity, q.amax)
    assert_same(requantize_t(strided), reference(strided))
    assert taken == [True, False]  # column-major data is left to the old route


@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_scales_that_transpose_exactly_take_the_dequantized_route(taken, granularity):
    """A per-tensor (or 128×128-block) Quantized re-quantized along its other axis: quantize_t of its values, as for
    every other granularity (per tensor it raised a reshape error, its one scale read as one per row)."""
    q = quantize(delicate(256, 128, seed=4), mf.E4M3, granularity=granularity)
    for options in (dict(), dict(operand_dtype=torch.bfloat16, keep_data=False)):
        assert_same(requantize_t(q, **options), reference(q, **options))
    assert taken == [False, False]  # each call went the dequantized route


@pytest.mark.parametrize("recipe", [mf.CurrentScaling(granularity="row"), mf.BlockScaling(power_of_two=False)],
                         ids=["row", "block-f32"])
def test_layer_backward_reads_the_saved_bytes(monkeypatch, taken, recipe):
    """An emulated Fp8Linear's wgrad operand xᵀ comes from the saved FP8 x without dequantizing it whole, and the
    layer's results are bitwise those of the old route (each _decoded_columns answering None)."""

    def run():
        torch.manual_seed(0)
        layer = mf.Fp8Linear(256, 128, recipe=recipe)
        x = (torch.randn(384, 256) * 3).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()
        return [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]

    got = run()
    assert taken == [True]
    monkeypatch.setattr(other_axis, "_decoded_columns", lambda *a, **k: None)
    for a, b in zip(got, run()):
        assert torch.equal(bits(a), bits(b))
