"""attention: the fp32 path matches float64 maths, runs its softmax and GEMMs in fp32 under bf16 autocast (checked by
the audit) and returns the input dtype; the SDPA path agrees with it within named SQNR floors, with a KV cache's
shorter q and with grouped-query heads; "auto" is the fp32 path on the CPU, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from minifloat.amp.attention import attention, resolve
from minifloat.safety.audit import audit

# fp32 scores/softmax/PV on bf16 inputs, returned in bf16: one bf16 rounding of the output (2^-8 relative)
BF16_OUT_RTOL = 2.0**-7
FP32_ATOL = 1e-5  # fp32 accumulation over 16-dim heads and 32-key softmax
# SQNR floors against a float64 reference of the same (rounded) inputs. fp32 carries 24 bits (~144 dB); both paths
# measure 136-140 dB on these shapes. A bf16 output carries 8 bits (~54 dB for one rounding); SDPA's bf16
# probabilities (the probs·V GEMM's operands) cost ~1-2 dB more: measured 53.5-55.5 dB (torch 2.13, CPU)
FP32_SQNR_DB = 120.0
BF16_SQNR_DB = 45.0


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 32, 16, generator=g) for _ in range(3)]


def reference(q, k, v, causal):
    """float64 attention; k/v heads repeated explicitly for grouped-query shapes; q holds the last Tq positions."""
    groups = q.shape[-3] // k.shape[-3]
    q, k, v = q.double(), k.double().repeat_interleave(groups, -3), v.double().repeat_interleave(groups, -3)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        tq, tk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), float("-inf"))
    return torch.softmax(s, -1) @ v


def sqnr_db(ref, x):
    """Signal-to-quantization-noise ratio of `x` against `ref`, in dB."""
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x.double()).pow(2).sum())).item()


# (name, q heads, kv heads, Tq, Tk): training shapes, a KV cache's prefill continuation and decode step, GQA
SHAPES = [("square", 4, 4, 32, 32), ("kv-cache", 4, 4, 5, 32), ("decode", 4, 4, 1, 32),
          ("gqa", 4, 2, 32, 32), ("gqa-kv-cache", 4, 1, 5, 32)]


def make_qkv(heads, kv_heads, tq, tk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, tq, 16, generator=g), torch.randn(2, kv_heads, tk, 16, generator=g),
            torch.randn(2, kv_heads, tk, 16, generator=g))


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
    def __init__(self, impl):
        super().__init__()
        self.proj = nn.Linear(16, 48)
        self.impl = impl

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        if self.impl != "plain":
            return attention(q, k, v, impl=self.impl)
        s = (q @ k.transpose(-2, -1)).softmax(-1)  # what autocast gives a plain implementation on CPU
        return s @ v


# the fused SDPA kernel keeps its softmax statistics and probs·V accumulation in fp32 (minifloat.amp.attention):
# the audit passes it, and still flags a softmax written by hand under bf16 autocast
@pytest.mark.parametrize("impl, violations", [("fp32", 0), ("sdpa", 0), ("plain", 1)],
                         ids=["minifloat-attention", "sdpa", "plain"])
def test_audit_sees_softmax_precision(impl, violations):
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit(Attn(impl), torch.randn(2, 8, 16), loss_fn=lambda out, _: out.float().pow(2).mean())
    assert len({v.module for v in report.violations}) == violations


def test_gradients_flow(qkv):
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    attention(q, k, v).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match="shapes"):
        attention(torch.randn(2, 4, 8), torch.randn(2, 4, 6), torch.randn(2, 4, 6))


@pytest.mark.parametrize("impl", ["fp32", "sdpa"])
@pytest.mark.parametrize("name, heads, kv_heads, tq, tk", SHAPES, ids=[c[0] for c in SHAPES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fp32_inputs_match_float64(impl, name, heads, kv_heads, tq, tk, causal):
    q, k, v = make_qkv(heads, kv_heads, tq, tk)
    out = attention(q, k, v, causal=causal, impl=impl)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert sqnr_db(reference(q, k, v, causal), out) > FP32_SQNR_DB


@pytest.mark.parametrize("impl", ["fp32", "sdpa"])
@pytest.mark.parametrize("name, heads, kv_heads, tq, tk", SHAPES, ids=[c[0] for c in SHAPES])
def test_bf16_autocast_matches_float64_of_rounded_inputs(impl, name, heads, kv_heads, tq, tk):
    q, k, v = (t.bfloat16() for t in make_qkv(heads, kv_heads, tq, tk))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, impl=impl)
    assert out.dtype == torch.bfloat16
    assert sqnr_db(reference(q, k, v, True), out) > BF16_SQNR_DB


def test_auto_is_the_fp32_path_on_cpu_bitwise():
    q, k, v = make_qkv(4, 2, 32, 32)
    assert resolve("auto", q.device) == "fp32"
    assert torch.equal(attention(q, k, v, impl="auto"), attention(q, k, v, impl="fp32"))
    assert torch.equal(attention(q, k, v), attention(q, k, v, impl="fp32"))  # the default


def test_auto_is_sdpa_on_cuda():
    assert resolve("auto", torch.device("cuda")) == "sdpa"  # resolve reads the device only: no GPU needed


@pytest.mark.parametrize("impl", ["fp32", "sdpa"])
def test_gqa_with_as_many_kv_heads_is_multi_head_bitwise(impl):
    q, k, v = make_qkv(4, 4, 32, 32)
    if impl == "fp32":  # the same ops as before grouped-query attention existed
        s = (q @ k.transpose(-2, -1)) / 4.0
        s = s.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf"))
        expected = torch.softmax(s, -1) @ v
    else:
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(attention(q, k, v, impl=impl), expected)


@pytest.mark.parametrize("fp32, impl", [(True, "fp32"), (False, "sdpa")])
def test_fp32_keyword_still_selects_the_path(fp32, impl):
    q, k, v = make_qkv(4, 4, 8, 8)
    assert torch.equal(attention(q, k, v, fp32=fp32), attention(q, k, v, impl=impl))


@pytest.mark.parametrize("kwargs, match", [
    ({"impl": "flash"}, "attention must be one of"),
    ({"impl": "sdpa", "fp32": True}, "disagree"),
], ids=["unknown-impl", "conflicting-keywords"])
def test_bad_choice_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention(*make_qkv(4, 4, 8, 8), **kwargs)


def test_kv_heads_must_divide_query_heads():
    with pytest.raises(ValueError, match="dividing"):
        attention(*make_qkv(4, 3, 8, 8))
