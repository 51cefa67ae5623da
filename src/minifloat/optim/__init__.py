"""Low-precision optimizers: block-wise quantized optimizer states (AdamW, Adam, SGD with momentum, Lion)."""

from minifloat.optim.optimizers import SGD, Adam, AdamW, Lion
from minifloat.numerics.stateformats import StateFormat

__all__ = ["SGD", "Adam", "AdamW", "Lion", "StateFormat"]
