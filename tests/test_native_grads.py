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
from minifloat.fp8.native import device_capability, row_wise_writes
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
    # row-wise scaling writes float32 on Hopper with CUDA 12.9+ only (native.row_wise_writes); elsewhere bfloat16
    grad = torch.float32 if name != "current-row" or row_wise_writes(torch.float32, device_capability()) \
        else torch.bfloat16
    assert [t.dtype for t in seen] == [torch.bfloat16, grad, grad]
    assert x.grad.dtype == torch.float32
    if grad == torch.float32:
        assert layer.weight.grad.data_ptr() == seen[-1].data_ptr() or torch.equal(layer.weight.grad, seen[-1])
        assert (layer.weight.grad != layer.weight.grad.bfloat16().float()).any()


def test_a_gpu_that_writes_only_bfloat16_runs_the_gradients_natively_in_bfloat16(native_on_cpu, monkeypatch):
    """Row-wise scaling off Hopper (native.row_wise_writes) writes bfloat16 only: dgrad and wgrad then still run
    natively, in the compute dtype, and the gradient is that product widened (what the native path did before it
    wrote gradients in their own dtype), not the emulation."""
    monkeypatch.setattr(gemm, "native_writes", lambda a, b, out_dtype: out_dtype == torch.bfloat16)
    emulated = []
    monkeypatch.setattr(gemm, "_emulated", lambda *args, **kwargs: emulated.append(1))
    dx, dw = _step(torch.float32)
    assert not emulated
    fprop, dgrad, wgrad = native_on_cpu[-3:]
    assert [fprop[0], dgrad[0], wgrad[0]] == [torch.bfloat16] * 3
    assert dx.dtype == dw.dtype == torch.float32
    assert torch.equal(dw, wgrad[2].float())


def test_a_refused_gradient_dtype_is_asked_once_then_the_compute_dtype_runs_natively(native_on_cpu, monkeypatch,
                                                                                      caplog):
    """Where torch._scaled_mm refuses to write a gradient's own dtype although the rules admit it, the product runs
    natively in the compute dtype at once, with one warning, and later steps do not ask for the refused dtype again."""
    real, asked = gemm.native_mm, []

    def fp32_refused(a, b, out_dtype, bias=None, fast_accum=False):
        asked.append(out_dtype)
        if out_dtype == torch.float32:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
        return real(a, b, out_dtype, bias, fast_accum)

    monkeypatch.setattr(gemm, "native_mm", fp32_refused)
    monkeypatch.setattr(gemm, "_REFUSED", set())
    with caplog.at_level("WARNING", logger="minifloat"):
        dx, dw = _step(torch.float32)  # two steps
    assert asked.count(torch.float32) == 2  # dgrad's and wgrad's first backward only: (64, 128) · (256, 128)ᵀ, ...
    assert asked[-3:] == [torch.bfloat16] * 3  # the second step: every GEMM native, in bfloat16
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and all("natively in the compute dtype" in m for m in refusals), refusals
    assert dw.dtype == torch.float32 and torch.equal(dw, dw.bfloat16().float())
