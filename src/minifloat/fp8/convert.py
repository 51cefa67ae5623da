"""Which layers run in FP8: `convert(model, ...)` swaps eligible nn.Linear layers for Fp8Linear."""

from __future__ import annotations

import logging
from typing import Callable

from torch import nn

from minifloat.fp8.modules import Fp8Linear
from minifloat.fp8.recipes import DelayedScaling, Recipe, check_recipe

log = logging.getLogger("minifloat")

MIN_DIM_MULTIPLE = 16  # FP8 tensor cores (torch._scaled_mm) need K and N divisible by 16


def convert(model: nn.Module, *, recipe: Recipe | None = None,
            filter: Callable[[str, nn.Linear], bool] | None = None, keep_first_last: bool = True,
            backend: str | None = None) -> nn.Module:
    """Replace the nn.Linear layers of `model` (in place) by Fp8Linear layers sharing their parameters.

    Args:
        model: any nn.Module (HF transformers models included).
        recipe: the FP8 recipe (default DelayedScaling()).
        filter: `filter(name, linear) -> bool`; only layers it accepts are converted.
        keep_first_last: keep the first and the last nn.Linear (in module order) in high precision, as
            mixed-precision practice advises for the layers nearest the data and the output.
        backend: GEMM backend for the converted layers.
    Returns:
        The same model. Layers whose in/out features are not multiples of 16 (what FP8 tensor cores accept) stay
        in high precision; one warning lists them.
    """
    recipe = check_recipe(recipe if recipe is not None else DelayedScaling())
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, Fp8Linear)]
    kept = {linears[0][0], linears[-1][0]} if (keep_first_last and linears) else set()
    skipped = []
    for name, lin in linears:
        if name in kept or (filter is not None and not filter(name, lin)):
            continue
        if lin.in_features % MIN_DIM_MULTIPLE or lin.out_features % MIN_DIM_MULTIPLE:
            skipped.append(f"{name} ({lin.in_features}->{lin.out_features})")
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(lin, recipe=recipe, backend=backend, name=name))
    if skipped:
        log.warning("minifloat.convert: kept %d layer(s) in high precision, their features are not multiples of "
                    "%d: %s", len(skipped), MIN_DIM_MULTIPLE, ", ".join(skipped))
    return model


def fp8_layers(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]
