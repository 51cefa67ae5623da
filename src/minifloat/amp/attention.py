"""Attention with its precision-sensitive part in fp32: scores, softmax and scores·V.

`torch.autocast` runs `q @ kᵀ` and `probs @ v` in bf16/fp16, and on CPU it leaves `softmax` of a bf16 tensor in bf16.
The scores of long sequences have a large dynamic range, their softmax sums T terms, and probs·V averages T values;
in bf16 each loses bits that training needs. mixed-precision practice keeps them in fp32. A policy cannot reach a
functional call inside someone's forward(), so models call this instead (minifloat's reference model does), and
`minifloat audit` checks the result.
"""

from __future__ import annotations

import math

import torch

from minifloat.core.autocast import autocast_off


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, fp32: bool = True,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v, computed in fp32 when `fp32` (autocast off inside), returned in q's dtype.

    Args:
        q, k, v: (..., T, head_dim) tensors (k and v may have their own T).
        causal: mask out keys after each query (q and k aligned at the end).
        fp32: compute scores, softmax and scores·V in fp32; False defers to the ambient autocast (SDPA).
        scale: score scale, default 1/sqrt(head_dim).
    Returns:
        (..., T, head_dim) in q's dtype.
    """
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not fp32:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    with autocast_off(q.device.type):
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (..., Tq, Tk)
        if causal:
            tq, tk = scores.shape[-2], scores.shape[-1]
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = probs @ v.float()  # (..., Tq, head_dim)
    return out.to(q.dtype)
