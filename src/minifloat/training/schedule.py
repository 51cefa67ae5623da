"""The learning-rate schedule: linear warm-up, cosine decay to min_lr (nanoGPT), as data a checkpoint keeps.

    schedule = Schedule.from_config(config)
    schedule.lr_at(step)

The lr is a pure function of the step, so a resumed run continues bitwise where the uninterrupted run would be. A
checkpoint stores its Schedule; resuming with more steps keeps it (past `decay_steps` the lr stays at min_lr), and
resuming with another decay step re-plans only the rest: a cosine from the lr the run had reached down to min_lr at
the new decay step (`replan`). Either way the lr never rises at the resume step, and the lr of every step already
run stays what it was.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from minifloat.core.validate import check_int, check_number

log = logging.getLogger("minifloat")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Warm-up over `warmup` steps to `lr`, cosine to `min_lr` at `decay_steps`, then `min_lr`; then the re-plans.

    Attributes:
        lr, min_lr, warmup, decay_steps: the plan (TrainConfig's lr, min_lr, warmup, lr_decay_steps or steps).
        replans: (step, lr at that step, new decay end) of each `replan`, in order: from each step on, a cosine
            from that lr down to min_lr at the new end.
    """

    lr: float
    min_lr: float
    warmup: int
    decay_steps: int
    replans: tuple[tuple[int, float, int], ...] = ()

    def __post_init__(self):
        check_number("lr", self.lr, low=0.0, low_open=True)
        check_number("min_lr", self.min_lr, low=0.0, high=self.lr)
        check_int("warmup", self.warmup, low=0)
        check_int("lr_decay_steps", self.decay_steps, low=1)
        object.__setattr__(self, "replans", tuple(tuple(r) for r in self.replans))  # JSON gives lists
        starts = [r[0] for r in self.replans]
        if starts != sorted(set(starts)):
            raise ValueError(f"replans must start at increasing steps, got {self.replans!r}")

    @classmethod
    def from_config(cls, config) -> Schedule:
        """The plan of a TrainConfig (anything with lr, min_lr, warmup, lr_decay_steps, steps)."""
        return cls(lr=config.lr, min_lr=config.min_lr, warmup=config.warmup,
                   decay_steps=config.lr_decay_steps or config.steps)

    @property
    def decay_end(self) -> int:
        """The step at which the lr reaches min_lr: the last re-plan's end, else decay_steps."""
        return self.replans[-1][2] if self.replans else self.decay_steps

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        for start, lr, end in reversed(self.replans):
            if step >= start:
                return _cosine(step, start, end, lr, self.min_lr)
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        return _cosine(step, self.warmup, self.decay_steps, self.lr, self.min_lr)

    def replan(self, step: int, decay_steps: int) -> Schedule:
        """This schedule up to `step`, then a cosine from the lr it has at `step` down to min_lr at `decay_steps`
        (min_lr from `step` on when step >= decay_steps). The lr at `step` is unchanged, so it never jumps; a
        `decay_steps` equal to the current decay end changes nothing, and during warm-up only the decay's end moves
        (the warm-up still climbs to lr, as planned)."""
        check_int("step", step, low=0)
        check_int("lr_decay_steps", decay_steps, low=1)
        if decay_steps == self.decay_end:
            return self
        if not self.replans and step <= self.warmup:
            return dataclasses.replace(self, decay_steps=decay_steps)
        kept = tuple(r for r in self.replans if r[0] < step)
        return dataclasses.replace(self, replans=(*kept, (step, self.lr_at(step), decay_steps)))


def _cosine(step: int, start: int, end: int, high: float, low: float) -> float:
    """Half a cosine from `high` at `start` to `low` at `end`; `low` from `end` on."""
    if step >= end:
        return low
    ratio = (step - start) / max(1, end - start)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (high - low)


def resumed_schedule(saved: dict, config) -> Schedule:
    """The schedule a resume of the checkpoint extra `saved` (at saved["step"]) continues under `config`: the one it
    stored (older checkpoints: the plan of their config), re-planned from the step reached when config states a decay
    end. A run shorter than its warm-up planned its decay to end inside it, so never began it: continued past the
    warm-up it would reach lr and drop to min_lr at once, so its decay ends at config.steps, as in one run that long."""
    schedule = Schedule(**saved["schedule"]) if "schedule" in saved else Schedule.from_config(
        dataclasses.replace(config, **{k: saved["config"][k] for k in ("lr", "min_lr", "warmup", "lr_decay_steps",
                                                                          "steps")}))
    if config.lr_decay_steps is not None:
        return schedule.replan(saved["step"], config.lr_decay_steps)
    if not schedule.replans and schedule.decay_steps <= schedule.warmup < config.steps:
        log.info("minifloat: the run was planned for %d steps, within its warm-up of %d: its cosine decay now ends "
                 "at --steps %d", schedule.decay_steps, schedule.warmup, config.steps)
        return schedule.replan(saved["step"], config.steps)
    return schedule
