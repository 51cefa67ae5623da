"""How a batch is fed to a model: one convention for every part of minifloat that runs a model on a user's batch
(the audit, pre-flight, the shadow check).

    call_model(model, x)                  # a tensor (or anything else): model(x)
    call_model(model, (x, y))             # a tuple or list: model(x, y)
    call_model(model, tokenizer(text))    # a mapping: model(**batch), as Hugging Face models take it
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def call_model(model: nn.Module, batch):
    """`model`'s output on `batch` (see the module docstring for the convention)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def described(batch) -> str:
    """A batch in a few words, for a message: "a torch.float32 tensor of shape (8, 32)", "a tuple of 2", ..."""
    if isinstance(batch, torch.Tensor):
        return f"a {batch.dtype} tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, Mapping):
        return f"a mapping of {', '.join(map(str, list(batch)[:4]))}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return f"a {type(batch).__name__}"


def call_on_batch(model: nn.Module, batch, what: str, index: int):
    """call_model, where a batch the model cannot take (a string, floats for token ids, an id past the vocabulary)
    is one ValueError naming `what` the batches are for and the batch, not an error from deep in the forward."""
    try:
        return call_model(model, batch)
    except (TypeError, AttributeError, RuntimeError, IndexError, ValueError) as err:
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        raise ValueError(f"{what} batch {index} ({described(batch)}) failed in the {type(model).__name__}'s "
                         f"forward ({type(err).__name__}: {first}); give batches the model takes: model(batch), "
                         f"model(*batch) for a tuple, model(**batch) for a mapping") from err
