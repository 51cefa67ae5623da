"""Tests for minifloat.fp8.gemm: scaled_mm against float64 matmul of the dequantized operands.

The reference multiplies exactly what the operands hold (data · scale, dequantized) in float64, so the only error
left is the GEMM's own: fp32 accumulation for a float32 output, plus the output rounding for bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from minifloat.numerics.formats import E4M3, E5M2
from minifloat.fp8.gemm import GemmPath, gemm_path, resolve_backend, scaled_mm
from minifloat.numerics.quantize import quantize

# fp32 accumulation of K ≈ 300 exact products: rounding errors grow like sqrt(K)·2^-24 of the partial sums (measured
# ≤ 1.2e-7 of max|ref|); the dequantized reference itself carries one fp32 rounding of data · scale per operand.
FP32_ACC_RTOL = 1e-6
# bfloat16 output: one or two roundings to bfloat16 (unit roundoff 2^-8 each; the emulated backend may round the
# accumulator before applying per-row scales), measured ≤ 5.9e-3 of max|ref|.
BF16_OUT_RTOL = 2.0**-7
# native (tensor-core) vs emulated: tensor cores accumulate FP8 products with reduced precision (DeepSeek-V3 §3.3.2
# measures about 14 bits on H800), so a float32 output may differ by about 2^-14 of the partial sums.
NATIVE_FP32_RTOL = 2.0**-10

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


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype, rtol", [(torch.float32, NATIVE_FP32_RTOL), (torch.bfloat16, BF16_OUT_RTOL)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("fa, fb", [c[1:] for c in FORMAT_PAIRS], ids=[c[0] for c in FORMAT_PAIRS])
def test_native_matches_emulated(granularity, out_dtype, rtol, fa, fb):
    from minifloat.fp8.gemm import native_fp8_available

    if not native_fp8_available():
        pytest.skip("GPU has no FP8 tensor cores (needs SM 8.9+)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 512, device="cuda", generator=gen) * 3.0
    b = torch.randn(128, 512, device="cuda", generator=gen) * 0.05
    bias = torch.randn(128, device="cuda", generator=gen)
    qa, qb = quantize(a, fa, granularity=granularity), quantize(b, fb, granularity=granularity)
    native = scaled_mm(qa, qb, out_dtype=out_dtype, bias=bias, backend="native")
    emulated = scaled_mm(qa, qb, out_dtype=out_dtype, bias=bias, backend="emulated")
    ref_nobias = qa.dequantize().double() @ qb.dequantize().double().T
    ref = ref_nobias + bias.double()
    assert native.dtype == emulated.dtype == out_dtype
    assert rel_max_error(native, ref, ref_nobias) <= rtol
    assert rel_max_error(emulated, ref, ref_nobias) <= (FP32_ACC_RTOL if out_dtype == torch.float32 else rtol)
    scale = max(ref.abs().max().item(), ref_nobias.abs().max().item())
    assert (native.double() - emulated.double()).abs().max().item() <= 2 * rtol * scale
