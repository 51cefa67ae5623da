"""Row scaling's backward casts in two passes (minifloat.numerics.triton_rows) give the torch path's bits, run in
Triton's interpreter.

On a GPU, dy is cast per row (dgrad) and per column written as dyᵀ (wgrad) by one amax pass and one cast pass, and
the forward's saved FP8 x is re-quantized per column from its bytes. Here TRITON_INTERPRET=1 runs those kernels on CPU
tensors and every result is compared bit for bit with `quantize` / `quantize_t` on the torch path: data, scales,
amaxes (NaN in the same places), for both formats, ragged and strided inputs and the delicate values. A spy checks
that the kernels ran. The GPU tier (tests/test_gpu_numerics.py) repeats the check on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.numerics import triton_rows
from minifloat.numerics.other_axis import quantize_both, requantize_t
from minifloat.numerics.quantize import quantize
from test_triton_blocks import _train, assert_same, native_on_cpu, with_nan  # noqa: F401 - a fixture
from test_triton_cast import bits, both

pytest.importorskip("triton", reason="the Triton interpreter needs `pip install triton` (in the dev extras)")


@pytest.fixture
def casts(monkeypatch):
    """The row_col_cast calls, each as what it wrote ("rows", "cols", "from-fp8")."""
    seen = []
    real = triton_rows.row_col_cast

    def spy(x, fmt, **kw):
        seen.append("+".join([k for k in ("rows", "cols") if kw.get(k, True)]
                             + (["from-fp8"] if kw.get("row_scales") is not None else [])))
        return real(x, fmt, **kw)

    monkeypatch.setattr(triton_rows, "row_col_cast", spy)
    return seen


@pytest.mark.parametrize("fmt, power_of_two, margin", [(mf.E4M3, False, 0), (mf.E5M2, True, 1)],
                         ids=["e4m3", "e5m2-pow2-margin1"])
def test_rows_and_columns_in_two_passes(monkeypatch, casts, fmt, power_of_two, margin):
    """dy per row and per column (as dyᵀ, row-major): a NaN makes its row's and column's amax NaN and their scales
    the fallback 1; a strided bfloat16 view with ragged edges."""
    x = with_nan(90, 70, torch.bfloat16, seed=5).t()  # (70, 90), a transposed view
    options = dict(granularity="row", power_of_two=power_of_two, margin=margin)
    ref, got = both(monkeypatch, lambda: quantize_both(x, fmt, **options))
    assert casts == ["rows+cols"]
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])
    assert got[1].data.is_contiguous() and got[1].data.shape == (90, 70)
    assert torch.isnan(got[0].amax).sum() == 1 and torch.isnan(got[1].amax).sum() == 1


@pytest.mark.parametrize("fmt", [mf.E4M3, mf.E5M2], ids=lambda f: f.name)
def test_saved_fp8_rows_requantized_per_column_from_their_bytes(monkeypatch, casts, fmt):
    """wgrad's xᵀ from the forward's saved FP8 x: decoded, times its row scales in float32, cast per column; the torch
    path writes the float32 values first."""
    x = with_nan(70, 90, torch.float32, seed=6)
    x[7] *= 2.0**-120  # a row whose values reach float32's subnormals once scaled back
    saved = quantize(x, fmt, granularity="row")  # the torch path's bytes
    ref, got = both(monkeypatch, lambda: requantize_t(saved))
    assert casts == ["cols+from-fp8"]
    assert_same(ref, got)
    assert got.data.is_contiguous() and got.data.shape == (90, 70)


def test_row_col_cast_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="row_col_cast takes a non-empty 2-D tensor"):
        triton_rows.row_col_cast(torch.randn(4, 8), mf.E4M3, rows=False, cols=False)
    with pytest.raises(ValueError, match="row_col_cast takes a non-empty 2-D tensor"):
        triton_rows.row_col_cast(torch.randn(2, 4, 8), mf.E4M3)


def test_row_recipe_layer_on_the_native_path(monkeypatch, casts, native_on_cpu):
    """CurrentScaling(granularity="row") on the native path: x and W cast per row in two passes each (an amax pass
    that records, a cast pass), dy per row and per column in two passes, W per column for dgrad (two passes, written
    as Wᵀ), xᵀ from x's saved FP8 bytes; every GEMM operand row-major; outputs and gradients bitwise the torch
    path's."""
    recipe = mf.CurrentScaling(granularity="row")
    expected = _train(recipe)  # TRITON_INTERPRET unset: the torch casts, the same native decisions
    assert casts == [] and len(native_on_cpu) == 6
    native_on_cpu.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = _train(recipe)
    assert casts == ["rows", "rows", "rows+cols", "cols", "cols+from-fp8"] * 2, casts
    assert native_on_cpu == [(True, True)] * 6
    for e, g in zip(expected, got):
        assert torch.equal(bits(g), bits(e))
