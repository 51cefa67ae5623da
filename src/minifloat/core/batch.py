"""How a batch is fed to a model: one convention for every part of minifloat that runs a model on a user's batch
(the audit, pre-flight, the shadow check).

    call_model(model, x)                  # a tensor (or anything else): model(x)
    call_model(model, (x, y))             # a tuple or list: model(x, y)
    call_model(model, tokenizer(text))    # a mapping: model(**batch), as Hugging Face models take it
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn


def call_model(model: nn.Module, batch):
    """`model`'s output on `batch` (see the module docstring for the convention)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)
