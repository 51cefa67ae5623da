"""fp32 islands: modules that compute in float32 with autocast off inside a lower-precision model (norms, embeddings,
the head, softmax, losses), as PrecisionPolicy.apply makes them."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from minifloat.core.autocast import autocast_off

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISLAND_ATTR = "minifloat_fp32_island"  # set on a module apply() made an fp32 island; its value is the island's kind
ISLAND_OUT_ATTR = "minifloat_fp32_island_out"  # the output dtype of an island (None: its first input's)


def make_fp32_island(module: nn.Module, out_dtype: torch.dtype | None) -> None:
    """Run `module` in float32 with autocast off: its forward is wrapped (an instance attribute, a partial of a module
    function, so deepcopy and torch.save of the whole model carry it; a bound method would not unpickle) to upcast
    bf16/fp16 tensor arguments, switch autocast off around the class's forward and cast floating outputs to
    `out_dtype` (None: the dtype of the first floating input).

    One `with` block inside one function, where forward pre/post hooks would have to enter and leave the autocast
    context in two calls, which torch.compile cannot trace.
    """
    setattr(module, ISLAND_OUT_ATTR, out_dtype)
    module.forward = functools.partial(_island_forward, module)


def _island_forward(module: nn.Module, *args, **kwargs):
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    out = getattr(module, ISLAND_OUT_ATTR) or (floats[0] if floats else torch.float32)
    args, kwargs = _cast((args, kwargs), torch.float32)
    with autocast_off(tensors[0].device.type if tensors else "cpu"):
        output = type(module).forward(module, *args, **kwargs)
    return _cast(output, out)


def inside(name: str, islands: set[str]) -> bool:
    """Whether module `name` is an island or inside one (an island's children compute in fp32 too)."""
    return any(name == i or not i or name.startswith(i + ".") for i in islands)


def _cast(obj, dtype: torch.dtype):
    """Cast the bf16 / fp16 / fp32 tensors in a nest of tuples, lists and dicts to `dtype` (others pass)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.dtype in FLOAT_DTYPES else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj
