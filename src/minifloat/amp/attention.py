"""Attention with its precision-sensitive part in fp32: scores, softmax and scores·V.

`torch.autocast` runs `q @ kᵀ` and `probs @ v` in bf16/fp16, and on CPU it leaves `softmax` of a bf16 tensor in bf16.
The scores of long sequences have a large dynamic range, their softmax sums T terms, and probs·V averages T values;
in bf16 each loses bits that training needs. mixed-precision practice keeps them in fp32. A policy cannot reach a
functional call inside someone's forward(), so models call this instead (minifloat's reference model does), and
`minifloat audit` checks the result.

Two implementations (`IMPLEMENTATIONS`), both fp32 where it matters:

* "fp32": explicit. Autocast off, q, k, v upcast, the (Tq, Tk) scores, their softmax and probs·V computed and stored
  in fp32; the output rounded once to q's dtype. Any device, any shape; it materialises Tq × Tk per head.
* "sdpa": torch's `scaled_dot_product_attention` under the ambient autocast. Its fused kernels (FlashAttention-2,
  Dao, arXiv 2307.08691; cuDNN's SDPA; the memory-efficient kernel of xFormers, Rabe & Staats, arXiv 2112.05682; on
  CPU ATen's `cpu_flash_attention`) take bf16 q, k, v, accumulate q·kᵀ in fp32, keep the softmax's running max and
  sum in fp32 (the online softmax), accumulate probs·V in fp32 and round only the output; the probabilities enter
  the probs·V GEMM as bf16 operands, as every tensor-core GEMM's operands are. They never store Tq × Tk, which on an
  H100 doubles bf16 throughput against "fp32".
* "auto": "sdpa" when q is on CUDA, "fp32" elsewhere (the CPU keeps the explicit path: bitwise what it always was).

Grouped-query attention (Ainslie et al., arXiv 2305.13245): k and v may carry fewer heads than q, a divisor of q's;
query head h reads key/value head h // (q heads / kv heads), as Llama 3 and Hugging Face's `repeat_kv` pair them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minifloat.core.autocast import autocast_off
from minifloat.core.validate import check_choice

IMPLEMENTATIONS = ("auto", "sdpa", "fp32")  # see the module docstring


def resolve(impl: str, device: torch.device) -> str:
    """The implementation "auto" stands for on `device` ("sdpa" on CUDA, else "fp32"); others are returned as given."""
    check_choice("attention", impl, list(IMPLEMENTATIONS))
    if impl == "auto":
        return "sdpa" if device.type == "cuda" else "fp32"
    return impl


def causal_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """(tq, tk) bool, True where query i may read key j: queries are the last tq of tk positions (a KV cache holds
    the first tk - tq), so query i sits at position tk - tq + i and reads keys 0 .. tk - tq + i."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    heads_ok = q.dim() < 3 or (q.shape[:-3] == k.shape[:-3] and q.shape[-3] % k.shape[-3] == 0)
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1] or q.dim() != k.dim() or not heads_ok:
        raise ValueError(f"attention shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         f"k and v need q's head_dim, one length, and a number of heads dividing q's")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, impl: str | None = None,
              fp32: bool | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v, returned in q's dtype.

    Args:
        q: (..., H, Tq, head_dim).
        k, v: (..., H_kv, Tk, head_dim), H_kv dividing H (grouped-query attention; H_kv == H is plain multi-head).
        causal: mask out keys after each query, q and k aligned at the end (q holds the last Tq of Tk positions).
        impl: "fp32", "sdpa" or "auto" (the module docstring); default "fp32".
        fp32: the older spelling: True is impl="fp32", False impl="sdpa".
        scale: score scale, default 1/sqrt(head_dim).
    Returns:
        (..., H, Tq, head_dim) in q's dtype.
    """
    _check_shapes(q, k, v)
    if fp32 is not None:
        legacy = "fp32" if fp32 else "sdpa"
        if impl is not None and impl != legacy:
            raise ValueError(f"attention got impl={impl!r} and fp32={fp32!r}, which disagree; pass impl only")
        impl = legacy
    impl = resolve("fp32" if impl is None else impl, q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    tq, tk = q.shape[-2], k.shape[-2]
    groups = q.shape[-3] // k.shape[-3] if q.dim() > 2 else 1  # query heads per key/value head
    if impl == "sdpa":
        # is_causal aligns the mask at the top left (query i reads keys 0..i); with a KV cache (Tq < Tk) the
        # queries are the last positions, so the mask is spelled out. One query reads every key: no mask at all.
        mask = causal_mask(tq, tk, q.device) if causal and tq != tk and tq > 1 else None
        k, v = k.to(q.dtype), v.to(q.dtype)  # one dtype for the kernel (a KV cache may store another); no-op if equal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and tq == tk,
                                              scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)  # (..., H, Tk, hd)
    with autocast_off(q.device.type):
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (..., Tq, Tk)
        if causal:
            scores = scores.masked_fill(~causal_mask(tq, tk, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = probs @ v.float()  # (..., Tq, head_dim)
    return out.to(q.dtype)
