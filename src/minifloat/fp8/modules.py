"""FP8 modules and the switches around them: `Fp8Linear`, `convert(model, ...)` and `autocast(...)`."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from typing import Iterator

import torch
from torch import nn

from minifloat.fp8.autograd import Fp8LinearFunction, LayerCaster, recording_linear
from minifloat.fp8.gemm import BACKENDS
from minifloat.fp8.recipes import DelayedScaling, Recipe, check_recipe
from minifloat.fp8.scaling import ScalingState

log = logging.getLogger("minifloat")

@dataclasses.dataclass(frozen=True)
class _AutocastState:
    recipe: Recipe | None = None
    enabled: bool = True
    calibrating: bool = False
    backend: str | None = None


_STATE: contextvars.ContextVar[_AutocastState] = contextvars.ContextVar("minifloat_autocast", default=_AutocastState())


@contextlib.contextmanager
def autocast(*, recipe: Recipe | None = None, enabled: bool = True, calibrating: bool = False,
             backend: str | None = None) -> Iterator[None]:
    """Switch FP8 on or off, or change its recipe, for the Fp8Linear layers run inside the block.

    Args:
        recipe: overrides each layer's own recipe (None keeps them).
        enabled: False runs every Fp8Linear in high precision (as nn.Linear, under any torch.autocast in force).
        calibrating: run in high precision but record amax statistics of inputs, weights and output gradients,
            so that FP8 scales are current when FP8 is switched (back) on.
        backend: GEMM backend, "auto", "native" or "emulated" (None keeps the layers' own).
    """
    if recipe is not None:
        check_recipe(recipe)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(enabled, bool) or not isinstance(calibrating, bool):
        raise ValueError(f"enabled and calibrating must be bools, got {enabled!r}, {calibrating!r}")
    token = _STATE.set(_AutocastState(recipe, enabled, calibrating, backend))
    try:
        yield
    finally:
        _STATE.reset(token)


def current_autocast() -> _AutocastState:
    """The FP8 autocast state in force here (recipe override, enabled, calibrating, backend)."""
    return _STATE.get()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Fp8Linear(nn.Linear):
    """nn.Linear whose three GEMMs (fprop, dgrad, wgrad) run in FP8 under a scaling recipe.

    Parameters keep their dtype (FP32 master weights stay FP32); the bias is added in high precision; the input is
    saved for backward in FP8. Scaling state (amax history, scales) lives in the `fp8_state` buffers and so in
    `state_dict`.

    Args:
        in_features, out_features, bias, device, dtype: as nn.Linear.
        recipe: DelayedScaling, CurrentScaling, BlockScaling or MXScaling (default DelayedScaling()).
        backend: GEMM backend ("auto", "native", "emulated"); None means auto / $MINIFLOAT_GEMM_BACKEND.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | None = None, backend: str | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = check_recipe(recipe if recipe is not None else DelayedScaling())
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.fp8_state = ScalingState(self.recipe.history_len, device=self.weight.device)
        self.fp8_name = ""

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: Recipe | None = None, backend: str | None = None,
                    name: str = "") -> "Fp8Linear":
        """An Fp8Linear sharing `linear`'s parameters (the same Parameter objects, so optimizers keep them)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                      dtype=linear.weight.dtype, recipe=recipe, backend=backend)
        new.weight = linear.weight
        new.bias = linear.bias
        new.fp8_state = ScalingState(new.fp8_state.history_len, device=linear.weight.device)
        new.fp8_name = name
        new.train(linear.training)
        return new

    def _caster(self, state: _AutocastState) -> LayerCaster:
        recipe = state.recipe if state.recipe is not None else self.recipe
        backend = state.backend if state.backend is not None else self.backend
        return LayerCaster(recipe, self.fp8_state, self.fp8_name, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = _STATE.get()
        if not state.enabled or x.numel() == 0:
            return super().forward(x)
        caster = self._caster(state)
        training_step = self.training and torch.is_grad_enabled()
        caster.recording = training_step or state.calibrating
        if caster.recording:
            caster.begin_step()
        if state.calibrating:
            return recording_linear(x, self.weight, self.bias, caster)
        return Fp8LinearFunction.apply(x, self.weight, self.bias, caster, _compute_dtype(x))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
