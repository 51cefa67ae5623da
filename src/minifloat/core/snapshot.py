"""Copies of a model's tensors, and putting them back.

A step the guard rejects, and every look at a model that is not a training step (the audit, the shadow check,
pre-flight), must leave the buffers as they were: FP8 layers roll their amax history and count non-finite amaxes,
batch norms update their running statistics, in every forward and backward.

    saved = buffer_snapshot(model)      # before the step
    ...
    restore_buffers(model, saved)       # the step is rejected

    with restoring_buffers(model):      # a forward for a look
        model(x)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn


def buffer_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every buffer (persistent or not), by name."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


@torch.no_grad()
def restore_buffers(model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Copy `buffer_snapshot` output back into the model's buffers, in place.

    Persistent buffers go through load_state_dict, so modules that cache state derived from their buffers
    (ScalingState's host copy of `initialized`) refresh it; non-persistent ones are copied in place.
    """
    keys = model.state_dict().keys()
    persistent = {k: v for k, v in saved.items() if k in keys}
    model.load_state_dict(persistent, strict=False)
    for name, b in model.named_buffers():
        if name not in persistent and name in saved:
            b.copy_(saved[name])


@contextlib.contextmanager
def restoring_buffers(model: nn.Module) -> Iterator[None]:
    """Run the block, then put the model's buffers back as they were (parameters are not touched)."""
    saved = buffer_snapshot(model)
    try:
        yield
    finally:
        restore_buffers(model, saved)


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of `model.state_dict()` (parameters and buffers), for an in-memory rollback point; restore it
    with `model.load_state_dict`, which copies in place."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
