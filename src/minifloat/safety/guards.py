"""Step guards: skip a step that met a non-finite value or spikes, and roll back after a bad streak.

One object, bound to the model and optimizer, keeps a plain training loop readable:

    guard = StepGuard(model, optimizer, config=GuardConfig(rollback_after=3, snapshot_every=100))
    step, data_position = 0, 0
    while step < max_steps:
        guard.begin_step(step, data_position=data_position)  # snapshot buffers; now and then a rollback point
        x, y = get_batch(data_position)
        loss = loss_fn(model(x), y)
        loss.backward()
        report = guard.check(loss)                            # on a bad step: grads dropped, buffers restored
        if not report.skipped:
            clip_grad_norms(model, 1.0)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, data_position = report.next_step, report.next_data_position   # a rollback moves both

Non-finite steps: a step is skipped when its loss or total gradient norm is NaN/inf, or when one of its FP8 casts (an
Fp8Linear's input, weight or output gradient) met NaN/inf: FP8 casts saturate (+inf becomes +448 in E4M3), so the loss
and the gradients may stay finite, and only the layers' `nonfinite` counters, read against their value at
`begin_step` (minifloat.fp8.nonfinite.NonfiniteWatch), show it. `nonfinite_reason` names the first of these to go bad.

What a skip guarantees: parameters, optimizer state and module buffers are bitwise what they were at `begin_step`
(FP8 layers record amaxes and count non-finite ones during the bad step's forward and backward, so buffers need the
snapshot). Gradients are set to None, so even an unconditional `optimizer.step()` changes nothing.

Spike rule: a value v of a watched signal (loss, gradient norm) is a spike if v > r · the median of the last
`spike_window` accepted values, once the window holds `spike_warmup` values; skipped values never enter the window.
A ratio to a median, not mean + k·σ: a healthy gradient norm is heavy-tailed and drifts, so a z-score skipped healthy
steps (docs/policy.md, "Calibrating the spike rule"). A value above the limit for `spike_max_skips` steps in a row
is a level shift, not a spike: that step is applied and the windows restart from the streak's values (logged).
Rollback (PaLM, arXiv 2204.02311 §5.1): after `rollback_after` consecutive skipped steps, restore the last in-memory
snapshot and continue with the data after the last bad batch, so the batches between the snapshot and the streak's
end are not replayed.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import logging
import math
import statistics

import torch
from torch import nn

from minifloat.core.rng import rng_state, set_rng_state
from minifloat.core.skip import SkipReason
from minifloat.core.snapshot import buffer_snapshot, restore_buffers, state_snapshot
from minifloat.core.validate import check_bool, check_choice, check_int, check_number
from minifloat.fp8.recipes import Role
from minifloat.fp8.nonfinite import NonfiniteWatch
from minifloat.safety.words import level_shift_in_words, skip_in_words, spike_in_words

log = logging.getLogger("minifloat")

class Signal(str, enum.Enum):
    LOSS = "loss"
    GRAD_NORM = "grad_norm"


_SPIKE_REASON = {Signal.LOSS: SkipReason.LOSS_SPIKE, Signal.GRAD_NORM: SkipReason.GRAD_NORM_SPIKE}
_SIGNAL_OF = {reason: signal for signal, reason in _SPIKE_REASON.items()}
_IN_WORDS = {Signal.LOSS: "loss", Signal.GRAD_NORM: "gradient norm"}


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """What a StepGuard checks, and when it rolls back.

    Args:
        skip_nonfinite: skip steps whose loss or gradients hold NaN/inf, or in which an FP8 cast met NaN/inf.
        spike_signals: signals watched for spikes, a tuple of "loss", "grad_norm"; () turns the spike guard off.
        spike_ratio: r, a spike is more than r times the median of the window (> 1).
        spike_window: number of accepted values in the rolling window (>= 2).
        spike_warmup: values the window must hold before spikes are detected (2 <= warmup <= window).
        spike_max_skips: consecutive spike skips after which the next spiking step is taken as a level shift: it is
            applied and the windows restart from the streak's values (>= 0; 0 skips a sustained rise forever).
            Rollback, when on, counts the same streak: with rollback_after <= spike_max_skips it acts first.
        rollback_after: consecutive skipped steps that trigger a rollback; 0 turns rollback (and snapshots) off.
        snapshot_every: steps between in-memory rollback snapshots (>= 1).
        rollback_extra_skip: batches skipped after the last bad one on a rollback (>= 0).
        max_rollbacks: rollbacks allowed in a run before the guard gives up with RuntimeError (>= 1).
    """

    skip_nonfinite: bool = True
    spike_signals: tuple[Signal | str, ...] = (Signal.LOSS, Signal.GRAD_NORM)
    spike_ratio: float = 5.0  # healthy runs reach 3.3× (tiny Llama, 2,400 steps); injected spikes are 10× and more
    spike_window: int = 32  # short enough to follow the gradient norm's fall in the first 100 steps
    spike_warmup: int = 20
    spike_max_skips: int = 3
    rollback_after: int = 0
    snapshot_every: int = 100
    rollback_extra_skip: int = 0
    max_rollbacks: int = 8

    def __post_init__(self):
        check_bool("skip_nonfinite", self.skip_nonfinite)
        if not isinstance(self.spike_signals, tuple):
            raise ValueError(f"spike_signals must be a tuple, got {self.spike_signals!r}")
        for s in self.spike_signals:
            check_choice("spike_signals", s, [m.value for m in Signal])
        check_number("spike_ratio", self.spike_ratio, low=1.0, low_open=True)
        check_int("spike_window", self.spike_window, low=2)
        check_int("spike_warmup", self.spike_warmup, low=2, high=self.spike_window)
        for field, low in (("spike_max_skips", 0), ("rollback_after", 0), ("snapshot_every", 1),
                           ("rollback_extra_skip", 0), ("max_rollbacks", 1)):
            check_int(field, getattr(self, field), low=low)


@dataclasses.dataclass(frozen=True)
class RollbackEvent:
    """A rollback: training state is back at `restored_step`; continue with batch `resume_data_position`.

    `skip_batches` batches (from the snapshot's data position up to resume_data_position) are never trained on.
    """

    restored_step: int
    resume_data_position: int
    skip_batches: int


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What the guard decided about one step.

    Attributes:
        step, data_position: as given to `begin_step`.
        skipped: whether the update must not be applied (gradients are already dropped).
        reason: why it was skipped, else None.
        loss, grad_norm: the step's loss and total gradient L2 norm (before any clipping).
        bad_params: names of parameters with non-finite gradients.
        nonfinite_operands: (layer name, role) of each FP8 cast operand that held NaN/inf in a step skipped as
            non-finite (whatever the reason: the loss can be NaN because an FP8 input was).
        rollback: the rollback this step triggered, else None.
        level_shift: the step spiked after `spike_max_skips` spike skips in a row, so it was applied and the spike
            windows restarted (see GuardConfig.spike_max_skips).
        next_step, next_data_position: where the loop continues (step + 1 and data_position + 1 without rollback).
    """

    step: int
    data_position: int | None
    skipped: bool
    reason: SkipReason | None
    loss: float
    grad_norm: float
    bad_params: tuple[str, ...] = ()
    nonfinite_operands: tuple[tuple[str, Role], ...] = ()
    rollback: RollbackEvent | None = None
    level_shift: bool = False
    next_step: int = 0
    next_data_position: int | None = None


def nonfinite_reason(loss: float, grad_norm: float, operands: tuple[tuple[str, Role], ...]) -> SkipReason | None:
    """Why a step is non-finite: the first place that held NaN/inf, in the order the step computes them.

    An FP8 forward operand (input, weight) comes before the loss; in backward an FP8 output gradient comes before the
    parameter gradients, since its cast saturates an inf and the bias gradient summed from it is the symptom.

    Args:
        loss, grad_norm: the step's loss and total gradient norm.
        operands: (layer, role) of the FP8 casts that met NaN/inf (NonfiniteWatch.operands).
    Returns:
        The SkipReason, or None for a finite step.
    """
    if any(role != Role.GRAD_OUTPUT for _, role in operands):
        return SkipReason.NONFINITE_FP8_OPERAND
    if not math.isfinite(loss):
        return SkipReason.NONFINITE_LOSS
    if operands:
        return SkipReason.NONFINITE_FP8_OPERAND
    if not math.isfinite(grad_norm):
        return SkipReason.NONFINITE_GRAD
    return None


def agree_across_ranks(verdict: torch.Tensor) -> torch.Tensor:
    """[loss, grad norm, FP8 non-finite counts...] of this rank -> the same vector on every rank (one all-reduce
    over the default group when torch.distributed is initialised): the mean loss and grad norm over ranks (the
    norm is already the global one: DDP's gradients are reduced, sharded ones are made whole) and the summed counts,
    so every rank reaches the same verdict. NaN/inf on one rank reaches all."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return verdict
    torch.distributed.all_reduce(verdict)  # SUM
    verdict[:2] /= torch.distributed.get_world_size()
    return verdict


class SpikeDetector:
    """Rolling median of one signal; `is_spike(v)` is v > ratio · median once `warmup` values were accepted."""

    def __init__(self, ratio: float, window: int, warmup: int):
        self.ratio, self.warmup = ratio, warmup
        self.values: collections.deque[float] = collections.deque(maxlen=window)

    def median(self) -> float | None:
        """The window's median; None while it holds fewer than `warmup` values."""
        return statistics.median(self.values) if len(self.values) >= self.warmup else None

    def is_spike(self, value: float) -> bool:
        median = self.median()
        # a ratio to a median <= 0 says nothing (a loss that can be negative): such a signal is never a spike
        return median is not None and median > 0 and value > self.ratio * median

    def accept(self, value: float) -> None:
        self.values.append(value)

    def restart(self, values: list[float]) -> None:
        self.values.clear()
        self.values.extend(values)


@dataclasses.dataclass
class _Snapshot:
    step: int
    data_position: int
    model: dict
    optimizer: dict
    stateful: dict
    guard: dict
    rng: dict


class StepGuard:
    """Non-finite guard, spike guard and rollback for one model and optimizer (see module docstring).

    Args:
        model: the model; its parameters' gradients are checked and its buffers restored on a skip.
        optimizer: the optimizer; its state is snapshotted for rollback and its params' gradients dropped on a skip.
        config: GuardConfig (default GuardConfig()).
        stateful: further objects with state_dict()/load_state_dict() restored on rollback, by name
            (a LossScaler, an LR scheduler).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, config: GuardConfig | None = None,
                 stateful: dict[str, object] | None = None):
        self.model, self.optimizer = model, optimizer
        self.config = config if config is not None else GuardConfig()
        if not isinstance(self.config, GuardConfig):
            raise ValueError(f"config must be a GuardConfig, got {type(self.config).__name__}")
        self.stateful = dict(stateful or {})
        c = self.config
        self.detectors = {Signal(s): SpikeDetector(c.spike_ratio, c.spike_window, c.spike_warmup)
                          for s in c.spike_signals}
        self.bad_streak = 0
        self.spike_streak: list[dict[Signal, float]] = []  # watched values of the current run of spike skips
        self.num_skipped = 0
        self.num_level_shifts = 0
        self.num_rollbacks = 0
        self._step: int | None = None
        self._data_position: int | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._fp8_nonfinite = NonfiniteWatch(model)
        self._snapshot: _Snapshot | None = None

    # ------------------------------------------------------------------------------------------------ begin

    def begin_step(self, step: int, *, data_position: int | None = None) -> None:
        """Call before the forward: snapshots the model's buffers (the FP8 non-finite counters with them) and, every
        `snapshot_every` steps outside a bad streak, the whole training state for rollback.

        Args:
            step: the training step about to run.
            data_position: index of the batch this step trains on (required when rollback is on).
        """
        if self.config.rollback_after and data_position is None:
            raise ValueError("data_position is required when rollback is on (rollback_after > 0), got None")
        self._step, self._data_position = step, data_position
        self._buffers = buffer_snapshot(self.model)
        self._fp8_nonfinite.mark()
        due = self._snapshot is None or step - self._snapshot.step >= self.config.snapshot_every
        if self.config.rollback_after and self.bad_streak == 0 and due:
            self._snapshot = _Snapshot(
                step, data_position,
                model=state_snapshot(self.model),
                optimizer=copy.deepcopy(self.optimizer.state_dict()),
                stateful={k: copy.deepcopy(s.state_dict()) for k, s in self.stateful.items()},
                guard=self.state_dict(), rng=rng_state())

    # ------------------------------------------------------------------------------------------------ check

    def _params(self) -> list[tuple[str, nn.Parameter]]:
        named = list(self.model.named_parameters())
        seen = {id(p) for _, p in named}
        extra = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in seen]
        return named + [(f"optimizer.param_{i}", p) for i, p in enumerate(extra)]

    @torch.no_grad()
    def check(self, loss: torch.Tensor) -> StepReport:
        """Call after backward, before clipping and optimizer.step(): decide whether the step is applied.

        On a skip the gradients are set to None, the buffers restored to their `begin_step` values and a warning
        logged; after `rollback_after` skips in a row the last snapshot is restored (see StepReport.rollback).
        One host synchronisation per call (the loss, the gradient norm and the FP8 non-finite counters), and under
        torch.distributed one all-reduce of them, so all ranks skip or step together (`agree_across_ranks`).

        Args:
            loss: the step's loss (with gradient accumulation, e.g. the mean over micro-batches).
        Returns:
            StepReport.
        """
        if self._step is None:
            raise RuntimeError("StepGuard.check called without begin_step")
        step, position = self._step, self._data_position
        self._step = None
        params = self._params()
        grads = [p.grad for _, p in params if p.grad is not None]
        grad_norm = nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if hasattr(grad_norm, "full_tensor"):  # sharded (DTensor) gradients: the norm of the whole gradient
            grad_norm = grad_norm.full_tensor()
        loss_v, norm_v, *counts = agree_across_ranks(torch.cat([
            loss.detach().float().reshape(1), grad_norm.float().to(loss.device).reshape(1),
            self._fp8_nonfinite.rises().flatten().to(loss.device, torch.float32)])).tolist()
        values = {Signal.LOSS: loss_v, Signal.GRAD_NORM: norm_v}

        reason, bad, operands = None, (), ()
        if self.config.skip_nonfinite:
            operands = self._fp8_nonfinite.operands(counts)
            reason = nonfinite_reason(loss_v, norm_v, operands)
        if reason is not None and not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            bad = tuple(n for n, p in params if p.grad is not None and not torch.isfinite(p.grad).all())
        if reason is None:
            spiking = [s for s, d in self.detectors.items() if d.is_spike(values[s])]
            reason = _SPIKE_REASON[spiking[0]] if spiking else None

        level_shift = (reason in _SPIKE_REASON.values() and self.config.spike_max_skips > 0
                       and len(self.spike_streak) >= self.config.spike_max_skips)
        if level_shift:
            log.warning("minifloat: step %d applied although %s. %s", step, self._compare(
                _SIGNAL_OF[reason], values[_SIGNAL_OF[reason]]), level_shift_in_words(len(self.spike_streak) + 1))
            for s, d in self.detectors.items():
                d.restart([v[s] for v in self.spike_streak] + [values[s]])
            self.num_level_shifts += 1
            reason = None
        elif reason is None:
            for s, d in self.detectors.items():
                d.accept(values[s])

        nxt = lambda p: None if p is None else p + 1  # noqa: E731
        if reason is None:
            self.bad_streak = 0
            self.spike_streak = []
            return StepReport(step, position, False, None, loss_v, norm_v, level_shift=level_shift,
                              next_step=step + 1, next_data_position=nxt(position))

        self.spike_streak = self.spike_streak + [values] if reason in _SPIKE_REASON.values() else []

        self._skip(params, step, reason, values, bad, operands)
        rollback = None
        if self.config.rollback_after and self.bad_streak >= self.config.rollback_after:
            rollback = self._rollback(position)
        return StepReport(step, position, True, reason, loss_v, norm_v, bad, operands, rollback,
                          next_step=rollback.restored_step if rollback else step + 1,
                          next_data_position=rollback.resume_data_position if rollback else nxt(position))

    def _skip(self, params, step: int, reason: SkipReason, values: dict, bad: tuple[str, ...],
              operands: tuple[tuple[str, Role], ...]) -> None:
        for _, p in params:
            p.grad = None
        restore_buffers(self.model, self._buffers)
        self.bad_streak += 1
        self.num_skipped += 1
        log.warning("minifloat: step %d skipped (%s): %s", step, reason.value,
                    self._explain(reason, values, bad, operands))

    def _compare(self, signal: Signal, value: float) -> str:
        d = self.detectors[signal]
        return spike_in_words(_IN_WORDS[signal], value, d.median(), len(d.values))

    def _explain(self, reason: SkipReason, values: dict, bad: tuple[str, ...],
                 operands: tuple[tuple[str, Role], ...]) -> str:
        spike = None
        if reason in _SIGNAL_OF:
            spike = self._compare(_SIGNAL_OF[reason], values[_SIGNAL_OF[reason]])
        return skip_in_words(reason, values[Signal.LOSS], values[Signal.GRAD_NORM], bad, operands, spike,
                             self.config.spike_ratio)

    def _rollback(self, position: int) -> RollbackEvent | None:
        snap = self._snapshot
        if snap is None:
            return None
        if self.num_rollbacks >= self.config.max_rollbacks:
            raise RuntimeError(f"minifloat: {self.bad_streak} bad steps in a row after {self.num_rollbacks} "
                               f"rollbacks (max_rollbacks={self.config.max_rollbacks}); training has diverged")
        self.model.load_state_dict(snap.model)  # copies in place, params and buffers
        self.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))  # a copy: load_state_dict may alias tensors
        for k, s in self.stateful.items():
            s.load_state_dict(copy.deepcopy(snap.stateful[k]))
        self.load_state_dict(snap.guard)
        set_rng_state(snap.rng)
        self.num_rollbacks += 1
        resume = position + 1 + self.config.rollback_extra_skip
        event = RollbackEvent(snap.step, resume, resume - snap.data_position)
        log.warning("minifloat: rolled back to step %d after %d bad steps; resuming at batch %d (%d batches skipped)",
                    event.restored_step, self.config.rollback_after, resume, event.skip_batches)
        return event

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The guard's own state (spike windows, bad and spike streaks), for checkpoints; counters are not part."""
        return {"windows": {s.value: list(d.values) for s, d in self.detectors.items()},
                "bad_streak": self.bad_streak,
                "spike_streak": {s.value: [v[s] for v in self.spike_streak] for s in Signal}}

    def load_state_dict(self, state: dict) -> None:
        for s, d in self.detectors.items():
            d.values.clear()
            d.values.extend(state["windows"].get(s.value, []))
        self.bad_streak = state["bad_streak"]
        streak = state.get("spike_streak", {})  # absent in checkpoints written before spike_max_skips existed
        columns = [streak.get(s.value, []) for s in Signal]
        self.spike_streak = [dict(zip(Signal, row)) for row in zip(*columns)]
