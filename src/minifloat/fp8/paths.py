"""Which GEMM path each recipe's products take on a device: the table `minifloat formats --gemms` prints.

Read from the one decision (minifloat.fp8.native's rules, the device's capability and, for rules minifloat has not
yet run on their GPU generation, the device's check against the emulation), so it says what a layer would do there.
A product also needs its shapes to fit the rule (the K multiple shown); others run emulated, exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from minifloat.fp8 import native
from minifloat.numerics.granularity import Granularity

G = Granularity
# (recipe, GEMMs, scaling pair, or "nvfp4", or None where no native kernel is used)
RECIPE_GEMMS = (
    ("DelayedScaling, CurrentScaling", "fprop, dgrad, wgrad", (G.TENSOR, G.TENSOR)),
    ("CurrentScaling(granularity='row')", "fprop, dgrad, wgrad", (G.ROW, G.ROW)),
    ("BlockScaling", "fprop, dgrad", (G.TILE, G.BLOCK)),
    ("BlockScaling", "wgrad", (G.TILE, G.TILE)),
    ("MXScaling", "fprop, dgrad, wgrad", (G.MX, G.MX)),
    ("NVFP4Scaling", "fprop, dgrad, wgrad", "nvfp4"),
    ("MXScaling(format='e2m1')", "fprop, dgrad, wgrad", None),
)


@dataclasses.dataclass(frozen=True)
class GemmPath:
    """One row of the table: a recipe's GEMMs, the path they take on the device, and why."""

    recipe: str
    gemms: str
    path: str  # "native" or "emulated"
    why: str


def gemm_paths(device: torch.device | str, backend: str | None = None) -> list[GemmPath]:
    """The path of each recipe's GEMMs on `device` under `backend` ("auto" by default, or $MINIFLOAT_GEMM_BACKEND).
    On a GPU generation minifloat has not run a rule on, asking runs the device's check of that rule (once)."""
    device = torch.device(device)
    backend = native.backend_from_env(backend)
    capability = native.device_capability(device.index or 0) if device.type == "cuda" else None
    rows = []
    for recipe, gemms, pair in RECIPE_GEMMS:
        rule = native.NVFP4_RULE if pair == "nvfp4" else native.NATIVE_RULES.get(pair) if pair else None
        name = native.NVFP4_PAIR if pair == "nvfp4" else f"{pair[0]} × {pair[1]}" if pair else ""
        if rule is None:
            path, why = "emulated", "no native kernel: torch's CUDA build takes FP4 data with E8M0 scales only on ROCm"
        elif device.type != "cuda":
            path, why = "emulated", f"{device.type} is not a CUDA device"
        elif backend == "emulated":
            path, why = "emulated", "the emulated backend was chosen"
        elif capability is None:
            path, why = "emulated", native.no_capability_reason()
        elif not native._rule_runs_on(rule, capability, native.blockwise_torch()):
            path, why = "emulated", f"{name} needs {native.generations(rule)}" + (
                " and a torch with blockwise _scaled_mm" if rule.needs_blockwise_torch else "")
        elif not native._checked_on(name, rule, device.index or 0):
            path, why = "emulated", native.check_failed(name, device.index or 0)
        else:
            checked = "" if rule.verified else "; checked against the emulation on this device"
            path, why = "native", f"{name}, K a multiple of {rule.k_multiple}, N of 16{checked}"
        rows.append(GemmPath(recipe, gemms, path, why))
    return rows

