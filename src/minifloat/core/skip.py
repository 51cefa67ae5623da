"""Why a training step was skipped: one enum for the loss scaler (minifloat.amp.scaler) and the step guard
(minifloat.safety.guards), so a log or a checkpoint names a reason the same way whichever decided."""

from __future__ import annotations

import enum
import logging

import torch


class SkipReason(str, enum.Enum):
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"  # the loss scaler's only reason: an inf/NaN gradient after unscaling
    # an FP8 cast (an Fp8Linear's input, weight or output gradient) met inf/NaN, which a saturating cast can hide
    # from the loss and the gradients; the guard's reason (minifloat.safety.guards.nonfinite_reason)
    NONFINITE_FP8_OPERAND = "nonfinite_fp8_operand"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"


log = logging.getLogger("minifloat")


def grads_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every tensor in `grads` is finite: one host sync (a torch optimizer would spread a NaN into the
    weights and its state)."""
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def warn_skipped(optimizer: str, skipped_steps: int) -> None:
    """Tell the user an optimizer skipped its step on a non-finite gradient (it changed nothing)."""
    log.warning("minifloat: %s skipped an optimizer step: a gradient is inf or NaN, so the weights and the "
                "optimizer's state are left as they were (%d step(s) skipped so far; `skipped_steps` counts them)",
                optimizer, skipped_steps)
