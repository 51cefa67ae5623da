"""A skipped step in plain words: what was seen, what was done, what to do if it repeats (StepGuard's warnings)."""

from __future__ import annotations

import math

from minifloat.core.skip import SkipReason
from minifloat.fp8.recipes import Role

MAX_NAMES_LOGGED = 8
UNCHANGED = ("The update was not applied: weights, optimizer state and FP8 scaling state are as they were before the "
             "step.")
SPIKE_ADVICE = ("A rare skip is harmless. If skips keep coming, lower the learning rate or look at the data of these "
                "steps.")
NONFINITE_ADVICE = ("If this repeats, lower the learning rate or look for NaN or infinity in the data of these steps; "
                    "for FP8 see docs/fp8.md, \"Non-finite values\".")


def listed(names: list[str]) -> str:
    """At most MAX_NAMES_LOGGED names, comma-separated, with a count of the rest."""
    more = len(names) - MAX_NAMES_LOGGED
    return ", ".join(names[:MAX_NAMES_LOGGED]) + (f" (+{more} more)" if more > 0 else "")


def _nonfinite(value: float) -> str:
    return "NaN" if math.isnan(value) else f"{value:g}"  # inf, -inf


def spike_in_words(signal: str, value: float, median: float, window: int) -> str:
    """'its gradient norm 15.1 is 15.4× the median 0.98 of the last 32 applied steps' (a spike's numbers)."""
    return (f"its {signal} {value:.3g} is {value / median:,.1f}× the median {median:.3g} of the last {window} applied "
            f"steps")


def skip_in_words(reason: SkipReason, loss: float, norm: float, bad: tuple[str, ...],
                  operands: tuple[tuple[str, Role], ...], spike: str | None, ratio: float) -> str:
    """The message after 'step N skipped (reason): '. spike: spike_in_words(...) for a spike skip, else None."""
    if spike is not None:
        return f"{spike}, above the spike limit of {ratio:g}× (GuardConfig.spike_ratio). {UNCHANGED} {SPIKE_ADVICE}"
    casts = listed([f"{layer} ({role.value})" for layer, role in operands])
    hidden = " (the cast saturates it, so the loss looks normal)" if math.isfinite(loss) else ""
    seen = {
        SkipReason.NONFINITE_LOSS: f"the loss is {_nonfinite(loss)}",
        SkipReason.NONFINITE_GRAD: f"the gradient norm is {_nonfinite(norm)} while the loss is {loss:.3g}",
        SkipReason.NONFINITE_FP8_OPERAND: f"an FP8 cast met NaN or infinity in {casts}{hidden}"}[reason]
    if bad:
        seen += f"; NaN or infinite gradients in {listed(list(bad))}"
    return f"{seen}. {UNCHANGED} {NONFINITE_ADVICE}"


def level_shift_in_words(streak: int) -> str:
    """Why a step above the spike limit was applied after all (GuardConfig.spike_max_skips)."""
    return (f"It has stayed above the spike limit for {streak} steps in a row, so the guard takes it as the run's new "
            f"level (a level shift), not a spike; the spike windows restart from these steps.")
