"""fp32 attention: matches float64 maths, runs its softmax and GEMMs in fp32 under bf16 autocast (checked by the
audit), returns the input dtype, and differs from bf16 SDPA by what bf16 costs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from minifloat.amp.attention import attention
from minifloat.safety.audit import audit

# fp32 scores/softmax/PV on bf16 inputs, returned in bf16: one bf16 rounding of the output (2^-8 relative)
BF16_OUT_RTOL = 2.0**-7
FP32_ATOL = 1e-5  # fp32 accumulation over 16-dim heads and 32-key softmax


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 32, 16, generator=g) for _ in range(3)]


def reference(q, k, v, causal):
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_matches_float64(qkv, causal):
    out = attention(*qkv, causal=causal)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(*qkv, causal), atol=FP32_ATOL, rtol=0)


def test_bf16_inputs_under_autocast_return_bf16_close_to_reference(qkv):
    q, k, v = (t.bfloat16() for t in qkv)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v)
    assert out.dtype == torch.bfloat16
    ref = reference(q.float(), k.float(), v.float(), True)
    torch.testing.assert_close(out.double(), ref, rtol=BF16_OUT_RTOL, atol=BF16_OUT_RTOL)


class Attn(nn.Module):
    def __init__(self, fp32):
        super().__init__()
        self.proj = nn.Linear(16, 48)
        self.fp32 = fp32

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        if self.fp32:
            return attention(q, k, v)
        s = (q @ k.transpose(-2, -1)).softmax(-1)  # what autocast gives a plain implementation on CPU
        return s @ v


@pytest.mark.parametrize("fp32, violations", [(True, 0), (False, 1)], ids=["minifloat-attention", "plain"])
def test_audit_sees_softmax_precision(fp32, violations):
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit(Attn(fp32), torch.randn(2, 8, 16), loss_fn=lambda out, _: out.float().pow(2).mean())
    assert len({v.module for v in report.violations}) == violations


def test_gradients_flow(qkv):
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    attention(q, k, v).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match="shapes"):
        attention(torch.randn(2, 4, 8), torch.randn(2, 4, 6), torch.randn(2, 4, 6))
