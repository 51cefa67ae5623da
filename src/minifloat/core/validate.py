"""The validators of every configuration in minifloat: each raises ValueError naming the field and the value.

    check_int("steps", steps, low=1)                            # steps must be an int >= 1, got 0
    check_number("threshold", t, low=0, low_open=True)          # threshold must be a finite number > 0, got nan
    check_number("alpha", a, low=0, high=1, low_open=True)      # alpha must be a finite number in (0, 1], got 1.5
    check_choice("reference_dtype", d, ("bfloat16", "float16")) # reference_dtype must be one of [...], got 'int8'
    check_bool("resume", resume)                                # resume must be a bool, got 1

A bool is not accepted where a number is expected: to Python True is the int 1, but never a count or a rate here.
"""

from __future__ import annotations

import math
from collections.abc import Collection


def check_bool(field: str, value) -> None:
    """`value` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be a bool, got {value!r}")


def check_int(field: str, value, *, low: int | None = None, high: int | None = None,
              allow_none: bool = False) -> None:
    """`value` is an int (not a bool) in [low, high]; None passes when `allow_none`."""
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not (ok and (low is None or value >= low) and (high is None or value <= high)):
        raise ValueError(f"{field} must be an int{_bounds(low, high, False, False)}{_or_none(allow_none)}, "
                         f"got {value!r}")


# the largest seed: torch's generators take a 64-bit integer, and 2^63 - 1 leaves room for seeds derived from it
MAX_SEED = 2**63 - 1


def check_seed(field: str, value) -> None:
    """`value` is a seed: an int in [0, MAX_SEED]."""
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED):
        raise ValueError(f"{field} must be an int in [0, 2^63 - 1], got {value!r}")


def check_number(field: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False, allow_none: bool = False) -> None:
    """`value` is a finite int or float (not a bool) within the bounds; `low_open` / `high_open` exclude a bound.
    None passes when `allow_none`."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ValueError(f"{field} must be a finite number{_bounds(low, high, low_open, high_open)}"
                         f"{_or_none(allow_none)}, got {value!r}")


def check_choice(field: str, value, choices: Collection) -> None:
    """`value` is one of `choices` (compared with ==)."""
    if not any(value is c or value == c for c in choices):
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")


def _bounds(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""


def _or_none(allow_none: bool) -> str:
    return " or None" if allow_none else ""


def check_module(caller: str, model, *, allow_none: bool = False) -> None:
    """TypeError unless `model` is a torch nn.Module (or None, with allow_none), naming `caller`."""
    from torch import nn  # here: the other validators need no torch

    if not (isinstance(model, nn.Module) or (allow_none and model is None)):
        raise TypeError(f"minifloat.{caller}: model must be a torch nn.Module{' or None' if allow_none else ''}, "
                        f"got {type(model).__name__}")


def param_groups(caller: str, params, held: Collection = ()) -> list[dict]:
    """An optimizer wrapper's `params` (an nn.Module, an iterable of parameters or of param-group dicts) as a list of
    groups, refused as torch.optim refuses them: a lone tensor (its rows would be iterated), nothing, a parameter that
    is not floating point, or one that appears twice, or is among the tensors `held` already (add_param_group): each
    copy would get its own master and one update be lost."""
    import torch
    from torch import nn

    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{caller}: params must be an nn.Module or an iterable of parameters or param groups, got a "
                        f"lone tensor of shape {tuple(params.shape)}: pass [tensor]")
    params = list(params)
    if not params:
        raise ValueError(f"{caller}: params must not be empty")
    groups = [dict(g) if isinstance(g, dict) else g for g in params] if isinstance(params[0], dict) else \
        [{"params": params}]
    seen: set[int] = {id(t) for t in held}
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"{caller}: params must be all parameters or all param-group dicts with a 'params' entry")
        group["params"] = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise ValueError(f"{caller}: params must be floating-point tensors, got "
                                 f"{type(p).__name__ if not isinstance(p, torch.Tensor) else p.dtype}")
            if id(p) in seen:
                raise ValueError(f"{caller}: some parameters appear in more than one parameter group (or twice in "
                                 f"one); list each once")
            seen.add(id(p))
    return groups
