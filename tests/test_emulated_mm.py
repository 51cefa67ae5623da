"""The emulated backend's GEMM kernels (minifloat.fp8.emulated_mm): exact products, fp32 sums, one bfloat16 rounding.

A bfloat16 output comes from torch's bfloat16 GEMM where the CPU has bfloat16 units and from an fp32 GEMM plus one
rounding where it has not (x86 without AVX512-BF16 or AMX, where torch's bfloat16 GEMM is 30-60x slower). Both
routes run here, whatever this CPU is, by setting the module's choice.
"""

from __future__ import annotations

import pathlib
import platform

import pytest
import torch

from minifloat.fp8 import emulated_mm

ROUTES = [pytest.param(True, id="bf16-gemm"), pytest.param(False, id="fp32-gemm")]
M, K, N = 96, 64, 80
# random bfloat16 operands: the routes add in different orders, so a sum near a bfloat16 rounding boundary may round
# either way; measured 25 of 307,200 elements apart (20 seeds, both kernels) on a 2-core AMD EPYC (AVX2)
MAX_ROUTES_APART = 0.01  # fraction of elements whose bits differ between the routes
ULP_BF16 = 2.0 ** -7  # bfloat16's spacing relative to a value's power of two


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def exact_operands(gen) -> tuple[torch.Tensor, torch.Tensor]:
    """bfloat16 operands whose products and every partial sum are exact in fp32: small multiples of 1/8 (E4M3
    values), so any summation order gives the same fp32 sum and both routes must give its bfloat16 rounding."""
    a = (torch.randint(-24, 25, (M, K), generator=gen) / 8).to(torch.bfloat16)
    b = (torch.randint(-24, 25, (N, K), generator=gen) / 8).to(torch.bfloat16)
    return a, b


@pytest.mark.parametrize("bf16_gemm", ROUTES)
def test_addmm_is_the_exact_sum_rounded_once(monkeypatch, gen, bf16_gemm):
    monkeypatch.setattr(emulated_mm, "CPU_BF16_GEMM", bf16_gemm)
    a, b = exact_operands(gen)
    bias = torch.randn(N, generator=gen)
    alpha = torch.tensor(0.5)  # a power of two: alpha · sum stays exact
    out = emulated_mm.addmm_bf16(a, b.t(), alpha, bias)
    exact = 0.5 * (a.double() @ b.double().t()) + bias.to(torch.bfloat16).double()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, exact.float().to(torch.bfloat16))  # exact + bias rounds once (fp32 holds it: |.| < 2^11)
    no_bias = emulated_mm.addmm_bf16(a, b.t(), alpha, None)
    assert torch.equal(no_bias, (0.5 * (a.double() @ b.double().t())).to(torch.bfloat16))


@pytest.mark.parametrize("bf16_gemm", ROUTES)
def test_mm_is_the_exact_sum_rounded_once(monkeypatch, gen, bf16_gemm):
    monkeypatch.setattr(emulated_mm, "CPU_BF16_GEMM", bf16_gemm)
    a, b = exact_operands(gen)
    out = emulated_mm.mm_bf16(a, b.t())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (a.double() @ b.double().t()).to(torch.bfloat16))


def test_the_routes_agree_on_random_operands(monkeypatch, gen):
    a = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    alpha, bias = torch.tensor(0.37), torch.randn(N, generator=gen)
    results = {}
    for route in (True, False):
        monkeypatch.setattr(emulated_mm, "CPU_BF16_GEMM", route)
        results[route] = (emulated_mm.addmm_bf16(a, b.t(), alpha, bias), emulated_mm.mm_bf16(a, b.t()))
    for fast, slow in zip(results[True], results[False]):
        apart = (fast.view(torch.int16) != slow.view(torch.int16)).float().mean().item()
        assert apart <= MAX_ROUTES_APART
        # where they differ, by one rounding of the value at most
        assert torch.all((fast.float() - slow.float()).abs() <= ULP_BF16 * slow.float().abs() + 1e-30)


@pytest.mark.skipif(platform.machine() != "x86_64" or not pathlib.Path("/proc/cpuinfo").exists(),
                    reason="reads the CPU's flags from Linux's /proc/cpuinfo on x86")
def test_the_choice_follows_the_cpus_bf16_units():
    flags = set()
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    has_units = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert emulated_mm.CPU_BF16_GEMM == has_units
