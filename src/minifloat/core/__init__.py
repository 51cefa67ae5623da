"""Shared small concepts, one home each, below every other layer (they import torch and nothing of minifloat):
RNG state (rng), tensor snapshots (snapshot), how a batch is fed to a model (batch), module roles (roles),
validators (validate) and why a step was skipped (skip)."""
