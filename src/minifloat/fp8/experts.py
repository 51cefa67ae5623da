"""FP8 for Mixture-of-Experts layers held as stacked 3-D parameters: transformers' experts modules.

transformers 5 holds a MoE layer's experts as one module with stacked weights (`gate_up_proj` (E, 2I, H) and
`down_proj` (E, H, I), or (E, in, out) where `is_transposed`) and dispatches its forward through
`use_experts_implementation`. `mf.convert` makes such a module compute each expert's two projections as FP8 GEMMs
(the recipe's casts and GEMMs, through `Fp8LinearFunction` as an Fp8Linear computes them), with one scaling state
per expert and projection: `fp8_state`, an nn.ModuleList of 2E ScalingStates, expert e's first projection at 2e
and its down projection at 2e + 1. The module's class becomes a subclass of its own (`Fp8<Class>`, picklable) whose
forward is the eager implementation's routing with FP8 projections; its parameters stay the same objects
(optimizers built before convert keep them) under the same names, the scaling state beside them in the state dict.
The step contract is the Fp8Linear's: one FP8 step per optimizer step over the module's parameters
(minifloat.fp8.step), amaxes max-folded over the step's forwards and backwards, an expert no token reached
recording nothing and keeping its scales, evaluation recording nothing.

Supported: a gated first projection (`gate_up_proj` with `_apply_gate`) or an ungated one (`up_proj` with `act_fn`),
concatenated gate/up rows, either storage orientation, with or without biases, features multiples of 16. Left in
high precision, with the reason (`experts_reason`): interleaved gate/up rows, a norm after each expert, 4-bit
recipes (their per-layer random state is not built here), other sizes, modules that are not transformers' experts.

Each expert's weight casts are made once per FP8 step and reused by the step's micro-batches and for dgrad, as an
Fp8Linear's are (`WeightCache`, one per expert and projection).

Not done yet: one grouped GEMM for all experts (each expert is its own pair of GEMMs, as in transformers' eager
implementation, with its host synchronisation per layer), telemetry,
expert or tensor parallelism. (FP8 inference of a plain model's experts: minifloat.inference.experts; their FP8
export: minifloat.inference.hf_experts.)
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from minifloat.core.autocast import compute_dtype
from minifloat.core.roles import MIN_DIM_MULTIPLE
from minifloat.fp8 import step as fp8_steps
from minifloat.fp8.autograd import Fp8LinearFunction, recording_linear
from minifloat.fp8.caster import LayerCaster, WeightCache
from minifloat.fp8.modules import COMPUTE_DTYPES, current_autocast, reusing_weight_casts
from minifloat.fp8.recipes import Recipe
from minifloat.fp8.scaling import ScalingState, advance_states


def _projections(module: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"), "down_proj"


def experts_reason(module: nn.Module, recipe: Recipe | None = None) -> str | None:
    """Why `module` (holding stacked weights) cannot compute its experts in FP8 under `recipe`, or None when it can
    (see the module docstring)."""
    if isinstance(module, Fp8Experts):
        return "converted already"
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts", "config")):
        return "not a transformers experts module (use_experts_implementation)"
    if not getattr(module, "is_concatenated", True):
        return "its gate and up rows are interleaved"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalises each expert's output"
    if recipe is not None and recipe.four_bit:
        return "4-bit recipes do not run stacked experts"
    if getattr(module, "_is_expert_parallel", False):
        return "its experts are sharded across ranks (expert parallelism)"
    for name in _projections(module):
        weight = getattr(module, name, None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 3 or weight.shape[0] != module.num_experts:
            return f"no 3-D {name} of its {module.num_experts} experts"
        if weight.shape[1] % MIN_DIM_MULTIPLE or weight.shape[2] % MIN_DIM_MULTIPLE:
            return f"{name}'s features {tuple(weight.shape[1:])} are not multiples of {MIN_DIM_MULTIPLE}"
        if not weight.is_floating_point() or weight.dtype == torch.float64:
            return f"{name} is {weight.dtype}"
    if not getattr(module, "has_gate", True) and not hasattr(module, "act_fn"):
        return "an ungated first projection without act_fn"
    return None


def rebuild(subclass_of: Callable[[type], type], base: type, state: dict) -> nn.Module:
    """Unpickle a module whose class was made from a transformers class: `subclass_of(base)` (fp8_class, ...)."""
    module = base.__new__(subclass_of(base))
    module.__setstate__(state)
    return module


def _restore(base: type, state: dict) -> nn.Module:  # FP8 experts pickled before `rebuild` existed
    return rebuild(fp8_class, base, state)


def routes(top_k_index: torch.Tensor, num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """transformers' eager routing: (expert, its tokens, their top-k slots) for each expert some token reached,
    slot-major (the order transformers' own experts sum in). The index `num_experts` is the slot expert parallelism
    masks other ranks' experts into: skipped."""
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for e in hit:
        if e != num_experts:
            slot, token = torch.where(mask[e])
            yield e, token, slot


class Fp8Experts:
    """The mixin `convert_experts` puts in front of a transformers experts class (see the module docstring)."""

    step_on = "optimizer"

    def __reduce_ex__(self, protocol):
        return rebuild, (fp8_class, type(self).__mro__[2], self.__dict__.copy())

    def __setstate__(self, state) -> None:  # deepcopy and unpickling build no module through convert_experts
        super().__setstate__(state)
        fp8_steps.track(self)

    def drop_weight_casts(self) -> None:
        """Forget the experts' weight casts made for this FP8 step (its end does)."""
        for cache in self.__dict__.get("_weights", ()):
            cache.clear()

    def step_ended(self) -> None:
        """Called by the step's end after the states advanced: the weight casts are dropped and the count of frozen
        training forwards starts again."""
        self._unstepped = 0
        self.drop_weight_casts()

    def _weight_cache(self, slot: int) -> WeightCache | None:
        """Slot `slot`'s weight casts, kept for the FP8 step as an Fp8Linear keeps its own: for the micro-batches of
        a training step (autograd on) or inside `reuse_weight_casts()`. An expert's weight is a view of the stacked
        parameter: its version counter is the parameter's (an optimizer step or load_state_dict misses), its
        storage address the expert's own."""
        if not (torch.is_grad_enabled() or reusing_weight_casts()):
            return None
        caches = self.__dict__.get("_weights")
        if caches is None or len(caches) != len(self.fp8_state):  # modules pickled before the cache existed
            caches = self.__dict__["_weights"] = [WeightCache() for _ in self.fp8_state]
        return caches[slot]

    def fp8_step(self) -> None:
        """End this module's FP8 step (minifloat.fp8.step calls it for you after optimizer steps)."""
        advance_states(list(self.fp8_state), [self.recipe] * len(self.fp8_state))
        self.step_ended()

    def _project(self, slot: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state,
                 recording: bool) -> torch.Tensor:
        weight = weight.t() if self.is_transposed else weight  # (out, in), as an nn.Linear holds it
        if not state.enabled:
            return F.linear(x, weight, bias)
        scaling = self.fp8_state[slot]
        name = "" if torch.compiler.is_compiling() else scaling.layer_name
        caster = LayerCaster(state.recipe if state.recipe is not None else self.recipe, scaling, name,
                             state.backend if state.backend is not None else self.backend, recording,
                             self._weight_cache(slot), None)
        if state.calibrating:
            return recording_linear(x, weight, bias, caster)
        return Fp8LinearFunction.apply(x, weight, bias, caster, compute_dtype(x))

    # run eagerly inside a compiled model: the routing reads which experts are hit on the host, and a graph per
    # expert slot recompiled past dynamo's limit (151 s for a tiny Mixtral's first step); the casts inside are
    # minifloat's own compiled kernels either way
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        state = current_autocast()
        if state.enabled and compute_dtype(hidden_states) not in COMPUTE_DTYPES:
            raise TypeError(f"FP8 experts {self.fp8_name!r} got a {hidden_states.dtype} input: FP8 layers compute in "
                            f"float32, bfloat16 or float16; cast the model and its inputs with .float() (or run "
                            f"under torch.autocast)")
        recording = (self.training and torch.is_grad_enabled()) or state.calibrating
        if (recording and not state.calibrating and not torch.compiler.is_compiling()
                and not any(p.requires_grad for p in self.parameters(recurse=False))):
            self._unstepped = getattr(self, "_unstepped", 0) + 1  # frozen (adapters train): the next step ends it
        first_name, down_name = _projections(self)
        first, down = getattr(self, first_name), getattr(self, down_name)
        first_bias = getattr(self, f"{first_name}_bias", None) if self.has_bias else None
        down_bias = getattr(self, f"{down_name}_bias", None) if self.has_bias else None
        out = torch.zeros_like(hidden_states)
        for e, token, slot in routes(top_k_index, self.num_experts):
            h = self._project(2 * e, hidden_states[token], first[e], None if first_bias is None else first_bias[e],
                              state, recording)
            h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
            y = self._project(2 * e + 1, h, down[e], None if down_bias is None else down_bias[e], state, recording)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


_CLASSES: dict[type, type] = {}


def fp8_class(base: type) -> type:
    """The FP8 subclass of a transformers experts class (made once per class)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Fp8{base.__name__}", (Fp8Experts, base), {"__module__": __name__})
    return _CLASSES[base]


def convert_experts(module: nn.Module, *, recipe: Recipe, backend: str | None, name: str) -> None:
    """Make a supported experts module (experts_reason None) compute its experts in FP8, in place."""
    if (reason := experts_reason(module, recipe)) is not None:
        raise ValueError(f"{name or type(module).__name__} cannot run its experts in FP8: {reason}")
    weight = getattr(module, _projections(module)[0])
    module.__class__ = fp8_class(type(module))
    module.recipe, module.backend, module.fp8_name = recipe, backend, name
    states = nn.ModuleList(ScalingState(recipe.history_len, device=weight.device) for _ in range(2 * module.num_experts))
    for e in range(module.num_experts):
        for i, projection in enumerate(_projections(module)):
            states[2 * e + i].layer_name = f"{name}.{projection}[{e}]"
    module.fp8_state = states
    fp8_steps.track(module)

