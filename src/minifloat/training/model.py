"""A Llama-style decoder, small enough to read top to bottom: minifloat's reference model.

    wte → N × [x + attn(RMSNorm(x)), x + mlp(RMSNorm(x))] → RMSNorm → lm_head

Llama (Touvron et al., arXiv 2302.13971) is GPT-2 with three changes: RMSNorm instead of LayerNorm, rotary position
embeddings (RoPE, Su et al., arXiv 2104.09864) instead of a learned position table, and a SwiGLU MLP
(Shazeer, arXiv 2002.05202). Optional QK-norm (RMSNorm on each head's queries and keys, as in OLMo 2 and Qwen3)
bounds the attention logits, which low-precision training tends to blow up.

The precision-sensitive parts are fp32 whatever autocast is in force: the norms (minifloat.amp.norms.RMSNorm), the
rotary rotation, attention scores / softmax / scores·V (minifloat.amp.attention.attention) and the cross-entropy. Every
nn.Linear has in/out features that are multiples of 16, so `mf.convert` and `PrecisionPolicy.apply` can turn each
of them into an FP8 GEMM; by role (minifloat.core.roles) they keep the first block's q/k/v projections and the head,
`lm_head`, in high precision.

    model = Llama(LlamaConfig.preset("tiny"))
    logits, loss = model(idx, targets)      # idx, targets: (B, T) int64; logits: (B, T, vocab_size)
    logits, _ = model(idx, cache=cache)     # generation: positions after the cache's, which keeps this call's k, v

A `cache` (minifloat.inference.kvcache.KVCache, or any object with `length`, `update(layer, k, v)` and
`advance(T)`) is generation's only addition; without one, forward() is the training forward, unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from minifloat.amp.attention import IMPLEMENTATIONS, attention
from minifloat.amp.norms import RMSNorm
from minifloat.core.roles import MIN_DIM_MULTIPLE
from minifloat.core.validate import check_bool, check_choice, check_int, check_number


# LlamaConfig.attention: how softmax(QKᵀ/√d)·V is computed (minifloat.amp.attention.attention's `impl`)
ATTENTIONS = IMPLEMENTATIONS


def swiglu_hidden(d_model: int) -> int:
    """The default SwiGLU hidden size: 8/3 · d_model (three matrices cost what a 4·d GELU MLP's two do), rounded
    up to a multiple of 16 so the FP8 GEMMs can take it."""
    return MIN_DIM_MULTIPLE * math.ceil(8 * d_model / 3 / MIN_DIM_MULTIPLE)


def _multiple_of_16(field: str, value: int) -> None:
    if value % MIN_DIM_MULTIPLE:
        padded = MIN_DIM_MULTIPLE * math.ceil(value / MIN_DIM_MULTIPLE)
        raise ValueError(f"{field} must be a multiple of {MIN_DIM_MULTIPLE} (FP8 GEMMs need it), got {value!r}; "
                         f"pad it to {padded}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama model.

    Attributes:
        vocab_size: tokens in the vocabulary (256: bytes). A multiple of 16, as every Linear's features.
        n_layer: transformer blocks.
        n_head: attention heads; d_model / n_head is the head size, which must be even (RoPE rotates pairs).
        n_kv_head: key/value heads (grouped-query attention, Ainslie et al., arXiv 2305.13245): query heads share
            them in groups of n_head / n_kv_head; a divisor of n_head; None means n_head (multi-head attention).
            n_kv_head · head_dim, the k/v projections' width, must be a multiple of 16 as every Linear's features.
        d_model: width of the residual stream; a multiple of 16 and of n_head.
        d_ff: SwiGLU hidden size, a multiple of 16; None means `swiglu_hidden(d_model)` (read `ffn_dim`).
        max_seq_len: the longest sequence forward() accepts.
        rope_theta: RoPE base; pair i of a head turns by position · rope_theta^(-2i / head_dim).
        qk_norm: RMSNorm on each head's queries and keys before RoPE.
        tie_embeddings: lm_head shares its weight with wte.
        norm_eps: eps of every RMSNorm.
        attention: "fp32" (scores, softmax and scores·V in fp32, explicitly), "sdpa" (scaled_dot_product_attention,
            whose kernels keep them in fp32 internally) or "auto" (sdpa on CUDA, fp32 elsewhere).
    """

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None
    d_model: int = 64
    d_ff: int | None = None
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    qk_norm: bool = False
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    attention: str = "auto"

    def __post_init__(self):
        for field in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len"):
            check_int(field, getattr(self, field), low=1)
        check_int("d_ff", self.d_ff, low=1, allow_none=True)
        check_int("n_kv_head", self.n_kv_head, low=1, allow_none=True)
        _multiple_of_16("vocab_size", self.vocab_size)
        _multiple_of_16("d_model", self.d_model)
        _multiple_of_16("d_ff", self.ffn_dim)
        if self.d_model % self.n_head:
            raise ValueError(f"n_head must divide d_model ({self.d_model}), got {self.n_head!r}")
        if self.head_dim % 2:
            raise ValueError(f"n_head must leave an even head size for RoPE, got n_head={self.n_head!r} "
                             f"(head size {self.head_dim})")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_head must divide n_head ({self.n_head}), got {self.n_kv_head!r}")
        if self.kv_dim % MIN_DIM_MULTIPLE:
            raise ValueError(f"n_kv_head · head_dim (the k/v projections' width) must be a multiple of "
                             f"{MIN_DIM_MULTIPLE} (FP8 GEMMs need it), got n_kv_head={self.n_kv_head!r} · "
                             f"{self.head_dim} = {self.kv_dim}")
        check_number("rope_theta", self.rope_theta, low=1.0, low_open=True)
        check_number("norm_eps", self.norm_eps, low=0.0)
        for field in ("qk_norm", "tie_embeddings"):
            check_bool(field, getattr(self, field))
        check_choice("attention", self.attention, list(ATTENTIONS))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads in use: n_kv_head, or n_head when n_kv_head is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def kv_dim(self) -> int:
        """Width of the k and v projections: kv_heads · head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU hidden size in use: d_ff, or swiglu_hidden(d_model) when d_ff is None."""
        return swiglu_hidden(self.d_model) if self.d_ff is None else self.d_ff

    @classmethod
    def preset(cls, name: str, **overrides) -> "LlamaConfig":
        """A named size from SIZES ("tiny", "small", "10m", "100m", "350m", "1b"), with fields replaced by
        `overrides`."""
        if name not in SIZES:
            raise ValueError(f"unknown model size {name!r}; known: {list(SIZES)}")
        return dataclasses.replace(SIZES[name], **overrides)


# Parameter counts at vocab_size=256 (the bytes; tests/test_model.py checks them); the first four: tied embeddings,
# no QK-norm, multi-head attention: CPU and CI sizes. The last two are Llama-3-shaped for a GPU: untied embeddings,
# grouped-query attention, rope_theta 500000, 2048 positions; "1b" is Llama-3.2-1B's body (its vocabulary is
# 128,256, tied: 1.24B). Their counts at a 32,000-token vocabulary (a BPE tokenizer's) are in parentheses.
_LLAMA3 = dict(tie_embeddings=False, rope_theta=500000.0, max_seq_len=2048)
SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(n_layer=2, n_head=4, d_model=64, max_seq_len=128),  # 0.12M, for CI
    "small": LlamaConfig(n_layer=6, n_head=4, d_model=128, max_seq_len=256),  # 1.24M
    "10m": LlamaConfig(n_layer=6, n_head=6, d_model=384, max_seq_len=512),  # 10.7M
    "100m": LlamaConfig(n_layer=14, n_head=12, d_model=768, max_seq_len=1024),  # 99.3M
    "350m": LlamaConfig(n_layer=20, n_head=16, n_kv_head=8, d_model=1024, d_ff=3584, **_LLAMA3),  # 283.7M (348.7M)
    "1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192, **_LLAMA3),  # 974.2M (1104.2M)
}


# ---------------------------------------------------------------------------------------------------------- RoPE


def rope_tables(positions: torch.Tensor, head_dim: int, *, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles position · θ_i, θ_i = theta^(-2i / head_dim), i < head_dim / 2, in fp32.

    Args:
        positions: (T,) integer positions.
        head_dim: the (even) head size.
        theta: the RoPE base.
    Returns:
        cos, sin: (T, head_dim / 2) float32 each.
    """
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2); an outer product, which autocast leaves
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + hd/2]) by its angle, in fp32; returns x's dtype.

    A rotation by m·θ of the query and n·θ of the key leaves q·k depending on m - n only: RoPE encodes relative
    position in the attention scores. This is the "rotate half" pairing (GPT-NeoX, Hugging Face Llama) rather than
    Meta's interleaved pairs; the two differ by a fixed permutation of the q and k features.

    Args:
        x: (..., T, head_dim).
        cos, sin: (T, head_dim / 2) from rope_tables.
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # (..., T, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


# -------------------------------------------------------------------------------------------------------- blocks


class CausalSelfAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, self.n_head, self.n_kv_head, self.head_dim = config.d_model, config.n_head, config.kv_heads, config.head_dim
        self.attention = config.attention  # "fp32", "sdpa" or "auto" (minifloat.amp.attention)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, config.kv_dim, bias=False)  # n_kv_head heads (grouped-query attention)
        self.v_proj = nn.Linear(d, config.kv_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        if config.qk_norm:  # over each head's features
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, config.norm_eps), RMSNorm(self.head_dim, config.norm_eps)
        else:
            self.q_norm, self.k_norm = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, H_kv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, H_kv, T, hd)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:  # generation: the cache stores this call's k, v and returns every position's so far
            k, v = kv(k, v)  # (B, H_kv, T_cached + T, hd) each
        # (B, H, T, hd); query head h reads kv head h // (H / H_kv); softmax and scores·V in fp32 (explicitly, or
        # inside SDPA's fused kernel)
        y = attention(q, k, v, causal=True, impl=self.attention)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C): heads side by side again (C/t under TP)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C) via (B, T, ffn_dim)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None) -> torch.Tensor:
        h = self.attn_norm(x)
        # kv only when generating: tensor parallelism's PrepareModuleInput lays out exactly (x, cos, sin)
        x = x + (self.attn(h, cos, sin) if kv is None else self.attn(h, cos, sin, kv))
        x = x + self.mlp(self.mlp_norm(x))
        return x


# --------------------------------------------------------------------------------------------------------- model


class Llama(nn.Module):
    """The decoder: token embedding, `n_layer` pre-norm blocks, a final RMSNorm and the `lm_head`.

    Args:
        config: a LlamaConfig (e.g. LlamaConfig.preset("tiny")).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a LlamaConfig, got {config!r}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # one matrix maps tokens in and out (Press & Wolf, arXiv 1608.05859); both modules hold the same Parameter
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaling: each block adds two projections to the residual stream, so the stream's variance grows
        # with 2·n_layer terms; 1/sqrt(2·n_layer) keeps it O(1) at init
        for block in self.blocks:
            for proj in (block.attn.o_proj, block.mlp.down_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of parameters, a tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache=None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy against `targets` if given.

        Args:
            idx: (B, T) token ids, 1 <= T and T + the cached positions <= max_seq_len.
            targets: (B, T) next-token ids (-1 is ignored), or None.
            cache: for generation, a KV cache holding `cache.length` earlier positions (see the module docstring):
                idx continues them, and its keys and values are appended to it.
        Returns:
            logits (B, T, vocab_size) in the compute dtype, and the loss (fp32 scalar) or None.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        start = 0 if cache is None else cache.length  # position of idx[:, 0]
        if not 1 <= T <= self.config.max_seq_len - start:
            cached = f" after {start} cached positions" if start else ""
            raise ValueError(f"sequence length T={T}{cached} must be in [1, max_seq_len={self.config.max_seq_len}]")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        cos, sin = rope_tables(torch.arange(start, start + T, device=idx.device), self.config.head_dim,
                               theta=self.config.rope_theta)  # (T, hd/2) each, shared by every layer
        x = self.wte(idx)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if cache is None else functools.partial(cache.update, i))  # (B, T, C)
        if cache is not None:
            cache.advance(T)
        logits = self.lm_head(self.norm(x))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            # fp32 log-softmax: each position sums vocab_size exponentials, which bf16 (8 bits) would round away
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), ignore_index=-1)
        return logits, loss
