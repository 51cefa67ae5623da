"""FP8 ↔ BF16 shadow check: compare FP8 against a BF16 reference every N steps and fall back when FP8 goes wrong.

    shadow = ShadowCheck(ShadowConfig(interval=50, threshold=0.05, patience=3, recover_after=5))
    for step, batch in enumerate(loader):
        event = shadow.maybe_check(step, model, loss_fn, batch)       # None, or a ShadowEvent when the mode switched
        with torch.autocast("cpu", dtype=torch.bfloat16), shadow.context(step):
            loss = loss_fn(model(batch), batch)
        loss.backward(); opt.step(); opt.zero_grad()

A check runs the batch twice from the same weights, with the same RNG state (dropout masks agree): once with FP8 on
and once with `mf.autocast(enabled=False)` (Fp8Linear layers as plain linears), both under torch.autocast in the
reference dtype (bf16). It is unhealthy when the relative loss difference |L_fp8 − L_ref| / |L_ref| exceeds
`threshold` (a non-finite FP8 loss counts as infinitely different), or, with `grad_cosine_min`, when the cosine of
the two gradients falls below it. `patience` unhealthy checks in a row switch the run to BF16; while in BF16 the
steps run under `mf.autocast(calibrating=True)`, so amax histories and delayed scales stay current, and the checks go
on; `recover_after` healthy checks in a row switch back to FP8. The check leaves the model as found: no `.grad` is
written (torch.autograd.grad) and buffers (scaling state, batch-norm statistics) are restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
from typing import Callable, Iterator

import torch
from torch import nn

from minifloat.core.batch import call_model
from minifloat.core.rng import restoring_rng, set_rng_state
from minifloat.core.snapshot import restoring_buffers
from minifloat.core.validate import check_choice, check_int, check_number
from minifloat.fp8.modules import autocast, current_autocast

log = logging.getLogger("minifloat")

_REFERENCE_DTYPES = ("bfloat16", "float16", "float32")
_TINY_LOSS = 1e-12  # floor of |L_ref| in the relative difference, so a zero reference loss does not divide by zero


class Mode(str, enum.Enum):
    FP8 = "fp8"
    BF16 = "bf16"  # high-precision fallback (the reference dtype), FP8 scales kept current by calibration


@dataclasses.dataclass(frozen=True)
class ShadowConfig:
    """When and how FP8 is checked against the BF16 reference.

    Attributes:
        interval: check every `interval` steps (steps where step % interval == 0).
        threshold: largest healthy relative loss difference |L_fp8 - L_ref| / |L_ref|.
        patience: unhealthy checks in a row that switch FP8 -> BF16.
        recover_after: healthy checks in a row that switch BF16 -> FP8.
        grad_cosine_min: if set, a check is also unhealthy when cos(grad_fp8, grad_ref) < this (costs two backwards).
        reference_dtype: torch.autocast dtype of both passes ("bfloat16", "float16" or "float32" = no autocast).
    """

    interval: int = 100
    threshold: float = 0.05
    patience: int = 3
    recover_after: int = 5
    grad_cosine_min: float | None = None
    reference_dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("interval", "patience", "recover_after"):
            check_int(name, getattr(self, name), low=1)
        check_number("threshold", self.threshold, low=0.0, low_open=True)
        check_number("grad_cosine_min", self.grad_cosine_min, low=-1.0, high=1.0, allow_none=True)
        check_choice("reference_dtype", self.reference_dtype, _REFERENCE_DTYPES)


@dataclasses.dataclass
class CheckResult:
    step: int
    mode: str  # the mode the run was in when checked
    fp8_loss: float
    ref_loss: float
    rel_diff: float
    grad_cosine: float | None
    healthy: bool | None  # None: the reference itself was not finite, the check decides nothing


@dataclasses.dataclass
class ShadowEvent:
    """A switch between FP8 and BF16, with the check that triggered it."""

    step: int
    switched_to: str  # "fp8" or "bf16"
    reason: str
    streak: int  # the consecutive (un)healthy checks that caused it
    check: CheckResult


def grad_cosine(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """Cosine of two gradient lists flattened into one vector each (None = zero), accumulated in float64 (sums of
    squares over millions of elements lose digits in fp32)."""
    dot = na = nb = torch.zeros((), dtype=torch.float64)
    for x, y in zip(a, b):
        if x is None or y is None:
            na = na + (0 if x is None else x.double().square().sum())
            nb = nb + (0 if y is None else y.double().square().sum())
            continue
        x, y = x.double(), y.double()
        dot, na, nb = dot + (x * y).sum(), na + x.square().sum(), nb + y.square().sum()
    denom = (na * nb).sqrt()
    return float(dot / denom) if denom > 0 else math.nan


class ShadowCheck:
    """Runs the shadow check and holds the FP8/BF16 mode of a run (see module docstring)."""

    def __init__(self, config: ShadowConfig | None = None):
        self.config = config if config is not None else ShadowConfig()
        if not isinstance(self.config, ShadowConfig):
            raise ValueError(f"config must be a ShadowConfig, got {self.config!r}")
        self.mode = Mode.FP8
        self.streak = 0  # unhealthy checks in a row (in FP8) or healthy checks in a row (in BF16)
        self.checks: list[CheckResult] = []
        self.events: list[ShadowEvent] = []

    @contextlib.contextmanager
    def context(self, step: int | None = None) -> Iterator[Mode]:
        """The minifloat context for a training step: FP8 as configured, or BF16 with calibration. Yields the mode.

        Enter it inside the step's torch.autocast; an enclosing mf.autocast's recipe and backend are kept.
        """
        if self.mode == Mode.FP8:
            yield self.mode
            return
        outer = current_autocast()
        log.debug("minifloat.safety.shadow: step %s runs in BF16 (calibrating)", step)
        with autocast(recipe=outer.recipe, backend=outer.backend, calibrating=True):
            yield self.mode

    def _autocast(self, device_type: str):
        dtype = getattr(torch, self.config.reference_dtype)
        return torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)

    def _loss_and_grads(self, model: nn.Module, loss_fn: Callable, batch, fp8: bool, params: list[nn.Parameter]):
        outer = current_autocast()
        with autocast(recipe=outer.recipe, backend=outer.backend, enabled=fp8), self._autocast(params[0].device.type):
            loss = loss_fn(call_model(model, batch), batch)
        if self.config.grad_cosine_min is None:
            return loss.detach().float(), None
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.detach().float(), grads

    def run_check(self, step: int, model: nn.Module, loss_fn: Callable, batch) -> CheckResult:
        """Compare the FP8 and reference losses (and gradients) of `batch` at the current weights."""
        params = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
        need_grad = self.config.grad_cosine_min is not None
        # grad enabled, as in a training step: Fp8Linear then first turns the recorded amaxes into delayed scales,
        # so the FP8 pass uses the scales the next FP8 step would use (not the previous step's); buffers and RNG
        # are restored afterwards
        with restoring_buffers(model), restoring_rng() as start, torch.enable_grad():
            fp8_loss, fp8_grads = self._loss_and_grads(model, loss_fn, batch, True, params)
            set_rng_state(start)  # same dropout masks for the reference
            ref_loss, ref_grads = self._loss_and_grads(model, loss_fn, batch, False, params)
        fp8_v, ref_v = float(fp8_loss), float(ref_loss)
        if not math.isfinite(ref_v):
            rel, healthy = math.nan, None
        else:
            rel = abs(fp8_v - ref_v) / max(abs(ref_v), _TINY_LOSS) if math.isfinite(fp8_v) else math.inf
            healthy = rel <= self.config.threshold
        cos = grad_cosine(fp8_grads, ref_grads) if need_grad else None
        if cos is not None and healthy and not cos >= self.config.grad_cosine_min:  # NaN cosine is unhealthy
            healthy = False
        return CheckResult(step, self.mode.value, fp8_v, ref_v, rel, cos, healthy)

    def maybe_check(self, step: int, model: nn.Module, loss_fn: Callable, batch) -> ShadowEvent | None:
        """On check steps, run the check and update the mode.

        Args:
            step: the training step (checked when step % interval == 0).
            model: the model; `loss_fn(model_output, batch)` gives the loss, the model is called as in
                minifloat.core.batch.call_model (tensor: model(batch), tuple: model(*batch), mapping: model(**batch)).
        Returns:
            The ShadowEvent if this check switched the mode, else None.
        """
        if step % self.config.interval:
            return None
        result = self.run_check(step, model, loss_fn, batch)
        self.checks.append(result)
        if result.healthy is None:
            log.warning("minifloat.safety.shadow: step %d: the reference loss is %s; check inconclusive", step,
                        result.ref_loss)
            return None
        if self.mode == Mode.FP8:
            self.streak = 0 if result.healthy else self.streak + 1
            if self.streak >= self.config.patience:
                return self._switch(Mode.BF16, result, "unhealthy")
        else:
            self.streak = self.streak + 1 if result.healthy else 0
            if self.streak >= self.config.recover_after:
                return self._switch(Mode.FP8, result, "healthy")
        return None

    def state_dict(self) -> dict:
        """Mode, streak and the switches so far, as plain data (JSON values) for checkpoints; `checks` is not part."""
        return {"mode": self.mode.value, "streak": self.streak,
                "events": [dataclasses.asdict(e) for e in self.events]}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; the config is not part of it (the run supplies its own)."""
        if not isinstance(state, dict) or set(state) != {"mode", "streak", "events"}:
            raise ValueError(f"state must be a dict with exactly the keys 'events', 'mode' and 'streak', got "
                             f"{sorted(state) if isinstance(state, dict) else state!r}")
        check_choice("mode", state["mode"], [m.value for m in Mode])
        streak = state["streak"]
        check_int("streak", streak, low=0)
        if not isinstance(state["events"], list):
            raise ValueError(f"events must be a list of ShadowEvent dicts, got {state['events']!r}")
        events = [ShadowEvent(**{**e, "check": CheckResult(**e["check"])}) for e in state["events"]]
        self.mode, self.streak, self.events = Mode(state["mode"]), streak, events

    def _switch(self, to: Mode, result: CheckResult, kind: str) -> ShadowEvent:
        cos = "" if result.grad_cosine is None else f", grad cosine {result.grad_cosine:.4f}"
        reason = (f"{self.streak} {kind} check(s) in a row; last: relative loss difference {result.rel_diff:.3g} "
                  f"(threshold {self.config.threshold:g}), fp8 loss {result.fp8_loss:.6g}, "
                  f"{self.config.reference_dtype} loss {result.ref_loss:.6g}{cos}")
        event = ShadowEvent(result.step, to.value, reason, self.streak, result)
        log.warning("minifloat.safety.shadow: step %d: switching %s -> %s: %s", result.step, self.mode.value, to.value,
                    reason)
        self.mode, self.streak = to, 0
        self.events.append(event)
        return event
