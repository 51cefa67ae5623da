"""The loss scaler's kernel: divide gradients by the loss scale in place and flag any inf/NaN, in one pass.

torch._amp_foreach_non_finite_check_and_unscale_ (GradScaler's kernel) does it for the gradient dtypes and devices
it knows; anything else (another device, a float8 gradient) takes `check_and_unscale_fallback`, which keeps the
same contract. tests/test_scaler.py checks the two against each other on CPU.
"""

from __future__ import annotations

from collections import defaultdict

import torch

# gradient dtypes and devices torch._amp_foreach_non_finite_check_and_unscale_ handles
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DEVICES = ("cpu", "cuda")


def check_and_unscale_fallback(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Same contract as torch._amp_foreach_non_finite_check_and_unscale_: set found_inf to 1 if any element is
    inf/NaN, and multiply every gradient in place by inv_scale in float32 (one rounding back to the grad's dtype)."""
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
        if inv_scale.item() != 1.0:
            g.copy_(g.float() * inv_scale)


def check_and_unscale_(grads: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Unscale `grads` (all on one device) in place in fp32 math; returns a float32 flag on their device, 1.0 if
    any was non-finite.

    Like GradScaler, fp32(1 / float64(scale)) is the multiplier: a float32 reciprocal can be off by an ulp.
    """
    found_inf = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    inv = torch.full((), inv_scale, dtype=torch.float32, device=grads[0].device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_dtype[g.dtype].append(g)
    for dtype, group in by_dtype.items():
        if dtype in KERNEL_DTYPES and group[0].device.type in KERNEL_DEVICES:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv)
        else:
            check_and_unscale_fallback(group, found_inf, inv)
    return found_inf


def grad_values(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient tensor to check and unscale (a sparse gradient's values, coalesced first as GradScaler does:
    duplicate indices of a scaled fp16 gradient may overflow only once summed); None without a gradient."""
    if param.grad is None:
        return None
    if param.grad.is_sparse:
        if param.grad.dtype == torch.float16:
            param.grad = param.grad.coalesce()
        return param.grad._values()
    return param.grad


def grad_param_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's parameter groups holding the tensors whose .grad its next step reads. For a wrapper that
    steps stand-ins (fp32 masters, fp32 temporaries: MasterWeightOptimizer, LowPrecisionWeightOptimizer) those are
    the model's parameters (`model_param_groups()`); its own groups hold the stand-ins, which get their gradients
    only inside `step`. Unscaling, clipping and non-finite checks walk these."""
    model_groups = getattr(optimizer, "model_param_groups", None)
    return model_groups() if callable(model_groups) else optimizer.param_groups
