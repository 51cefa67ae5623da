"""Tests for minifloat.amp.norms: fp32-internal RMSNorm / LayerNorm against float64 references, and swap_norms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.amp.norms import LayerNorm, RMSNorm, fp32_norm, swap_norms

# fp32 compute of a 256-wide norm against float64: a few fp32 ulps (u = 2^-24) per reduction step, measured ≤ 1e-6
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# bf16 output = the fp32 result rounded once to bfloat16: relative error ≤ u = 2^-(mbits+1), plus the fp32 error
BF16_RTOL = 2.0 ** -(mf.BF16.mbits + 1) + FP32_RTOL
D = 256


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def rms_ref(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def ln_ref(x, w, b, eps):
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w.double() + b.double()


def make(kind, gen):
    norm = RMSNorm(D, eps=1e-6) if kind == "rms" else LayerNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen))
        if norm.bias is not None:
            norm.bias.copy_(0.1 * torch.randn(D, generator=gen))
    return norm


def reference(norm, x):
    if isinstance(norm, RMSNorm):
        return rms_ref(x, norm.weight, norm.eps)
    return ln_ref(x, norm.weight, norm.bias, norm.eps)


# (name, input dtype, rtol): the output keeps the input dtype; inputs have an offset so LayerNorm's variance cancels
CASES = [
    ("fp32", torch.float32, FP32_RTOL),
    ("bf16", torch.bfloat16, BF16_RTOL),
    ("fp16", torch.float16, 2.0 ** -(mf.FP16.mbits + 1) + FP32_RTOL),
]


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("name,dtype,rtol", CASES, ids=[c[0] for c in CASES])
def test_matches_float64_reference(kind, name, dtype, rtol, gen):
    norm = make(kind, gen)
    x = (3.0 + 2.0 * torch.randn(8, 16, D, generator=gen)).to(dtype)
    y = norm(x)
    assert y.dtype == dtype
    ref = reference(norm, x)  # float64 of exactly the (rounded) input the layer saw
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=FP32_ATOL)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fp32_inside_bf16_autocast(kind, gen):
    norm = make(kind, gen)
    x = torch.randn(4, D, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.float32  # autocast did not push the norm into bf16
    torch.testing.assert_close(y.double(), reference(norm, x), rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_backward_bf16(kind, gen):
    norm = make(kind, gen)
    x = torch.randn(4, D, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    norm(x).float().pow(2).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32
    assert torch.isfinite(x.grad).all()


def test_float64_input_computes_in_float64(gen):
    norm = make("layer", gen)
    x = torch.randn(4, D, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(norm(x), reference(norm, x), rtol=1e-12, atol=1e-12)


SWAPS = [
    ("layernorm", nn.LayerNorm(D), LayerNorm),
    ("layernorm-no-bias", nn.LayerNorm(D, bias=False), LayerNorm),
    ("layernorm-no-affine", nn.LayerNorm(D, elementwise_affine=False), LayerNorm),
    ("rmsnorm", nn.RMSNorm(D, eps=1e-6), RMSNorm),
    ("rmsnorm-eps-none", nn.RMSNorm(D), RMSNorm),
]


@pytest.mark.parametrize("name,torch_norm,cls", SWAPS, ids=[s[0] for s in SWAPS])
def test_fp32_norm_matches_torch_and_shares_parameters(name, torch_norm, cls, gen):
    for p in torch_norm.parameters():
        with torch.no_grad():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    x = torch.randn(4, D, generator=gen)
    expected = torch_norm(x)
    params = list(torch_norm.parameters())
    new = fp32_norm(torch_norm)
    assert type(new) is cls
    assert [id(p) for p in new.parameters()] == [id(p) for p in params]
    torch.testing.assert_close(new(x), expected, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_swap_norms_in_place_keeps_state_dict_keys(gen):
    model = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.Sequential(nn.RMSNorm(D)), nn.BatchNorm1d(D))
    keys = list(model.state_dict())
    assert swap_norms(model) is model
    assert [type(m) for m in (model[1], model[2][0], model[3])] == [LayerNorm, RMSNorm, nn.BatchNorm1d]
    assert list(model.state_dict()) == keys


def test_swap_norms_root_and_subclass():
    class MyNorm(nn.LayerNorm):  # may override forward: left alone
        pass

    assert type(swap_norms(nn.RMSNorm(D))) is RMSNorm
    assert type(swap_norms(MyNorm(D))) is MyNorm


BAD = [
    ("zero-dim", lambda: RMSNorm(0), "normalized_shape"),
    ("negative-eps", lambda: LayerNorm(8, eps=-1.0), "eps"),
    ("not-a-norm", lambda: fp32_norm(nn.Linear(2, 2)), "norm"),
]


@pytest.mark.parametrize("name,build,field", BAD, ids=[b[0] for b in BAD])
def test_invalid_arguments(name, build, field):
    with pytest.raises(ValueError, match=field):
        build()
