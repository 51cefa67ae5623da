"""The trainer's optimizer: AdamW (torch's, or minifloat.optim's with low-precision moments) over the weights the
`master` mode stores, and the parameter groups whose gradients the step clips.

    master        weights (outside the fp32 islands)          how an update reaches them
    fp32          fp32, their own master (4 B/param)          the optimizer steps the parameters (autocast casts
                                                              them to bf16 per op)
    bf16-sr       bf16, no fp32 copy (2 B/param)              an fp32 temporary is stepped and written back by
                                                              stochastic rounding (unbiased, seeded)
    bf16-kahan    bf16 + a bf16 compensation (2 + 2 B/param)  written back to nearest; the compensation keeps what
                                                              the rounding dropped and joins the next update

The bf16 modes are minifloat.amp.lowp_weights.LowPrecisionWeightOptimizer around the AdamW: norms, embeddings and
the head stay fp32 (the policy's islands) and are stepped directly. The moments stay as `--optimizer-state` says
(fp32: 8 B/param), and gradients are bf16 (2 B/param instead of 4).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minifloat.amp.lowp_weights import LowPrecisionWeightOptimizer
from minifloat.amp.policy import PrecisionPolicy
from minifloat.amp.unscale import grad_param_groups  # noqa: F401 (the loop's clipping walks these)
from minifloat.optim import AdamW as LowPrecisionAdamW

ADAMW_BETAS = (0.9, 0.95)  # nanoGPT / Llama; beta2 = 0.95 reacts faster to the gradient growth of low precision
# TrainConfig.master -> how LowPrecisionWeightOptimizer writes updates back (None: fp32 parameters, no wrapper)
MASTER_UPDATES = {"fp32": None, "bf16-sr": "stochastic", "bf16-kahan": "kahan"}
MASTER_HELP = {
    "fp32": "fp32 weights, their own master (4 B/param; autocast casts them per op)",
    "bf16-sr": "bf16 weights, no fp32 copy (2 B/param); each update is computed in fp32 and written back by "
               "stochastic rounding (unbiased, seeded, bitwise on resume)",
    "bf16-kahan": "bf16 weights plus a bf16 Kahan compensation buffer (2 + 2 B/param) that keeps what "
                  "round-to-nearest dropped",
}


def master_policy(policy: PrecisionPolicy, master: str) -> PrecisionPolicy:
    """`policy` with the weights `master` asks for: unchanged for "fp32", else bf16 parameters (outside the
    policy's fp32 islands) updated without an fp32 copy (PrecisionPolicy.master_weights)."""
    if MASTER_UPDATES[master] is None:
        return policy
    return dataclasses.replace(policy, param_dtype=torch.bfloat16, master_weights=master)


def adamw(model: nn.Module, groups: list[dict], *, lr: float, state_formats: tuple[str, ...], master: str,
          seed: int) -> torch.optim.Optimizer:
    """The run's AdamW over `groups` (the model's parameter groups).

    Args:
        model: the model, under the policy of `master_policy(..., master)`.
        groups: its parameter groups (minifloat.safety.stability.param_groups).
        lr: the initial learning rate (the loop sets every step's).
        state_formats: (m, v) formats; ("fp32", "fp32") is torch.optim.AdamW, anything else minifloat.optim.AdamW,
            whose norms, embeddings and small tensors keep fp32 state.
        master: a key of MASTER_UPDATES.
        seed: seeds the stochastic rounding of "bf16-sr".
    Returns:
        The optimizer; for the bf16 modes a LowPrecisionWeightOptimizer, whose `param_groups` are its inner AdamW's.
    """
    if tuple(state_formats) == ("fp32", "fp32"):
        cls, kwargs = torch.optim.AdamW, fused_on_cuda(groups)
    else:
        # the fp32-state rule finds norms and embeddings by their parameters' ids: they are fp32 islands, stepped
        # directly (not through temporaries), so the ids it collects from `model` are the ones it steps
        cls, kwargs = LowPrecisionAdamW, {"state_formats": tuple(state_formats), "model": model}
    update = MASTER_UPDATES[master]
    if update is None:
        return cls(groups, lr=lr, betas=ADAMW_BETAS, **kwargs)
    return LowPrecisionWeightOptimizer(cls, groups, update=update, seed=seed, lr=lr, betas=ADAMW_BETAS, **kwargs)


def fused_on_cuda(groups: list[dict]) -> dict:
    """torch.optim.AdamW's arguments for `groups`: the fused kernel (one pass over each parameter's tensors instead of
    foreach's several, which at a billion parameters is tens of GB of memory traffic a step; not yet timed here)
    where every parameter is on a CUDA device. Elsewhere torch's default, so CPU runs keep their bits."""
    params = [p for group in groups for p in group["params"]]
    return {"fused": True} if params and all(p.is_cuda for p in params) else {}


def master_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors the optimizer keeps beside the model's weights to carry their precision: what it steps (fp32 masters
    of minifloat.amp.master; the storage-less temporaries of the bf16 modes) and the Kahan compensation buffers."""
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    if isinstance(optimizer, LowPrecisionWeightOptimizer):
        return stepped + optimizer.compensation
    return stepped
