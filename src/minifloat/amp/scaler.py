"""Dynamic loss scaling for FP16 training, and a no-op with the same API for BF16 and FP32.

FP16 has 5 exponent bits: gradients below 2^-24 flush to zero and values above 65504 overflow. Multiplying the loss
by a scale S before `backward()` shifts every gradient up by S (chain rule), out of the underflow range; the
gradients are divided by S again before the optimizer sees them. S is chosen dynamically:

    overflow (any inf/NaN gradient)   skip the optimizer step; after `hysteresis` such steps S <- S * backoff_factor
                                      (with `model` given, an FP8 backward cast that met inf/NaN counts too: it
                                      saturates, so the gradients it feeds stay finite)
    growth_interval finite steps      S <- S * growth_factor

With hysteresis=1 this is exactly torch.amp.GradScaler's rule (scale kept in float32, same update order), so
`LossScaler` can replace GradScaler in a training loop: scale(loss), unscale_(optimizer), step(optimizer), update().
Unlike GradScaler, `step` returns a `StepRecord` saying whether the optimizer stepped and which parameters held
non-finite gradients, and a skipped step is logged.

A disabled scaler (BF16 / FP32, whose exponent range makes scaling unnecessary) multiplies nothing and always steps,
so a training loop needs no precision `if`s. It still checks the gradients and reports non-finite ones in the record
(with a warning) — it does not skip: deciding to skip a bad step in BF16/FP32 belongs to the guards, not to loss
scaling.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from minifloat.amp.unscale import check_and_unscale_, grad_param_groups, grad_values
from minifloat.core.skip import SkipReason
from minifloat.core.validate import check_bool, check_int, check_number
from minifloat.fp8.recipes import Role
from minifloat.fp8.nonfinite import NonfiniteWatch
from minifloat.fp8.scaling import ROLE_INDEX
from minifloat.numerics.formats import NumberFormat

log = logging.getLogger("minifloat")

_FP32_MAX = torch.finfo(torch.float32).max
_MAX_NAMES_LOGGED = 8


class _Stage(str, enum.Enum):
    """Where an optimizer is within one iteration (GradScaler's OptState)."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What `LossScaler.step` did for one optimizer.

    Attributes:
        stepped: whether `optimizer.step()` ran.
        scale: the loss scale the gradients of this step were computed with (1.0 when disabled).
        reason: why the step was skipped (a `SkipReason` value), None if it was not.
        nonfinite_params: names of the parameters whose gradients held inf or NaN (also filled by a disabled
            scaler, which steps anyway).
    """

    stepped: bool
    scale: float
    reason: str | None = None
    nonfinite_params: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ScalerConfig:
    """Validated options of a `LossScaler` (see `LossScaler` for their meaning)."""

    enabled: bool = True
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self):
        check_bool("enabled", self.enabled)
        for field in ("init_scale", "min_scale", "max_scale"):
            check_number(field, getattr(self, field), low=0.0, high=_FP32_MAX, low_open=True)
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale must be <= max_scale ({self.max_scale!r}), got {self.min_scale!r}")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"init_scale must lie in [min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}], "
                f"got {self.init_scale!r}"
            )
        check_number("growth_factor", self.growth_factor, low=1.0, low_open=True)
        check_number("backoff_factor", self.backoff_factor, low=0.0, high=1.0, low_open=True, high_open=True)
        for field in ("growth_interval", "hysteresis"):
            check_int(field, getattr(self, field), low=1)


def _fp32(x: float) -> float:
    """Round to the nearest float32, as GradScaler's float32 scale tensor does after each multiply."""
    return torch.tensor(x, dtype=torch.float32).item()


def _apply(outputs, fn):
    """Apply fn to a tensor or to every tensor of a (nested) list, tuple or iterable, keeping the container type."""
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_apply(o, fn) for o in outputs)
    if isinstance(outputs, Iterable):
        return map(lambda o: _apply(o, fn), outputs)
    raise ValueError(f"outputs must be a tensor or an iterable of tensors, got {type(outputs).__name__}")


class LossScaler:
    """Dynamic loss scaler with torch.amp.GradScaler's API, hysteresis, scale bounds and per-step records.

    Usage (the same loop for FP16, BF16 and FP32)::

        scaler = LossScaler.for_dtype(torch.float16, model=model)
        for batch in data:
            scaler.scale(loss_fn(model, batch)).backward()
            scaler.unscale_(opt)                        # optional: only to clip or inspect the true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            record = scaler.step(opt)                   # StepRecord: stepped? why not? which parameters?
            scaler.update()
            opt.zero_grad()

    Args:
        enabled: False makes scale/unscale_ no-ops and step() always step (BF16 / FP32 training).
        init_scale: the first loss scale.
        growth_factor: multiplier (> 1) applied after `growth_interval` consecutive finite steps.
        backoff_factor: multiplier in (0, 1) applied when the hysteresis budget is spent.
        growth_interval: consecutive finite steps before the scale grows.
        hysteresis: overflowing steps tolerated before the scale backs off (Megatron-LM); 1 backs off on every one,
            as GradScaler does.
        min_scale, max_scale: bounds on the scale (GradScaler has none; the defaults are only reached after 16
            consecutive back-offs or 8 growths from the default init_scale).
        model: names parameters in records (from `model.named_parameters()`), and lets the scaler see FP8
            backward casts of the model that met inf/NaN (an overflow the saturating cast hides from the gradients).
        param_names: {name: parameter} for parameters of no `model` (e.g. `dict(model.named_parameters())`).
            Parameters of neither are named "group{g}.param{i}" after their place in the optimizer.
    """

    def __init__(self, *, enabled: bool = True, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1, min_scale: float = 1.0,
                 max_scale: float = 2.0**24, model: nn.Module | None = None,
                 param_names: Mapping[str, torch.Tensor] | None = None):
        self.config = ScalerConfig(
            enabled=enabled, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
        )
        self._scale = _fp32(init_scale)
        self._growth_tracker = 0  # consecutive finite steps since the last growth or overflow
        self._hysteresis_tracker = hysteresis  # overflows left before the next back-off
        # id(parameter) -> name. Ids, not parameters, so the scaler keeps no model alive; a parameter freed and
        # replaced by a new one at the same address would inherit its name.
        self._names: dict[int, str] = {}
        named = list(model.named_parameters()) if model is not None else []
        named += list((param_names or {}).items())
        for name, p in named:
            self._names.setdefault(id(p), name)
        self._opt_states: dict[int, dict[str, Any]] = defaultdict(self._fresh_state)
        self._fp8_watch = NonfiniteWatch(model) if model is not None else None  # overflows in FP8 backward casts
        self._watching = False  # marked at this iteration's first scale()

    @staticmethod
    def _fresh_state() -> dict[str, Any]:
        return {"stage": _Stage.READY, "found_inf": None}

    @classmethod
    def for_dtype(cls, dtype: torch.dtype | NumberFormat, **kwargs) -> LossScaler:
        """A scaler enabled for float16 and disabled (a no-op) for bfloat16 and float32.

        Args:
            dtype: the training (gradient) dtype, as a torch dtype or a minifloat format (mf.FP16, ...).
            **kwargs: further `LossScaler` options.

        Returns:
            The scaler.
        """
        torch_dtype = dtype.torch_dtype if isinstance(dtype, NumberFormat) else dtype
        if torch_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")
        return cls(enabled=torch_dtype == torch.float16, **kwargs)

    # ------------------------------------------------------------------------------------------------ GradScaler API

    def is_enabled(self) -> bool:
        return self.config.enabled

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled, as GradScaler)."""
        return self._scale if self.config.enabled else 1.0

    def scale(self, outputs):
        """Multiply a loss (or a nested list/tuple/iterable of losses) by the scale.

        The scale is a float32 0-d tensor, so a 0-d fp16 loss becomes an fp32 scaled loss (type promotion of two
        0-d tensors) and cannot overflow fp16 here; a batched fp16 output stays fp16, as with GradScaler.

        Args:
            outputs: tensor or iterable of tensors.

        Returns:
            The scaled outputs, in the same container type; `outputs` itself when disabled.
        """
        if not self.config.enabled:
            return outputs
        if self._fp8_watch is not None and not self._watching:
            self._fp8_watch.mark()
            self._fp8_watch.save_amaxes()  # after the forward: a skipped step drops only its backward's amaxes
            self._watching = True
        return _apply(outputs, lambda t: t * torch.full((), self._scale, dtype=torch.float32, device=t.device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any is inf/NaN.

        Call it at most once per optimizer between `update()`s, after all gradients are accumulated, e.g. before
        `clip_grad_norm_`; `step` calls it when you did not. No-op when disabled.

        fp16 gradients are accepted (GradScaler refuses them) and unscaled in fp32 math with one rounding back to
        fp16, so unscaled values below 2^-24 flush to zero: keep fp32 master gradients where small ones matter.
        """
        if not self.config.enabled:
            return
        state = self._opt_states[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["found_inf"] = self._check(optimizer, 1.0 / self._scale)  # 1/scale in float64, as GradScaler
        state["stage"] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs) -> StepRecord:
        """Unscale (if not done yet) and call `optimizer.step(*args, **kwargs)` unless a gradient is inf/NaN.

        Each optimizer is judged on its own gradients (as GradScaler): with two optimizers, one may step while the
        other skips; the scale backs off in `update()` if any skipped. A skipped step leaves parameters and
        optimizer state untouched and logs a warning.

        Returns:
            A `StepRecord`.
        """
        if not self.config.enabled:
            found_inf = self._check(optimizer)
            names = self._nonfinite_names(optimizer) if found_inf.item() else ()
            if names:
                log.warning(
                    "LossScaler (disabled): non-finite gradients in %s; stepping anyway (skipping is the guards' job)",
                    _short(names),
                )
            optimizer.step(*args, **kwargs)
            return StepRecord(stepped=True, scale=1.0, nonfinite_params=names)

        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported by an enabled LossScaler (nor by GradScaler).")
        state = self._opt_states[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the last update().")
        if not any(p.grad is not None for group in grad_param_groups(optimizer) for p in group["params"]):
            raise RuntimeError("LossScaler.step: no parameter of this optimizer has a gradient (GradScaler: 'No inf "
                               "checks were recorded for this optimizer'); call scaler.scale(loss).backward() first")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        state["stage"] = _Stage.STEPPED
        if not state["found_inf"].item():
            optimizer.step(*args, **kwargs)
            return StepRecord(stepped=True, scale=self._scale)
        names = self._nonfinite_names(optimizer)
        if self._fp8_watch is not None:
            self._fp8_watch.restore_amaxes()
        log.warning(
            "LossScaler: skipped optimizer step at scale %g: non-finite gradients in %s", self._scale, _short(names)
        )
        return StepRecord(
            stepped=False, scale=self._scale, reason=SkipReason.NONFINITE_GRAD.value, nonfinite_params=names
        )

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's inf/NaN checks (of every optimizer) and start a new iteration.

        Rule (Megatron-LM's DynamicGradScaler.update, megatron/core/optimizer/grad_scaler.py; with hysteresis=1 it
        is torch._amp_update_scale_):
          * an overflow in any optimizer: growth tracker <- 0, hysteresis tracker -= 1, and if that tracker is <= 0
            the scale backs off. The hysteresis tracker is not reset by the back-off nor by a single finite step,
            so once the budget is spent every further overflow backs off.
          * a finite iteration: growth tracker += 1; on reaching growth_interval the scale grows, the growth tracker
            returns to 0 and the hysteresis tracker to `hysteresis`.
        Products are rounded to float32 (GradScaler's scale tensor) and then clamped to [min_scale, max_scale].

        Args:
            new_scale: set the scale to this value instead (trackers unchanged), as GradScaler.update(new_scale).
        """
        if not self.config.enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            if not self.config.min_scale <= value <= self.config.max_scale:
                raise ValueError(
                    f"new_scale must lie in [min_scale, max_scale] = [{self.config.min_scale!r}, "
                    f"{self.config.max_scale!r}], got {new_scale!r}"
                )
            self._scale = _fp32(value)
        else:
            found = [s["found_inf"] for s in self._opt_states.values() if s["found_inf"] is not None]
            if not found:
                raise RuntimeError("update() called before any unscale_() or step() in this iteration.")
            if any(f.item() for f in found):
                self._growth_tracker = 0
                self._hysteresis_tracker -= 1
                if self._hysteresis_tracker <= 0:
                    self._scale = self._clamp(self._scale * self.config.backoff_factor)
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self.config.growth_interval:
                    self._growth_tracker = 0
                    self._hysteresis_tracker = self.config.hysteresis
                    self._scale = self._clamp(self._scale * self.config.growth_factor)
        self._opt_states = defaultdict(self._fresh_state)
        self._watching = False

    def state_dict(self) -> dict[str, Any]:
        """Scale, trackers and options as plain Python numbers; GradScaler's five keys plus four of ours.

        Empty when disabled (as GradScaler). Call it after `update()`.
        """
        if not self.config.enabled:
            return {}
        c = self.config
        return {
            "scale": self._scale,
            "growth_factor": c.growth_factor,
            "backoff_factor": c.backoff_factor,
            "growth_interval": c.growth_interval,
            "_growth_tracker": self._growth_tracker,
            "hysteresis": c.hysteresis,
            "_hysteresis_tracker": self._hysteresis_tracker,
            "min_scale": c.min_scale,
            "max_scale": c.max_scale,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output, or a torch.amp.GradScaler state dict (our extra keys keep this scaler's
        values, the hysteresis tracker starts full). Options in the dict replace this scaler's, as in GradScaler.
        No-op when disabled."""
        if not self.config.enabled:
            return
        if not state_dict:
            raise RuntimeError("The state dict is empty, possibly because it was saved from a disabled scaler.")
        c = self.config
        get = state_dict.get
        low, high, scale = float(get("min_scale", c.min_scale)), float(get("max_scale", c.max_scale)), \
            float(state_dict["scale"])
        if not low <= scale <= high:  # a torch.amp.GradScaler's scale is unbounded
            bound = "max_scale" if scale > high else "min_scale"
            fix = f"2.0**{math.ceil(math.log2(scale))}" if scale > high else f"{scale:g}"
            raise ValueError(f"the loaded scale {scale:g} lies outside this LossScaler's [min_scale, max_scale] = "
                             f"[{low:g}, {high:g}] (a torch.amp.GradScaler's scale has no bounds): build it with "
                             f"{bound}={fix} or beyond")
        self.config = dataclasses.replace(
            c,
            init_scale=float(state_dict["scale"]),
            growth_factor=float(state_dict["growth_factor"]),
            backoff_factor=float(state_dict["backoff_factor"]),
            growth_interval=int(state_dict["growth_interval"]),
            hysteresis=int(get("hysteresis", c.hysteresis)),
            min_scale=float(get("min_scale", c.min_scale)),
            max_scale=float(get("max_scale", c.max_scale)),
        )
        self._scale = _fp32(self.config.init_scale)
        self._growth_tracker = int(state_dict["_growth_tracker"])
        self._hysteresis_tracker = int(get("_hysteresis_tracker", self.config.hysteresis))

    # ------------------------------------------------------------------------------------------------ internals

    def _clamp(self, scale: float) -> float:
        return _fp32(min(max(_fp32(scale), self.config.min_scale), self.config.max_scale))

    def _check(self, optimizer: torch.optim.Optimizer, inv_scale: float = 1.0) -> torch.Tensor:
        """Unscale the optimizer's gradients by inv_scale; a float32 flag, 1.0 if any is inf/NaN.

        The default inv_scale=1 only checks, as GradScaler's own inf check does.
        """
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in grad_param_groups(optimizer):
                for p in group["params"]:
                    g = grad_values(p)
                    if g is not None:
                        by_device[g.device].append(g)
            flags = [check_and_unscale_(grads, inv_scale) for grads in by_device.values()]
            if self._watching:  # an output gradient that overflowed into an FP8 cast (saturated there)
                flags.append((self._fp8_watch.rises()[:, ROLE_INDEX[Role.GRAD_OUTPUT]] > 0).any().float())
        if not flags:
            return torch.zeros((), dtype=torch.float32)
        return sum(f.cpu() for f in flags) if len(flags) > 1 else flags[0]

    def _nonfinite_names(self, optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
        """Names of the optimizer's parameters with an inf/NaN gradient (the slow path, after an overflow)."""
        names = []
        for g_idx, group in enumerate(grad_param_groups(optimizer)):
            for p_idx, p in enumerate(group["params"]):
                g = grad_values(p)
                if g is not None and not torch.isfinite(g).all():
                    names.append(self._names.get(id(p), f"group{g_idx}.param{p_idx}"))
        return tuple(names)


def _short(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_LOGGED])
    more = len(names) - _MAX_NAMES_LOGGED
    return shown + (f" (+{more} more)" if more > 0 else "") if names else "(no gradients named)"
