"""Which FP8 casts of a model met NaN/inf operands during a step, read from the layers' scaling states
(`minifloat.fp8.scaling.ScalingState.nonfinite`): what StepGuard and LossScaler name when a saturating cast hid the
bad operand from the loss and the gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from minifloat.fp8.recipes import ROLES, Role
from minifloat.fp8.scaling import ScalingState


class NonfiniteWatch:
    """Which FP8 casts of a model met NaN/inf operands since `mark()`, read from the layers' `nonfinite` counters.

    A saturating cast turns +inf into +fmt.max, so the layer's output, the loss and the gradients may all stay finite:
    the counters are then the only trace of the bad operand. `rises()` stays on the device (no host synchronisation);
    the caller converts it to numbers once, typically together with the loss.

        watch = NonfiniteWatch(model)
        watch.mark()                                   # before the step's first forward
        ...                                            # forwards and backwards
        counts = watch.rises().flatten().tolist()      # casts per (layer, role) since mark()
        watch.operands(counts)                         # (("blocks.0.mlp.up", Role.INPUT), ...)

    A cast run twice (activation-checkpoint recompute) counts twice; a weight cast reused from the layer's cache by a
    later micro-batch is not a new cast and counts once.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._layers: list[tuple[str, ScalingState]] = []  # (name of the module owning the state, the state)
        self._before: torch.Tensor | None = None

    def mark(self) -> None:
        """Count from now on. The layers are looked up here, so a model converted after construction is seen."""
        self._layers = [(name.rpartition(".")[0], m) for name, m in self.model.named_modules()
                        if isinstance(m, ScalingState)]
        self._before = self._counts()

    def _counts(self) -> torch.Tensor:
        if not self._layers:
            return torch.zeros(0, len(ROLES), dtype=torch.int64)
        device = self._layers[0][1].nonfinite.device
        return torch.stack([s.nonfinite.to(device) for _, s in self._layers])  # (layers, roles)

    def rises(self) -> torch.Tensor:
        """(layers, roles) int64 on the first layer's device: casts that met NaN/inf since `mark()`."""
        if self._before is None:
            raise RuntimeError("NonfiniteWatch.rises called before mark")
        return self._counts() - self._before

    def save_amaxes(self) -> None:
        """Keep this step's amaxes so far (row 0 of every history seen at `mark()`): one stacking launch."""
        rows = [s.amax_history[0] for _, s in self._layers]
        self._saved = (torch.stack(rows) if rows else None, [s.generation for _, s in self._layers])

    @torch.no_grad()
    def restore_amaxes(self) -> None:
        """Put back the amaxes `save_amaxes` kept, dropping those recorded since (a loss-scaled backward that
        overflowed, whose step is skipped: they would enter the next step's scales). Not once a layer's step ended."""
        rows, generations = getattr(self, "_saved", (None, []))
        if rows is not None and generations == [s.generation for _, s in self._layers]:
            torch._foreach_copy_([s.amax_history[0] for _, s in self._layers], list(rows.unbind(0)))

    def operands(self, counts: Sequence[float]) -> tuple[tuple[str, Role], ...]:
        """(layer name, role) of every positive entry of `counts`, `rises()` flattened on the host, in module order
        (the model itself is named "")."""
        n = len(ROLES)
        return tuple((name, role) for i, (name, _) in enumerate(self._layers) for j, role in enumerate(ROLES)
                     if counts[i * n + j] > 0)
