"""The one-pass Triton casts of 1×128 tiles and 128×128 blocks (minifloat.numerics.triton_blocks) give the torch
path's bits, run in Triton's interpreter.

On a GPU, the block recipe's casts go to one kernel: dy along both axes from one read (dgrad's and wgrad's operands),
the forward's saved FP8 x re-quantized along the token axis straight from its bytes, and 128×128 weight blocks written
in both layouts. Here TRITON_INTERPRET=1 runs that kernel on CPU tensors and every result is compared bit for bit with
the torch path's (the CPU emulation): data, scales, amaxes, for both formats, ragged edges, strided inputs and the
delicate values (ties, binade edges, subnormals, saturation, ±0, ±inf, NaN). A spy checks that the kernel ran. Each
128×128 program costs about half a second in the interpreter, so the cases are few and small; the slow tier adds
more of them. The GPU tier (tests/test_gpu_numerics.py) repeats the check on CUDA through the self-check.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.numerics import triton_blocks
from minifloat.numerics.other_axis import quantize_both, quantize_t, requantize_t
from minifloat.numerics.quantize import quantize
from test_triton_cast import _train, awkward, bits, both

pytest.importorskip("triton", reason="the Triton interpreter needs `pip install triton` (in the dev extras)")


@pytest.fixture
def modes(monkeypatch):
    """The casts block_cast ran, each as the sorted names of what it wrote ("rows", "cols", "block", "from-fp8")."""
    seen = []
    real = triton_blocks.block_cast

    def spy(x, fmt, **kw):
        seen.append("+".join(sorted([k for k in ("rows", "cols", "block", "write_t") if kw.get(k)]
                                    + (["from-fp8"] if kw.get("row_scales") is not None else []))))
        return real(x, fmt, **kw)

    monkeypatch.setattr(triton_blocks, "block_cast", spy)
    return seen


def assert_same(ref, got):
    """Data bytes and scales bit for bit; amaxes bit for bit where finite, NaN in the same places."""
    assert torch.equal(bits(got.data), bits(ref.data)), "FP8 data differs from the CPU emulation"
    assert torch.equal(bits(got.scale), bits(ref.scale)), "scales differ"
    assert got.scale_folded == ref.scale_folded and got.granularity == ref.granularity
    nan = torch.isnan(ref.amax)
    assert torch.equal(torch.isnan(got.amax), nan)
    assert torch.equal(bits(got.amax[~nan]), bits(ref.amax[~nan]))


def with_nan(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    x = awkward(rows, cols, dtype, seed)
    x[3, cols - 2] = float("nan")  # one NaN in the last column tile of row 3 and the first row tile of its column
    return x


@pytest.mark.parametrize("fmt, power_of_two, margin", [
    (mf.E4M3, True, 0),  # BlockScaling's default
    pytest.param(mf.E5M2, False, 1, marks=pytest.mark.slow),
], ids=["e4m3-pow2", "e5m2-margin1"])
def test_tiles_along_both_axes_in_one_pass(monkeypatch, modes, fmt, power_of_two, margin):
    """dy's two casts (1×128 tiles along K for dgrad, along M written as dyᵀ for wgrad) from one read; a NaN makes
    its tiles' amaxes NaN and their scales the fallback, and nothing else."""
    x = with_nan(130, 140, torch.bfloat16, seed=1)
    options = dict(granularity="tile", power_of_two=power_of_two, margin=margin)
    ref, got = both(monkeypatch, lambda: quantize_both(x, fmt, **options))
    assert modes == ["cols+rows"]
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])
    assert got[1].data.is_contiguous() and got[1].data.shape == (140, 130)  # xᵀ row-major: no copy for the GEMM
    assert torch.isnan(got[0].amax[3, 1]) and torch.isnan(got[1].amax[138, 0]) and got[0].scale[3, 1] == 1.0
    assert torch.isnan(got[0].amax).sum() == 1 and torch.isnan(got[1].amax).sum() == 1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [mf.E4M3, mf.E5M2], ids=lambda f: f.name)
def test_tiles_each_way_alone(monkeypatch, modes, fmt):
    """quantize (tiles along K) and quantize_t (tiles down the columns) of a strided float32 view, one kernel each."""
    x = awkward(140, 130, torch.float32, seed=2).t()
    ref, got = both(monkeypatch, lambda: (quantize(x, fmt, granularity="tile"),
                                          quantize_t(x, fmt, granularity="tile")))
    assert modes == ["rows", "cols"]
    assert_same(ref[0], got[0])
    assert_same(ref[1], got[1])


@pytest.mark.parametrize("fmt, power_of_two", [
    (mf.E4M3, True),
    pytest.param(mf.E5M2, False, marks=pytest.mark.slow),
], ids=["e4m3-pow2", "e5m2"])
def test_blocks_written_in_both_layouts(monkeypatch, modes, fmt, power_of_two):
    """A 128×128-block weight cast writes W and Wᵀ row-major in one pass (fprop's and dgrad's operands), and
    quantize_t of blocks hands over the transposed copy instead of a strided view."""
    w = with_nan(130, 140, torch.bfloat16, seed=3)
    ref, got = both(monkeypatch, lambda: quantize(w, fmt, granularity="block", power_of_two=power_of_two,
                                                  with_t=True))
    assert modes == ["block+rows+write_t"]
    assert_same(ref, got)
    assert torch.equal(bits(got.data_t), bits(ref.data.t()))
    assert torch.isnan(got.amax).sum() == 1 and got.scale.shape == (2, 2)
    t = got.t()
    assert t.data.is_contiguous() and t.data.data_ptr() == got.data_t.data_ptr()


def test_the_kernels_transposed_blocks_are_not_copied_again(monkeypatch):
    """The weight's cast in both layouts hands over the kernel's Wᵀ as it is: no second transposed copy of the data
    is made next to it (once one was, each FP8 step, a full copy of every weight)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    w = torch.randn(256, 128)
    written = {"data": torch.zeros(256, 128, dtype=torch.float8_e4m3fn),
               "data_t": torch.zeros(128, 256, dtype=torch.float8_e4m3fn),
               "scale": torch.ones(2, 1), "amax": torch.ones(2, 1)}
    monkeypatch.setattr(triton_blocks, "takes", lambda *a: True)
    monkeypatch.setattr(triton_blocks, "block_cast", lambda *a, **k: dict(written))

    class Copies(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("clone", "copy", "_to_copy", "contiguous")):
                Copies.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Copies():
        q = quantize(w, mf.E4M3, granularity="block", with_t=True)
    assert q.data_t is written["data_t"]
    assert Copies.seen == []


@pytest.mark.parametrize("power_of_two", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["folded-bf16", "float32"])
def test_saved_fp8_requantized_from_its_bytes(monkeypatch, modes, power_of_two):
    """wgrad's xᵀ from the forward's saved FP8 x: the kernel decodes the bytes, applies the row tiles' scales (as
    bfloat16 where they are folded powers of two, as the torch path's dequantization does) and casts tiles down the
    columns; the torch path materialises the dequantized x and calls quantize_t."""
    x = awkward(130, 100, torch.float32, seed=4).nan_to_num(posinf=3e4, neginf=-3e4)
    x[:128] *= 2.0**-128  # tiles whose values lie below bfloat16's subnormal step: the dequantization rounds
    saved = quantize(x, mf.E4M3, granularity="tile", power_of_two=power_of_two)  # torch path: the reference bytes
    ref, got = both(monkeypatch, lambda: requantize_t(saved, power_of_two=power_of_two))
    assert modes == ["cols+from-fp8"]
    assert_same(ref, got)
    assert got.data.is_contiguous() and got.data.shape == (100, 130)


def test_block_cast_refuses_what_it_cannot_do():
    x = torch.randn(4, 8)
    for kw in (dict(), dict(cols=True, block=True), dict(rows=True, write_t=True), dict(block=True)):
        with pytest.raises(ValueError, match="block_cast casts rows and/or cols"):
            triton_blocks.block_cast(x, mf.E4M3, **kw)
    with pytest.raises(ValueError, match="non-empty 2-D tensor and an FP8 format"):
        triton_blocks.block_cast(torch.randn(2, 4, 8), mf.E4M3, rows=True)
    with pytest.raises(ValueError, match="non-empty 2-D tensor and an FP8 format"):
        triton_blocks.block_cast(x, mf.E2M1, rows=True)


def test_not_taken_for_operands_or_off_gpu(monkeypatch, modes):
    """The emulated backend's bfloat16 operands, MX blocks, 3-D tensors and (without the interpreter) CPU tensors
    stay on the torch path."""
    x = awkward(130, 140, torch.bfloat16)
    quantize(x, mf.E4M3, granularity="tile")  # a CPU tensor, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    quantize(x, mf.E4M3, granularity="tile", operand_dtype=torch.bfloat16)
    quantize(x, mf.E4M3, granularity="mx")
    quantize(x.reshape(2, 65, 140), mf.E4M3, granularity="block")
    assert modes == []


# ---------------------------------------------------------------------------------------------------- in a layer


@pytest.fixture
def native_on_cpu(monkeypatch):
    """The native backend's decisions on this CPU for every pairing torch._scaled_mm has (tiles and blocks
    included), with torch._scaled_mm replaced by the exact emulation of the same FP8 operands. Records, per GEMM,
    whether each operand reached it row-major."""
    from minifloat.fp8 import caster, gemm
    from minifloat.fp8.native import NATIVE_RULES

    monkeypatch.setattr(caster, "native_granularity", lambda device, g, backend=None: True)
    monkeypatch.setattr(gemm, "native_support", lambda a, b, out_dtype=None, **kw: None
                        if a.data is not None and b.data is not None and (a.granularity, b.granularity) in NATIVE_RULES
                        else "no")
    seen = []

    def native_mm(a, b, out_dtype, bias=None, fast_accum=False):
        seen.append((a.data.is_contiguous(), b.data.is_contiguous()))
        factored = all(gemm._factors_or_folds(q) for q in (a, b))  # the emulated backend's own choice
        path = gemm.GemmPath.FACTORED if factored else gemm.GemmPath.K_BLOCKS
        return gemm._emulated(a, b, out_dtype, bias, path)

    monkeypatch.setattr(gemm, "native_mm", native_mm)
    return seen


@pytest.mark.parametrize("recipe", [mf.BlockScaling(), pytest.param(mf.BlockScaling(power_of_two=False),
                                                                     marks=pytest.mark.slow)],
                         ids=["pow2", "float-scales"])
def test_block_recipe_layer_on_the_native_path(monkeypatch, modes, native_on_cpu, recipe):
    """DeepSeek-V3's recipe on the native path with the one-pass casts: per step x is cast once (tiles), W once in
    both layouts (blocks), dy once along both axes, and xᵀ comes from x's saved FP8 bytes; every GEMM operand
    arrives row-major, and the layer's outputs and gradients are bitwise the torch path's."""
    expected = _train(recipe)  # TRITON_INTERPRET unset: the torch casts, the same native decisions
    assert modes == [] and len(native_on_cpu) == 6
    native_on_cpu.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = _train(recipe)
    assert modes == ["rows", "block+rows+write_t", "cols+rows", "cols+from-fp8"] * 2, modes
    assert native_on_cpu == [(True, True)] * 6
    for e, g in zip(expected, got):
        assert torch.equal(bits(g), bits(e))
