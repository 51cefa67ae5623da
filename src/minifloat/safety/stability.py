"""Stability tricks for low-precision training, as one frozen configuration and the functions behind it.

    stab = StabilityConfig()                                  # the defaults below; dataclasses.replace for variants
    optimizer = torch.optim.AdamW(stab.param_groups(model), lr=3e-4)
    h = stab.shrink_embedding_grad(model.wte(idx))            # (B, T, C)
    logits = model.head(h)                                    # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + stab.z_loss(logits)
    loss.backward()
    norms = stab.clip_grad_norms(model)                       # GradNorms before clipping

Sources: embedding gradient shrink, GLM-130B (arXiv 2210.02414 §3.3); z-loss, PaLM (arXiv 2204.02311 §5) after
ST-MoE; a separate clipping limit for embeddings, as their gradients are sparse and bursty; no weight decay on norms
and biases (nanoGPT's `configure_optimizers`, and most LLM recipes), decay 0.1 as in GPT-3/Llama.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from minifloat.core.roles import embedding_param_ids, is_norm
from minifloat.core.validate import check_bool, check_number

EMBEDDING_GROUP = "embedding"  # name of the embedding parameter group made by `param_groups`


def _check_alpha(field: str, alpha) -> float:
    check_number(field, alpha, low=0.0, high=1.0, low_open=True)
    return float(alpha)


def shrink_embedding_grad(x: torch.Tensor, alpha: float = 0.1) -> torch.Tensor:
    """Scale the gradient flowing into `x` by alpha, leaving its value unchanged.

    x·α + x.detach()·(1−α) (GLM-130B): the forward value is x (up to one rounding), the backward passes α·grad.

    Args:
        x: the embedding output, any shape.
        alpha: gradient multiplier in (0, 1]; 1 returns x itself.
    Returns:
        A tensor equal to x whose gradient reaches x multiplied by alpha.
    """
    alpha = _check_alpha("alpha", alpha)
    if alpha == 1.0:
        return x
    return x * alpha + x.detach() * (1.0 - alpha)


class ShrinkEmbeddingGrad(nn.Module):
    """Wraps an embedding module so that its output's gradient is shrunk by alpha (see `shrink_embedding_grad`).

    Args:
        embedding: the module to wrap (usually nn.Embedding); still reachable as `.embedding`.
        alpha: gradient multiplier in (0, 1].
    """

    def __init__(self, embedding: nn.Module, alpha: float = 0.1):
        super().__init__()
        self.alpha = _check_alpha("alpha", alpha)
        self.embedding = embedding

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return shrink_embedding_grad(self.embedding(*args, **kwargs), self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


def z_loss(logits: torch.Tensor, coeff: float = 1e-4) -> torch.Tensor:
    """Auxiliary loss coeff · mean(logsumexp(logits)²), pulling the softmax normalizer log Z towards 0.

    Computed in float32 whatever the logits' dtype: logsumexp over a large vocabulary is one of the reductions
    that must stay in high precision.

    Args:
        logits: (..., V) unnormalized log-probabilities.
        coeff: weight of the term (PaLM: 1e-4).
    Returns:
        A float32 scalar.
    """
    check_number("coeff", coeff, low=0.0)
    log_z = torch.logsumexp(logits.float(), dim=-1)  # (...,)
    return coeff * log_z.square().mean()


def param_groups(model: nn.Module, weight_decay: float = 0.1, *, decay_embeddings: bool = True) -> list[dict]:
    """Parameter groups for torch.optim.AdamW: weight decay on matrices, none on norms and biases.

    Embedding weights (nn.Embedding / nn.EmbeddingBag, and an output layer tied to one) get a group of their own, named
    "embedding", so `clip_grad_norms` can find them in the optimizer. Each group carries a "name" key.

    Args:
        model: the model; parameters without requires_grad are left out; tied parameters appear once.
        weight_decay: decay for the "decay" group (and the embedding group if decay_embeddings).
        decay_embeddings: False puts the embeddings under no weight decay.
    Returns:
        Non-empty groups among "decay", "no_decay", "embedding", in that order.
    """
    check_number("weight_decay", weight_decay, low=0.0)
    check_bool("decay_embeddings", decay_embeddings)
    embeddings = embedding_param_ids(model)
    no_decay = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)}
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], EMBEDDING_GROUP: []}
    for name, p in model.named_parameters():  # named_parameters drops tied duplicates
        if not p.requires_grad:
            continue
        if id(p) in embeddings:
            groups[EMBEDDING_GROUP].append(p)
        elif id(p) in no_decay or name.endswith("bias") or p.ndim < 2:
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    decay = {"decay": weight_decay, "no_decay": 0.0, EMBEDDING_GROUP: weight_decay if decay_embeddings else 0.0}
    return [{"name": k, "params": ps, "weight_decay": decay[k]} for k, ps in groups.items() if ps]


@dataclasses.dataclass(frozen=True)
class GradNorms:
    """Gradient L2 norms before clipping (0-dim tensors)."""

    total: torch.Tensor
    embedding: torch.Tensor
    rest: torch.Tensor


def _split(params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(embedding params, the rest) of a model or of a list of param-group dicts."""
    if isinstance(params, nn.Module):
        embeddings = embedding_param_ids(params)
        ps = [p for p in params.parameters()]
        return [p for p in ps if id(p) in embeddings], [p for p in ps if id(p) not in embeddings]
    emb, rest = [], []
    for group in params:
        (emb if group.get("name") == EMBEDDING_GROUP else rest).extend(group["params"])
    return emb, rest


def _clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return nn.utils.clip_grad_norm_(grads, max_norm)


def clip_grad_norms(params: nn.Module | Iterable[dict], max_norm: float = 1.0, *,
                    embedding_max_norm: float | None = None) -> GradNorms:
    """Clip gradients by L2 norm, optionally with a separate limit for the embeddings.

    Args:
        params: a model (embeddings are its nn.Embedding / EmbeddingBag weights) or optimizer param groups (the
            embeddings are the group named "embedding", as made by `param_groups`).
        max_norm: limit for all gradients, or for the non-embedding ones when embedding_max_norm is given.
        embedding_max_norm: limit for the embedding gradients, clipped on their own; None clips everything jointly.
    Returns:
        GradNorms before clipping.
    """
    check_number("max_norm", max_norm, low=0.0, low_open=True)
    check_number("embedding_max_norm", embedding_max_norm, low=0.0, low_open=True, allow_none=True)
    emb, rest = _split(params)
    if embedding_max_norm is None:
        emb_norm = nn.utils.get_total_norm([p.grad for p in emb if p.grad is not None])
        rest_norm = nn.utils.get_total_norm([p.grad for p in rest if p.grad is not None])
        total = _clip(emb + rest, max_norm)
    else:
        emb_norm, rest_norm = _clip(emb, embedding_max_norm), _clip(rest, max_norm)
        total = torch.linalg.vector_norm(torch.stack([emb_norm.float(), rest_norm.float().to(emb_norm.device)]))
    return GradNorms(total, emb_norm, rest_norm)


@dataclasses.dataclass(frozen=True)
class StabilityConfig:
    """The stability tricks of one run, in one place; methods apply them with these settings.

    Args:
        embedding_grad_alpha: gradient multiplier for the embedding output, in (0, 1] (1 = off; GLM-130B: 0.1).
        z_loss_coeff: weight of the z-loss, >= 0 (0 = off; PaLM: 1e-4).
        max_grad_norm: gradient clipping limit, > 0.
        embedding_max_grad_norm: separate clipping limit for embedding gradients, > 0; None clips jointly.
        weight_decay: AdamW weight decay for matrices, >= 0.
        decay_embeddings: whether embedding weights are decayed too.
    """

    embedding_grad_alpha: float = 0.1
    z_loss_coeff: float = 1e-4
    max_grad_norm: float = 1.0
    embedding_max_grad_norm: float | None = None
    weight_decay: float = 0.1
    decay_embeddings: bool = True

    def __post_init__(self):
        _check_alpha("embedding_grad_alpha", self.embedding_grad_alpha)
        check_number("z_loss_coeff", self.z_loss_coeff, low=0.0)
        check_number("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True)
        check_number("embedding_max_grad_norm", self.embedding_max_grad_norm, low=0.0, low_open=True,
                     allow_none=True)
        check_number("weight_decay", self.weight_decay, low=0.0)
        check_bool("decay_embeddings", self.decay_embeddings)

    def shrink_embedding_grad(self, x: torch.Tensor) -> torch.Tensor:
        return shrink_embedding_grad(x, self.embedding_grad_alpha)

    def z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        return z_loss(logits, self.z_loss_coeff)

    def clip_grad_norms(self, params: nn.Module | Iterable[dict]) -> GradNorms:
        return clip_grad_norms(params, self.max_grad_norm, embedding_max_norm=self.embedding_max_grad_norm)

    def param_groups(self, model: nn.Module) -> list[dict]:
        return param_groups(model, self.weight_decay, decay_embeddings=self.decay_embeddings)
