"""Tiny random transformers MoE models for the MoE tests (tests/test_moe.py, tests/test_moe_inference.py): Mixtral
and Qwen2-MoE with 4 experts of hidden size 128, two picked per token."""

from __future__ import annotations

import torch

_SIZES = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
MODELS = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_SIZES, intermediate_size=256, num_local_experts=4,
                                                                  num_experts_per_tok=2)),
          "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_SIZES, intermediate_size=256, num_experts=4,
                                                                      num_experts_per_tok=2, moe_intermediate_size=128,
                                                                      shared_expert_intermediate_size=256))}


def build(arch: str = "mixtral"):
    """The model `arch` with seed-0 random weights, in training mode (transformers' default)."""
    import transformers

    config_name, class_name, fields = MODELS[arch]
    torch.manual_seed(0)
    return getattr(transformers, class_name)(getattr(transformers, config_name)(**fields))


def routing(num_tokens: int = 24, experts: int = 4, k: int = 2, seed: int = 1, allowed: int | None = None):
    """(x, top-k expert indices, their weights) for `num_tokens` random tokens of width 128."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 128, generator=g)
    scores = torch.rand(num_tokens, allowed or experts, generator=g)
    weights, index = scores.topk(k, dim=-1)
    return x, index, torch.softmax(weights, dim=-1)
