"""Tests for minifloat.core.snapshot: buffer snapshots put back exactly, parameters left alone."""

from __future__ import annotations

import torch
from torch import nn

from minifloat.core.snapshot import buffer_snapshot, restore_buffers, restoring_buffers, state_snapshot


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        self.steps += 1
        return self.norm(self.lin(x))


def test_restoring_buffers_restores_persistent_and_non_persistent():
    model = WithBuffers()
    before = buffer_snapshot(model)
    with restoring_buffers(model):
        model(torch.randn(8, 4))
        assert model.steps.item() == 1 and model.norm.num_batches_tracked.item() == 1
    after = dict(model.named_buffers())
    assert after.keys() == before.keys()
    for name, b in before.items():
        assert torch.equal(after[name], b), name


def test_restore_buffers_copies_in_place_and_leaves_parameters():
    model = WithBuffers()
    saved = buffer_snapshot(model)
    running_mean = model.norm.running_mean
    with torch.no_grad():
        model.lin.weight.add_(1.0)
    weight = model.lin.weight.detach().clone()
    model(torch.randn(8, 4))
    restore_buffers(model, saved)
    assert model.norm.running_mean is running_mean and torch.equal(running_mean, saved["norm.running_mean"])
    assert torch.equal(model.lin.weight, weight)


def test_state_snapshot_is_a_copy():
    model = WithBuffers()
    snap = state_snapshot(model)
    with torch.no_grad():
        model.lin.weight.zero_()
    assert not torch.equal(snap["lin.weight"], model.lin.weight)
    model.load_state_dict(snap)
    assert torch.equal(snap["lin.weight"], model.lin.weight)
