"""FP32 master weights for bfloat16 / float16 parameters.

An optimizer step w ← w - Δ is lost when Δ is below half an ulp of w: in bfloat16 (7 explicit mantissa bits) the ulp
just below 1.0 is 2^-8, so every |Δ| < 2^-9 ≈ 2e-3 leaves a weight of 1.0 unchanged, and typical updates (lr 1e-4
times a unit gradient) are far smaller. Mixed-precision training therefore keeps a float32 "master" copy of every
low-precision weight, applies the update to it and rounds it back to the low-precision weight used by forward and
backward (Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740 §3.1).

Two ways to use it:

    master = MasterWeights(model.parameters())            # the building block, for loops with GradScaler etc.
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3)  # the optimizer updates the float32 copies
    loss.backward(); master.copy_grads(); opt.step(); master.copy_weights()

    opt = MasterWeightOptimizer(torch.optim.AdamW, model, lr=1e-3)  # the same, wrapped as one optimizer
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from minifloat.core.skip import grads_finite, warn_skipped
from minifloat.core.validate import check_bool, param_groups
from minifloat.fp8 import step as fp8_steps

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """float32 copies of the bfloat16 / float16 parameters among `params`.

    float32 (and float64) parameters need no copy: they are their own master and are passed through.

    Args:
        params: an iterable of parameters, or of param-group dicts with a "params" entry (as torch optimizers take).
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]]):
        self.groups: list[dict[str, Any]] = []
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (low-precision param, float32 master)
        self._versions: list[int] = []  # each parameter's _version after the masters last wrote it
        for group in param_groups("MasterWeights", params):
            self.add_group(group)

    def add_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """Add a param group (a dict with "params"): its low-precision parameters get masters. Returns the group as
        the optimizer takes it (masters in place of those parameters)."""
        held = [p for g in self.groups for p in g["params"]] + [p for p, _ in self.pairs]
        (group,) = param_groups("MasterWeights", [group], held)
        masters = []
        for p in group["params"]:
            if p.dtype in LOW_PRECISION:
                m = nn.Parameter(p.detach().float().clone())
                fp8_steps.alias(m, p)  # stepping the master ends the FP8 step of p's layer
                self.pairs.append((p, m))
                self._versions.append(p._version)
                masters.append(m)
            else:
                masters.append(p)
        self.groups.append({**group, "params": masters})
        return self.groups[-1]

    def parameters(self) -> list[dict[str, Any]]:
        """The param groups with every low-precision parameter replaced by its float32 master: give them to the
        optimizer."""
        return self.groups

    @torch.no_grad()
    def copy_grads(self) -> None:
        """Upcast each low-precision parameter's .grad into its master's .grad (None stays None). A parameter written
        since the masters last wrote it (model.load_state_dict of other weights, an in-place edit) first becomes its
        master's value again, so the step continues from the weights the user wrote, not from stale masters (a write of
        the values the parameter already held, as a checkpoint's load of the same step, keeps the masters' bits)."""
        for i, (p, m) in enumerate(self.pairs):
            if p._version != self._versions[i]:  # written since: stale unless it still holds the master's rounding
                if not torch.equal(p, m.to(p.dtype)):
                    m.copy_(p)
                self._versions[i] = p._version
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def copy_weights(self) -> None:
        """Round each float32 master onto its parameter's dtype (to nearest even) and write it into the parameter."""
        for i, (p, m) in enumerate(self.pairs):
            p.copy_(m)
            self._versions[i] = p._version

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in self.pairs:
            for t in (p, m):
                if set_to_none:
                    t.grad = None
                elif t.grad is not None:
                    t.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"master": [m.detach().clone() for _, m in self.pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the masters and write them back into the parameters."""
        saved = state["master"]
        if len(saved) != len(self.pairs):
            raise ValueError(f"state holds {len(saved)} master weights, this model has {len(self.pairs)}")
        for (_, m), s in zip(self.pairs, saved):
            if s.shape != m.shape:
                raise ValueError(f"master weight shape {tuple(s.shape)} does not match {tuple(m.shape)}")
            m.copy_(s)
        self.copy_weights()


class MasterWeightOptimizer(torch.optim.Optimizer):
    """A torch optimizer that updates float32 master copies of low-precision parameters.

    `step()` upcasts the parameters' gradients into the masters, runs the inner optimizer on the masters (so its
    state is float32 too) and rounds the masters back into the parameters. `param_groups` and `state` are the inner
    optimizer's, so learning-rate schedulers work unchanged. `state_dict()` holds the inner optimizer's state and the
    masters (they carry the bits the low-precision parameters lack).

    A step whose gradients are not all finite is skipped whole (weights, masters and optimizer state unchanged), a
    warning says so and `skipped_steps` counts it: one host sync per step. `check_finite=False` leaves that to a
    guard of the caller's (minifloat's LossScaler or StepGuard).

    Args:
        optimizer_cls: a torch.optim.Optimizer class (SGD, AdamW, ...).
        params: an nn.Module, or parameters / param groups as a torch optimizer takes them.
        check_finite: skip a step whose gradients are not all finite.
        **kwargs: passed to `optimizer_cls`.
    """

    def __init__(self, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 params: nn.Module | Iterable[nn.Parameter] | Iterable[dict[str, Any]], *,
                 check_finite: bool = True, **kwargs):
        check_bool("check_finite", check_finite)
        self.check_finite, self.skipped_steps = check_finite, 0
        self.master = MasterWeights(param_groups(type(self).__name__, params))
        self.optimizer = optimizer_cls(self.master.parameters(), **kwargs)
        super().__init__(self.master.parameters(), self.optimizer.defaults)  # sets up torch's hook registries
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self._built = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, with masters for the group's low-precision parameters."""
        if not getattr(self, "_built", False):  # torch's __init__ registering the groups made above
            return super().add_param_group(param_group)
        self.optimizer.add_param_group(self.master.add_group(param_group))

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for group in self.master.groups for p in group["params"] if p.grad is not None]
        if self.check_finite and not grads_finite(grads + [p.grad for p, _ in self.master.pairs if p.grad is not None]):
            self.skipped_steps += 1
            warn_skipped(type(self).__name__, self.skipped_steps)
            fp8_steps.step_skipped(self)  # the FP8 step goes on into the next optimizer step
            return loss
        self.master.copy_grads()
        with fp8_steps.suppressed():  # this step's own post-step hook ends the FP8 step, once
            self.optimizer.step()
        self.master.copy_weights()
        return loss

    def model_param_groups(self) -> list[dict[str, Any]]:
        """`param_groups` with each fp32 master replaced by its low-precision parameter: the tensors whose .grad the
        next step reads (unscale and clip those; the masters get their gradients inside `step`)."""
        params = {id(m): p for p, m in self.master.pairs}
        return [{**group, "params": [params.get(id(q), q) for q in group["params"]]} for group in self.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.master.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), **self.master.state_dict(),
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.master.load_state_dict(state_dict)
        self.skipped_steps = state_dict.get("skipped_steps", 0)  # states saved before it was counted have none
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r}, masters={len(self.master.pairs)})"
