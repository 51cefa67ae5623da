"""The native path's backward GEMMs write each gradient in its own dtype (an fp32 master weight's dW in fp32, dx in
x's dtype): one rounding of the fp32 accumulator and no bfloat16 copy to widen. Run on this CPU with the native
decisions forced and torch._scaled_mm's own CPU kernel doing the products (per-tensor scales)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minifloat as mf
from gpu_device import device  # noqa: F401  (the GPU tier's device fixture)
from minifloat.fp8 import caster, gemm
from minifloat.fp8.gemm import native_fp8_available
from minifloat.numerics.granularity import Granularity
from minifloat.numerics.metrics import sqnr_db

FP32_ROUNDED_SQNR_DB = 100.0  # an fp32 result of the exact product: ~24 bits, far above bfloat16's ~8
BF16_ROUNDED_SQNR_DB = 60.0  # a bfloat16-rounded result is below this (2^-9 relative: about 54 dB)


@pytest.fixture
def native_on_cpu(monkeypatch):
    """Per-tensor products take the native path on this CPU; records (out dtype, the exact product in float64)."""
    monkeypatch.setattr(caster, "native_granularity",
                        lambda device, g, backend=None: Granularity.parse(g) == Granularity.TENSOR)
    monkeypatch.setattr(gemm, "native_support", lambda a, b, out_dtype=None, **kw: None
                        if a.granularity == b.granularity == Granularity.TENSOR else "not per tensor")
    seen, real = [], gemm.native_mm

    def native_mm(a, b, out_dtype, bias=None, fast_accum=False):
        exact = (a.dequantize().double() @ b.dequantize().double().t())
        out = real(a, b, out_dtype, bias, fast_accum)
        seen.append((out.dtype, exact, out))
        return out

    monkeypatch.setattr(gemm, "native_mm", native_mm)
    return seen


def _step(x_dtype, backend=None):
    torch.manual_seed(0)
    layer = mf.Fp8Linear(256, 128, recipe=mf.DelayedScaling(), bias=False, backend=backend)
    x = torch.randn(64, 256, dtype=x_dtype, requires_grad=True)
    for _ in range(2):  # the second step runs on delayed scales from the first
        layer.weight.grad = x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()
        mf.fp8_step(layer)
    return x.grad, layer.weight.grad


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_native_dgrad_and_wgrad_write_their_gradients_dtype(native_on_cpu, x_dtype):
    dx, dw = _step(x_dtype)
    fprop, dgrad, wgrad = native_on_cpu[-3:]
    assert [fprop[0], dgrad[0], wgrad[0]] == [torch.bfloat16, x_dtype, torch.float32]
    assert dx.dtype == x_dtype and dw.dtype == torch.float32
    assert torch.equal(dw, wgrad[2])  # the GEMM's own output is the gradient: nothing widened it
    assert sqnr_db(wgrad[1], dw.double()) > FP32_ROUNDED_SQNR_DB
    assert (dw != dw.bfloat16().float()).any()  # not bfloat16 values widened


def test_the_emulated_path_keeps_bfloat16_products_widened():
    """The emulation (every CPU without the forced decisions) is unchanged: dW is a bfloat16 product widened."""
    _, dw = _step(torch.float32, backend="emulated")
    assert torch.equal(dw, dw.bfloat16().float())


def test_native_gradients_are_the_exact_products_rounded_once(native_on_cpu):
    """Against the same FP8 operands' float64 product, native dW is fp32-close where the emulated one, rounded to
    bfloat16 first, is not."""
    _, dw = _step(torch.float32)
    exact = native_on_cpu[-1][1]
    emulated = exact.float().bfloat16().float()  # what a bfloat16 output widened gives, at best
    assert sqnr_db(exact, dw.double()) > FP32_ROUNDED_SQNR_DB
    assert sqnr_db(exact, emulated.double()) < BF16_ROUNDED_SQNR_DB


class _Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.widened = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.bfloat16 and out.dtype == torch.float32:
            self.widened.append(tuple(out.shape))
        return out


def test_no_pass_widens_a_native_gradient(native_on_cpu):
    torch.manual_seed(0)
    layer = mf.Fp8Linear(256, 128, recipe=mf.DelayedScaling(), bias=False)
    x = torch.randn(64, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    loss = y.float().square().mean()
    with _Copies() as copies:
        loss.backward()
    assert (64, 256) not in copies.widened and (128, 256) not in copies.widened, copies.widened


def test_a_refused_native_product_runs_the_emulation_in_the_compute_dtype(native_on_cpu, monkeypatch):
    """Where torch._scaled_mm refuses a product the rules admit, the layer gets the emulation's own results (bfloat16
    products widened), bitwise."""
    expected = _step(torch.float32, backend="emulated")

    def refuse(a, b, out_dtype, bias=None, fast_accum=False):
        raise RuntimeError("refused by this cuBLAS")

    monkeypatch.setattr(gemm, "native_mm", refuse)
    monkeypatch.setattr(gemm, "_REFUSED", set())
    got = _step(torch.float32)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["delayed", "current-row", "block"])
def test_on_the_gpu_native_gradients_come_out_in_their_own_dtype(device, name, monkeypatch):  # noqa: F811
    """On an FP8 GPU, with the product's own decisions (nothing forced): fprop writes bfloat16, dgrad and wgrad fp32
    for an fp32 input and weight, and W.grad is wgrad's output itself."""
    from gpu_device import RECIPE_BY_NAME, autocast

    if not native_fp8_available():
        pytest.skip("the native FP8 GEMM needs a GPU with FP8 tensor cores (SM 8.9+)")
    seen, real = [], gemm.native_mm
    monkeypatch.setattr(gemm, "native_mm", lambda *args, **kwargs: seen.append(real(*args, **kwargs)) or seen[-1])
    torch.manual_seed(0)
    layer = mf.Fp8Linear(512, 512, recipe=RECIPE_BY_NAME[name], bias=False).to(device)  # K = 512 in all three:
    x = torch.randn(512, 512, device=device, requires_grad=True)  # blockwise products need K a multiple of 512
    with autocast(device):
        y = layer(x)
    y.float().square().mean().backward()
    assert [t.dtype for t in seen] == [torch.bfloat16, torch.float32, torch.float32]
    assert layer.weight.grad.data_ptr() == seen[-1].data_ptr() or torch.equal(layer.weight.grad, seen[-1])
    assert x.grad.dtype == torch.float32 and (layer.weight.grad != layer.weight.grad.bfloat16().float()).any()
