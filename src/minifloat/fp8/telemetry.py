"""Numerics telemetry: what each FP8 cast did, per layer and per tensor role, on demand.

    with mf.telemetry.capture() as tel:
        loss = model(x).sum(); loss.backward()
    tel.print_table()          # or tel.records / tel.to_json()

Each record holds the amax, the scale, the fraction of values saturated (clamped at ±max), the fraction of non-zero
values flushed to zero, the number of non-finite values and the SQNR of the cast against its high-precision source.
NVFP4 casts (E2M1 elements, E4M3 block scales under an fp32 tensor scale) also report the range of their E4M3 block
scales: a block scale near E4M3's 448 or in its subnormal range (below 2^-6) is one the two-level scaling could not
fit. When no capture is active the only cost is one attribute check per cast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from typing import Iterator

import torch

from minifloat.numerics.formats import E2M1
from minifloat.numerics.fp4 import NVFP4Quantized
from minifloat.numerics.granularity import granularity_info
from minifloat.numerics.quantize import Quantized, sqnr_db

_ACTIVE: "Recorder | None" = None
_SATURATION_SLACK = 2.0**-20  # a few fp32 ulps


@dataclasses.dataclass
class CastRecord:
    layer: str
    role: str
    fmt: str
    granularity: str
    amax: float
    scale: float  # dequantization scale (mean over blocks for block granularities)
    saturated: float  # fraction of elements beyond ±max before clamping
    underflow: float  # fraction of non-zero elements that became zero
    nonfinite: int  # NaN/inf elements in the source
    sqnr_db: float  # over the finite elements
    step: int  # FP8 steps ended since the capture began (0 for the casts before the first optimizer step)
    block_scale_min: float = math.nan  # NVFP4: the smallest E4M3 block scale of a non-zero block (NaN for others)
    block_scale_max: float = math.nan  # NVFP4: the largest E4M3 block scale


class Recorder:
    """Collects CastRecords while active (see `capture`)."""

    def __init__(self, sqnr: bool = True):
        self.sqnr = sqnr
        self.records: list[CastRecord] = []
        self.step = 0
        self.weights_seen: set[int] = set()  # ids of the scaling states whose (cached) weight cast this capture saw

    def next_step(self) -> None:
        self.step += 1

    def to_json(self) -> str:
        """The records as strict JSON: a value that is not a finite number (NaN block scales of a recipe without
        them, an infinite SQNR) is null, which every JSON reader takes."""
        finite = [{k: None if isinstance(v, float) and not math.isfinite(v) else v
                   for k, v in dataclasses.asdict(r).items()} for r in self.records]
        return json.dumps(finite, indent=1, allow_nan=False)

    def by_layer(self) -> dict[tuple[str, str], list[CastRecord]]:
        out: dict[tuple[str, str], list[CastRecord]] = {}
        for r in self.records:
            out.setdefault((r.layer, r.role), []).append(r)
        return out

    def table(self):
        """A rich Table with the latest record of each (layer, role)."""
        from rich.table import Table

        t = Table(title="minifloat FP8 casts")
        for col in ("layer", "role", "fmt", "gran.", "amax", "scale", "saturated", "underflow", "non-finite",
                    "SQNR dB", "block scales"):
            t.add_column(col, justify="left" if col in ("layer", "role", "fmt", "gran.") else "right")
        for (layer, role), recs in self.by_layer().items():
            r = recs[-1]
            t.add_row(layer, role, r.fmt, r.granularity, f"{r.amax:.3g}", f"{r.scale:.3g}", f"{r.saturated:.2%}",
                      f"{r.underflow:.2%}", str(r.nonfinite), f"{r.sqnr_db:.1f}",
                      "" if math.isnan(r.block_scale_max) else f"{r.block_scale_min:.3g}–{r.block_scale_max:.3g}")
        return t

    def print_table(self) -> None:
        """Print `table()` on stdout: whole in a log or pipe (where rich would assume 80 columns and cut every cell
        to "…", the console takes the table's own width), folded to the width of a terminal."""
        from rich.console import Console
        from rich.measure import Measurement

        console, table = Console(), self.table()
        if not console.is_terminal:
            console.width = max(console.width,
                                Measurement.get(console, console.options.update_width(1000), table).maximum)
        console.print(table)


def enabled() -> bool:
    return _ACTIVE is not None


def step_ended() -> None:
    """An FP8 step ended (minifloat.fp8.step: each optimizer step that updates FP8 layers): the active capture's
    later records carry the next step number."""
    if _ACTIVE is not None:
        _ACTIVE.next_step()


@contextlib.contextmanager
def capture(*, sqnr: bool = True) -> Iterator[Recorder]:
    """Record every FP8 cast made inside the block."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, Recorder(sqnr=sqnr)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = prev


def unseen_weight(state: object) -> bool:
    """Whether the active capture has not yet seen the weight cast of the layer owning `state` (and now has): a
    weight cast cached before the capture began is then made again for it, once, so its table has the weight."""
    if _ACTIVE is None or id(state) in _ACTIVE.weights_seen:
        return False
    _ACTIVE.weights_seen.add(id(state))
    return True


@torch.no_grad()
def observe(layer: str, role: str, source: torch.Tensor, q: Quantized | NVFP4Quantized) -> None:
    """Add a record for cast `source` -> `q` to the active recorder (no-op when none is active)."""
    rec = _ACTIVE
    if rec is None:
        return
    x = source.detach().float()
    finite = torch.isfinite(x)
    n_finite = int(finite.sum())
    deq = q.dequantize()
    xf = torch.where(finite, x, torch.zeros_like(x))
    if isinstance(q, NVFP4Quantized):  # an element's dequantization multiplier: its block's scale · the tensor's
        grid, max_value, block_scale = q.data, E2M1.max, q.expanded_scale()
        multiplier = block_scale * q.global_scale
        used = block_scale[xf != 0]  # the E4M3 scales of blocks with something to represent
        fields = dict(fmt=E2M1.name, granularity="nvfp4-16x16" if q.block_2d else "nvfp4-1x16",
                      scale=float(q.scale.float().mean() * q.global_scale) if q.scale.numel() else math.nan,
                      block_scale_min=float(used.min()) if used.numel() else math.nan,
                      block_scale_max=float(used.max()) if used.numel() else math.nan)
    else:
        grid, max_value = q.grid_values(), q.fmt.max
        multiplier = q.scale if granularity_info(q.granularity).per_tensor else q.expanded_scale().expand_as(x)
        fields = dict(fmt=q.fmt.name, granularity=q.granularity,
                      scale=float(q.scale.float().mean()) if q.scale.numel() else math.nan)
    # |x|/scale > max, with slack for the fp32 rounding of scale = amax/max (the amax element itself is not clamped)
    saturated = (xf.abs() > max_value * multiplier * (1.0 + _SATURATION_SLACK)).sum().item()
    underflow = ((xf != 0) & (grid == 0)).sum().item()
    nonzero = int((xf != 0).sum())
    amax = float(xf.abs().max()) if x.numel() else 0.0
    snr = sqnr_db(xf[finite], deq[finite]) if (rec.sqnr and n_finite) else math.nan
    rec.records.append(CastRecord(
        layer=layer, role=role, amax=amax, saturated=saturated / max(n_finite, 1),
        underflow=underflow / max(nonzero, 1), nonfinite=x.numel() - n_finite, sqnr_db=snr, step=rec.step, **fields))
