"""Tests for minifloat.core.rng: the generator states as plain data, restored exactly."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import torch

from minifloat.core.rng import named_seed, restoring_rng, rng_state, set_rng_state


def draw() -> tuple:
    return random.random(), np.random.rand(), torch.rand(3).tolist()


def test_restore_replays_every_generator():
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state = rng_state()
    first = draw()
    assert draw() != first
    set_rng_state(state)
    assert draw() == first


def test_state_is_plain_data():
    state = rng_state()
    assert isinstance(state["torch"], torch.Tensor) and state["torch"].dtype == torch.uint8
    plain = {k: v for k, v in state.items() if k not in ("torch", "cuda")}
    assert json.loads(json.dumps(plain)) is not None  # no NumPy array: checkpoints write it as JSON


def test_restoring_rng_leaves_generators_as_found_and_replays():
    torch.manual_seed(1)
    with restoring_rng() as start:
        a = torch.rand(4)
        set_rng_state(start)
        b = torch.rand(4)
        torch.rand(100)
    assert torch.equal(a, b)
    assert torch.equal(torch.rand(4), a)  # the block's draws are undone


def test_cuda_state_without_cuda_is_skipped_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = {**rng_state(), "cuda": [torch.zeros(16, dtype=torch.uint8)]}
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        set_rng_state(state)
    assert "CUDA" in caplog.text


def test_named_seeds_differ_by_name_and_seed_and_fit_int64():
    seeds = {named_seed(s, name) for s in (0, 1) for name in ("", "blocks.0.attn.q", "blocks.0.attn.k")}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert named_seed(0, "a") == named_seed(0, "a")
