"""GPU tier: minifloat's numerics on the device against the CPU emulation. Every cast (`quantize`, `quantize_t`, NVFP4,
`cast`, the FP8 KV cache) gives the CPU's bits on the device. Every recipe's Fp8Linear runs forward and backward on
the device, emulated and with the default backend, against the CPU emulation: the operands of its GEMMs are the same
bits on both devices (the casts are), so outputs and gradients differ only where the GEMMs accumulate in another
order or round differently (SQNR floors below), and the scaling state, computed from the same tensors, is the same
bits.

The device and the switch: tests/gpu_device.py (MINIFLOAT_GPU_TESTS_DEVICE=cpu runs the tier without a GPU).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import minifloat as mf
from gpu_device import device  # noqa: F401  (the module's device fixture)
from gpu_device import (RECIPE_BY_NAME, RECIPE_NAMES, assert_same_bits, assert_same_state, autocast, fp8_state,
                        native_gemm_calls)
from minifloat.fp8.gemm import native_fp8_available
from minifloat.inference.kvcache import KVCache
from minifloat.numerics.compiling import EAGER_BELOW, eager_kernels
from minifloat.numerics.fp4 import quantize_nvfp4, quantize_nvfp4_t
from minifloat.numerics.formats import holds
from minifloat.numerics.granularity import GRANULARITIES
from minifloat.numerics import triton_cast
from minifloat.numerics.hadamard import rht_signs
from minifloat.numerics.other_axis import quantize_both, quantize_t, requantize_t
from minifloat.numerics.quantize import quantize
from minifloat.training.model import LlamaConfig

pytestmark = pytest.mark.gpu

SEED = 0
ROWS, COLS = 512, 1024  # 524288 elements: far above EAGER_BELOW, so the device runs the compiled kernels
assert ROWS * COLS >= 8 * EAGER_BELOW

# Emulated Fp8Linear, device against CPU. Both multiply the same exact bfloat16 operands (FP8 values, times
# power-of-two scales) with fp32 accumulation; the order of the fp32 sums differs (cuBLAS against oneDNN), and a
# bfloat16 output is rounded once on the CPU (one GEMM with the scales as alpha) but twice on CUDA (the bfloat16
# GEMM output, then the scaled result). Each rounding moves an element by at most half a bfloat16 ulp (2^-9
# relative): even if every element moved by a whole ulp the SQNR would be ≥ 20·log10(2^8) ≈ 48 dB. Measured on an
# H100 (torch 2.11, CUDA 13): 50.0-51.1 dB where the output is bfloat16-rounded twice, 99-inf dB elsewhere; the CPU
# against its own compiled kernels (MINIFLOAT_GPU_TESTS_DEVICE=cpu) is inf: the same GEMM.
EMULATED_CROSS_DEVICE_SQNR_DB = 40.0
# Default backend (native torch._scaled_mm where it runs) against the CPU emulation: the tensor cores accumulate in
# their own order and precision and round the scaled fp32 result to bfloat16 once. The inputs of every cast are the
# same bits, so this is the GEMMs' rounding alone. Measured on an H100: per-tensor 63.4-64.2 dB, DeepSeek blocks
# 62.7-63.3 dB, per-row 51.0-51.1 dB; 40 dB leaves other GPUs' accumulators room and still fails any real
# difference in what is computed (an FP8 rounding is ~30 dB).
NATIVE_VS_EMULATED_SQNR_DB = 40.0
# An FP8 layer is FP8: its output against the unquantized bfloat16 linear of the same weights is E4M3's rounding of
# both operands. Measured on an H100: 28.4-28.8 dB (delayed scaling's second step 24.0 dB: its scale is the first
# step's), MXFP4 15.6 dB, NVFP4 16.7 dB. Measured ~97 dB when the block and MX recipes silently ran the bfloat16
# GEMM on CUDA (issue 20): above this ceiling a recipe did not quantize.
QUANTIZED_VS_BF16_CEILING_DB = 40.0


# ---------------------------------------------------------------------------------------------------- casts


def wide_range(rows: int = ROWS, cols: int = COLS, seed: int = SEED) -> torch.Tensor:
    """Gaussian rows spread over 2^-24 .. 2^12 (subnormals of every format, saturation under a given scale), a zero
    row (amax 0: the fallback scale) and a row of one outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-24, 12, (rows, 1), generator=g).float())
    x[1] = 0.0
    x[2] = 1e-3
    x[2, 7] = 3e4
    return x


def quantized_fields(q) -> dict[str, torch.Tensor | None]:
    return {name: getattr(q, name, None) for name in ("data", "operand", "scale", "amax", "global_scale")}


def assert_same_quantized(on_device, on_cpu, what: str) -> None:
    for name, expected in quantized_fields(on_cpu).items():
        assert_same_bits(quantized_fields(on_device)[name], expected, f"{what} .{name}")
    assert getattr(on_device, "scale_folded", None) == getattr(on_cpu, "scale_folded", None), what


# (format, granularity, power_of_two): every granularity in both FP8 formats with and without power-of-two scales
# (MX scales are powers of two by construction), and MXFP4
QUANTIZE_CASES = [pytest.param(fmt, g, p2, id=f"{fmt.name}-{g}{'-pow2' if p2 else ''}")
                  for fmt in (mf.E4M3, mf.E5M2) for g in GRANULARITIES for p2 in (False, True)
                  if not (g == "mx" and p2)] + [pytest.param(mf.E2M1, "mx", False, id="e2m1-mx")]


@pytest.mark.parametrize("transposed", [False, True], ids=["x", "xT"])
@pytest.mark.parametrize("fmt, granularity, power_of_two", QUANTIZE_CASES)
def test_quantize_is_the_cpu_cast_bit_for_bit(device, fmt, granularity, power_of_two, transposed):
    """data, GEMM operand, scales and amaxes; `quantize_t` (the backward's re-quantization along the other axis) too,
    with the device's compiled kernels and its eager ones."""
    x = wide_range()
    fn = quantize_t if transposed else quantize
    options = dict(granularity=granularity, power_of_two=power_of_two, operand_dtype=torch.bfloat16)
    with eager_kernels():
        expected = fn(x, fmt, **options)
        eager = fn(x.to(device), fmt, **options)
    compiled = fn(x.to(device), fmt, **options)
    assert_same_quantized(compiled, expected, "compiled")
    assert_same_quantized(eager, expected, "eager")


def test_quantize_with_a_given_saturating_scale_is_the_cpu_cast(device):
    """Delayed scaling's cast: a stored scale under which a quarter of the range saturates."""
    x = wide_range()
    scale = x.abs().amax() / mf.E4M3.max / 4  # dequantization scale: |x| above amax/4 saturates at 448
    with eager_kernels():
        expected = quantize(x, mf.E4M3, scale=scale, operand_dtype=torch.bfloat16)
    got = quantize(x.to(device), mf.E4M3, scale=scale.to(device), operand_dtype=torch.bfloat16)
    assert (expected.data.float().abs() == mf.E4M3.max).any()  # the case saturates
    assert_same_quantized(got, expected, "given scale")


# The native path's one-pass casts (minifloat.numerics.triton_cast: FP8 data without a bfloat16 operand, per tensor
# with its transposed copy, per row, and per column written transposed): on CUDA the Triton kernel, on the CPU the
# torch path; the same bits.
FUSED_CASES = [("tensor", False), ("tensor-scale", False), ("row", False), ("row", True)]


@pytest.mark.parametrize("fmt", [mf.E4M3, mf.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("case, transposed", FUSED_CASES, ids=["tensor", "tensor-scale", "row", "column"])
def test_one_pass_cast_is_the_cpu_cast_bit_for_bit(device, fmt, case, transposed):
    if device == "cuda":  # else the casts below would take the torch path, and this compares nothing new
        assert triton_cast.self_check(torch.device(device)), "the one-pass Triton casts are off on this GPU"
    x = wide_range().to(torch.bfloat16)
    if case == "tensor-scale":
        scale = x.float().abs().amax() / fmt.max / 4  # a quarter of the range saturates
        fn = functools.partial(quantize, scale=scale, with_t=True)
    elif case == "tensor":
        fn = functools.partial(quantize, with_t=True)
    else:
        fn = functools.partial(quantize_t if transposed else quantize, granularity="row")
    with eager_kernels():
        expected = fn(x, fmt)
    got = fn(x.to(device), fmt) if case != "tensor-scale" else quantize(x.to(device), fmt, scale=scale.to(device),
                                                                         with_t=True)
    assert_same_quantized(got, expected, case)
    if case.startswith("tensor"):
        assert_same_bits(got.data_t, expected.data_t, "transposed copy")
        assert got.data_t.is_contiguous()


# The block recipe's one-pass casts (minifloat.numerics.triton_blocks: 1×128 tiles along either axis or both from one
# read, 128×128 blocks in both layouts, and tiles re-quantized from saved FP8 bytes) and row scaling's backward casts
# (triton_rows): on CUDA the Triton kernels, on the CPU the torch path; the same bits.
BLOCK_CASES = ["tile", "tile-t", "tile-both", "block", "from-fp8", "row-both", "row-from-fp8"]


@pytest.mark.parametrize("power_of_two", [False, True], ids=["float", "pow2"])
@pytest.mark.parametrize("fmt", [mf.E4M3, mf.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_one_pass_block_cast_is_the_cpu_cast_bit_for_bit(device, fmt, case, power_of_two):
    if device == "cuda":
        assert triton_cast.self_check(torch.device(device)), "the one-pass Triton casts are off on this GPU"
    x = wide_range().to(torch.bfloat16)
    options = dict(granularity="tile", power_of_two=power_of_two)

    def cast(t):
        if case == "tile":
            return (quantize(t, fmt, **options),)
        if case == "tile-t":
            return (quantize_t(t, fmt, **options),)
        if case == "tile-both":
            return quantize_both(t, fmt, **options)
        if case == "block":
            return (quantize(t, fmt, granularity="block", power_of_two=power_of_two, with_t=True),)
        if case == "row-both":  # (minifloat.numerics.triton_rows: per row and per column in two passes)
            return quantize_both(t, fmt, granularity="row", power_of_two=power_of_two)
        if case == "row-from-fp8":
            return (requantize_t(quantize(t, fmt, granularity="row", power_of_two=power_of_two),
                                 power_of_two=power_of_two),)
        return (requantize_t(quantize(t, fmt, **options), power_of_two=power_of_two),)

    with eager_kernels():
        expected = cast(x)
    got = cast(x.to(device))
    for g, e in zip(got, expected):
        assert_same_quantized(g, e, case)
        assert g.data.is_contiguous() or device != "cuda"  # written row-major by the kernel: no copy for the GEMM
        if e.data_t is not None:
            assert_same_bits(g.data_t, e.data_t, "transposed copy")


# (layout, with the RHT): 1×16 blocks (activations, gradients), 16×16 tiles (weights), and blocks down the columns
# (the wgrad operands, which the random Hadamard transform rotates)
NVFP4_LAYOUTS = [("1x16", False), ("16x16", False), ("transposed", False), ("transposed", True)]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("layout, rht", NVFP4_LAYOUTS, ids=[f"{n}{'-rht' if r else ''}" for n, r in NVFP4_LAYOUTS])
def test_nvfp4_quantize_is_the_cpu_cast_bit_for_bit(device, layout, rht, rounding):
    """NVFP4's two-level scales, its stochastic rounding (counter-based draws: the same on every device) and the
    random Hadamard transform of the wgrad operands."""
    x = wide_range() * 2.0**-6

    def cast(t):
        seed = None if rounding == "nearest" else torch.tensor(1234, dtype=torch.int64, device=t.device)
        options = dict(rounding=rounding, seed=seed, operand_dtype=torch.bfloat16)
        if layout == "transposed":
            signs = rht_signs(7).to(t.device) if rht else None
            return quantize_nvfp4_t(t, rht_signs=signs, **options)
        return quantize_nvfp4(t, block_2d=layout == "16x16", **options)

    with eager_kernels():
        expected = cast(x)
    assert_same_quantized(cast(x.to(device)), expected, layout)


def _format_cases(fmt: mf.NumberFormat) -> list[tuple[str, list[float]]]:
    """(name, values) edge cases of `fmt`, derived from its table row."""
    tiny, top = fmt.min_subnormal, fmt.max
    return [
        ("saturation", [top, top * 1.0625, top * 3, -top * 1.5, float("inf"), float("-inf")]),
        ("ties", [tiny * 0.5, tiny * 1.5, tiny * 2.5, -tiny * 0.5, fmt.min_normal * (1 + 2.0**-(fmt.mbits + 1))]),
        ("subnormals", [tiny, tiny * 0.49, tiny * 0.51, fmt.min_normal * 0.75, -tiny * 3]),
        ("specials", [0.0, -0.0, float("nan"), 1.0, -1.0]),
    ]


CAST_FORMATS = [mf.E4M3, mf.E5M2, mf.E2M1, mf.E8M0, mf.BF16, mf.FP16]
CAST_CASES = [pytest.param(fmt, name, values, id=f"{fmt.name}-{name}")
              for fmt in CAST_FORMATS for name, values in _format_cases(fmt)]


@pytest.mark.parametrize("fmt, name, values", CAST_CASES)
def test_cast_edge_cases_are_the_cpu_values(device, fmt, name, values):
    x = torch.tensor(values, dtype=torch.float32)
    assert_same_bits(mf.cast(x.to(device), fmt), mf.cast(x, fmt), f"{fmt.name} {name}")


@pytest.mark.parametrize("fmt", CAST_FORMATS, ids=lambda f: f.name)
def test_cast_of_a_wide_range_is_the_cpu_cast(device, fmt):
    x = wide_range()
    for dtype in (torch.float32, torch.bfloat16):
        if not holds(dtype, fmt):  # bfloat16 cannot hold FP16's precision: refused alike on every device
            with pytest.raises(ValueError, match="cannot hold every"):
                mf.cast(x.to(device, dtype), fmt)
            continue
        assert_same_bits(mf.cast(x.to(device, dtype), fmt), mf.cast(x.to(dtype), fmt), f"{fmt.name} {dtype}")


@pytest.mark.parametrize("fmt", [mf.E4M3, mf.E5M2, mf.E2M1, mf.BF16], ids=lambda f: f.name)
def test_stochastic_cast_with_the_same_draws_is_the_cpu_cast(device, fmt):
    """Stochastic rounding given its draws (as a compiled kernel is) depends on nothing device-specific."""
    x = wide_range() * 2.0**-8
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(SEED + 1))
    expected = mf.cast(x, fmt, rounding="stochastic", uniform=u)
    assert_same_bits(mf.cast(x.to(device), fmt, rounding="stochastic", uniform=u.to(device)), expected, fmt.name)


def test_fp8_kv_cache_stores_the_cpu_bytes(device):
    config = LlamaConfig.preset("tiny")
    g = torch.Generator().manual_seed(SEED)
    k, v = (torch.randn(2, config.n_head, 5, config.head_dim, generator=g) * 3 for _ in range(2))  # (B, H, T, hd)
    caches, outs = {}, {}
    for where in ("cpu", device):
        caches[where] = KVCache(config, batch=2, max_len=8, dtype="fp8", device=where)
        outs[where] = caches[where].update(1, k.to(where), v.to(where))
    cpu, dev = caches["cpu"], caches[device]
    assert dev.k.device.type == torch.device(device).type and dev.k.dtype == torch.float8_e4m3fn
    for name in ("k", "v", "k_scale", "v_scale"):
        assert_same_bits(getattr(dev, name), getattr(cpu, name), name)
    for got, expected, name in zip(outs[device], outs["cpu"], "kv"):
        assert_same_bits(got, expected, f"dequantized {name}")


# ---------------------------------------------------------------------------------------------------- Fp8Linear


TOKENS, D_IN, D_OUT = 512, 512, 512  # every GEMM's K a multiple of 512: each native scaling's shape rule holds
STEPS = 2
# recipes whose three GEMMs run natively on every GPU with FP8 tensor cores (cuBLASLt per-tensor and row-wise
# scaling, SM 8.9+); MXFP8 and NVFP4 run natively from SM 10.0 (Blackwell) once their check against the emulation
# passed there (minifloat.fp8.native_check), MXFP4 emulated on every GPU (minifloat.fp8.gemm). The DeepSeek block
# recipes run natively on Hopper with a blockwise torch only: not asserted
NATIVE_EVERYWHERE = {"delayed", "current", "current-row"}
NATIVE_FROM_BLACKWELL = {"mx", "nvfp4"}
NATIVE_NOWHERE = {"mxfp4"}
GEMMS_PER_STEP = 3  # fprop, dgrad, wgrad
RECIPE_PARAMS = pytest.mark.parametrize("name", RECIPE_NAMES)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output gradient) per step. Inputs grow, so delayed scales move; gradients are bfloat16 values, so the
    upstream gradient is the same bits on every device."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randn(TOKENS, D_IN, generator=g) * (1 + i),
             (torch.randn(TOKENS, D_OUT, generator=g) * 2.0**-6).to(torch.bfloat16)) for i in range(STEPS)]


def make_layer(name: str) -> mf.Fp8Linear:
    torch.manual_seed(SEED)
    return mf.Fp8Linear(D_IN, D_OUT, recipe=RECIPE_BY_NAME[name])  # fp32 parameters, built on the CPU


def run_layer(layer: mf.Fp8Linear, device: str, backend: str | None, *, fp8: bool = True) -> list[dict]:
    """STEPS FP8 steps of forward and backward under bfloat16 autocast; per step y, dx, dW and db on the CPU.

    The weights do not change (the FP8 step ends by `mf.fp8_step`, no optimizer): every cast of every step sees
    the same tensors on every device, so what differs is the GEMMs alone.
    """
    results = []
    for x, dy in batches():
        x = x.to(device).requires_grad_(True)
        with autocast(device), mf.autocast(backend=backend, enabled=fp8):
            y = layer(x)
        y.backward(dy.to(device))
        results.append({"y": y, "dx": x.grad, "dW": layer.weight.grad, "db": layer.bias.grad})
        layer.zero_grad(set_to_none=True)
        mf.fp8_step(layer)
    return [{k: v.detach().float().cpu() for k, v in r.items()} for r in results]


@functools.cache
def cpu_emulation(name: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The CPU emulation's per-step results and final scaling state (eager kernels)."""
    layer = make_layer(name)
    with eager_kernels():
        return run_layer(layer, "cpu", "emulated"), fp8_state(layer)


def on_device(name: str, device: str) -> mf.Fp8Linear:
    return copy.deepcopy(make_layer(name)).to(device)


def assert_sqnr_floor(got: list[dict], expected: list[dict], floor: float, what: str) -> None:
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        for key in e:
            sqnr = mf.sqnr_db(e[key], g[key])
            assert sqnr >= floor, f"{what} step {step} {key}: {sqnr:.1f} dB < {floor} dB"


@RECIPE_PARAMS
def test_emulated_fp8_linear_on_the_device_follows_the_cpu_emulation(device, name):
    expected, expected_state = cpu_emulation(name)
    layer = on_device(name, device)
    with native_gemm_calls() as calls:
        got = run_layer(layer, device, "emulated")
    assert calls == [], "the emulated backend called torch._scaled_mm"
    assert_sqnr_floor(got, expected, EMULATED_CROSS_DEVICE_SQNR_DB, name)
    assert_same_state(fp8_state(layer), expected_state, f"{name} ")  # amax histories, scales, RHT signs, SR counts


def expected_native_calls(name: str) -> int | None:
    """torch._scaled_mm calls the default backend makes over STEPS steps; None where it depends on the GPU."""
    if not native_fp8_available() or name in NATIVE_NOWHERE:
        return 0
    if name in NATIVE_FROM_BLACKWELL and torch.cuda.get_device_capability() < (10, 0):
        return 0
    return GEMMS_PER_STEP * STEPS if name in NATIVE_EVERYWHERE else None


@RECIPE_PARAMS
def test_default_backend_fp8_linear_on_the_device_follows_the_cpu_emulation(device, name):
    """The GEMM path taken, the output against the CPU emulation, and that the output is quantized at all."""
    expected, expected_state = cpu_emulation(name)
    layer = on_device(name, device)
    with native_gemm_calls() as calls:
        got = run_layer(layer, device, None)
    want = expected_native_calls(name)
    if want is not None:
        assert len(calls) == want, f"{len(calls)} native GEMMs, expected {want}"
    if calls:
        assert_sqnr_floor(got, expected, NATIVE_VS_EMULATED_SQNR_DB, f"{name} native")
    else:  # the default backend ran the emulation: the device's emulated results, bit for bit
        emulated = run_layer(on_device(name, device), device, "emulated")
        for step, (g, e) in enumerate(zip(got, emulated)):
            for key in e:
                assert_same_bits(g[key], e[key], f"step {step} {key}")
        assert_sqnr_floor(got, expected, EMULATED_CROSS_DEVICE_SQNR_DB, name)
    assert_same_state(fp8_state(layer), expected_state, f"{name} ")
    bf16 = run_layer(on_device(name, device), device, None, fp8=False)  # the unquantized linear, bf16 autocast
    for step, (g, b) in enumerate(zip(got, bf16)):
        sqnr = mf.sqnr_db(b["y"], g["y"])
        assert sqnr < QUANTIZED_VS_BF16_CEILING_DB, f"step {step}: {sqnr:.1f} dB from bf16: not quantized"


@pytest.mark.parametrize("scale,granularity", [(0.01, "tensor"), (None, "tensor"), (None, "row"), (None, "tile"),
                                               (None, "block")], ids=["delayed", "current", "row", "tile", "block"])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")], ids=["finite", "inf", "nan"])
def test_a_cast_recording_its_amax_in_its_launch_leaves_the_cpu_state(device, scale, granularity, bad):
    """Hundreds of programs race to record one cast's amax (on a GPU for real, where the interpreter runs them one
    after another): the last one must see every other's tile amax. Ten casts in a row, each with its largest value in
    another place and a bad value in one of them: the state's history and counter are the CPU's bits, and the scratch
    is zero again after each launch. Per tensor (the delayed cast, current scaling's amax pass), per row (the row amax
    pass), in 1×128 tiles and 128×128 blocks (the block pass)."""
    from minifloat.fp8.recipes import Role
    from minifloat.fp8.scaling import ScalingState

    if device == "cuda":
        assert triton_cast.self_check(torch.device(device)), "the one-pass Triton casts are off on this GPU"
    g = torch.Generator().manual_seed(7)
    casts = []
    for i in range(10):
        x = torch.rand(1000, 1100, generator=g) * (i + 1)
        x.view(-1)[(i * 97_001) % x.numel()] = 20.0 + i  # the largest, somewhere else each time
        if bad is not None and i == 4:
            x[999, 1099] = bad
        casts.append(x.to(torch.bfloat16))

    def run(on):
        state = ScalingState(history_len=2).to(on)
        slot = state.amax_slot(Role.INPUT)
        scratch_clean = []
        for x in casts:
            quantize(x.to(on), mf.E4M3, scale=None if scale is None else torch.tensor(scale, device=on),
                     granularity=granularity, with_t=granularity != "tile", record=slot)
            scratch_clean.append(not bool(slot.scratch.any()))
        return state.state_dict(), scratch_clean

    expected, _ = run("cpu")
    got, clean = run(device)
    assert all(clean)
    assert_same_state(got, expected)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_a_large_cast_takes_the_autotuned_tiling_and_the_cpus_bits(device, granularity):
    """A tensor of TUNE_FROM elements or more picks its tiling by timing the candidates (triton_tiles): the trials
    run the kernel on the real buffers, so each must leave the amax history's slot and the non-finite counter as it
    found them. With an inf in x, the counter goes up by exactly one; data, both layouts and the state are the
    CPU's bits."""
    from minifloat.fp8.recipes import Role
    from minifloat.fp8.scaling import ScalingState
    from minifloat.numerics import triton_tiles

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2048, 2304, generator=g) * 3.0).to(torch.bfloat16)
    assert x.numel() >= triton_tiles.TUNE_FROM
    x[1000, 7] = float("inf")
    x[5, 2300] = -700.0

    def run(on):
        state = ScalingState(history_len=2).to(on)
        q = quantize(x.to(on), mf.E4M3, granularity=granularity, with_t=True, record=state.amax_slot(Role.INPUT))
        return q, state.state_dict()

    want_q, want_state = run("cpu")
    before = sum(len(tuned) for tuned in triton_tiles.picked().values())
    got_q, got_state = run(device)
    assert_same_bits(got_q.data.view(torch.uint8), want_q.data.view(torch.uint8), "data")
    assert_same_bits(got_q.data_t.view(torch.uint8), want_q.data_t.view(torch.uint8), "data_t")
    assert_same_bits(got_q.scale, want_q.scale, "scale")
    assert_same_state(got_state, want_state)
    if device == "cuda":  # this granularity's kernels tuned a shape of their own (another case's do not count)
        assert sum(len(tuned) for tuned in triton_tiles.picked().values()) > before, "no tiling was autotuned"
