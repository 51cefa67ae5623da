"""The KV cache of the reference Llama: every layer's keys and values, kept so that generation feeds one token a step.

A decoder's position t attends to the keys and values of positions 0..t, which do not change once computed (causal
attention), so generation stores them: the prompt goes through the model once (prefill) and each new token after it
alone (decode), attending to the stored rows. Without a cache each new token would re-run the whole sequence.

    cache = KVCache(model.config, batch=B, max_len=T_prompt + N, dtype="fp8")
    logits, _ = model(prompt, cache=cache)           # prefill: cache.length = T_prompt
    logits, _ = model(next_token, cache=cache)       # decode:  cache.length = T_prompt + 1

Storage (`KV_DTYPES`): "fp32", "bf16", or "fp8": float8_e4m3fn with one fp32 scale per (token, head), i.e. the
row granularity of minifloat's one rounding path (minifloat.numerics.quantize) over each head's head_dim features.
A per-(token, head) scale is set once, when the token is written: later tokens never rescale earlier ones, and an
outlier head or token costs its own row only. FP8 rows are dequantized to fp32 for attention, whose scores, softmax and
scores·V are fp32 in every case (minifloat.amp.attention).
"""

from __future__ import annotations

import torch

from minifloat.core.validate import check_choice, check_int
from minifloat.numerics.formats import E4M3
from minifloat.numerics.quantize import Quantized, quantize
from minifloat.training.model import LlamaConfig

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": E4M3.torch_dtype}  # name -> storage dtype
FP8_KV_FORMAT = E4M3  # keys and values are activations: E4M3's precision, as the forward GEMMs' operands


class KVCache:
    """Keys and values of every layer for `batch` sequences, preallocated to `max_len` positions.

    The model calls `update(layer, k, v)` once per layer and then `advance(T)` (minifloat.training.model.Llama's
    `cache` argument); `length` is the number of positions stored, i.e. the position of the next token.

    Args:
        config: the model's LlamaConfig (layers, key/value heads, head size).
        batch: sequences generated together (they share positions: prompts of equal length).
        max_len: positions to hold, at most config.max_seq_len; None means config.max_seq_len.
        dtype: "fp32", "bf16" or "fp8" (E4M3 with a scale per token and head).
        device: where the cache lives (the model's device).
    """

    def __init__(self, config: LlamaConfig, *, batch: int, max_len: int | None = None, dtype: str = "bf16",
                 device: torch.device | str = "cpu"):
        check_int("batch", batch, low=1)
        check_int("max_len", max_len, low=1, high=config.max_seq_len, allow_none=True)
        check_choice("kv_cache", dtype, list(KV_DTYPES))
        self.dtype, self.max_len, self.length = dtype, max_len or config.max_seq_len, 0
        # (L, B, H_kv, T, hd): grouped-query attention stores n_kv_head heads, n_head / n_kv_head times fewer bytes
        shape = (config.n_layer, batch, config.kv_heads, self.max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=KV_DTYPES[dtype], device=device)
        self.v = torch.zeros(shape, dtype=KV_DTYPES[dtype], device=device)
        scale_shape = (*shape[:-1], 1) if dtype == "fp8" else (0,)  # (L, B, H, T, 1): one per token and head
        self.k_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values of positions length .. length + T; return those of 0 .. length + T.

        Args:
            layer: the block's index.
            k, v: (B, H_kv, T, head_dim), after RoPE (keys are cached rotated: their positions never change).
        Returns:
            k, v: (B, H_kv, length + T, head_dim): views of the cache (fp32, bf16), or fp32 dequantized copies (fp8).
        """
        start, end = self.length, self.length + k.shape[-2]
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {start} are stored and {k.shape[-2]} "
                             f"more do not fit")
        if self.dtype != "fp8":
            self.k[layer, :, :, start:end] = k
            self.v[layer, :, :, start:end] = v
            return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        out = []
        for x, data, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q = quantize(x, FP8_KV_FORMAT, granularity="row")  # data (B, H, T, hd) E4M3, scale (B, H, T, 1)
            data[layer, :, :, start:end] = q.data
            scale[layer, :, :, start:end] = q.scale
            stored = Quantized(data[layer, :, :, :end], scale[layer, :, :, :end], FP8_KV_FORMAT, "row")
            out.append(stored.dequantize(torch.float32))  # (B, H, end, hd)
        return out[0], out[1]

    def advance(self, tokens: int) -> None:
        """Count `tokens` new positions as stored (after every layer's `update`)."""
        self.length += tokens

    def nbytes(self) -> int:
        """Bytes the cache holds (keys, values and FP8 scales, at its full `max_len`)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale))
