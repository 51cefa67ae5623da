"""Why a training step was skipped: one enum for the loss scaler (minifloat.amp.scaler) and the step guard
(minifloat.safety.guards), so a log or a checkpoint names a reason the same way whichever decided."""

from __future__ import annotations

import enum


class SkipReason(str, enum.Enum):
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"  # the loss scaler's only reason: an inf/NaN gradient after unscaling
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"
