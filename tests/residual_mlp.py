"""The small residual MLP the step-contract tests train (tests/test_step.py on the CPU, tests/test_gpu_training.py
on a device): three blocks x + down(relu(up(x))), each optionally under activation checkpointing."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as ckpt
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class MLP(nn.Module):
    """Three residual blocks; `checkpoint` None, "reentrant" or "non-reentrant"."""

    def __init__(self, dim: int, hidden: int, checkpoint: str | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(3))
        self.checkpoint = checkpoint

    def forward(self, x):  # (tokens, dim)
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                x = ckpt.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
        return x
