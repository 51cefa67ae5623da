"""Tests for minifloat.fp8.gemm and .native: scaled_mm against float64 matmul of the dequantized operands.

The reference multiplies exactly what the operands hold (data · scale, dequantized) in float64, so the only error
left is the GEMM's own: fp32 accumulation for a float32 output, plus the output rounding for bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
import minifloat as mf

from minifloat.numerics.formats import E4M3, E5M2
from minifloat.fp8.gemm import GemmPath, gemm_path, resolve_backend, scaled_mm
from minifloat.fp8.native import native_granularity, native_scale, native_support
from minifloat.numerics.quantize import quantize

# fp32 accumulation of K ≈ 300 exact products: rounding errors grow like sqrt(K)·2^-24 of the partial sums (measured
# ≤ 1.2e-7 of max|ref|); the dequantized reference itself carries one fp32 rounding of data · scale per operand.
FP32_ACC_RTOL = 1e-6
# bfloat16 output: one rounding to bfloat16 of the fp32 result (unit roundoff 2^-9), or two where a native stand-in
# is compared with the emulation (each rounds once, on its own accumulator): within 2^-7 of max|ref|.
BF16_OUT_RTOL = 2.0**-7
# native (tensor-core) vs emulated: tensor cores accumulate FP8 products with reduced precision (DeepSeek-V3 §3.3.2
# measures about 14 bits on H800), so a float32 output may differ by about 2^-14 of the partial sums.
NATIVE_FP32_RTOL = 2.0**-10
# an MX layer's gradients on the native path against the emulated layer's (the CPU stand-in for the kernel): the
# first layer's output differs by bfloat16 roundings, so the second layer's casts move a few elements to the other
# E4M3 neighbour (measured: dx bitwise, dW 56 dB and more)
MX_NATIVE_GRAD_SQNR_DB = 45.0

M, N, K = 96, 80, 300  # K = 300 is a multiple of neither 128 (tiles, blocks) nor 32 (MX blocks)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def operands(gen):
    a = torch.randn(M, K, generator=gen) * 3.0
    b = torch.randn(N, K, generator=gen) * 0.05
    # make the scales differ across rows and K blocks, so a wrongly applied scale shows
    a[: M // 2] *= 50.0
    a[:, 200:] *= 1e-2
    b[:, :64] *= 20.0
    bias = torch.randn(N, generator=gen)
    return a, b, bias


def rel_max_error(out: torch.Tensor, ref: torch.Tensor, ref_nobias: torch.Tensor) -> float:
    # normalised by the larger of the GEMM's own magnitude and the output's (a bias may shrink the output)
    denom = max(ref.abs().max().item(), ref_nobias.abs().max().item())
    return ((out.double() - ref).abs().max() / denom).item()


# (name, granularity of a, granularity of b, power_of_two)
GRANULARITY_PAIRS = [
    ("tensor-tensor", "tensor", "tensor", False),
    ("tensor-tensor-pow2", "tensor", "tensor", True),
    ("row-row", "row", "row", False),
    ("row-row-pow2", "row", "row", True),
    ("tile-block-pow2", "tile", "block", True),
    ("tile-block", "tile", "block", False),
    ("mx-mx", "mx", "mx", True),
    ("tile-tile-pow2", "tile", "tile", True),
    ("tile-tile", "tile", "tile", False),
    ("tensor-row", "tensor", "row", False),
    ("row-tile", "row", "tile", False),
    ("block-tile", "block", "tile", False),
]

# (name, fmt of a, fmt of b)
FORMAT_PAIRS = [("e4m3-e4m3", E4M3, E4M3), ("e4m3-e5m2", E4M3, E5M2), ("e5m2-e4m3", E5M2, E4M3)]

# (name, out_dtype, tolerance)
OUT_DTYPES = [("fp32", torch.float32, FP32_ACC_RTOL), ("bf16", torch.bfloat16, BF16_OUT_RTOL)]


@pytest.mark.parametrize("ga, gb, power_of_two", [c[1:] for c in GRANULARITY_PAIRS],
                         ids=[c[0] for c in GRANULARITY_PAIRS])
@pytest.mark.parametrize("fa, fb", [c[1:] for c in FORMAT_PAIRS], ids=[c[0] for c in FORMAT_PAIRS])
@pytest.mark.parametrize("out_dtype, rtol", [c[1:] for c in OUT_DTYPES], ids=[c[0] for c in OUT_DTYPES])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_emulated_matches_float64_of_dequantized(operands, ga, gb, power_of_two, fa, fb, out_dtype, rtol, with_bias):
    a, b, bias = operands
    qa = quantize(a, fa, granularity=ga, power_of_two=power_of_two)
    qb = quantize(b, fb, granularity=gb, power_of_two=power_of_two)
    ref_nobias = qa.dequantize().double() @ qb.dequantize().double().T  # (M, K) · (K, N)
    ref = ref_nobias + bias.double() if with_bias else ref_nobias

    out = scaled_mm(qa, qb, out_dtype=out_dtype, bias=bias if with_bias else None, backend="emulated")

    assert out.shape == (M, N)
    assert out.dtype == out_dtype
    assert rel_max_error(out, ref, ref_nobias) <= rtol


# A bfloat16 output rounded once: within one bfloat16 step (2^-8 relative) of the exact result, plus the fp32
# accumulator's own error, at most (K + 3)·2^-24 of Σ|a·b| (K sums, the scales' products and the bias's add).
# That first term is what a bias cancelling most of the product shrinks; the second does not shrink with it.
ONE_BF16_STEP = 2.0**-8
FP32_GEMM_UNIT = 2.0**-24


@pytest.mark.parametrize("ga, gb, power_of_two", [c[1:] for c in GRANULARITY_PAIRS],
                         ids=[c[0] for c in GRANULARITY_PAIRS])
def test_a_bias_that_cancels_the_product_leaves_one_bf16_rounding(operands, ga, gb, power_of_two):
    """A bfloat16 output is (x·Wᵀ)·scales + bias rounded once, as the tensor cores' epilogue rounds it, also when
    the bias cancels most of the product. The emulation of row scales rounded the product to bfloat16 before the
    scales and the bias were applied: up to 9,463 bfloat16 steps off in such a case (2026-12-02)."""
    a, b, _ = operands
    qa = quantize(a, E4M3, granularity=ga, power_of_two=power_of_two)
    qb = quantize(b, E4M3, granularity=gb, power_of_two=power_of_two)
    A, B = qa.dequantize().double(), qb.dequantize().double()
    exact = A @ B.T
    # bfloat16 values, so that no path's rounding of the bias itself enters: row 0 cancels to a residual
    bias = (-exact[0]).to(torch.bfloat16).float()
    out = scaled_mm(qa, qb, out_dtype=torch.bfloat16, bias=bias, backend="emulated")
    ref = exact + bias.double()
    assert (ref[0].abs() < 2.0**-7 * exact[0].abs()).float().mean() > 0.9, "the bias does not cancel row 0"
    bound = ONE_BF16_STEP * ref.abs() + (K + 3) * FP32_GEMM_UNIT * (A.abs() @ B.abs().T)
    over = (out.double() - ref).abs() > bound
    assert not over.any(), f"{int(over.sum())} of {over.numel()} elements beyond one bfloat16 rounding"


# (name, granularity of a, granularity of b, power_of_two of a, power_of_two of b): one operand's power-of-two scales
# are folded into it, the other's are applied per K block — each scale must be applied exactly once
MIXED_FOLDING = [
    ("tile-pow2-block", "tile", "block", True, False),
    ("tile-block-pow2", "tile", "block", False, True),
    ("tile-pow2-tile", "tile", "tile", True, False),
    ("block-pow2-tile", "block", "tile", True, False),
    ("mx-tile", "mx", "tile", True, False),
]


@pytest.mark.parametrize("ga, gb, pa, pb", [c[1:] for c in MIXED_FOLDING], ids=[c[0] for c in MIXED_FOLDING])
@pytest.mark.parametrize("out_dtype, rtol", [c[1:] for c in OUT_DTYPES], ids=[c[0] for c in OUT_DTYPES])
def test_mixed_folding_matches_float64_of_dequantized(operands, ga, gb, pa, pb, out_dtype, rtol):
    a, b, bias = operands
    qa, qb = quantize(a, E4M3, granularity=ga, power_of_two=pa), quantize(b, E5M2, granularity=gb, power_of_two=pb)
    assert qa.scale_folded != qb.scale_folded
    ref_nobias = qa.dequantize().double() @ qb.dequantize().double().T
    ref = ref_nobias + bias.double()
    out = scaled_mm(qa, qb, out_dtype=out_dtype, bias=bias, backend="emulated")
    assert rel_max_error(out, ref, ref_nobias) <= rtol


# (name, granularity of a, granularity of b, power_of_two, path on a machine without FP8 tensor cores)
GEMM_PATHS = [
    ("tensor-tensor", "tensor", "tensor", False, GemmPath.FACTORED),
    ("row-row", "row", "row", False, GemmPath.FACTORED),
    ("tensor-row", "tensor", "row", False, GemmPath.FACTORED),
    ("mx-mx", "mx", "mx", True, GemmPath.FACTORED),  # E8M0 scales fold
    ("tile-block-pow2", "tile", "block", True, GemmPath.FACTORED),  # power-of-two block scales fold
    ("tile-block", "tile", "block", False, GemmPath.K_BLOCKS),
    ("row-tile", "row", "tile", False, GemmPath.K_BLOCKS),
    ("mx-tile", "mx", "tile", False, GemmPath.K_BLOCKS),
]


@pytest.mark.parametrize("ga, gb, power_of_two, expected", [c[1:] for c in GEMM_PATHS], ids=[c[0] for c in GEMM_PATHS])
@pytest.mark.parametrize("backend", ["auto", "emulated"])
def test_gemm_path_without_native_fp8(operands, ga, gb, power_of_two, expected, backend):
    if torch.cuda.is_available():
        pytest.skip("on a GPU, auto may pick the native path")
    a, b, _ = operands
    qa = quantize(a, E4M3, granularity=ga, power_of_two=power_of_two)
    qb = quantize(b, E4M3, granularity=gb, power_of_two=power_of_two)
    assert gemm_path(qa, qb, torch.bfloat16, backend) == expected
    assert resolve_backend(backend, qa, qb) == "emulated"


def test_gemm_path_validates_the_backend(operands):
    a, b, _ = operands
    qa, qb = quantize(a, E4M3), quantize(b, E4M3)
    with pytest.raises(ValueError, match="backend must be one of.*'bogus'"):
        gemm_path(qa, qb, backend="bogus")


@pytest.mark.parametrize("ga, gb, power_of_two", [c[1:] for c in GRANULARITY_PAIRS],
                         ids=[c[0] for c in GRANULARITY_PAIRS])
def test_precomputed_operand_gives_identical_result(operands, ga, gb, power_of_two):
    a, b, bias = operands
    kwargs = dict(power_of_two=power_of_two)
    plain = scaled_mm(quantize(a, E4M3, granularity=ga, **kwargs), quantize(b, E5M2, granularity=gb, **kwargs),
                      bias=bias, backend="emulated")
    cached = scaled_mm(quantize(a, E4M3, granularity=ga, operand_dtype=torch.bfloat16, **kwargs),
                       quantize(b, E5M2, granularity=gb, operand_dtype=torch.bfloat16, **kwargs),
                       bias=bias, backend="emulated")
    assert torch.equal(plain, cached)


def test_auto_backend_on_cpu_is_emulated(operands):
    a, b, _ = operands
    qa, qb = quantize(a, E4M3), quantize(b, E4M3)
    assert torch.equal(scaled_mm(qa, qb), scaled_mm(qa, qb, backend="emulated"))


def test_single_k_block_and_tiny_shapes(gen):
    # K smaller than one MX block and one tile; M = N = 1
    a, b = torch.randn(1, 5, generator=gen), torch.randn(1, 5, generator=gen)
    for granularity in ("tensor", "row", "tile", "mx"):
        qa, qb = quantize(a, E4M3, granularity=granularity), quantize(b, E4M3, granularity=granularity)
        ref = qa.dequantize().double() @ qb.dequantize().double().T
        out = scaled_mm(qa, qb, backend="emulated")
        assert (out.double() - ref).abs().max().item() <= FP32_ACC_RTOL * ref.abs().max().item(), granularity


# ---------------------------------------------------------------------------------------------------- errors

# (name, shape of a, shape of b)
BAD_SHAPES = [
    ("k-mismatch", (8, 32), (16, 48)),
    ("a-3d", (2, 8, 32), (16, 32)),
    ("b-3d", (8, 32), (2, 16, 32)),
    ("a-1d", (32,), (16, 32)),
]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("sa_shape, sb_shape", [((256, 1), (1, 512)), ((), (1, 512)), ((256, 1), ())],
                         ids=["row-row", "tensor-row", "row-tensor"])
def test_cpu_epilogue_rounds_the_product_before_the_bias_like_the_custom_op(gen, out_dtype, sa_shape, sb_shape):
    """On a CPU whose compiler rounds each op (inductor's default), the epilogue acc·sa·sb + bias runs as one
    compiled pass instead of the unfusable custom op (eager: an fp32 temporary per op): the same bits. A compiler
    allowed to contract (TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast) gets the custom op, the same
    bits again (tests/test_fma_contraction.py fails if the fused pass is taken there)."""
    from minifloat.fp8 import gemm
    acc = (torch.randn(256, 512, generator=gen) * 100).to(out_dtype)  # 131072 elements: above EAGER_BELOW
    sa = torch.rand(sa_shape, generator=gen) + 0.01
    sb = torch.rand(sb_shape, generator=gen) + 0.01
    bias = torch.randn(512, generator=gen).to(torch.bfloat16)
    fused = gemm._epilogue(acc, sa, sb, bias, out_dtype)
    custom = gemm.scale_then_add(acc, sa, sb, bias, out_dtype)
    fma = (acc.double() * sa.double() * sb.double() + bias.double()).to(out_dtype)  # what a contraction nears
    bits = {torch.float32: torch.int32}.get(out_dtype, torch.int16)
    assert torch.equal(fused.view(bits), custom.view(bits))
    assert out_dtype != torch.float32 or not torch.equal(fused.view(bits), fma.view(bits))  # the test could see it


@pytest.mark.parametrize("shape_a, shape_b", [c[1:] for c in BAD_SHAPES], ids=[c[0] for c in BAD_SHAPES])
def test_bad_shapes_raise(gen, shape_a, shape_b):
    qa = quantize(torch.randn(*shape_a, generator=gen), E4M3)
    qb = quantize(torch.randn(*shape_b, generator=gen), E4M3)
    with pytest.raises(ValueError, match="scaled_mm needs"):
        scaled_mm(qa, qb)


def test_native_backend_on_cpu_raises(operands):
    a, b, _ = operands
    with pytest.raises(ValueError, match="native backend"):
        scaled_mm(quantize(a, E4M3), quantize(b, E4M3), backend="native")


def test_unknown_backend_raises(operands):
    a, b, _ = operands
    with pytest.raises(ValueError, match="bogus"):
        scaled_mm(quantize(a, E4M3), quantize(b, E4M3), backend="bogus")


def test_unknown_backend_from_environment_raises(operands, monkeypatch):
    a, b, _ = operands
    monkeypatch.setenv("MINIFLOAT_GEMM_BACKEND", "bogus")
    with pytest.raises(ValueError, match="MINIFLOAT_GEMM_BACKEND"):
        scaled_mm(quantize(a, E4M3), quantize(b, E4M3))


# ---------------------------------------------------------------------------------------------------- native rules

HOPPER, ADA, BLACKWELL = (9, 0), (8, 9), (10, 0)
# (name, a granularity, b granularity, a fmt, b fmt, (M, K, N), capability, blockwise torch, out dtype, reason or None),
# each on a torch built with CUDA CUDA_BUILD (the GPU machine's: torch 2.11+cu130)
CUDA_BUILD = (13, 0)
NATIVE_CASES = [
    ("tensor-hopper", "tensor", "tensor", E4M3, E4M3, (64, 256, 128), HOPPER, True, torch.bfloat16, None),
    ("tensor-fp32-out", "tensor", "tensor", E4M3, E4M3, (64, 256, 128), HOPPER, True, torch.float32, None),
    ("tensor-fp16-out", "tensor", "tensor", E4M3, E5M2, (64, 256, 128), ADA, False, torch.float16, None),
    ("row-ada", "row", "row", E4M3, E4M3, (64, 256, 128), ADA, False, torch.bfloat16, None),
    ("row-fp32-ada", "row", "row", E4M3, E4M3, (64, 256, 128), ADA, False, torch.float32, "writes only bfloat16"),
    ("row-fp32-hopper", "row", "row", E4M3, E4M3, (64, 256, 128), HOPPER, True, torch.float32, None),
    ("row-fp16-hopper", "row", "row", E4M3, E4M3, (64, 256, 128), HOPPER, True, torch.float16, None),
    ("row-fp32-blackwell", "row", "row", E4M3, E4M3, (64, 256, 128), BLACKWELL, True, torch.float32,
     "writes only bfloat16"),
    ("row-blackwell", "row", "row", E4M3, E4M3, (64, 256, 128), BLACKWELL, True, torch.bfloat16, None),
    ("tensor-ampere", "tensor", "tensor", E4M3, E4M3, (64, 256, 128), (8, 0), True, torch.bfloat16, "SM 8.9+"),
    ("e5m2-e5m2", "tensor", "tensor", E5M2, E5M2, (64, 256, 128), HOPPER, True, torch.bfloat16, "E5M2 × E5M2"),
    ("k-not-16", "tensor", "tensor", E4M3, E4M3, (64, 200, 128), HOPPER, True, torch.bfloat16, "K a multiple"),
    ("n-not-16", "row", "row", E4M3, E4M3, (64, 256, 120), HOPPER, True, torch.bfloat16, "N=120"),
    ("tensor-row", "tensor", "row", E4M3, E4M3, (64, 256, 128), HOPPER, True, torch.bfloat16, "no tensor × row"),
    ("tile-block-hopper", "tile", "block", E4M3, E4M3, (64, 512, 256), HOPPER, True, torch.bfloat16, None),
    ("tile-block-e5m2", "tile", "block", E5M2, E4M3, (64, 512, 256), HOPPER, True, torch.float32, None),
    ("tile-tile-hopper", "tile", "tile", E4M3, E4M3, (128, 1024, 256), HOPPER, True, torch.bfloat16, None),
    ("tile-block-k640", "tile", "block", E4M3, E4M3, (64, 640, 256), HOPPER, True, torch.bfloat16, "K=640"),
    ("tile-tile-k640", "tile", "tile", E4M3, E4M3, (200, 640, 256), HOPPER, True, torch.bfloat16, None),
    ("tile-tile-k200", "tile", "tile", E4M3, E4M3, (200, 200, 256), HOPPER, True, torch.bfloat16, "multiple of 128"),
    ("tile-block-old-torch", "tile", "block", E4M3, E4M3, (64, 512, 256), HOPPER, False, torch.bfloat16,
     "blockwise _scaled_mm"),
    ("tile-block-ada", "tile", "block", E4M3, E4M3, (64, 512, 256), ADA, True, torch.bfloat16, "SM 9.0+"),
    ("tile-block-blackwell", "tile", "block", E4M3, E4M3, (64, 512, 256), BLACKWELL, True, torch.bfloat16,
     "below SM 10.0"),
    ("mx-blackwell", "mx", "mx", E4M3, E4M3, (64, 512, 256), BLACKWELL, True, torch.bfloat16, None),
    ("mx-fp32-out", "mx", "mx", E4M3, E5M2, (200, 352, 144), BLACKWELL, False, torch.float32, None),
    ("mx-hopper", "mx", "mx", E4M3, E4M3, (64, 512, 256), HOPPER, True, torch.bfloat16, "SM 10.0+"),
    ("mx-k-not-32", "mx", "mx", E4M3, E4M3, (64, 528, 256), BLACKWELL, True, torch.bfloat16, "K a multiple of 32"),
    ("mx-tensor", "mx", "tensor", E4M3, E4M3, (64, 512, 256), BLACKWELL, True, torch.bfloat16, "no mx × tensor"),
    ("int-out", "tensor", "tensor", E4M3, E4M3, (64, 256, 128), HOPPER, True, torch.int32, "outputs"),
]


@pytest.mark.parametrize("ga, gb, fa, fb, mkn, capability, blockwise, out_dtype, reason",
                         [c[1:] for c in NATIVE_CASES], ids=[c[0] for c in NATIVE_CASES])
def test_native_support_table(gen, ga, gb, fa, fb, mkn, capability, blockwise, out_dtype, reason):
    m, k, n = mkn
    qa = quantize(torch.randn(m, k, generator=gen), fa, granularity=ga)
    qb = quantize(torch.randn(n, k, generator=gen), fb, granularity=gb)
    got = native_support(qa, qb, out_dtype, capability=capability, blockwise=blockwise, cuda=CUDA_BUILD)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got, got


@pytest.mark.parametrize("cuda, writes", [((12, 6), False), ((12, 8), False), ((12, 9), True), ((13, 0), True)])
def test_row_wise_float32_output_needs_cuda_12_9_on_hopper(gen, cuda, writes):
    """torch._scaled_mm takes cuBLAS's row-wise kernel, the one that writes float32, from CUDA 12.9 on (a cu126 build
    on an H100 writes bfloat16 only); bfloat16 is written everywhere."""
    qa = quantize(torch.randn(64, 256, generator=gen), E4M3, granularity="row")
    qb = quantize(torch.randn(128, 256, generator=gen), E4M3, granularity="row")
    got = native_support(qa, qb, torch.float32, capability=HOPPER, blockwise=True, cuda=cuda)
    assert (got is None) == writes, got
    assert native_support(qa, qb, torch.bfloat16, capability=HOPPER, blockwise=True, cuda=cuda) is None


def test_native_support_needs_fp8_data(gen):
    qa = quantize(torch.randn(64, 256, generator=gen), E4M3, operand_dtype=torch.bfloat16, keep_data=False)
    qb = quantize(torch.randn(128, 256, generator=gen), E4M3)
    assert "emulated backend" in native_support(qa, qb, capability=HOPPER, blockwise=True)


def test_native_granularity_is_off_on_cpu_and_for_emulated():
    for g in ("tensor", "row", "tile", "block", "mx"):
        assert not native_granularity(torch.device("cpu"), g)
        assert not native_granularity(torch.device("cuda", 0), g, "emulated")


def test_a_compiled_graph_does_not_guard_on_the_capability_cache(monkeypatch):
    """A graph traced before the device's capability was cached (a compiled model's first step in a fresh process)
    is not recompiled once an eager call fills the cache: on a GPU a fullgraph compile with error_on_recompile failed
    at its second step on exactly that (dynamo guards on a dict's keys)."""
    from minifloat.fp8 import native

    def f(x):
        return x + (1.0 if native.device_capability(0) is None else 2.0)

    torch._dynamo.reset()
    try:
        g = torch.compile(f, fullgraph=True, backend="eager")
        x = torch.ones(3)
        want = f(x)
        monkeypatch.setattr(native, "_CAPABILITY", {})
        assert torch.equal(g(x), want)  # traced with the cache empty
        native.device_capability(0)  # an eager call fills it
        assert 0 in native._CAPABILITY
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert torch.equal(g(x), want)
    finally:
        torch._dynamo.reset()


# (name, granularity, side, expected shape (from M, K), expected strides (from M, K)): the layouts torch._scaled_mm
# checks (torch's ScaledBlas.cpp: is_blockwise_1x128_scaling / is_blockwise_128x128_scaling, applied to a and bᵀ)
SCALE_LAYOUTS = [
    ("tensor-a", "tensor", "a", lambda m, kb: (), lambda m, kb: ()),
    ("row-a", "row", "a", lambda m, kb: (m, 1), lambda m, kb: (1, 1)),
    ("row-b", "row", "b", lambda m, kb: (1, m), lambda m, kb: (m, 1)),
    ("tile-a", "tile", "a", lambda m, kb: (m, kb), lambda m, kb: (1, m)),
    ("tile-b", "tile", "b", lambda m, kb: (kb, m), lambda m, kb: (m, 1)),
    ("block-a", "block", "a", lambda m, kb: (m // 128, kb), lambda m, kb: (kb, 1)),
    ("block-b", "block", "b", lambda m, kb: (kb, m // 128), lambda m, kb: (1, kb)),
]


@pytest.mark.parametrize("granularity, side, shape, strides", [c[1:] for c in SCALE_LAYOUTS],
                         ids=[c[0] for c in SCALE_LAYOUTS])
def test_native_scale_layouts(gen, granularity, side, shape, strides):

    m, k = 256, 512
    q = quantize(torch.randn(m, k, generator=gen), E4M3, granularity=granularity)
    s = native_scale(q, side)
    assert s.dtype == torch.float32
    assert tuple(s.shape) == shape(m, k // 128) and s.stride() == strides(m, k // 128)
    # the same numbers as q's scales, only laid out for cuBLASLt
    flat = q.scale.float().reshape(s.shape) if granularity in ("tensor",) else None
    if granularity == "tensor":
        assert torch.equal(s, flat)
    elif side == "a":
        assert torch.equal(s, q.scale.float().reshape(s.shape))
    else:
        assert torch.equal(s.t(), q.scale.float().reshape(s.t().shape))


def test_mx_scales_reach_cublas_as_swizzled_e8m0_bytes(gen):
    """MX scales go to torch._scaled_mm as E8M0 bytes in cuBLASLt's 1-D block-scaling layout: read back at the
    documented offset of each (row, K block), every byte is its scale's exponent + 127; the padding is zero."""
    from block_scaled_reference import unswizzle

    for m, k in ((256, 512), (200, 352), (8, 32)):  # whole tiles; rows and columns padded; one tiny tile
        q = quantize(torch.randn(m, k, generator=gen) * 2.0 ** torch.randint(-40, 40, (m, 1), generator=gen),
                     E4M3, granularity="mx", operand_dtype=None, keep_data=True)
        want = torch.log2(q.scale.double()).long() + 127
        for side in ("a", "b"):
            s = native_scale(q, side)
            padded = (-(-m // 128) * 128) * (-(-(k // 32) // 4) * 4)
            assert s.dtype == torch.float8_e8m0fnu and s.is_contiguous() and s.numel() == padded
            got = unswizzle(s, m, k // 32)
            assert torch.equal(got, want), (m, k, side)
            assert int(s.view(torch.uint8).long().sum()) == int(want.sum())  # every other byte is padding: zero


def test_mx_scales_swizzle_the_same_inside_a_compiled_graph(gen):
    """A compiled FP8 layer builds the swizzled E8M0 scales inside its graph: bit casts, padding and the tile
    permutation trace without a break and give the eager bytes."""
    from minifloat.numerics.quantize import Quantized

    q = quantize(torch.randn(200, 352, generator=gen) * 3.0, E4M3, granularity="mx", operand_dtype=None,
                 keep_data=True)

    def swizzled(scale):
        return native_scale(Quantized(q.data, scale, q.fmt, q.granularity, scale_folded=True), "b").view(torch.uint8)

    torch._dynamo.reset()
    try:
        assert torch.equal(torch.compile(swizzled, fullgraph=True)(q.scale), swizzled(q.scale))
    finally:
        torch._dynamo.reset()


def test_e8m0_bytes_are_the_exponents_of_every_mx_scale():
    from minifloat.fp8.native import e8m0_bytes

    e = torch.arange(-127, 128)
    assert torch.equal(e8m0_bytes(torch.pow(2.0, e.double()).float()).long(), e + 127)  # 2^-127 is subnormal


# ---------------------------------------------------------------------------------------------------- GPU


# (name, a granularity, b granularity, M, K, N): every native pairing NATIVE_RULES admits on a Hopper GPU
NATIVE_PAIRS = [
    ("tensor", "tensor", "tensor", 256, 512, 128),
    ("row", "row", "row", 256, 512, 128),
    ("tile-block", "tile", "block", 256, 512, 384),
    ("block-tile", "block", "tile", 256, 512, 384),
    ("tile-tile", "tile", "tile", 256, 1024, 384),
    ("tile-tile-ragged-m", "tile", "tile", 200, 640, 384),
    ("tile-block-ragged-m", "tile", "block", 8, 512, 256),
    ("mx", "mx", "mx", 256, 512, 384),  # Blackwell (SM 10.x) only; skipped, with the reason, elsewhere
    ("mx-ragged", "mx", "mx", 200, 352, 144),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ga, gb, m, k, n", [c[1:] for c in NATIVE_PAIRS], ids=[c[0] for c in NATIVE_PAIRS])
@pytest.mark.parametrize("out_dtype, rtol", [(torch.float32, NATIVE_FP32_RTOL), (torch.bfloat16, BF16_OUT_RTOL),
                                             (torch.float16, BF16_OUT_RTOL)], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fa, fb", [c[1:] for c in FORMAT_PAIRS], ids=[c[0] for c in FORMAT_PAIRS])
def test_native_matches_emulated(ga, gb, m, k, n, out_dtype, rtol, fa, fb, monkeypatch):
    import minifloat.fp8.gemm as gemm

    refused = []  # a refusal would fall back to the emulation, silently passing this test: it fails it instead
    monkeypatch.setattr(gemm, "_warn_native_refused", lambda a, b, exc: refused.append(" ".join(str(exc).split())))
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=gen) * 3.0
    b = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    a[:, : k // 4] *= 30.0  # scales that differ across K blocks, so a misplaced block scale shows
    bias = torch.randn(n, device="cuda", generator=gen)
    qa, qb = quantize(a, fa, granularity=ga), quantize(b, fb, granularity=gb)
    reason = native_support(qa, qb, out_dtype)
    if reason is not None:
        pytest.skip(f"not native on this GPU: {reason}")
    native = scaled_mm(qa, qb, out_dtype=out_dtype, bias=bias, backend="native")
    assert not refused, f"torch._scaled_mm refused a product native_support admits: {refused[0][:300]}"
    emulated = scaled_mm(qa, qb, out_dtype=out_dtype, bias=bias, backend="emulated")
    ref_nobias = qa.dequantize().double() @ qb.dequantize().double().T
    ref = ref_nobias + bias.double()
    assert native.dtype == emulated.dtype == out_dtype
    assert rel_max_error(native, ref, ref_nobias) <= rtol
    assert rel_max_error(emulated, ref, ref_nobias) <= (FP32_ACC_RTOL if out_dtype == torch.float32 else rtol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_native_takes_expanded_row_scales():
    """A row scale that is a stride-0 view (prepare_inference's) reaches cuBLASLt densely, not as an error."""
    from minifloat.numerics.quantize import Quantized

    gen = torch.Generator(device="cuda").manual_seed(0)
    qa = quantize(torch.randn(64, 256, device="cuda", generator=gen), E4M3, granularity="row")
    qb = quantize(torch.randn(128, 256, device="cuda", generator=gen), E4M3, granularity="row")
    qb = Quantized(qb.data, torch.ones((), device="cuda").expand(128, 1), qb.fmt, qb.granularity)
    if native_support(qa, qb) is not None:
        pytest.skip(native_support(qa, qb))
    out = scaled_mm(qa, qb, out_dtype=torch.bfloat16, backend="native")
    ref = qa.dequantize().double() @ qb.dequantize().double().T
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() <= BF16_OUT_RTOL


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal configuration"),
                                   ValueError("Invalid scaling configuration for RowWise scaling")],
                         ids=["RuntimeError", "ValueError"])
def test_a_refused_native_gemm_runs_emulated_and_says_so_once(operands, monkeypatch, caplog, error):
    """torch._scaled_mm refuses some configurations with a RuntimeError and others with a ValueError
    (TORCH_CHECK_VALUE); either way the product runs emulated, with the same result as the emulated backend, and a
    warning names the product once per shape."""
    import minifloat.fp8.gemm as gemm

    a_x, b_x, bias = operands
    a = quantize(a_x, E4M3, granularity="row", operand_dtype=torch.bfloat16)
    b = quantize(b_x, E4M3, granularity="row", operand_dtype=torch.bfloat16)

    tries = []

    def refuse(*args, **kwargs):
        tries.append(1)
        raise error

    monkeypatch.setattr(gemm, "native_mm", refuse)
    monkeypatch.setattr(gemm, "_REFUSED", set())
    want = scaled_mm(a, b, out_dtype=torch.bfloat16, bias=bias, backend="emulated")
    with caplog.at_level("WARNING", logger="minifloat"):
        for _ in range(3):
            assert torch.equal(gemm._native(a, b, torch.bfloat16, bias, False), want)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and str(error).split(":")[0] in refusals[0].getMessage()
    assert len(tries) == 1, "a refused product asks cuBLAS again every step instead of going straight to the emulation"
    gemm._native(a, b, torch.float32, bias, False)  # another output dtype is another product: asked once more
    assert len(tries) == 2


def test_plain_tensors_are_refused_in_one_line():
    with pytest.raises(TypeError, match=r"quantized operands, mf.quantize.*got Tensor and Tensor"):
        scaled_mm(torch.randn(4, 32), torch.randn(8, 32))


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.CurrentScaling(), mf.CurrentScaling(granularity="row"),
                                    mf.BlockScaling()], ids=["delayed", "current", "row", "block"])
def test_every_pointer_the_native_gemm_gets_is_16_byte_aligned(recipe, monkeypatch):
    """cuBLASLt's FP8 kernels refuse a data, scale or bias pointer that is not 16-byte aligned
    (CUBLAS_STATUS_NOT_SUPPORTED): a delayed layer's 0-d scales, once views at odd offsets into its (roles,) buffer,
    sent every delayed GEMM on an H200 to the emulation. The layer's native path, steered on the CPU into a spy of
    torch._scaled_mm, passes only aligned pointers, in the first step and in the steady state."""
    import minifloat.fp8.caster as caster
    import minifloat.fp8.gemm as gemm

    calls = []

    def spy(a, b, scale_a, scale_b, bias=None, out_dtype=None, **kwargs):
        calls.append({"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "bias": bias})
        return (a.float() @ b.float()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    monkeypatch.setattr(gemm, "native_support", lambda *args, **kwargs: None)
    monkeypatch.setattr(caster, "native_granularity", lambda *args, **kwargs: True)
    torch.manual_seed(0)
    model = mf.convert(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128, bias=False)), recipe=recipe,
                       keep_first_last=False)
    x = torch.randn(128, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            model(x).float().square().mean().backward()
            mf.fp8_step(model)
    assert len(calls) == 3 * 2 * 3, f"{len(calls)} native GEMMs, expected 3 steps × 2 layers × 3"
    misaligned = [(i, name, t.data_ptr() % 16) for i, call in enumerate(calls) for name, t in call.items()
                  if t is not None and t.data_ptr() % 16]
    assert not misaligned, f"(call, argument, address mod 16) not 16-byte aligned: {misaligned[:6]}"


def test_aligned_copies_only_what_is_misaligned():
    from minifloat.fp8.native import aligned

    buffer = torch.arange(8, dtype=torch.float32)
    assert aligned(buffer[4]).data_ptr() == buffer[4].data_ptr()  # 16 bytes in: itself
    moved = aligned(buffer[1])
    assert moved.data_ptr() % 16 == 0 and moved.data_ptr() != buffer[1].data_ptr() and moved.item() == 1.0


def test_aligned_leaves_fake_tensors_alone():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from minifloat.fp8.native import aligned

    with FakeTensorMode():
        view = torch.empty(8)[1]
        assert aligned(view) is view  # no data pointer read (fake tensors have none), no copy traced


def test_a_delayed_layers_cached_scales_are_16_byte_aligned_themselves():
    """The delayed state lays its cached scales out one role per 16 bytes, so the native GEMM never has to copy them
    (native_mm's `aligned` would, silently, on every GEMM)."""
    from minifloat.fp8.recipes import ROLES
    from minifloat.fp8.scaling import ROLE_INDEX, scaling_states

    model = mf.convert(nn.Sequential(nn.Linear(64, 64)), recipe=mf.DelayedScaling(), keep_first_last=False)
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):  # seeded roles: the steady state's cached reciprocals
        model(x).sum().backward()
        mf.fp8_step(model)
    (state,) = scaling_states(model)
    for role in ROLES:
        dscale, multiplier, _ = state.delayed_cast_scales(ROLE_INDEX[role], lambda: None, mf.E4M3)
        assert dscale.data_ptr() % 16 == 0 and multiplier.data_ptr() % 16 == 0, role
        assert torch.equal(dscale, state.scale[ROLE_INDEX[role]].reciprocal())


# ---------------------------------------------------------------------------------------------------- MXFP8 natively


@pytest.mark.parametrize("kernel, problem", [("documented", None), ("wrong-layout", "from the emulation"),
                                             ("raises", "raised RuntimeError")])
def test_a_rule_not_yet_run_on_its_gpu_is_checked_against_the_emulation(kernel, problem, monkeypatch):
    """MXFP8 on Blackwell was written from the documentation: each device multiplies a test product natively before
    it uses the rule. A kernel computing what cuBLASLt documents passes; one that misreads the scale layout, or
    refuses the product, turns the rule off with the reason."""
    import functools

    from minifloat.fp8 import native_check
    from block_scaled_reference import scaled_mm_mx

    def raises(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")

    fake = {"documented": scaled_mm_mx, "wrong-layout": functools.partial(scaled_mm_mx, layout="row-major"),
            "raises": raises}[kernel]
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    got = native_check.check("mx × mx", torch.device("cpu"))
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got, got


def test_a_failed_check_warns_once_and_the_rule_stays_off(monkeypatch, caplog):
    from minifloat.fp8 import native, native_check

    calls = []
    monkeypatch.setattr(native_check, "_RESULTS", {})
    monkeypatch.setattr(native_check, "check", lambda pair, device: calls.append(pair) or "differs by 0.5")
    monkeypatch.setattr(native, "device_capability", lambda index=0: BLACKWELL)
    assert not native_granularity(torch.device("cuda", 0), "mx")
    assert not native_granularity(torch.device("cuda", 0), "mx")
    assert native_granularity(torch.device("cuda", 0), "tensor")  # verified rules ask nothing
    assert calls == ["mx × mx"]
    assert caplog.text.count("native mx × mx GEMM on cuda:0 is off (differs by 0.5)") == 1


def test_the_check_is_a_constant_to_a_compiled_graph(monkeypatch):
    """A graph traced before the check ran (a compiled model's first step) runs it once while tracing, on real
    tensors (here on the CPU, into the stand-in kernel), and is not recompiled when the result is stored (dynamo
    would guard on the results dict)."""
    from minifloat.fp8 import native_check
    from block_scaled_reference import scaled_mm_mx

    calls = []
    real_check = native_check.check
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_mx)
    monkeypatch.setattr(native_check, "_RESULTS", {})
    monkeypatch.setattr(native_check, "check",
                        lambda pair, device: calls.append(pair) or real_check(pair, torch.device("cpu")))

    def f(x):
        return x * (2.0 if native_check.passes("mx × mx", 0) else 3.0)

    torch._dynamo.reset()
    try:
        g = torch.compile(f, fullgraph=True, backend="eager")
        x = torch.ones(3)
        assert torch.equal(g(x), x * 2)
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert torch.equal(g(x), x * 2)
        assert calls == ["mx × mx"]
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("tokens", [256, 200])
def test_an_mx_layer_on_the_native_path_computes_what_the_emulation_does(tokens, monkeypatch):
    """An MXScaling layer steered on the CPU onto the native path, into a kernel computing what cuBLASLt documents:
    all three GEMMs (fprop, and dgrad and wgrad on operands re-quantized along the other axis) take FP8 data with
    swizzled E8M0 scales, and y, dx and dW are the emulated layer's within the native rounding (200 tokens: wgrad's
    K is not a multiple of 32, so that GEMM runs emulated from the FP8 data)."""
    import copy

    import minifloat.fp8.caster as caster
    import minifloat.fp8.gemm as gemm
    from block_scaled_reference import layer_step, scaled_mm_mx

    torch.manual_seed(0)
    emulated = mf.convert(nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 128, bias=False)),
                          recipe=mf.MXScaling(), keep_first_last=False)
    native = copy.deepcopy(emulated)
    x = torch.randn(tokens, 256) * torch.logspace(-3, 3, 256, base=2.0)
    dy = torch.randn(tokens, 128)

    want = layer_step(emulated, x, dy)
    calls = []

    def kernel(*args, **kwargs):
        calls.append((args[2] if len(args) > 2 else kwargs["scale_a"]).dtype)
        return scaled_mm_mx(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", kernel)
    monkeypatch.setattr(caster, "native_granularity", lambda *args, **kwargs: True)
    real_support = native_support
    monkeypatch.setattr(gemm, "native_support",
                        lambda a, b, out_dtype=torch.bfloat16: real_support(a, b, out_dtype, capability=BLACKWELL,
                                                                            blockwise=True))
    got = layer_step(native, x, dy)
    assert calls and set(calls) == {torch.float8_e8m0fnu}
    assert len(calls) == (6 if tokens % 32 == 0 else 4), len(calls)  # fprop, dgrad, wgrad of each layer
    y, dx, grads = got
    assert rel_max_error(y, want[0], want[0]) <= BF16_OUT_RTOL
    assert mf.sqnr_db(want[1], dx) >= MX_NATIVE_GRAD_SQNR_DB
    for g_native, g_emulated in zip(grads, want[2]):
        assert mf.sqnr_db(g_emulated, g_native) >= MX_NATIVE_GRAD_SQNR_DB


def test_the_output_gradients_dgrad_layout_is_freed_before_wgrad(monkeypatch):
    """Peak memory of an FP8 backward (issue 21): dy's FP8 bytes in dgrad's layout are released before the wgrad GEMM
    allocates dW; only its transposed layout, which wgrad reads, stays (a per-tensor cast held both until the layer's
    backward returned: 64 MiB more at the peak of an 8192² layer's step on an H200)."""
    import weakref

    import minifloat.fp8.caster as caster
    import minifloat.fp8.gemm as gemm

    held = []  # per native GEMM: a weak reference to its a operand (the FP8 bytes themselves, not a view)

    def spy(a, b, scale_a, scale_b, bias=None, out_dtype=None, **kwargs):
        spy.alive_at_call.append([w() is not None for w in held])
        held.append(weakref.ref(a))
        return (a.float() @ b.float()).to(out_dtype)

    spy.alive_at_call = []
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    monkeypatch.setattr(gemm, "native_support", lambda *args, **kwargs: None)
    monkeypatch.setattr(caster, "native_granularity", lambda *args, **kwargs: True)
    torch.manual_seed(0)
    layer = mf.Fp8Linear(256, 128, bias=False, recipe=mf.DelayedScaling())
    x = torch.randn(128, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    assert len(held) == 3  # fprop, dgrad, wgrad
    # at the wgrad call, dgrad's a operand (dy's row-major FP8 bytes) is gone; fprop's (x, saved for wgrad in its
    # transposed layout only) was released after the forward
    assert spy.alive_at_call[2] == [False, False], spy.alive_at_call
