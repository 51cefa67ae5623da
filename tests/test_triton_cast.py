"""The one-pass Triton cast (minifloat.numerics.triton_cast) gives `quantize`'s bits, run in Triton's interpreter.

On a GPU, `quantize` and `quantize_t` send 2-D FP8 casts per tensor, row or column to one Triton kernel that writes the
row-major data, its transposed copy and the amax in one pass. Here TRITON_INTERPRET=1 runs that kernel on CPU tensors,
and every result is compared bit for bit with the same call on the torch path (the CPU emulation): data, the
transposed copy, scales and amax, for both FP8 formats, ragged and strided inputs, and the values where rounding is
delicate (ties, binade edges, subnormals, saturation, ±0, ±inf, NaN). A spy checks the kernel really ran, so no test
passes by comparing the torch path with itself. The GPU tier (tests/test_gpu_numerics.py) repeats the bitwise check
on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.numerics import triton_cast, triton_selfcheck, triton_tiles
from minifloat.numerics.other_axis import quantize_t
from minifloat.numerics.quantize import Quantized, quantize

pytest.importorskip("triton", reason="the Triton interpreter needs `pip install triton` (in the dev extras)")

FORMATS = [mf.E4M3, mf.E5M2]


@pytest.fixture
def calls(monkeypatch):
    """Counts fused_cast calls; the interpreter is switched on per comparison by `both`."""
    seen = []
    real = triton_cast.fused_cast

    def spy(*args, **kwargs):
        seen.append(kwargs.get("along", "tensor"))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_cast, "fused_cast", spy)
    return seen


def both(monkeypatch, fn):
    """(fn() on the torch path, fn() through the Triton kernel in the interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reference = fn()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        return reference, fn()
    finally:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(ref, got, *, with_t: bool = False):
    assert torch.equal(bits(got.data), bits(ref.data)), "FP8 data differs from the CPU emulation"
    assert torch.equal(bits(got.scale), bits(ref.scale))
    if ref.amax is not None or got.amax is not None:
        assert torch.equal(bits(got.amax), bits(ref.amax))
    if with_t:
        assert got.data_t.is_contiguous() and got.data_t.shape == got.data.t().shape
        assert torch.equal(bits(got.data_t), bits(ref.data.t()))


def fresh_slot() -> triton_cast.AmaxSlot:
    """A ScalingState slot's stand-in on the CPU: amax 1, no non-finite casts, the scratch zero."""
    return triton_cast.AmaxSlot(torch.ones(()), torch.zeros((), dtype=torch.int64), torch.zeros(2, dtype=torch.int32))


def awkward(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values over 30 binades, with the delicate ones planted in the first rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-14, 4, cols).roll(seed)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-30, -1e-30, 0.487, -0.487, 448.0, 449.0,
                             464.0, -465.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1.0625, 1.1875, 57344.0, 61440.0, 7.5e4])
    x[0, : len(specials)] = specials
    # exact midpoints between neighbouring E4M3 / E5M2 values (ties to even)
    n = min(cols, 64)
    grid = torch.arange(1, n + 1, dtype=torch.float32) / 8.0
    x[1, :n] = grid + 1.0 / 16
    x[2, :n] = (grid + 1.0 / 32) * 2.0**-6
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tensor_scale_given(monkeypatch, calls, fmt, dtype):
    """Delayed scaling: a stored scale, data and its transposed copy and the step's amax in one pass."""
    x = awkward(97, 130, dtype)
    scale = torch.tensor(0.37)
    ref, got = both(monkeypatch, lambda: quantize(x, fmt, scale=scale, with_t=True))
    assert calls == ["tensor"]
    assert_same(ref, got, with_t=True)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_tensor_scale_from_amax_strided(monkeypatch, calls, fmt):
    """Current scaling of a transposed (non-contiguous) view; NaN-free so the scale is finite."""
    x = awkward(70, 150, torch.bfloat16, seed=3).nan_to_num(posinf=3.0, neginf=-3.0).t()
    ref, got = both(monkeypatch, lambda: quantize(x, fmt, margin=1, with_t=True))
    assert calls == ["tensor"]
    assert_same(ref, got, with_t=True)


def test_nan_propagates_to_amax(monkeypatch, calls):
    x = awkward(40, 66, torch.bfloat16)
    x[5, 7] = float("nan")
    ref, got = both(monkeypatch, lambda: quantize(x, mf.E4M3, scale=torch.tensor(2.0)))
    assert calls == ["tensor"]
    assert torch.isnan(got.amax) and torch.isnan(ref.amax)
    assert got.data.view(torch.uint8)[5, 7] == ref.data.view(torch.uint8)[5, 7] == 0x7F
    assert torch.equal(bits(got.data), bits(ref.data))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("power_of_two", [False, True])
def test_row_scales(monkeypatch, calls, fmt, power_of_two):
    """Per-row casts from the rows' amaxes take triton_rows' two passes (an amax pass, a cast pass); given per-row
    scales, this kernel (along="row"). Both give the torch path's bits."""
    from minifloat.numerics import triton_rows

    rows = []
    real = triton_rows.row_col_cast
    monkeypatch.setattr(triton_rows, "row_col_cast", lambda *a, **k: rows.append(k.get("cols")) or real(*a, **k))
    x = awkward(65, 129, torch.bfloat16, seed=1)
    ref, got = both(monkeypatch, lambda: quantize(x, fmt, granularity="row", power_of_two=power_of_two))
    assert calls == [] and rows == [False]
    assert_same(ref, got)
    scale = ref.scale * 1.5
    ref, got = both(monkeypatch, lambda: quantize(x, fmt, granularity="row", scale=scale))
    assert calls == ["row"] and rows == [False]
    assert_same(ref, got)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_column_scales_written_transposed(monkeypatch, calls, fmt):
    """quantize_t per row of xᵀ: triton_rows' column passes write xᵀ's row-major data directly (the torch path returns
    a view)."""
    from minifloat.numerics import triton_rows

    passes = []
    real = triton_rows.row_col_cast
    monkeypatch.setattr(triton_rows, "row_col_cast", lambda *a, **k: passes.append(k.get("rows")) or real(*a, **k))
    x = awkward(130, 70, torch.bfloat16, seed=2)
    ref, got = both(monkeypatch, lambda: quantize_t(x, fmt, granularity="row"))
    assert calls == [] and passes == [False]
    assert got.data.is_contiguous() and not ref.data.is_contiguous()
    assert_same(ref, got)


def test_other_casts_stay_on_the_torch_path(monkeypatch, calls):
    """Block scales (tiles and 128×128 blocks are triton_blocks' kernel's), bfloat16 operands and tensors other
    than 2-D are not this kernel's."""
    x = awkward(128, 256, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    quantize(x, mf.E4M3, granularity="mx")
    quantize(x, mf.E4M3, operand_dtype=torch.bfloat16)
    quantize(x.reshape(2, 64, 256), mf.E4M3)
    assert calls == []


def test_transpose_swaps_layouts():
    """Quantized.t() hands over the row-major transposed copy, and gives the original back as its own copy."""
    q = quantize(torch.randn(8, 24), mf.E4M3, with_t=True)
    t = q.t()
    assert t.data is q.data_t and t.data_t is q.data and t.data.is_contiguous()
    assert torch.equal(t.dequantize(), q.dequantize().t())
    assert q.nbytes() == 2 * 8 * 24 + 4


def test_with_t_needs_2d():
    with pytest.raises(ValueError, match="with_t needs a 2-D tensor"):
        quantize(torch.randn(2, 3, 4), mf.E4M3, with_t=True)


# ---------------------------------------------------------------------------------------------------- in a layer


@pytest.fixture
def native_on_cpu(monkeypatch):
    """The native backend's decisions on this CPU, with torch._scaled_mm replaced by the exact emulation of the same
    FP8 operands. Records, per GEMM, whether each operand reached it row-major (what cuBLASLt reads without a copy)."""
    from minifloat.fp8 import caster, gemm
    from minifloat.numerics.granularity import Granularity

    per_tensor_or_row = (Granularity.TENSOR, Granularity.ROW)
    monkeypatch.setattr(caster, "native_granularity",
                        lambda device, g, backend=None: Granularity.parse(g) in per_tensor_or_row)
    monkeypatch.setattr(gemm, "native_support", lambda a, b, out_dtype=None, **kw: None
                        if a.data is not None and b.data is not None and a.granularity == b.granularity else "no")
    seen = []

    def native_mm(a, b, out_dtype, bias=None, fast_accum=False):
        seen.append((a.data.is_contiguous(), b.data.is_contiguous(), fast_accum))
        return gemm._emulated(a, b, out_dtype, bias, gemm.GemmPath.FACTORED)

    monkeypatch.setattr(gemm, "native_mm", native_mm)
    return seen


def _train(recipe, steps: int = 2):
    """y, dx and the parameter gradients of an Fp8Linear over `steps` optimizer steps (bfloat16 autocast)."""
    torch.manual_seed(0)
    layer = mf.Fp8Linear(96, 80, recipe=recipe)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x = (torch.randn(70, 96) * (step + 1)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()
        out += [y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.CurrentScaling(), mf.CurrentScaling(granularity="row")],
                         ids=["delayed", "current", "row"])
def test_layer_on_the_native_path_copies_no_operand(monkeypatch, calls, native_on_cpu, recipe):
    """The native path with the one-pass casts: every GEMM operand arrives row-major (x, W and dy cast once with
    their transposed copies; column scales written transposed), fprop alone asks for fast accumulation, and the
    layer's results are bitwise the emulated path's. (Row scaling's casts are triton_rows' passes: this kernel's
    spy sees none of them; tests/test_triton_rows.py follows them.)"""
    from minifloat.numerics import triton_rows

    real = triton_rows.row_col_cast
    monkeypatch.setattr(triton_rows, "row_col_cast", lambda *a, **k: calls.append("rows") or real(*a, **k))
    expected = _train(recipe)  # TRITON_INTERPRET unset: the torch casts
    assert calls == [] and len(native_on_cpu) == 6
    native_on_cpu.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = _train(recipe)
    assert len(native_on_cpu) == 6 and all(a and b for a, b, _ in native_on_cpu), native_on_cpu
    # fast accumulation in fprop only (Transformer Engine's choice); GEMMs run fprop, dgrad, wgrad per step
    assert [fast for _, _, fast in native_on_cpu] == [True, False, False] * 2
    assert calls, "the Triton kernel did not run"
    for e, g in zip(expected, got):
        assert torch.equal(bits(g), bits(e))


def _vector_amaxes(shape, dtype, bad):
    """|values| of `shape` (a cast's amaxes: one per row or tile), the largest 3.75 at a place that is not in the first
    block of the fold kernel's walk, and `bad` (inf or NaN) or nothing at another place."""
    g = torch.Generator().manual_seed(3)
    a = (torch.rand(shape, generator=g) * 3.0).to(dtype)
    flat = a.view(-1)
    flat[flat.numel() * 2 // 3] = 3.75
    if bad is not None:
        flat[flat.numel() // 3] = bad
    return a


AMAXES = [
    pytest.param(lambda bad: torch.tensor(3.5 if bad is None else bad), id="one"),
    pytest.param(lambda bad: torch.tensor(0.25), id="one-small"),
    pytest.param(lambda bad: _vector_amaxes((77, 1), torch.float32, bad), id="rows"),
    pytest.param(lambda bad: _vector_amaxes((2500, 3), torch.float32, bad), id="tiles-several-blocks"),
    pytest.param(lambda bad: _vector_amaxes((1, 1), torch.bfloat16, bad), id="one-bf16"),
    pytest.param(lambda bad: _vector_amaxes((300,), torch.bfloat16, bad), id="bf16"),
]


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("make", AMAXES)
def test_recording_an_amax_is_the_torch_path(monkeypatch, make, bad):
    """ScalingState.record's one-launch form, for one amax or a cast's many (one per row or tile, longer than the
    kernel's block): the history keeps the max of finite amaxes, a cast with a non-finite one only bumps the counter
    (once); the state's bytes are the torch path's."""
    from minifloat.fp8.recipes import Role
    from minifloat.fp8.scaling import ScalingState

    amax = make(bad)

    def recorded():
        state = ScalingState(history_len=4)
        state.amax_history[0] = 1.0
        for a in (amax, torch.tensor(2.0)):
            state.record(Role.INPUT, a)
        return state.state_dict()

    seen = []
    real = triton_cast.fold_amax
    monkeypatch.setattr(triton_cast, "fold_amax", lambda *a: seen.append(1) or real(*a))
    ref, got = both(monkeypatch, recorded)
    assert len(seen) == 2
    for key in ref:
        assert torch.equal(bits(got[key]) if got[key].is_floating_point() else got[key],
                           bits(ref[key]) if ref[key].is_floating_point() else ref[key]), key
    finite = bool(torch.isfinite(amax.float()).all())
    assert int(got["nonfinite"][0]) == (0 if finite else 1)
    expected = max(1.0, 2.0, float(amax.float().max())) if finite else 2.0
    assert float(got["amax_history"][0, 0]) == expected


def test_fold_amax_refuses_no_amax():
    slot, counter = torch.zeros(()), torch.zeros((), dtype=torch.int64)
    with pytest.raises(ValueError, match="at least one amax"):
        triton_cast.fold_amax(slot, counter, torch.zeros(0))


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("margin", [0, 8])
def test_scales_from_edge_amaxes(monkeypatch, calls, power_of_two, margin):
    """Scales computed in the kernel from amaxes where `scale_from_amax` takes its branches: a zero row and an
    infinite one (fallback 1), a tiny one (the quotient overflows: clamped to float32's max), a huge one (with a
    margin of 8 the scale is float32-subnormal, whose power of two needs the 2^64 detour). Per row of x and per
    column of xᵀ (triton_rows' passes), and this kernel given the rows' amaxes (along="row": its scales from amaxes)."""
    x = awkward(8, 40, torch.float32, seed=4).nan_to_num(posinf=1.0, neginf=-1.0)
    x[1] = 0.0
    x[2, 3] = float("inf")
    x[3] = 1e-38
    x[4, 5] = 3e38
    options = dict(granularity="row", margin=margin, power_of_two=power_of_two)
    amax = x.abs().amax(-1, keepdim=True)

    def kernel_from_amaxes():
        if triton_cast.interpreted():
            data, _, _, dscale = triton_cast.fused_cast(x, mf.E4M3, None, along="row", amax=amax, margin=margin,
                                                        power_of_two=power_of_two)
            return Quantized(data, dscale.reshape(-1, 1), mf.E4M3, "row", amax)
        return quantize(x, mf.E4M3, **options)

    for cast, kernel in ((lambda: quantize(x, mf.E4M3, **options), []),
                         (lambda: quantize_t(x.t().contiguous(), mf.E4M3, **options), []),
                         (kernel_from_amaxes, ["row"])):
        ref, got = both(monkeypatch, cast)
        assert calls == kernel
        assert_same(ref, got)
        if margin == 8:
            assert 0 < ref.scale[4] and 1.0 / ref.scale[4] < torch.finfo(torch.float32).tiny  # the subnormal case ran
        calls.clear()


def test_self_check_covers_every_tiling_and_turns_broken_kernels_off(monkeypatch, caplog):
    """On a GPU the kernels are used only after a self-check against the torch path; a kernel that raises (a Triton
    without one of the ops used) or gives other bits turns them off for that device, with one warning. (That the
    kernels as shipped pass it: the slow test below, ~40 s in the interpreter; each kernel's bits are also checked
    against the torch path by the tests above.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # the self-check's cases include every other tiling (on a GPU it runs them all; here each costs seconds in the
    # interpreter, and test_every_tiling_the_autotuner_may_pick_gives_the_torch_paths_bits runs them)
    names = [name for name, _ in triton_selfcheck.checks(torch.device("cpu"))]
    for i in range(1, triton_tiles.candidates_most()):
        assert sum(f"in tiling {i}" in n for n in names) == (3 if i < len(triton_tiles.CAST_TILES) else 1), names
    monkeypatch.setattr(triton_tiles, "candidates_most", lambda: 1)
    real = triton_cast.fused_cast

    def off_by_one(*args, **kwargs):
        data, data_t, amax, dscale = real(*args, **kwargs)
        if data is not None:
            data.view(torch.uint8)[0, 10] += 1
        return data, data_t, amax, dscale

    for broken, why in ((off_by_one, "differs from the torch path"), (lambda *a, **k: 1 / 0, "ZeroDivisionError")):
        monkeypatch.setattr(triton_cast, "_CHECKED", {})
        monkeypatch.setattr(triton_cast, "fused_cast", broken)
        caplog.clear()
        assert not triton_cast.self_check(torch.device("cpu"))
        assert len(caplog.records) == 1 and why in caplog.text and "casts run as compiled torch ops" in caplog.text


@pytest.mark.slow
def test_self_check_passes_with_the_kernels_as_shipped(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_cast, "_CHECKED", {})
    monkeypatch.setattr(triton_tiles, "candidates_most", lambda: 1)
    assert triton_cast.self_check(torch.device("cpu"))


def test_self_check_covers_recording_amaxes(monkeypatch, caplog):
    """A fold kernel that loses the amaxes past its first block (a GPU whose Triton compiles the loop wrongly) turns
    the kernels off, with the reason named."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_selfcheck, "checks", lambda device: iter(()))  # the casts' checks: the test above
    # the in-launch records (checked after the fold kernel): the test above runs them as shipped, the next test broken
    monkeypatch.setattr(triton_selfcheck, "records_in_pass_as_torch_does", lambda device: True)
    assert triton_cast.self_check(torch.device("cpu"))  # the fold kernel as shipped passes
    real = triton_cast.fold_amax
    monkeypatch.setattr(triton_cast, "fold_amax", lambda slot, counter, amax: real(slot, counter,
                                                                                   amax.reshape(-1)[:1024]))
    monkeypatch.setattr(triton_cast, "_CHECKED", {})
    caplog.clear()
    assert not triton_cast.self_check(torch.device("cpu"))
    assert "recording an amax differs from the torch path" in caplog.text


def test_tensors_of_2_31_elements_take_the_torch_path(monkeypatch):
    """The kernels address elements with int32 offsets: a tensor of 2^31 elements or more is never sent to them
    (meta tensors: the sizes without the memory)."""
    monkeypatch.setattr(triton_cast, "interpreted", lambda: True)
    assert triton_cast.available(torch.empty(2**16, 2**15 - 1, device="meta"))
    assert not triton_cast.available(torch.empty(2**16, 2**15, device="meta"))


def assert_recorded_as_torch_does(got_state, ref_state, scratch, col, *, finite, largest):
    """A recording cast left the ScalingState's bytes the torch path's: the role's history entry the largest finite
    amax (else the starting 1.0), its counter up by one if the tensor held NaN/inf, and the scratch zero again."""
    for key in ref_state:
        same = bits(got_state[key]) if got_state[key].is_floating_point() else got_state[key]
        assert torch.equal(same, bits(ref_state[key]) if ref_state[key].is_floating_point() else ref_state[key]), key
    assert int(got_state["nonfinite"][col]) == (0 if finite else 1)
    assert float(got_state["amax_history"][0, col]) == (largest if finite else 1.0)
    assert not scratch.any(), "the scratch must be zero again for the next launch"


def _recording_cast(x, scale):
    """A per-tensor E4M3 cast of `x` (a stored scale: delayed scaling; None: current scaling) recording its amax into
    a fresh ScalingState's input slot; returns (the cast, the state's buffers, the slot's scratch)."""
    from minifloat.fp8.recipes import Role
    from minifloat.fp8.scaling import ScalingState

    state = ScalingState(history_len=4)
    state.amax_history[0] = 1.0
    slot = state.amax_slot(Role.INPUT)
    q = quantize(x, mf.E4M3, scale=scale, with_t=True, record=slot)
    return q, state.state_dict(), slot.scratch.clone()


@pytest.mark.parametrize("scale", [torch.tensor(0.37), None], ids=["delayed", "current"])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("shape", [(5, 24), (70, 200)], ids=["one-program", "twelve-programs"])
def test_a_cast_records_its_amax_in_its_own_launch(monkeypatch, calls, scale, bad, shape):
    """A per-tensor cast given a ScalingState's slot folds its amax in the launch that takes it (delayed: the cast
    kernel; current: the amax pass), with no fold kernel and no zero-filled buffer: the state's bytes are the torch
    path's (the history keeps the max of finite amaxes; a non-finite amax only bumps the counter, once per cast
    however many programs saw it), the cast is the same, and the scratch is zero again for the next launch."""
    x = awkward(*shape, torch.bfloat16, seed=5).nan_to_num(posinf=2.0, neginf=-2.0).clamp(-5.0, 5.0)
    x[-1, -1] = 5.5  # the largest value, in the grid's last program
    if bad is not None:
        x[0, -1] = bad
    folds = []
    real = triton_cast.fold_amax
    monkeypatch.setattr(triton_cast, "fold_amax", lambda *a: folds.append(1) or real(*a))
    (ref, ref_state, _), (got, got_state, scratch) = both(monkeypatch, lambda: _recording_cast(x, scale))
    assert calls == ["tensor"] and folds == [], "the amax was not recorded in the cast's own launch"
    if bad is None or scale is not None:  # current scaling of a tensor holding inf or NaN: scale 1, data not compared
        assert_same(ref, got, with_t=True)
    assert torch.equal(bits(got.amax), bits(ref.amax))
    assert_recorded_as_torch_does(got_state, ref_state, scratch, 0, finite=bad is None, largest=5.5)


def test_a_recording_cast_twice_in_a_row_records_both(monkeypatch):
    """The scratch the last program resets is what the next launch starts from: two recording casts of different
    tensors leave the larger amax, and a NaN one after them only the counter."""
    from minifloat.fp8.recipes import Role
    from minifloat.fp8.scaling import ScalingState

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    state = ScalingState(history_len=2)
    slot = state.amax_slot(Role.GRAD_OUTPUT)
    first = torch.full((40, 70), 3.0)
    second = torch.full((40, 70), 0.5)
    spoiled = second.clone()
    spoiled[3, 3] = float("nan")
    for x in (first, second, spoiled):
        quantize(x, mf.E5M2, scale=torch.tensor(1.0), record=slot)
    assert float(state.amax_history[0, 2]) == 3.0 and int(state.nonfinite[2]) == 1 and not slot.scratch.any()


@pytest.mark.parametrize("granularity,both_axes,bad", [
    *[(g, both_axes, None) for g, both_axes in (("row", False), ("row", True), ("tile", True), ("block", False),
                                                ("mx", False))],
    ("row", False, float("nan")),
    *[pytest.param(g, both_axes, bad, marks=pytest.mark.slow)  # (the default suite keeps to its 10 minutes; tiles
      for g, both_axes, bad in (("tile", False, None), ("row", False, float("inf")),  # alone record as both ways do)
                                ("tile", False, float("nan")), ("block", False, float("nan")))]])
def test_row_and_block_casts_record_their_amax_in_their_own_launch(monkeypatch, granularity, both_axes, bad):
    """A cast per row (triton_rows' amax pass), in 1×128 tiles or 128×128 blocks (triton_blocks' pass), alone or
    both ways at once (`quantize_both`, the output gradient's casts), records the tensor's amax into a ScalingState's
    slot in its own launch: the state's bytes are what the torch path's `record_amax` of the cast's amaxes leaves, no
    fold kernel runs, and the scratch is zero again. MX blocks have no such kernel: one fold launch records them."""
    from minifloat.fp8.recipes import Role
    from minifloat.fp8.scaling import ScalingState
    from minifloat.numerics.other_axis import quantize_both

    x = awkward(140, 150, torch.bfloat16, seed=6).nan_to_num(posinf=2.0, neginf=-2.0).clamp(-5.0, 5.0)
    x[-1, -1] = 5.5  # the largest value, in the grid's last program
    if bad is not None:
        x[0, -1] = bad

    def recording_cast():
        state = ScalingState(history_len=4)
        state.amax_history[0] = 1.0
        slot = state.amax_slot(Role.GRAD_OUTPUT)
        if both_axes:
            q, q_t = quantize_both(x, mf.E4M3, granularity=granularity, record=slot)
        else:
            q, q_t = quantize(x, mf.E4M3, granularity=granularity, record=slot), None
        return q, q_t, state.state_dict(), slot.scratch.clone()

    folds = []
    real = triton_cast.fold_amax
    monkeypatch.setattr(triton_cast, "fold_amax", lambda *a: folds.append(1) or real(*a))
    (ref, ref_t, ref_state, _), (got, got_t, got_state, scratch) = both(monkeypatch, recording_cast)
    assert folds == ([1] if granularity == "mx" else []), "the amax was not recorded in the cast's own launch"
    assert got.data.dtype == mf.E4M3.torch_dtype and torch.equal(bits(got.amax), bits(ref.amax))
    if bad is None:
        assert_same(ref, got)
        if both_axes:
            assert torch.equal(bits(got_t.data), bits(ref_t.data.contiguous()))
    assert_recorded_as_torch_does(got_state, ref_state, scratch, 2, finite=bad is None, largest=5.5)


def test_self_check_covers_recording_in_the_casts_launch(monkeypatch, caplog):
    """A cast kernel whose last program never folds (a GPU that orders the atomics wrongly would lose amaxes the same
    way) turns the kernels off, with the reason named."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_selfcheck, "checks", lambda device: iter(()))
    assert triton_cast.self_check(torch.device("cpu"))
    real = triton_cast.fused_cast
    monkeypatch.setattr(triton_cast, "fused_cast", lambda *a, record=None, **k: real(*a, **k))  # records nothing
    monkeypatch.setattr(triton_cast, "_CHECKED", {})
    caplog.clear()
    assert not triton_cast.self_check(torch.device("cpu"))
    assert "recording an amax differs from the torch path" in caplog.text


@pytest.mark.parametrize("index", [pytest.param(i, marks=() if i == 1 else pytest.mark.slow)  # seconds each
                                   for i in range(1, triton_tiles.candidates_most())])
def test_every_tiling_the_autotuner_may_pick_gives_the_torch_paths_bits(monkeypatch, calls, index):
    """On a GPU a large tensor's cast takes whichever tiling the autotuner timed fastest (triton_tiles): each one
    gives the torch path's bits, on ragged edges, per tensor (amax and scale in the kernel, or a given scale), per
    row and column, recording its amax like `ScalingState.record`."""
    from minifloat.numerics import triton_rows
    from minifloat.numerics.other_axis import quantize_both

    x = awkward(70, 260, torch.bfloat16, seed=index)
    rows_calls = []
    real_rows = triton_rows.row_col_cast
    monkeypatch.setattr(triton_rows, "row_col_cast", lambda *a, **k: rows_calls.append(1) or real_rows(*a, **k))

    def cases():
        current, given = fresh_slot(), fresh_slot()
        with triton_tiles.forced(index):
            out = (quantize(x, mf.E4M3, with_t=True, record=current),
                   quantize(x, mf.E5M2, scale=torch.tensor(0.5), with_t=True, record=given),
                   quantize_both(x, mf.E4M3, granularity="row"))
        return out, [(s.amax.item(), s.nonfinite.item(), s.scratch.tolist()) for s in (current, given)]

    (ref, ref_slots), (got, got_slots) = both(monkeypatch, cases)
    assert calls and rows_calls, "the kernels did not run"
    assert_same(ref[0], got[0], with_t=True)
    assert_same(ref[1], got[1], with_t=True)
    for r, g in zip(ref[2], got[2]):
        assert_same(r, g)
    assert got_slots == ref_slots and got_slots[0][1] == 1  # x holds an inf: counted once, scratch back to zero


def test_small_tensors_and_the_interpreter_take_the_first_tiling(monkeypatch):
    """Only a CUDA tensor of TUNE_FROM elements or more is autotuned; the rest launch the first candidate."""
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, kw["BLOCK_M"], kw["BLOCK_K"], kw["num_warps"]))

    x = torch.zeros(100, 300)
    triton_tiles.launch(Kernel(), triton_tiles.CAST_TILES, x, (), {})
    bm, bk, warps = triton_tiles.CAST_TILES[0]
    assert seen == [((-(-100 // bm), -(-300 // bk)), bm, bk, warps)]
    with triton_tiles.forced(99):  # past the list: its last tiling
        triton_tiles.launch(Kernel(), triton_tiles.AMAX_TILES, x, (), {})
    bm, bk, warps = triton_tiles.AMAX_TILES[-1]
    assert seen[-1] == ((-(-100 // bm), -(-300 // bk)), bm, bk, warps)

    class Big:  # a large CUDA tensor, as launch sees it
        shape, is_cuda, device = (4096, 4096), True, torch.device("cuda")

        def numel(self):
            return 4096 * 4096

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not triton_tiles._tunes(Big())  # capturing a CUDA graph: no timing
    triton_tiles.launch(Kernel(), triton_tiles.CAST_TILES, Big(), (), {})
    bm, bk, warps = triton_tiles.CAST_TILES[0]
    assert seen[-1] == ((4096 // bm, 4096 // bk), bm, bk, warps)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert triton_tiles._tunes(Big())


def test_the_autotuners_trials_leave_the_recorded_state_as_they_found_it(monkeypatch):
    """Picking a tiling runs the kernel on the real buffers once per trial (here two runs of each candidate, in
    the interpreter, with a stand-in timer that makes the last candidate fastest): the amax history's slot and the
    non-finite counter are restored after each, so an inf in x counts once; the data, both layouts and scales are the
    torch path's; `picked` reports the tiling chosen per kernel and shape."""
    import functools

    import triton

    runs = []

    def timer(kernel_call, quantiles=None):
        for _ in range(2):
            kernel_call()
        runs.append(1)
        return [1.0 / len(runs)] * 3  # each candidate "faster" than the one before

    monkeypatch.setattr(triton, "autotune", functools.partial(triton.autotune, do_bench=timer))
    monkeypatch.setattr(triton_tiles, "_TUNED", {})
    monkeypatch.setattr(triton_tiles, "_tunes", lambda x: True)  # as a large CUDA tensor
    x = awkward(40, 140, torch.bfloat16, seed=5)  # holds ±inf

    def cases():
        current, given = fresh_slot(), fresh_slot()
        out = (quantize(x, mf.E4M3, with_t=True, record=current),
               quantize(x, mf.E5M2, scale=torch.tensor(0.5), with_t=True, record=given))
        return out, [(s.amax.item(), s.nonfinite.item(), s.scratch.tolist()) for s in (current, given)]

    (ref, ref_slots), (got, got_slots) = both(monkeypatch, cases)
    assert runs, "nothing was tuned"
    for r, g in zip(ref, got):
        assert_same(r, g, with_t=True)
    assert got_slots == ref_slots and [s[1] for s in got_slots] == [1, 1]
    picked = triton_tiles.picked()
    assert picked["_amax_fn"][0]["tiles"] == list(triton_tiles.AMAX_TILES[-1])
    assert {tuple(p["tiles"]) for p in picked["_cast_kernel_fn"]} == {triton_tiles.CAST_TILES[-1]}


def test_a_view_whose_elements_lie_2_31_apart_takes_the_torch_path(monkeypatch):
    # the kernels' int32 offsets overflowed on a few-element view with far-apart rows (a column slice of a large
    # fused tensor): a segfault in the interpreter, a read outside the tensor on a GPU
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    base = torch.empty(3, 2**30, dtype=torch.bfloat16)  # address space only: the pages written below are touched
    x = base[:, :8]
    x.copy_(torch.arange(24, dtype=torch.bfloat16).reshape(3, 8) + 1)
    assert x.numel() == 24 and triton_cast.span(x) > triton_cast.MAX_ELEMENTS
    assert not triton_cast.available(x) and triton_cast.available(x.contiguous())
    got = quantize(x, mf.E4M3, granularity="row")
    monkeypatch.delenv("TRITON_INTERPRET")
    want = quantize(x.contiguous(), mf.E4M3, granularity="row")
    assert torch.equal(bits(got.data), bits(want.data)) and torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_float8_input_is_quantized_as_its_float32_values_on_every_path(monkeypatch, granularity):
    # the torch path raised torch's '"aminmax_cpu" not implemented for Float8_e4m3fn' where the kernels ran
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 130, generator=g) * 50).to(torch.float8_e4m3fn)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    want = quantize(x.float(), mf.E5M2, granularity=granularity)
    for got in both(monkeypatch, lambda: quantize(x, mf.E5M2, granularity=granularity)):
        assert torch.equal(bits(got.data), bits(want.data)) and torch.equal(got.scale, want.scale)


def test_an_all_zero_tensors_amax_is_plus_zero_on_every_path(monkeypatch):
    # the torch path gave -0.0 (maximum(-0.0, +0.0)), the kernels +0.0
    x = torch.zeros(4, 5)
    for q in both(monkeypatch, lambda: quantize(x, mf.E4M3)):
        assert q.amax.view(torch.int32).item() == 0


def test_a_broadcast_view_of_2_31_elements_takes_the_torch_path(monkeypatch):
    # its span is small (stride 0), but the kernels write its (M, K) output with int32 offsets
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.ones(1, 2**16, dtype=torch.bfloat16).expand(2**15, 2**16)
    assert triton_cast.span(x) < triton_cast.MAX_ELEMENTS <= x.numel()
    assert not triton_cast.available(x)
