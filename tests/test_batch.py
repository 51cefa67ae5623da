"""Tests for minifloat.core.batch: one way to feed a batch to a model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifloat.core.batch import call_model


class Echo(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


X, Y = torch.zeros(2), torch.ones(2)

# (name, batch, expected positional args, expected keyword args)
CASES = [
    ("tensor", X, (X,), {}),
    ("tuple", (X, Y), (X, Y), {}),
    ("list", [X, Y], (X, Y), {}),
    ("mapping", {"input_ids": X, "labels": Y}, (), {"input_ids": X, "labels": Y}),
]


@pytest.mark.parametrize("name, batch, args, kwargs", CASES, ids=[c[0] for c in CASES])
def test_call_model(name, batch, args, kwargs):
    got_args, got_kwargs = call_model(Echo(), batch)
    assert got_args == args and got_kwargs == kwargs
