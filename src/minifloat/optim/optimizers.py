"""AdamW, Adam, SGD with momentum and Lion over block-wise low-precision states (optim/blockwise.py).

Each rule runs on float32 chunks and spells out the same operations, in the same order, as torch.optim's
single-tensor implementations, so that with "fp32" states AdamW, Adam and SGD are bitwise torch.optim's on CPU.

    opt = AdamW(model.parameters(), lr=1e-3, state_formats=("e4m3", "bf16"), model=model)
"""

from __future__ import annotations

from torch import nn

from minifloat.optim.blockwise import (
    DEFAULT_BLOCK,
    DEFAULT_CHUNK_BLOCKS,
    DEFAULT_MIN_QUANTIZED_NUMEL,
    BlockwiseOptimizer,
    StateSpec,
)


def _check_betas(betas) -> None:
    """betas as a pair of numbers in [0, 1); ValueError naming the field otherwise."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    _check_hyper("betas[0]", betas[0], 0.0, 1.0)
    _check_hyper("betas[1]", betas[1], 0.0, 1.0)


def _check_hyper(name: str, value: float, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            low <= value and (high is None or value < high)):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value!r}")


class Adam(BlockwiseOptimizer):
    """Adam with block-wise quantized moments; `weight_decay` is L2 (added to the gradient), as torch.optim.Adam.

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as torch.optim.Adam.
        state_formats: formats of (exp_avg, exp_avg_sq): e.g. ("e4m3", "bf16"), or one format for both.
        block_size, expand, min_quantized_numel, model, chunk_blocks, check_finite: see BlockwiseOptimizer.
    """

    STATES = (StateSpec("exp_avg"), StateSpec("exp_avg_sq", non_negative=True))
    DECOUPLED = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, state_formats=("fp32", "fp32"), block_size: int = DEFAULT_BLOCK,
                 expand: bool = False, min_quantized_numel: int = DEFAULT_MIN_QUANTIZED_NUMEL,
                 model: nn.Module | None = None, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
                 check_finite: bool = True):
        _check_hyper("lr", lr, 0.0)
        _check_hyper("eps", eps, 0.0)
        _check_betas(betas)
        _check_hyper("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         state_formats=state_formats, block_size=block_size, expand=expand,
                         min_quantized_numel=min_quantized_numel, model=model, chunk_blocks=chunk_blocks,
                         check_finite=check_finite)

    def update_chunk(self, group, param, grad, states, step):
        exp_avg, exp_avg_sq = states
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if wd != 0:
            if self.DECOUPLED:
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param, alpha=wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # m̂ / (√v̂ + eps) with the bias corrections 1 - β^t folded into the step size and the denominator
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(Adam):
    """AdamW (decoupled weight decay: p ← p·(1 - lr·wd) before the Adam update), as torch.optim.AdamW.

    Same arguments as `Adam`; weight_decay defaults to 0.01 as torch's.
    """

    DECOUPLED = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **options):
        super().__init__(params, lr, betas, eps, weight_decay, **options)


class SGD(BlockwiseOptimizer):
    """SGD with (optionally Nesterov) momentum held in a low-precision buffer, as torch.optim.SGD.

    Args:
        params: parameters or parameter groups.
        lr, momentum, dampening, weight_decay, nesterov: as torch.optim.SGD (momentum > 0: the buffer is the state).
        state_formats: the momentum buffer's format.
        block_size, expand, min_quantized_numel, model, chunk_blocks, check_finite: see BlockwiseOptimizer.
    """

    STATES = (StateSpec("momentum_buffer"),)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, state_formats="fp32",
                 block_size: int = DEFAULT_BLOCK, expand: bool = False,
                 min_quantized_numel: int = DEFAULT_MIN_QUANTIZED_NUMEL, model: nn.Module | None = None,
                 chunk_blocks: int = DEFAULT_CHUNK_BLOCKS, check_finite: bool = True):
        _check_hyper("lr", lr, 0.0)
        _check_hyper("weight_decay", weight_decay, 0.0)
        if not momentum > 0:
            raise ValueError(f"momentum must be > 0 (plain SGD has no state to store), got {momentum!r}")
        if nesterov and dampening != 0:
            raise ValueError("nesterov momentum requires dampening = 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov),
                         state_formats=state_formats, block_size=block_size, expand=expand,
                         min_quantized_numel=min_quantized_numel, model=model, chunk_blocks=chunk_blocks,
                         check_finite=check_finite)

    def update_chunk(self, group, param, grad, states, step):
        (buf,) = states
        momentum, wd = group["momentum"], group["weight_decay"]
        if wd != 0:
            grad = grad.add(param, alpha=wd)
        if step == 1:
            buf.copy_(grad)  # torch starts the buffer at the first gradient
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
        direction = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
        param.add_(direction, alpha=-group["lr"])


class Lion(BlockwiseOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2):
    c = β1·m + (1-β1)·g;  p ← p·(1 - lr·wd) - lr·sign(c);  m ← β2·m + (1-β2)·g.

    Args:
        params: parameters or parameter groups.
        lr, betas, weight_decay: the paper's (decoupled weight decay).
        state_formats: the momentum's format.
        block_size, expand, min_quantized_numel, model, chunk_blocks, check_finite: see BlockwiseOptimizer.
    """

    STATES = (StateSpec("exp_avg"),)

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, state_formats="fp32", block_size: int = DEFAULT_BLOCK,
                 expand: bool = False, min_quantized_numel: int = DEFAULT_MIN_QUANTIZED_NUMEL,
                 model: nn.Module | None = None, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
                 check_finite: bool = True):
        _check_hyper("lr", lr, 0.0)
        _check_betas(betas)
        _check_hyper("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay),
                         state_formats=state_formats, block_size=block_size, expand=expand,
                         min_quantized_numel=min_quantized_numel, model=model, chunk_blocks=chunk_blocks,
                         check_finite=check_finite)

    def update_chunk(self, group, param, grad, states, step):
        (exp_avg,) = states
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        param.mul_(1 - lr * wd)
        param.add_(exp_avg.lerp(grad, 1 - beta1).sign_(), alpha=-lr)
        exp_avg.lerp_(grad, 1 - beta2)
