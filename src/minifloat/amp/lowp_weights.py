"""bfloat16 weights updated without an fp32 master copy: stochastic rounding or Kahan compensation.

fp32 master weights (minifloat.amp.master) cost 4 bytes per parameter on top of the 2-byte bf16 weight. Two ways
keep the small updates that round-to-nearest drops (see amp/master.py for the 2^-9 threshold) without them:

  * "stochastic": w ← SR(w + Δ). SR is unbiased, E[SR(y)] = y, so E[w_t] follows the fp32 trajectory; each
    step adds a rounding noise of at most one ulp (Zamirai et al., "Revisiting BFloat16 Training",
    arXiv 2010.06192 §4). Weights 2 B/param, plus a generator state per device.
  * "kahan": a bf16 buffer c holds what the last write-back rounded away; the next step updates w + c and keeps
    the new remainder: y = w + c + Δ (fp32), w ← RNE(y), c ← RNE(y - w) (Kahan summation; ibid. §4). The
    weight lags the fp32 trajectory by about c, which itself loses only its own rounding error. 2 + 2 B/param.

Each step upcasts every bf16 / fp16 parameter (with its compensation) into an fp32 *temporary*, lets the inner torch
optimizer step the temporaries (the update is computed in fp32; its state is created like the temporaries, fp32)
and writes them back; between steps the temporaries hold no storage. fp32 parameters (norms, embeddings, the head)
are stepped directly, as their own master.

    opt = LowPrecisionWeightOptimizer(torch.optim.AdamW, model, update="stochastic", seed=0, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

The FP8 step ends once per `step()`: the temporaries stand for their parameters (`fp8.step.alias`) and the inner
optimizer's own post-step hook is suppressed. A step whose gradients hold an inf or NaN is skipped entirely —
weights, compensation, generator and inner state untouched — and counted in `skipped_steps`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from minifloat.core.skip import grads_finite, warn_skipped
from minifloat.core.validate import check_choice, check_seed, param_groups
from minifloat.fp8 import step as fp8_steps
from minifloat.numerics.formats import BF16, FP16
from minifloat.numerics.quantize import cast

UPDATES = ("stochastic", "kahan")
LOW_PRECISION_FORMATS = {torch.bfloat16: BF16, torch.float16: FP16}


class LowPrecisionWeightOptimizer(torch.optim.Optimizer):
    """A torch optimizer over bf16 / fp16 parameters that keeps small updates without fp32 master weights.

    `param_groups` and `state` are the inner optimizer's (LR schedulers work). `state_dict()` holds the inner
    optimizer's state, the compensation buffers ("kahan") and the generator states ("stochastic"), so a resumed run
    continues bitwise.

    Args:
        optimizer_cls: a torch.optim.Optimizer class (SGD, AdamW, ...).
        params: an nn.Module, or parameters / param groups as a torch optimizer takes them.
        update: "stochastic" (stochastic rounding) or "kahan" (a compensation buffer per parameter).
        seed: seed of the stochastic-rounding generators (one per device).
        **kwargs: passed to `optimizer_cls`.
    """

    def __init__(self, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 params: nn.Module | Iterable[nn.Parameter] | Iterable[dict[str, Any]], *,
                 update: str = "stochastic", seed: int = 0, **kwargs):
        check_choice("update", update, UPDATES)
        check_seed("seed", seed)
        self.update, self.seed = update, seed
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (low-precision param, fp32 temporary)
        self.compensation: list[torch.Tensor] = []  # "kahan": per pair, in the parameter's dtype
        self.generators: dict[str, torch.Generator] = {}  # "stochastic": per device
        stepped_groups = [self._wrap(group) for group in param_groups(type(self).__name__, params)]
        self.optimizer = optimizer_cls(stepped_groups, **kwargs)
        super().__init__(stepped_groups, self.optimizer.defaults)  # sets up torch's hook registries
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.skipped_steps = 0
        self._built = True

    def _wrap(self, group: dict[str, Any]) -> dict[str, Any]:
        """`group` as the inner optimizer takes it: each low-precision parameter stands in by an fp32 temporary
        (with its compensation buffer or generator)."""
        held = [p for p, _ in self.pairs] + [q for g in getattr(self, "param_groups", []) for q in g["params"]]
        (group,) = param_groups(type(self).__name__, [group], held)
        stepped = []
        for p in group["params"]:
            if p.dtype not in LOW_PRECISION_FORMATS:
                stepped.append(p)  # fp32 / fp64: its own master
                continue
            t = nn.Parameter(_empty(p))
            fp8_steps.alias(t, p)  # stepping the temporary ends the FP8 step of p's layer
            self.pairs.append((p, t))
            stepped.append(t)
            if self.update == "kahan":
                self.compensation.append(torch.zeros_like(p, memory_format=torch.preserve_format))
            else:
                self.generators.setdefault(str(p.device), _generator(p.device, self.seed))
        return {**group, "params": stepped}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, with the group's low-precision parameters updated as the others are."""
        if not getattr(self, "_built", False):  # torch's __init__ registering the groups made above
            return super().add_param_group(param_group)
        self.optimizer.add_param_group(self._wrap(param_group))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._grads_finite():
            self.skipped_steps += 1
            warn_skipped(type(self).__name__, self.skipped_steps)
            fp8_steps.step_skipped(self)  # the FP8 step goes on into the next optimizer step
            return loss
        for i, (p, t) in enumerate(self.pairs):
            w = p.float() if self.update == "stochastic" else p.float() + self.compensation[i].float()
            t.data = w
            t.grad = None if p.grad is None else p.grad.float()
        with fp8_steps.suppressed():  # this step's own post-step hook ends the FP8 step, once
            self.optimizer.step()
        for i, (p, t) in enumerate(self.pairs):
            if self.update == "stochastic":
                fmt = LOW_PRECISION_FORMATS[p.dtype]
                p.copy_(cast(t.data, fmt, rounding="stochastic", generator=self.generators[str(p.device)]))
            else:
                p.copy_(t.data)  # RNE
                self.compensation[i].copy_(t.data - p.float())  # what the write-back rounded away
            t.data, t.grad = _empty(p), None
        return loss

    def _grads_finite(self) -> bool:
        """Whether every gradient is finite (one host sync; torch optimizers would spread a NaN into the state)."""
        grads = [q.grad for group in self.param_groups for q in group["params"] if q.grad is not None]
        return grads_finite(grads + [p.grad for p, _ in self.pairs if p.grad is not None])

    def model_param_groups(self) -> list[dict[str, Any]]:
        """`param_groups` with each fp32 temporary replaced by its low-precision parameter: the tensors whose .grad
        the next step reads (clip those; the temporaries get their gradients inside `step`)."""
        params = {id(t): p for p, t in self.pairs}
        return [{**group, "params": [params.get(id(q), q) for q in group["params"]]} for group in self.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "compensation": [c.detach().clone() for c in self.compensation],
            "generators": {device: g.get_state() for device, g in self.generators.items()},
            "skipped_steps": self.skipped_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["compensation"]
        if len(saved) != len(self.compensation):
            raise ValueError(f"state holds {len(saved)} compensation buffers, this optimizer has "
                             f"{len(self.compensation)} (update={self.update!r})")
        if set(state_dict["generators"]) != set(self.generators):
            raise ValueError(f"state holds generators for devices {sorted(state_dict['generators'])}, this "
                             f"optimizer has {sorted(self.generators)}")
        for c, s in zip(self.compensation, saved):
            if s.shape != c.shape:
                raise ValueError(f"compensation shape {tuple(s.shape)} does not match {tuple(c.shape)}")
            c.copy_(s)
        for device, g in self.generators.items():
            g.set_state(state_dict["generators"][device])
        # the inner optimizer loads against temporaries of their parameters' shape (zero-stride views of one
        # element): rules that read a parameter's size, such as minifloat.optim's fp32 state below 4096 elements,
        # see the size they saw in `step`
        for p, t in self.pairs:
            t.data = torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        finally:
            for p, t in self.pairs:
                t.data = _empty(p)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.skipped_steps = state_dict["skipped_steps"]

    def __repr__(self) -> str:
        return f"LowPrecisionWeightOptimizer({self.optimizer!r}, update={self.update!r}, params={len(self.pairs)})"


def _empty(p: torch.Tensor) -> torch.Tensor:
    """A float32 tensor with no storage, on p's device: the temporary between steps."""
    return torch.empty(0, dtype=torch.float32, device=p.device)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
