"""Why a training step was skipped: one enum for the loss scaler (minifloat.amp.scaler) and the step guard
(minifloat.safety.guards), so a log or a checkpoint names a reason the same way whichever decided."""

from __future__ import annotations

import enum


class SkipReason(str, enum.Enum):
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"  # the loss scaler's only reason: an inf/NaN gradient after unscaling
    # an FP8 cast (an Fp8Linear's input, weight or output gradient) met inf/NaN, which a saturating cast can hide
    # from the loss and the gradients; the guard's reason (minifloat.safety.guards.nonfinite_reason)
    NONFINITE_FP8_OPERAND = "nonfinite_fp8_operand"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"
