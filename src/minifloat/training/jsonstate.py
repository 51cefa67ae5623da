"""The JSON form of training state: what a checkpoint writes instead of pickle.

Non-tensor structure is JSON with four tagged forms for what JSON lacks: {"__tensor__": name} (a tensor stored
elsewhere, e.g. in a safetensors file, under that name), {"__tuple__": [...]}, {"__float__": "nan"} (and "inf",
"-inf"), {"__items__": [[key, value], ...]} (a dict with non-string keys, e.g. optimizer state by param index).
Used by the single-file checkpoints (minifloat.training.checkpoint) and the multi-process ones
(minifloat.training.sharded).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


class CheckpointError(ValueError):
    """A checkpoint that is truncated, corrupt, of another format version, or does not fit the objects given."""


def view_key(t: torch.Tensor) -> tuple[tuple, tuple] | None:
    """(storage, exact view) identities of a tensor; None for an empty one (which owns no memory to share)."""
    if not t.numel():
        return None
    storage = (t.device, t.untyped_storage().data_ptr())
    return storage, storage + (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class TensorTable:
    """Tensors to write, by name; a tensor that views exactly what an earlier one does is stored once."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, str] = {}  # exact view -> the name it is stored under
        self._storages: set[tuple] = set()

    def add(self, name: str, tensor: torch.Tensor) -> str:
        """Store `tensor` under `name` unless an exact alias is stored already; returns the name it is stored under."""
        t = tensor.detach()
        key = view_key(t)
        if key is not None:
            storage, view = key
            if view in self._views:
                return self._views[view]
            self._views[view] = name
            if storage in self._storages:  # overlaps another stored tensor without being it: safetensors needs a copy
                t = t.clone()
            self._storages.add(storage)
        if name in self.tensors:
            raise ValueError(f"two tensors would be stored under the name {name!r}")
        self.tensors[name] = t.cpu().contiguous()
        return name


def encode(obj: Any, path: str, table: TensorTable) -> Any:
    """JSON form of obj; tensors go into `table` under `path` (e.g. "optim/state/3/exp_avg")."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}  # strict JSON has no NaN / Infinity
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": table.add(path, obj)}
    if isinstance(obj, list):
        return [encode(v, f"{path}/{i}", table) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{path}/{i}", table) for i, v in enumerate(obj)]}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{path}/{k}", table) for k, v in obj.items()}
        return {"__items__": [[encode(k, f"{path}/key", table), encode(v, f"{path}/{k}", table)]
                              for k, v in obj.items()]}
    raise ValueError(f"{path}: a {type(obj).__name__} cannot be stored in a checkpoint (JSON values, tuples and "
                     f"tensors only; nothing is pickled)")


def decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `encode`: tagged forms back to tensors (from `tensors`), tuples, floats and keyed dicts."""
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == "__tensor__":
            if value not in tensors:
                raise CheckpointError(f"the manifest refers to tensor {value!r}, which the tensor file lacks")
            return tensors[value]
        if tag == "__tuple__":
            return tuple(decode(v, tensors) for v in value)
        if tag == "__float__":
            return float(value)
        if tag == "__items__":
            return {decode(k, tensors): decode(v, tensors) for k, v in value}
    return {k: decode(v, tensors) for k, v in obj.items()}
