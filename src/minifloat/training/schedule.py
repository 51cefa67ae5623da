"""The learning-rate schedule: linear warm-up, cosine decay to min_lr (nanoGPT), as data a checkpoint keeps.

    schedule = Schedule.from_config(config)
    schedule.lr_at(step)

The lr is a pure function of the step, so a resumed run continues bitwise where the uninterrupted run would be. A
checkpoint stores its Schedule; resuming with more steps keeps it (past `decay_steps` the lr stays at min_lr), and
resuming with another decay step re-plans only the rest: a cosine from the lr the run had reached down to min_lr at
the new decay step (`replan`). Either way the lr never rises at the resume step.
"""

from __future__ import annotations

import dataclasses
import math

from minifloat.core.validate import check_int, check_number


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Warm-up over `warmup` steps to `lr`, cosine to `min_lr` at `decay_steps`, then `min_lr`.

    Attributes:
        lr, min_lr, warmup, decay_steps: the plan (TrainConfig's lr, min_lr, warmup, lr_decay_steps or steps).
        replan_step, replan_lr: set by `replan`: from replan_step on, a cosine from replan_lr to min_lr at
            decay_steps (None: the plain plan).
    """

    lr: float
    min_lr: float
    warmup: int
    decay_steps: int
    replan_step: int | None = None
    replan_lr: float | None = None

    def __post_init__(self):
        check_number("lr", self.lr, low=0.0, low_open=True)
        check_number("min_lr", self.min_lr, low=0.0, high=self.lr)
        check_int("warmup", self.warmup, low=0)
        check_int("lr_decay_steps", self.decay_steps, low=1)
        check_int("replan_step", self.replan_step, low=0, allow_none=True)
        if (self.replan_step is None) != (self.replan_lr is None):
            raise ValueError("replan_step and replan_lr are set together")
        if self.replan_lr is not None:
            check_number("replan_lr", self.replan_lr, low=self.min_lr, high=self.lr)

    @classmethod
    def from_config(cls, config) -> Schedule:
        """The plan of a TrainConfig (anything with lr, min_lr, warmup, lr_decay_steps, steps)."""
        return cls(lr=config.lr, min_lr=config.min_lr, warmup=config.warmup,
                   decay_steps=config.lr_decay_steps or config.steps)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        if self.replan_step is not None and step >= self.replan_step:
            return _cosine(step, self.replan_step, self.decay_steps, self.replan_lr, self.min_lr)
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        return _cosine(step, self.warmup, self.decay_steps, self.lr, self.min_lr)

    def replan(self, step: int, decay_steps: int) -> Schedule:
        """This schedule up to `step`, then a cosine from the lr it has at `step` down to min_lr at `decay_steps`
        (when the run is already past decay_steps, min_lr from `step` on). The lr at `step` is unchanged, so it
        never jumps; `decay_steps` equal to this schedule's changes nothing, and during warm-up only the decay's
        end moves (the warm-up still climbs to lr, as the plan did)."""
        check_int("step", step, low=0)
        check_int("lr_decay_steps", decay_steps, low=1)
        if decay_steps == self.decay_steps:
            return self
        if self.replan_step is None and step <= self.warmup:
            return dataclasses.replace(self, decay_steps=decay_steps)
        return dataclasses.replace(self, decay_steps=decay_steps, replan_step=step, replan_lr=self.lr_at(step))


def _cosine(step: int, start: int, end: int, high: float, low: float) -> float:
    """Half a cosine from `high` at `start` to `low` at `end`; `low` from `end` on."""
    if step >= end:
        return low
    ratio = (step - start) / max(1, end - start)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (high - low)
