"""NVFP4 on Blackwell's FP4 tensor cores (issue 20), checked on the CPU: the packing and scale layout torch._scaled_mm
takes, the rule table, the per-device check against the emulation, and a 4-bit layer steered onto the native path
into a stand-in kernel written from the documentation (tests/block_scaled_reference.py). Not yet run on an SM100 GPU:
there `pytest -m gpu tests/test_gemm.py` and the check itself decide."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import minifloat as mf
from block_scaled_reference import layer_step, scaled_mm_block_scaled, scaled_mm_nvfp4, unpack_e2m1, unswizzle
from minifloat.fp8 import native_check
from minifloat.fp8.native import NVFP4_PAIR, e2m1_packed, nvfp4_block_scales, nvfp4_support
from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.fp4 import quantize_nvfp4

BLACKWELL, HOPPER = (10, 0), (9, 0)
# a 4-bit layer's output and gradients on the native path against the emulated layer's (the stand-in rounds its
# float64 product once; the emulation rounds the bfloat16 accumulator, then applies the per-tensor scales): measured
# 51 dB for y, dx and dW
NATIVE_Y_SQNR_DB = 45.0
NATIVE_GRAD_SQNR_DB = 45.0
# |native - emulated| / max|emulated| of one product on a Blackwell GPU (native_check.TOLERANCE)
DEVICE_RTOL = native_check.TOLERANCE


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def _eager_casts():
    """The casts' compiled kernels are tested elsewhere (the same bits either way): here they run eagerly, so that
    these GEMM tests pay no compile time."""
    with eager_kernels():
        yield


def test_e2m1_elements_pack_as_torchs_float4_e2m1fn_x2(gen):
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    grid = torch.cat((values, -values))[torch.randint(0, 16, (64, 96), generator=gen)]
    packed = e2m1_packed(grid)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (64, 48)
    assert torch.equal(unpack_e2m1(packed), grid.double())
    assert torch.equal(unpack_e2m1(e2m1_packed(torch.tensor([[-0.0, 6.0]]))).signbit(), torch.tensor([[True, False]]))


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_nvfp4_scales_reach_cublas_swizzled_with_nan_blocks_nan(gen, block_2d):
    m, k = 200, 352  # rows pad to 256; K/16 = 22 scales per row pad to 24
    x = torch.randn(m, k, generator=gen) * 2.0 ** torch.randint(-8, 8, (m, 1), generator=gen)
    x[5, 40] = float("nan")
    q = quantize_nvfp4(x, block_2d=block_2d, operand_dtype=None, keep_data=True)
    s = nvfp4_block_scales(q)
    assert s.dtype == torch.float8_e4m3fn and s.is_contiguous() and s.numel() == 256 * 24
    want = q.scale.view(torch.uint8).long()
    if block_2d:
        want = want.repeat_interleave(16, dim=0)[:m]
    want = want.clone()
    want[5, 40 // 16] = 0x7F  # E4M3 NaN: the product's row 5 is NaN, as the emulation's
    assert torch.equal(unswizzle(s, m, k // 16), want)


# (name, (M, K, N), capability, out dtype, reason or None)
SUPPORT_CASES = [
    ("blackwell", (64, 512, 256), BLACKWELL, torch.bfloat16, None),
    ("fp32-out", (200, 352, 144), BLACKWELL, torch.float32, None),
    ("hopper", (64, 512, 256), HOPPER, torch.bfloat16, "SM 10.0+"),
    ("k-not-32", (64, 528, 256), BLACKWELL, torch.bfloat16, "K a multiple of 32"),
    ("n-not-16", (64, 512, 120), BLACKWELL, torch.bfloat16, "N=120"),
    ("int-out", (64, 512, 256), BLACKWELL, torch.int32, "outputs"),
]


@pytest.mark.parametrize("mkn, capability, out_dtype, reason", [c[1:] for c in SUPPORT_CASES],
                         ids=[c[0] for c in SUPPORT_CASES])
def test_nvfp4_support_table(gen, mkn, capability, out_dtype, reason):
    m, k, n = mkn
    qa = quantize_nvfp4(torch.randn(m, k, generator=gen), operand_dtype=None, keep_data=True)
    qb = quantize_nvfp4(torch.randn(n, k, generator=gen), block_2d=True, operand_dtype=None, keep_data=True)
    got = nvfp4_support(qa, qb, out_dtype, capability=capability)
    assert got is None if reason is None else (got is not None and reason in got), got


def test_an_operand_cast_for_the_emulation_is_not_native(gen):
    qa = quantize_nvfp4(torch.randn(64, 512, generator=gen), operand_dtype=torch.bfloat16, keep_data=False)
    assert "no E2M1 elements" in nvfp4_support(qa, qa, capability=BLACKWELL)


# (A kernel reading each byte's nibbles the other way round would swap elements 2i and 2i+1 of both operands alike,
# which leaves every dot product unchanged: the packing test above pins the order torch documents.)
@pytest.mark.parametrize("kernel, problem", [("documented", None), ("wrong-layout", "from the emulation"),
                                             ("raises", "raised RuntimeError")])
def test_the_nvfp4_rule_is_checked_against_the_emulation(kernel, problem, monkeypatch):
    def raises(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")

    fake = {"documented": scaled_mm_nvfp4, "wrong-layout": functools.partial(scaled_mm_nvfp4, layout="row-major"),
            "raises": raises}[kernel]
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    got = native_check.check(NVFP4_PAIR, torch.device("cpu"))
    assert got is None if problem is None else (got is not None and problem in got), got


def _steer_native(monkeypatch, calls):
    """A 4-bit layer on the CPU cast and multiplied as on a Blackwell GPU whose check passed, into the stand-in."""
    import minifloat.fp8.caster as caster
    import minifloat.fp8.fourbit.gemm as fourbit_gemm

    def kernel(a, b, *args, **kwargs):
        calls.append(a.dtype)
        return scaled_mm_block_scaled(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", kernel)
    monkeypatch.setattr(caster, "native_nvfp4", lambda *args, **kwargs: True)
    monkeypatch.setattr(fourbit_gemm, "nvfp4_support",
                        lambda a, b, out_dtype=torch.bfloat16: nvfp4_support(a, b, out_dtype, capability=BLACKWELL))


@pytest.mark.parametrize("tokens", [256, 200])
def test_an_nvfp4_layer_on_the_native_path_computes_what_the_emulation_does(tokens, monkeypatch):
    """fprop, dgrad (the 16×16 weight tiles transposed) and wgrad (both operands rotated by the RHT, stochastic
    rounding on dy) on the native path: y, dx and dW follow the emulated layer (200 tokens: wgrad's K, padded to 208,
    is not a multiple of 32, so that GEMM runs emulated). One layer: behind a second one the first's output would
    differ by bfloat16 roundings, which E2M1's coarse grid turns into other elements (a 2-layer y: 27 dB)."""
    torch.manual_seed(0)
    emulated = mf.convert(nn.Sequential(nn.Linear(256, 384)), recipe=mf.NVFP4Scaling(), keep_first_last=False)
    native = copy.deepcopy(emulated)
    x = torch.randn(tokens, 256) * torch.logspace(-3, 3, 256, base=2.0)
    dy = torch.randn(tokens, 384)

    want = layer_step(emulated, x, dy)
    calls = []
    _steer_native(monkeypatch, calls)
    y, dx, grads = layer_step(native, x, dy)
    assert calls and set(calls) == {torch.float4_e2m1fn_x2}
    assert len(calls) == (3 if tokens % 32 == 0 else 2), len(calls)
    assert mf.sqnr_db(want[0], y) >= NATIVE_Y_SQNR_DB
    assert mf.sqnr_db(want[1], dx) >= NATIVE_GRAD_SQNR_DB
    for g_emulated, g_native in zip(want[2], grads):
        assert mf.sqnr_db(g_emulated, g_native) >= NATIVE_GRAD_SQNR_DB


def test_a_nan_input_gives_nan_outputs_on_the_native_path_as_emulated(monkeypatch):
    torch.manual_seed(0)
    layer = mf.convert(nn.Sequential(nn.Linear(256, 128)), recipe=mf.NVFP4Scaling(), keep_first_last=False)
    native = copy.deepcopy(layer)
    x = torch.randn(64, 256)
    x[3, 17] = float("nan")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x).float()
    _steer_native(monkeypatch, calls := [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = native(x).float()
    assert calls == [torch.float4_e2m1fn_x2]
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[3].isnan().all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvfp4_gemm_on_the_device_follows_the_emulation():
    """On a GPU with FP4 tensor cores (Blackwell) the native product follows the exact emulation; elsewhere skipped
    with the reason."""
    from minifloat.fp8.fourbit.gemm import fp4_mm

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(200, 512, device="cuda", generator=g) * 4.0
    b = torch.randn(144, 512, device="cuda", generator=g) * 0.05
    a[:, :128] *= 30.0  # block scales that differ along K, so that a misplaced one shows
    qa = quantize_nvfp4(a, operand_dtype=None, keep_data=True)
    qb = quantize_nvfp4(b, block_2d=True, operand_dtype=None, keep_data=True)
    reason = nvfp4_support(qa, qb)
    if reason is not None:
        pytest.skip(f"not native on this GPU: {reason}")
    for out_dtype in (torch.bfloat16, torch.float32):
        native = fp4_mm(qa, qb, out_dtype=out_dtype, backend="native").float()
        emulated = fp4_mm(qa, qb, out_dtype=out_dtype, backend="emulated").float()
        assert float((native - emulated).abs().max()) <= DEVICE_RTOL * float(emulated.abs().max())


def test_the_native_nvfp4_path_traces_into_one_graph(monkeypatch):
    """Under torch.compile (fullgraph) the native path's packing, scale layout and per-tensor scaling trace without a
    break and give the eager path's bits (aot_eager: the stand-in kernel is Python)."""
    torch.manual_seed(0)
    layer = mf.convert(nn.Sequential(nn.Linear(256, 384)), recipe=mf.NVFP4Scaling(), keep_first_last=False)
    compiled_layer = copy.deepcopy(layer)
    x = torch.randn(256, 256)
    _steer_native(monkeypatch, calls := [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x).float()
    assert calls == [torch.float4_e2m1fn_x2]
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_block_scaled)  # no recording: a side effect dynamo refuses
    torch._dynamo.reset()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = torch.compile(compiled_layer, fullgraph=True, backend="aot_eager")(x).float()
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
